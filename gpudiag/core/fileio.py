"""Crash-safe file writes: temporary file in the same folder, fsync, rename, fsync folder."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

_HINTS = {
    errno.ENOSPC: "the filesystem is full: free space there or write elsewhere",
    errno.EDQUOT: "the disk quota is used up: free space or write elsewhere",
    errno.ENOENT: "the folder does not exist (or vanished meanwhile)",
    errno.ENOTDIR: "a part of the path is not a folder",
    errno.EROFS: "the filesystem is read-only: write elsewhere",
    errno.EACCES: "no permission: write in a folder this user can write",
    errno.EIO: "an I/O error: check the disk (dmesg)",
}


def write_failure(error: OSError) -> str:
    """'CAUSE (what to do)' for a failed write: the OS's words and a hint, no traceback."""
    hint = _HINTS.get(error.errno or 0)
    return f"{error.strerror or error}" + (f" ({hint})" if hint else "")


def write_error(path: str | os.PathLike[str], error: OSError) -> str:
    """'cannot write PATH: CAUSE (what to do)' for a failed write."""
    return f"cannot write {path}: {write_failure(error)}"


def atomic_write(path: str | os.PathLike[str], data: str | bytes, mode: int = 0o644) -> Path:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never half."""
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    raw = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(raw)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return target
