"""A small real filesystem that tests fill up and empty again (no tests here).

A tmpfs of a few hundred KiB, mounted under the test's tmp folder and unmounted in teardown,
so that "disk full" is the kernel's own ENOSPC, seen by SQLite and by ``atomic_write`` alike.
Mounting needs root (the dev container and CI run as root); elsewhere the tests skip and say
why.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

NOT_ROOT = "a small tmpfs for the full-disk tests needs root (CI and the dev container are root)"


@contextmanager
def small_tmpfs(where: Path, size: str = "1m", options: str = "") -> Iterator[Path]:
    """Mount a tmpfs of ``size`` at ``where`` for the duration; skips when that is not allowed.

    ``options``: more mount options, e.g. ``ro`` for a filesystem even root cannot write.
    """
    if os.geteuid() != 0:
        pytest.skip(NOT_ROOT)
    if shutil.which("mount") is None:
        pytest.skip("no mount(8) on this host for the full-disk tests")
    where.mkdir(parents=True, exist_ok=True)
    opts = f"size={size},mode=0755" + (f",{options}" if options else "")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "gpudiag-test", str(where)],
                          capture_output=True, text=True, timeout=30, check=False)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs for the full-disk tests: {proc.stderr.strip()}")
    try:
        yield where
    finally:
        # Lazy: a daemon that still has a file open there must not fail the teardown.
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30,
                       check=False)


def fill(folder: Path) -> Path:
    """Write zeros into ``folder/filler`` until the filesystem says ENOSPC; returns the file."""
    path = folder / "filler"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    block = b"\0" * 4096
    try:
        while True:
            try:
                os.write(fd, block)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
                block = block[: len(block) // 2]
                if not block:  # not even one byte fits: full
                    return path
    finally:
        os.close(fd)


def free_bytes(folder: Path) -> int:
    """Bytes still free for an ordinary user on ``folder``'s filesystem."""
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize
