"""Crash-safe file writes: temporary file in the same folder, fsync, rename, fsync folder."""

from __future__ import annotations

import errno
import os
import re
import stat
import tempfile
from collections.abc import Container
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
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never half.

    The one crash-safe write of the package (``core/child.py`` alone keeps its own: it is
    copied into a job's ``sitecustomize.py`` and imports nothing of gpudiag). Safe in a folder
    others may write: the temporary is a fresh file of a random name (``O_EXCL``: never
    through a planted link), hidden (``.NAME.*.tmp``: inbox pollers read ``*.json`` only),
    given ``mode`` on its descriptor, and renamed over ``path``, which replaces a link planted
    there rather than writing through it.
    """
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    raw = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(raw)
            fh.flush()
            os.fsync(fh.fileno())
            os.fchmod(fh.fileno(), mode)
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


class UnwritableTarget(ValueError):
    """An output path gpudiag will not write (a symlink, a block device, a socket, a FIFO
    nobody reads); the message says why and what to give instead."""


_STD_STREAMS = {"/dev/stdout": 1, "/dev/stderr": 2}
_FD_PATH = re.compile(r"/(?:dev/fd|proc/self/fd)/([0-9]{1,9})")


def _inherited_fd(path: str) -> int | None:
    """The descriptor a /dev/stdout, /dev/stderr or /dev/fd/N path names, else None."""
    if path in _STD_STREAMS:
        return _STD_STREAMS[path]
    m = _FD_PATH.fullmatch(path)
    return int(m.group(1)) if m else None


def check_output_target(path: str | os.PathLike[str]) -> str:
    """How ``path`` will be written: ``fd`` (an inherited stream), ``stream`` (a FIFO or a
    character device such as a tty or /dev/null, written in place), or ``file`` (replaced
    atomically). UnwritableTarget for anything else: never renamed over, never followed."""
    text = os.fspath(path)
    if _inherited_fd(text) is not None:
        return "fd"
    try:
        st = os.lstat(text)
    except FileNotFoundError:
        return "file"
    if stat.S_ISREG(st.st_mode):
        return "file"
    if stat.S_ISFIFO(st.st_mode) or stat.S_ISCHR(st.st_mode):
        return "stream"
    kind = ("a symlink" if stat.S_ISLNK(st.st_mode) else "a block device"
            if stat.S_ISBLK(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
            else "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file")
    raise UnwritableTarget(f"{text} is {kind}: gpudiag neither follows nor replaces it; name a "
                           "regular file (or /dev/stdout, a FIFO, a tty)")


def write_output(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Write a record to ``path``: files atomically, streams in place (see check_output_target)."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    kind = check_output_target(path)
    if kind == "file":
        atomic_write(path, raw)
        return
    fd = _inherited_fd(os.fspath(path))
    if fd is not None:
        _write_all(fd, raw)
        return
    try:
        # Non-blocking open: a FIFO nobody reads fails at once (ENXIO) instead of hanging.
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
                     | os.O_NOCTTY)
    except OSError as e:
        if e.errno == errno.ENXIO:
            raise UnwritableTarget(f"{os.fspath(path)} is a FIFO that nobody reads") from e
        raise
    try:
        st = os.fstat(fd)
        if not (stat.S_ISFIFO(st.st_mode) or stat.S_ISCHR(st.st_mode)):  # swapped meanwhile
            raise UnwritableTarget(f"{os.fspath(path)} changed while it was opened")
        os.set_blocking(fd, True)
        _write_all(fd, raw)
    finally:
        os.close(fd)


def _write_all(fd: int, raw: bytes) -> None:
    view = memoryview(raw)
    while view:
        view = view[os.write(fd, view):]


class RefusedFile(ValueError):
    """A file not read: the message says why, without the path (the caller names it)."""


def read_regular(path: str | os.PathLike[str], limit: int, *, follow: bool = False
                 ) -> tuple[bytes, os.stat_result]:
    """A regular file's bytes (at most ``limit``) and its stat, never through a symlink.

    For folders other users write (inboxes): O_NOFOLLOW refuses a planted symlink,
    O_NONBLOCK a FIFO that would hang the reader, and fstat before reading refuses a folder
    or device (io would raise IsADirectoryError as a traceback on every poll; /dev/zero
    would be read until memory runs out). ``follow`` lets a symlink lead to the file (an
    admin's config that Kubernetes or a config manager links in): what it leads to must
    still be a regular file, read without blocking and within ``limit``.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise RefusedFile(f"cannot open it: {e.strerror or e}") from e
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device"
                if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "a folder"
                if stat.S_ISDIR(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
                else "not a regular file")
        raise RefusedFile(f"not a regular file ({kind})" if kind != "not a regular file"
                          else kind)
    with os.fdopen(fd, "rb") as fh:
        try:
            raw = fh.read(limit + 1)
        except OSError as e:
            raise RefusedFile(f"cannot read it: {e.strerror or e}") from e
    if len(raw) > limit:
        raise RefusedFile(f"larger than {limit} bytes")
    return raw, st


def inbox_names(folder: Path, skip: Container[str], limit: int | None = None) -> list[str]:
    """The ``.json`` files waiting in an inbox folder, oldest name first, less ``skip``; with
    ``limit``, of the first ``limit`` such names the listing gives (a folder of a million
    planted files then costs one bounded read, not a million names sorted).

    Empty when the folder cannot be listed: the next poll tries again.
    """
    names: list[str] = []
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.name.endswith(".json") and entry.name not in skip:
                    names.append(entry.name)
                    if limit is not None and len(names) >= limit:
                        break
    except OSError:
        return []
    return sorted(names)
