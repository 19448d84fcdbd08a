"""The daemon's state directory: one daemon per directory, and a history that always opens.

Two daemons on one state directory would probe the same GPUs twice and write one history, so
``gpudiag serve`` takes an exclusive ``flock`` on ``daemon.lock`` before it touches anything
else. The kernel drops the lock when the holder dies, however it dies, so a stale file never
blocks a restart; the PID written into it only serves the message of the second daemon.

A damaged history (random bytes, a torn copy, SQLite's "malformed") must not take monitoring
down with it: it is moved aside as ``history.sqlite3.damaged-<time>`` (never deleted, with
its WAL beside it) and a fresh history is started. Only a directory that cannot be used at
all (not a directory, not writable) is a startup error.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from gpudiag.core.ascii_ints import ascii_int
from gpudiag.core.records import dataclass
from gpudiag.daemon.recorder import HistoryRecorder
from gpudiag.daemon.store import DB_NAME, HistoryDamagedError, HistoryError, HistoryStore

log = logging.getLogger("gpudiag.daemon.statedir")

LOCK_NAME = "daemon.lock"
DAMAGED_INFIX = ".damaged-"
# SQLite's companions of a database file: they belong to the damaged file, not the new one
# (a fresh history opened beside an old WAL would replay its pages).
COMPANIONS = ("-wal", "-shm", "-journal")


class StateDirError(Exception):
    """The state directory cannot be used at all (not a directory, not writable)."""


class StateDirBusy(StateDirError):
    """Another daemon holds the state directory; the message names its PID."""

    def __init__(self, message: str, pid: int | None) -> None:
        super().__init__(message)
        self.pid = pid


@dataclass(frozen=True)
class StateDirLock:
    """The held lock: an open file descriptor (closed at exit, or by ``release``)."""

    path: Path
    fd: int

    def release(self) -> None:
        """Drop the lock (the kernel does it too when the process ends)."""
        try:
            os.close(self.fd)
        except OSError:
            pass


def lock_state_dir(state_dir: Path) -> StateDirLock:
    """Create the directory if needed and hold its lock; StateDirBusy when another daemon has it."""
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        if not state_dir.is_dir():
            raise StateDirError(f"{state_dir} is not a directory")
        path = state_dir / LOCK_NAME
        # O_CLOEXEC (Python's default): a probe child must never inherit and keep the lock.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise StateDirError(f"{state_dir}: {e.strerror or e}") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = _read_pid(fd)
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            who = f"PID {holder}" if holder is not None else "a process whose PID is unknown"
            raise StateDirBusy(f"another gpudiag daemon ({who}) uses the state directory "
                               f"{state_dir} (lock {path}); stop it, or give this one its own "
                               "--state-dir", holder) from e
        raise StateDirError(f"cannot lock {path}: {e.strerror or e}") from e
    try:
        # Said for the second daemon's message only: a full disk must not stop the first.
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as e:
        log.warning("could not write the PID into %s: %s", path, e.strerror or e)
    return StateDirLock(path, fd)


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return ascii_int(text)


def check_writable(state_dir: Path) -> None:
    """StateDirError unless the daemon can create files in ``state_dir``."""
    if not os.access(state_dir, os.W_OK | os.X_OK):
        raise StateDirError(f"{state_dir} is not writable by this user (uid {os.geteuid()})")


def damaged_histories(state_dir: Path) -> tuple[str, ...]:
    """Names of the damaged histories moved aside in ``state_dir``, oldest first."""
    try:
        names = os.listdir(state_dir)
    except OSError:
        return ()
    return tuple(sorted(n for n in names if n.startswith(DB_NAME + DAMAGED_INFIX)
                        and not n.endswith(COMPANIONS)))


def move_aside(db: Path, wall: Callable[[], float] = time.time) -> Path:
    """Rename a damaged history (and its WAL) to ``<name>.damaged-<UTC time>``; returns it."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(wall()))
    target = db.with_name(f"{db.name}{DAMAGED_INFIX}{stamp}")
    n = 1
    while target.exists():  # two in one second: never overwrite an earlier one
        n += 1
        target = db.with_name(f"{db.name}{DAMAGED_INFIX}{stamp}.{n}")
    os.rename(db, target)
    for suffix in COMPANIONS:
        companion = db.with_name(db.name + suffix)
        if companion.exists():
            os.rename(companion, target.with_name(target.name + suffix))
    return target


@dataclass(frozen=True)
class OpenedHistory:
    """The store the daemon writes, and the damaged files found or moved aside."""

    store: HistoryStore
    moved_aside: Path | None
    damaged: tuple[str, ...]


def open_history(state_dir: Path, *, retention_s: float, max_bytes: int,
                 wall: Callable[[], float] = time.time) -> OpenedHistory:
    """Open (checked) the history; a damaged one is moved aside and a fresh one started.

    Raises HistoryError when even a fresh history cannot be opened.
    """
    db = state_dir / DB_NAME
    moved: Path | None = None
    try:
        store = HistoryStore(db, retention_s=retention_s, max_bytes=max_bytes, check=True)
    except HistoryDamagedError as e:
        try:
            moved = move_aside(db, wall)
        except OSError as err:
            raise HistoryError(f"history {db} is damaged ({e.__cause__ or e}) and cannot be "
                               f"moved aside: {err.strerror or err}") from err
        log.error("history %s is damaged (%s); moved it aside to %s and started a fresh one",
                  db, e.__cause__ or e, moved.name,
                  extra={"damaged": str(moved), "cause": str(e.__cause__ or e)})
        store = HistoryStore(db, retention_s=retention_s, max_bytes=max_bytes, check=True)
    return OpenedHistory(store, moved, damaged_histories(state_dir))


def start_history(state_dir: Path, *, retention_s: float, max_bytes: int) -> HistoryRecorder:
    """The daemon's recorder; a history that cannot be opened now (a full disk at start) is
    a history that is not writable yet, retried while changes wait, not a daemon that exits."""

    def opener() -> HistoryStore:
        return open_history(state_dir, retention_s=retention_s, max_bytes=max_bytes).store

    try:
        opened = open_history(state_dir, retention_s=retention_s, max_bytes=max_bytes)
    except HistoryError as e:
        return HistoryRecorder(None, opener=opener, open_error=e,
                               damaged=damaged_histories(state_dir))
    return HistoryRecorder(opened.store, opener=opener, damaged=opened.damaged)
