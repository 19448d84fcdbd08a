"""NVIDIA's real user space (Debian non-free, 535 series) for the real-driver test tier.

``ensure_nvidia_userspace()`` downloads ``libnvidia-ml1``, ``libcuda1`` and ``nvidia-smi`` with
``apt-get download`` into ``.cache/nvidia-userspace/`` (ignored by git) and unpacks them with
``dpkg-deb -x``: nothing on the machine changes. The package index comes from this machine's
own Debian sources (``/etc/apt/sources.list.d/*.sources``, deb822), with the ``contrib`` and
``non-free`` components added, in a private sources file, lists and cache folder.
``python -m tests.support.realnvidia`` fetches it ahead and prints where it is.

The libraries must only ever run inside ``in_private_dev`` (tests/support/privatedev.py): as
root, NVIDIA's libraries create ``/dev/nvidiactl`` when it is missing, which would change what
every other test on the machine sees. That wrapper gives the command a private mount namespace
whose /dev is a tmpfs copy of the real one without NVIDIA nodes, plus N stale nodes
(/dev/nvidia0..N-1, /dev/nvidiactl, /dev/nvidia-uvm) with no driver behind them when asked.

Knob: ``GPUDIAG_REAL_NVIDIA`` = ``0`` (the tier is off), ``require`` (unavailable is a failure),
unset (skip with the reason; as root under ``CI=true`` a failure, like the real Slurm tier).
``GPUDIAG_REAL_NVIDIA_CACHE`` moves the cache.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CACHE = ROOT / ".cache" / "nvidia-userspace"
PACKAGES = ("libnvidia-ml1", "libcuda1", "nvidia-smi")
STAMP = ".gpudiag-nvidia-userspace-complete"
SYSTEM_SOURCES = Path("/etc/apt/sources.list.d")
LIB_SUBDIR = Path("usr/lib/x86_64-linux-gnu/nvidia/current")
SMI_SUBDIR = Path("usr/lib/nvidia/current")


class UserspaceUnavailable(Exception):
    """The packages could not be fetched or unpacked; the message says why."""


@dataclass(frozen=True)
class NvidiaUserspace:
    """Unpacked real NVIDIA user-space libraries and nvidia-smi."""

    root: Path
    version: str
    fetch_s: float | None  # None when it came from the cache

    @property
    def lib_dir(self) -> Path:
        """Holds libnvidia-ml.so.1, libcuda.so.1 and libcuda.so (the links dpkg unpacked)."""
        return self.root / LIB_SUBDIR

    @property
    def bin_dir(self) -> Path:
        """Holds the real nvidia-smi."""
        return self.root / SMI_SUBDIR


def cache_dir() -> Path:
    """Where the unpacked packages live."""
    return Path(os.environ.get("GPUDIAG_REAL_NVIDIA_CACHE") or DEFAULT_CACHE)


def _tail(text: str, lines: int = 6) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def private_sources(system: Path = SYSTEM_SOURCES) -> str:
    """This machine's Debian deb822 sources with contrib and non-free added."""
    stanzas = []
    for path in sorted(system.glob("*.sources")):
        for stanza in path.read_text(encoding="utf-8").split("\n\n"):
            lines = [ln for ln in stanza.splitlines() if ln.strip()]
            if not any(ln.startswith("Components:") for ln in lines):
                continue
            out = []
            for ln in lines:
                if ln.startswith("Components:"):
                    have = ln.split(":", 1)[1].split()
                    ln = "Components: " + " ".join(
                        dict.fromkeys([*have, "main", "contrib", "non-free"]))
                out.append(ln)
            stanzas.append("\n".join(out))
    if not stanzas:
        raise UserspaceUnavailable(f"no deb822 Debian sources in {system} to add non-free to")
    return "\n\n".join(stanzas) + "\n"


def _apt(base: Path, *args: str, cwd: Path | None = None, timeout_s: float = 300) -> None:
    options = [f"-oDir::Etc::sourcelist={base / 'apt' / 'nvidia.sources'}",
               "-oDir::Etc::sourceparts=/dev/null",
               f"-oDir::State::Lists={base / 'apt' / 'lists'}",
               f"-oDir::Cache={base / 'apt' / 'cache'}", "-q"]
    try:
        proc = subprocess.run(["apt-get", *options, *args], cwd=cwd, capture_output=True,
                              text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        raise UserspaceUnavailable(f"apt-get {args[0]} failed: {e}") from e
    if proc.returncode != 0:
        raise UserspaceUnavailable(
            f"apt-get {args[0]} exited {proc.returncode}:\n{_tail(proc.stderr or proc.stdout)}")


def ensure_nvidia_userspace(cache: Path | None = None) -> NvidiaUserspace:
    """The unpacked packages, fetched first if missing; UserspaceUnavailable when they cannot."""
    base = cache or cache_dir()
    base.mkdir(parents=True, exist_ok=True)
    root = base / "root"
    with open(base / ".lock", "w", encoding="utf-8") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one fetcher at a time
        stamp = root / STAMP
        if stamp.is_file():
            return NvidiaUserspace(root, stamp.read_text(encoding="utf-8").split()[0], None)
        if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
            raise UserspaceUnavailable("apt-get and dpkg-deb are needed (a Debian machine)")
        return _fetch(base, root)


def _fetch(base: Path, root: Path) -> NvidiaUserspace:
    started = time.monotonic()
    for sub in ("apt/lists/partial", "apt/cache/archives/partial"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    (base / "apt" / "nvidia.sources").write_text(private_sources(), encoding="utf-8")
    debs = base / "debs"
    shutil.rmtree(debs, ignore_errors=True)
    debs.mkdir()
    _apt(base, "update")
    _apt(base, "download", *PACKAGES, cwd=debs)
    tmp = base / f"root.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    for deb in sorted(debs.glob("*.deb")):
        proc = subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp)], capture_output=True,
                              text=True, timeout=120, check=False)
        if proc.returncode != 0:
            raise UserspaceUnavailable(f"dpkg-deb -x {deb.name}: {_tail(proc.stderr)}")
    names = sorted(d.name.split("_")[0] for d in debs.glob("*.deb"))
    if names != sorted(PACKAGES):
        raise UserspaceUnavailable(f"apt-get download gave {names}, not {list(PACKAGES)}")
    version = next(debs.glob("libnvidia-ml1_*.deb")).name.split("_")[1]
    # IREE loads the unversioned libcuda.so; the package ships it as a link already.
    elapsed = round(time.monotonic() - started, 1)
    (tmp / STAMP).write_text(f"{version}\nfetch_s={elapsed}\n", encoding="utf-8")
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    return NvidiaUserspace(root, version, elapsed)


def main() -> int:
    """``python -m tests.support.realnvidia``: fetch the packages (if missing) and print where."""
    try:
        found = ensure_nvidia_userspace()
    except UserspaceUnavailable as e:
        print(f"NVIDIA user space unavailable: {e}", file=sys.stderr)
        return 1
    print(f"{found.version} {found.lib_dir} {found.bin_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
