"""A private /dev for one command: the real NVIDIA stacks' tiers (tests/support/realjax.py,
tests/support/realnvidia.py) run their commands with it and never touch the machine's /dev.

The command runs in its own mount namespace (``unshare -m --propagation private``) whose /dev
is a tmpfs copy of the real one without any NVIDIA node, plus, when ``gpus`` > 0,
/dev/nvidiactl, /dev/nvidia-uvm and /dev/nvidia0..gpus-1 (nodes with no driver behind them:
JAX only tries CUDA when they exist, and NVIDIA's libraries as root would create
/dev/nvidiactl in the real /dev when it is missing). Needs root and util-linux's unshare.
"""

from __future__ import annotations

import os
import shutil
import subprocess

# Run as `sh -c NS_SCRIPT sh GPUS ARGV...` inside the private mount namespace. The copy drops
# the machine's own NVIDIA nodes first, so the nodes made after it are the only ones.
NS_SCRIPT = """set -e
d=$(mktemp -d /tmp/gpudiag-dev.XXXXXX)
mount -t tmpfs -o mode=755 gpudiag-dev "$d"
cp -a /dev/. "$d"/
rm -rf "$d"/nvidia*
mount --move "$d" /dev
rmdir "$d"
if [ "$1" -gt 0 ]; then
  mknod -m 666 /dev/nvidiactl c 195 255
  mknod -m 666 /dev/nvidia-uvm c 240 0
fi
i=0
while [ "$i" -lt "$1" ]; do mknod -m 666 "/dev/nvidia$i" c 195 "$i"; i=$((i + 1)); done
shift
exec "$@"
"""


def in_private_dev(argv: list[str], gpus: int = 0) -> list[str]:
    """``argv`` in a private mount namespace whose /dev has no NVIDIA node but ``gpus``'."""
    return ["unshare", "-m", "--propagation", "private", "--", "sh", "-c", NS_SCRIPT, "sh",
            str(gpus), *argv]


def namespace_problem() -> str | None:
    """Why a private /dev with NVIDIA nodes cannot be made here; None when it can."""
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    if os.geteuid() != 0:
        return "a private /dev (tmpfs over /dev in a mount namespace) with nodes needs root"
    try:
        proc = subprocess.run(in_private_dev(["test", "-c", "/dev/nvidia0"], gpus=1),
                              capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        return f"unshare failed: {e}"
    if proc.returncode != 0:
        said = "\n".join(proc.stderr.strip().splitlines()[-6:]) or f"exit {proc.returncode}"
        return f"unshare -m could not make a private /dev: {said}"
    return None
