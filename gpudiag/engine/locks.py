"""Full-UUID GPU locks: one lock file per GPU leaf, flock'ed, shared by every user's jobs.

``gpudiag run``, ``gpudiag.admit()`` and the probes that touch a GPU (cuda, jax, iree) take the
same lock, so a probe and a job never meet on one GPU. Non-blocking: a taken lock is skipped
or waited for by the caller, never here.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import stat
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpudiag.core.environment import is_full_uuid

SYSTEM_LOCK_DIR = Path("/run/gpudiag/locks")
# Why a GPU whose full-UUID lock a job holds is BUSY (its process may not be up yet).
JOB_LOCKED = "locked by a gpudiag run job"


@dataclass(frozen=True)
class LockDirChoice:
    """Which lock folder a process uses, and whether every job on the host shares it."""

    path: Path
    shared: bool  # /run/gpudiag/locks or GPUDIAG_LOCK_DIR: what jobs and the daemon agree on
    why: str  # how it was chosen; for a private fallback, why the shared one was unusable


def choose_lock_dir(env: Mapping[str, str] | None = None) -> LockDirChoice:
    """GPUDIAG_LOCK_DIR, else /run/gpudiag/locks when usable, else a private fallback."""
    env = os.environ if env is None else env
    if env.get("GPUDIAG_LOCK_DIR"):
        return LockDirChoice(Path(env["GPUDIAG_LOCK_DIR"]), True, "GPUDIAG_LOCK_DIR")
    system = SYSTEM_LOCK_DIR
    problem = ""
    try:
        if not system.is_dir():
            system.mkdir(parents=True, exist_ok=True)
            # Shared by every user's jobs, like /tmp: anyone may add a lock, none may delete.
            system.chmod(0o1777)
    except OSError as e:
        problem = f"cannot create it: {e.strerror or e}"
    if system.is_dir() and os.access(system, os.W_OK | os.X_OK):
        return LockDirChoice(system, True, "the system lock folder")
    if not problem:
        problem = (f"not writable by uid {os.getuid()}" if system.is_dir()
                   else "it does not exist")
    # A per-user fallback only excludes this user's own jobs: say so in docs/runner.md.
    runtime = env.get("XDG_RUNTIME_DIR")
    fallback = (Path(runtime) if runtime else _private_tmp_root()) / "gpudiag" / "locks"
    return LockDirChoice(fallback, False, f"{system}: {problem}")


def default_lock_dir(env: Mapping[str, str] | None = None) -> Path:
    """GPUDIAG_LOCK_DIR, else /run/gpudiag/locks when usable, else under XDG_RUNTIME_DIR."""
    return choose_lock_dir(env).path


def _private_tmp_root() -> Path:
    return Path(f"/tmp/gpudiag-{os.getuid()}")


def _check_private_root(lock_dir: Path) -> None:
    """The /tmp fallback must be this user's own folder: another user could have made it
    first, and whoever owns a lock folder can delete a held lock file and split the lock."""
    root = _private_tmp_root()
    if root != lock_dir and root not in lock_dir.parents:
        return
    with contextlib.suppress(FileExistsError):
        root.mkdir(mode=0o700)
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise LockFailed(f"{root} is not a folder of uid {os.getuid()} closed to others "
                         f"(owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}): someone "
                         "else may have made it; remove it, or set GPUDIAG_LOCK_DIR or "
                         "XDG_RUNTIME_DIR")


@dataclass(frozen=True)
class LockInfo:
    """One held lock: the full UUID, its file and the file's identity."""

    uuid: str
    path: str
    device: int
    inode: int
    fd: int = field(compare=False)

    def record(self) -> dict[str, Any]:
        return {"uuid": self.uuid, "path": self.path, "device": self.device,
                "inode": self.inode}


class LockFailed(Exception):
    """A lock file could not be opened (as opposed to being held by someone else)."""


def _lock_path(lock_dir: Path, uuid: str) -> Path:
    if not is_full_uuid(uuid):
        raise ValueError(f"{uuid!r} is not a full GPU-/MIG- UUID; locks name full UUIDs only")
    return lock_dir / f"{uuid}.lock"




MAX_HOLDER_BYTES = 4096      # a holder record is ~150 bytes; anyone may write the file
_OPEN_TRIES = 5              # re-opens when the path was replaced under us


def _check_lock_dir(lock_dir: Path) -> None:
    """A folder others may write must be sticky: otherwise anyone can remove a held lock."""
    with contextlib.suppress(OSError):
        st = os.stat(lock_dir)
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            mode = stat.S_IMODE(st.st_mode)
            raise LockFailed(f"lock folder {lock_dir} is writable by others without the sticky "
                             f"bit (mode {mode:o}): anyone could remove a held lock file and "
                             "split the lock; chmod 1777 it, or use a folder only you can write")


