"""``python -m tests.fakes [DEST] [--gpus N]``: a fake GPU host to try gpudiag without a GPU.

Builds the fake driver (libnvidia-ml, libcuda, nvidia-smi) into DEST, lays out what the host
probe reads (``/dev/nvidia*``, ``/proc/driver/nvidia/version`` and a PCI tree look-alike), and
prints the ``export`` lines of the environment that makes gpudiag see N healthy fake GPUs::

    eval "$(python -m tests.fakes /tmp/gpudiag-try)"
    gpudiag probe

Also written to DEST/env.sh (``source`` it in another shell); DEST/gpudiag.toml is a
``gpudiag serve --config`` for the fake host, DEST/gpudiag-slurm.toml the same with remediation
on a stand-in ``scontrol``/``sinfo`` (DEST/slurm, tests/fakes/slurm.py).
docs/try-without-a-gpu.md has recipes; the knobs are listed in tests/fakes/fake_common.h,
fake_nvml.c and fake_cuda.c.
"""

from __future__ import annotations

import argparse
import os
import shlex
import stat
import sys
from collections.abc import Sequence
from pathlib import Path

from tests.fakes.build import build_fakes
from tests.fakes.slurm import install as install_slurm
from tests.fakes.sysfs import make_pci_tree

DEFAULT_DEST = "/tmp/gpudiag-try"
FAKE_NODE = "fake-node"  # the stand-in Slurm's one node (DEST/slurm)
KERNEL_MODULE = ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.124.06  Fri Mar 14 2025\n"
                 "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")


def make_host(dest: Path, gpus: int) -> dict[str, str]:
    """Build everything under ``dest`` and return the environment variables to export."""
    driver = build_fakes(dest / "driver")
    dev, proc = dest / "dev", dest / "proc-driver-nvidia"
    dev.mkdir(parents=True, exist_ok=True)
    proc.mkdir(parents=True, exist_ok=True)
    for old in dev.glob("nvidia*"):
        old.unlink()
    for name in ["nvidiactl", "nvidia-uvm", *(f"nvidia{i}" for i in range(gpus))]:
        (dev / name).write_text("")
    (proc / "version").write_text(KERNEL_MODULE)
    pci = make_pci_tree(dest / "pci" / "devices", gpus)
    state = dest / "gpu-state"
    if not state.exists():
        state.write_text("# KEY=VALUE lines override the environment; re-read while gpudiag "
                         "runs\n")
    (dest / "locks").mkdir(exist_ok=True)
    # A daemon config for the fake host: the fakes emulate no GPU JAX or IREE could use.
    no_runtimes = "[backends.jax]\nenabled = false\n\n[backends.iree]\nenabled = false\n"
    (dest / "gpudiag.toml").write_text(
        "# gpudiag serve --config for the fake host (python -m tests.fakes)\n" + no_runtimes)
    # Remediation against a stand-in Slurm node (tests/fakes/slurm.py), observing first.
    scontrol, sinfo = install_slurm(dest / "slurm", FAKE_NODE)
    (dest / "gpudiag-slurm.toml").write_text(
        "# gpudiag serve --config for the fake host with remediation on a stand-in Slurm\n"
        + no_runtimes + f'\n[remediation]\nmode = "observe"\nscontrol = "{scontrol}"\n'
        f'sinfo = "{sinfo}"\nnode_name = "{FAKE_NODE}"\n'
        f'killswitch_file = "{dest / "remediation-killswitch"}"\n')
    return {
        "LD_LIBRARY_PATH": str(driver.lib_dir),  # prepended to the shell's own (see main)
        "PATH": str(driver.bin_dir),
        "FAKE_NVML_DEVICE_COUNT": str(gpus),
        "FAKE_GPU_STATE_FILE": str(state),
        "GPUDIAG_DEVICE_DIR": str(dev),
        "GPUDIAG_DRIVER_PROC_DIR": str(proc),
        "GPUDIAG_SYSFS_PCI_DIR": str(pci),
        # The fake GPUs' UUIDs are the same everywhere: locks of their own, never a real
        # gpudiag's (which would make them look busy).
        "GPUDIAG_LOCK_DIR": str(dest / "locks"),
    }


class UnsafeDest(Exception):
    """A DEST another user could write: what is built there would run (nvidia-smi, as root)."""


def check_dest(dest: Path) -> None:
    """Refuse a DEST (or a link there) that is not the caller's own folder, closed to others.

    DEST holds a fake nvidia-smi and libraries that gpudiag then runs, maybe as root: in a
    folder another user owns or may write (a fixed name in a shared /tmp made first by
    someone else), they could be swapped. A DEST that does not exist yet is made 0700.
    """
    try:
        os.mkdir(dest, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise UnsafeDest(f"cannot make {dest}: {e.strerror or e}") from e
    st = os.lstat(dest)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafeDest(f"{dest} is not a folder (a symlink?): give a folder of your own")
    if st.st_uid != os.geteuid():
        raise UnsafeDest(f"{dest} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()}):"
                         " another user made it; give a folder of your own")
    if st.st_mode & 0o022:
        raise UnsafeDest(f"{dest} is writable by others (mode {stat.S_IMODE(st.st_mode):o}): "
                         "chmod go-w it or give another folder")


def main(argv: Sequence[str] | None = None) -> int:
    """Build the fake host and print its environment as export lines."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.fakes",
        description="Build a fake NVIDIA GPU host and print the environment that uses it.")
    parser.add_argument("dest", nargs="?", default=DEFAULT_DEST,
                        help=f"folder to build into (default: {DEFAULT_DEST})")
    parser.add_argument("--gpus", type=int, default=8, choices=range(1, 17), metavar="N",
                        help="fake GPUs, 1 to 16 (default: 8)")
    args = parser.parse_args(argv)
    dest = Path(os.path.abspath(args.dest))  # not resolved: a planted link is refused below
    try:
        check_dest(dest)
    except UnsafeDest as e:
        print(f"python -m tests.fakes: refused: {e}", file=sys.stderr)
        return 2
    article = "an" if args.gpus in (8, 11) else "a"  # as the number is said: an 8, an 11
    print(f"building the fake driver and {article} {args.gpus}-GPU host in {dest} ...",
          file=sys.stderr)
    try:
        env = make_host(dest, args.gpus)
    except (RuntimeError, OSError) as e:
        print(f"python -m tests.fakes: {e}\n(gcc is needed: scripts/setup.sh installs it)",
              file=sys.stderr)
        return 1
    # PATH and LD_LIBRARY_PATH extend the shell's own values when the lines are evaluated.
    tails = {"PATH": ':"$PATH"', "LD_LIBRARY_PATH": '"${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"'}
    lines = [f"export {k}={shlex.quote(v)}{tails.get(k, '')}" for k, v in env.items()]
    (dest / "env.sh").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"done: eval these lines (or: source {dest / 'env.sh'}), then try `gpudiag probe`; "
          "recipes: docs/try-without-a-gpu.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
