"""The run's artifacts folder: private, the caller's own, created fresh; files never followed.

``gpudiag run`` writes the job's output, its plan and closeout there, puts a Python hook
folder from there first on the child's PYTHONPATH and reads the plan back. So the folder
decides what runs and where the job's output lands: it must be one nobody else can write.
A folder another user made (in a 1777 /tmp, say) could hold a symlink ``stdout.log -> /etc/...``
or a planted ``python-hook/json.py`` that root's job would import. Checked here, before
anything is written:

- the folder is a real folder (not a symlink), owned by the caller, not writable by group
  or others; absent, it is created 0700;
- no folder above it is writable by others without the sticky bit, and for root none is
  owned by another user (who could swap the folder under the run);
- default run folders are made with ``mkdtemp`` (an unpredictable name, 0700);
- every file gpudiag creates there is opened O_CREAT|O_EXCL|O_NOFOLLOW.
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import stat
import tempfile
import time
from pathlib import Path


class UntrustedFolder(Exception):
    """A folder others could write or swap; the message says which and how to fix it."""


def _describe(st: os.stat_result) -> str:
    return f"owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}"


def check_ancestors(folder: Path) -> None:
    """UntrustedFolder when a folder above ``folder`` lets someone else replace it."""
    me = os.geteuid()
    for parent in Path(os.path.realpath(folder)).parents:
        try:
            st = os.stat(parent)
        except OSError:
            continue
        if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            raise UntrustedFolder(f"{parent} is writable by everyone without the sticky bit "
                                  f"({_describe(st)}): anyone could replace {folder}; use "
                                  "a folder under one that only you (and root) can write")
        if me == 0 and st.st_uid not in (0, me):
            raise UntrustedFolder(f"{parent} belongs to another user ({_describe(st)}), who "
                                  f"could replace {folder} under root's run; use a folder "
                                  "under root-owned ones")


def check_private(folder: Path) -> None:
    """UntrustedFolder unless ``folder`` is a real folder of the caller closed to others."""
    st = os.lstat(folder)
    if stat.S_ISLNK(st.st_mode):
        raise UntrustedFolder(f"{folder} is a symlink: give the real folder")
    if not stat.S_ISDIR(st.st_mode):
        raise UntrustedFolder(f"{folder} is not a folder")
    if st.st_uid != os.geteuid():
        raise UntrustedFolder(f"{folder} belongs to another user ({_describe(st)}): its "
                              "files and hook could be planted; use a folder of your own "
                              "(absent folders are created private)")
    if st.st_mode & stat.S_IWOTH or (st.st_mode & stat.S_IWGRP
                                      and not _private_group(st.st_gid)):
        raise UntrustedFolder(f"{folder} is writable by others ({_describe(st)}): chmod "
                              "go-w it, or use a folder only you can write")


def _private_group(gid: int) -> bool:
    """A user-private group (named as the caller, no listed members): group-writable is
    then only the caller (Debian's and Fedora's umask 002 for ordinary users)."""
    try:
        group, user = grp.getgrgid(gid), pwd.getpwuid(os.geteuid())
    except KeyError:
        return False
    return gid == user.pw_gid and group.gr_name == user.pw_name and not group.gr_mem


def prepare_folder(folder: Path) -> Path:
    """Create ``folder`` 0700 when absent (parents as usual), then check it is private."""
    check_ancestors(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        pass
    check_private(folder)
    return folder


def new_run_folder(root: Path, now: float | None = None) -> Path:
    """A fresh private run folder under ``root``: ``STAMP-xxxxxxxx``, unpredictable, 0700.

    ``root`` itself must be the caller's (``prepare_folder``): whoever can write it could
    move a run folder aside and put their own in its place.
    """
    prepare_folder(root)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    return Path(tempfile.mkdtemp(prefix=f"{stamp}-", dir=root))


def fresh_subfolder(folder: Path) -> Path:
    """``folder`` made anew (0700), whatever was there: its content is only ever ours."""
    if folder.is_symlink() or folder.exists():
        if folder.is_dir() and not folder.is_symlink():
            shutil.rmtree(folder)
        else:
            folder.unlink()
    folder.mkdir(mode=0o700)
    return folder


def create_new(path: Path, mode: int = 0o644) -> int:
    """A new file at ``path`` for writing (an old one is removed first); never a symlink's
    target, never an existing file's inode."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                   mode)


def read_own(path: Path, limit: int = 16 * 2**20) -> bytes:
    """Read back a file gpudiag wrote: no symlink, a regular file, at most ``limit`` bytes."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        with os.fdopen(os.dup(fd), "rb") as fh:
            return fh.read(limit)
    finally:
        os.close(fd)