def _open_lock_file(path: Path) -> int:
    """Open (creating) a lock file: never through a symlink, never blocking on a FIFO.

    Read-write to write the holder record; read-only when someone made the file closed to
    us (flock works on either, so a planted 0644 file does not keep others off the GPU).
    """
    flags = os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        return os.open(path, flags | os.O_RDWR, 0o666)
    except PermissionError:
        return os.open(path, flags | os.O_RDONLY, 0o666)


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (not unlinked nor replaced)."""
    try:
        here, there = os.fstat(fd), os.lstat(path)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _claim(fd: int) -> None:
    """Make the locked file one its creator can no longer remove (root only).

    In a sticky folder only the file's owner (or root) may unlink it. A lock file created by
    another user could be unlinked by that user while root's job holds it, and the next job
    would lock a new file of the same name: two jobs on one GPU. Root takes the file over
    while holding its lock, so the lock cannot be split for as long as it is held.
    """
    st = os.fstat(fd)
    if os.geteuid() == 0 and st.st_uid != 0:
        os.fchown(fd, 0, -1)
    if os.fstat(fd).st_uid == os.geteuid():
        os.fchmod(fd, 0o666)  # other users' jobs must be able to open it too


def try_lock(lock_dir: Path, uuid: str, *, purpose: str = "job",
             shared: bool = False) -> LockInfo | None:
    """Take the lock of ``uuid`` without waiting; None when another process holds it.

    ``purpose`` goes into the holder record: ``job`` (a `gpudiag run` job, `admit()`) or
    ``probe`` (a probe touching the GPU for a moment), so that others can tell a GPU in use
    from one being proven right now. LockFailed names a lock file that is not a plain regular
    file (someone planted it): that GPU cannot be locked, the others still can.

    ``shared`` takes a shared lock (probes on a GPU in the default compute mode): gpudiag
    probes started together prove a GPU side by side instead of finding each other "busy",
    while a job's exclusive lock still excludes them all. A shared holder writes no holder
    record (several may hold it at once); an exclusive lock means a job, or a probe on a GPU
    in exclusive-process mode, and its holder record says which.
    """
    path = _lock_path(lock_dir, uuid)
    try:
        _check_private_root(lock_dir)
        lock_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LockFailed(f"cannot make lock folder {lock_dir}: {e.strerror or e}") from e
    _check_lock_dir(lock_dir)
    for _ in range(_OPEN_TRIES):
        fd = _locked_fd(path, shared)
        if fd is None:
            return None
        # The lock is ours only if the path still names the file we locked: a file unlinked
        # or renamed over meanwhile (the lock was split, or a waiter's file went stale) is
        # let go and the path opened again.
        if _same_file(fd, path):
            with contextlib.suppress(OSError):
                _claim(fd)
            if _same_file(fd, path):
                if not shared:  # several shared holders at once: the record is exclusive's
                    _write_holder(fd, uuid, purpose)
                st = os.fstat(fd)
                return LockInfo(uuid, str(path), st.st_dev, st.st_ino, fd)
        os.close(fd)
    raise LockFailed(f"lock file {path} kept being replaced while it was locked (someone is "
                     "removing or renaming it); that GPU is left alone")


def _locked_fd(path: Path, shared: bool = False) -> int | None:
    """Open ``path`` and flock it; None when another process holds it; LockFailed if unusable."""
    try:
        # Never unlinked by gpudiag: a lock file that vanished under a waiter splits the lock.
        # O_NOFOLLOW: the lock folder is shared (sticky, world-writable), so a symlink planted
        # there must not make this process truncate and write a file the planter chose.
        fd = _open_lock_file(path)
    except OSError as e:
        raise LockFailed(f"cannot open lock file {path}: {e.strerror or e} (a lock file must "
                         "be a regular file, not a symlink)") from e
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        raise LockFailed(f"lock file {path} is not a plain regular file (a FIFO, device or "
                         "hard link someone planted?); remove it")
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError as e:
        os.close(fd)
        raise LockFailed(f"cannot lock {path}: {e.strerror or e}") from e
    return fd


def _write_holder(fd: int, uuid: str, purpose: str) -> None:
    holder = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                         "since": time.time(), "uuid": uuid, "purpose": purpose}) + "\n"
    with contextlib.suppress(OSError):  # a read-only fd (a file closed to us): no record
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder.encode(), 0)


def read_shared_file(path: Path, limit: int = MAX_HOLDER_BYTES) -> bytes | None:
    """At most ``limit`` bytes of a regular file in a folder others may write; else None.

    Never follows a symlink, never blocks on a FIFO (or a device), never reads past the
    limit: whatever someone planted at ``path`` costs a None, not a hang or a crash.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.pread(fd, limit, 0)
    except OSError:
        return None
    finally:
        os.close(fd)


def lock_holder(lock_dir: Path, uuid: str) -> dict[str, Any] | None:
    """What the last holder wrote into the lock file (evidence only; may be stale)."""
    raw = read_shared_file(_lock_path(lock_dir, uuid))
    if raw is None:
        return None
    try:
        text = raw.decode("utf-8", errors="replace")
        value = json.loads(text) if text.strip() else None
    except (ValueError, RecursionError):  # anyone may write a lock file
        return None
    return value if isinstance(value, dict) else None


def release(locks: Sequence[LockInfo]) -> None:
    """Close the lock files (the kernel drops the flock once no process holds the file)."""
    for lk in locks:
        with contextlib.suppress(OSError):
            st = os.fstat(lk.fd)
            # Idempotent: a second release must not close an unrelated file that reused
            # the descriptor number.
            if (st.st_dev, st.st_ino) == (lk.device, lk.inode):
                os.close(lk.fd)
