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
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from gpudiag.core.environment import is_full_uuid
from gpudiag.core.proclocks import KernelLock as KernelLock
from gpudiag.core.proclocks import flocks_on, parse_proc_locks
from gpudiag.core.records import dataclass

if TYPE_CHECKING:
    import psutil  # imported where a lock holder is named: 11 ms of every CLI start else

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
    # A probe also holds the GPU's probe mark (``UUID.probing``, shared): what tells others,
    # through the kernel's lock table, that this process is proving the GPU, not using it.
    # A qualification holds ``UUID.qualifying`` the same way: a user of the GPU that yields.
    mark: tuple[int, int, int] | None = field(default=None, compare=False)  # fd, dev, inode

    def record(self) -> dict[str, Any]:
        return {"uuid": self.uuid, "path": self.path, "device": self.device,
                "inode": self.inode}


class LockFailed(Exception):
    """A lock file could not be opened (as opposed to being held by someone else)."""


def _lock_path(lock_dir: Path, uuid: str) -> Path:
    if not is_full_uuid(uuid):
        raise ValueError(f"{uuid!r} is not a full GPU-/MIG- UUID; locks name full UUIDs only")
    return lock_dir / f"{uuid}.lock"


def _mark_path(lock_dir: Path, uuid: str) -> Path:
    """The probe mark of ``uuid``: a probe holds its flock beside the GPU's lock."""
    return _lock_path(lock_dir, uuid).with_suffix(".probing")


def qualifying_path(lock_dir: Path, uuid: str) -> Path:
    """The qualification mark of ``uuid``: a qualification holds its flock (shared) beside
    the GPU's lock, so that a job refused or waiting can say that a qualification holds the
    GPU (and that it yields), not "others"."""
    return _lock_path(lock_dir, uuid).with_suffix(".qualifying")


def waiting_path(lock_dir: Path, uuid: str) -> Path:
    """The waiting mark of ``uuid``: a job waiting for the GPU holds its flock (shared), so
    that a qualification measuring the GPU sees it (in /proc/locks) and yields."""
    return _lock_path(lock_dir, uuid).with_suffix(".waiting")


def hold_waiting(lock_dir: Path, uuids: Sequence[str]) -> list[int]:
    """Hold the waiting marks of ``uuids`` (shared; unusable ones skipped): the descriptors,
    for ``let_go``."""
    fds: list[int] = []
    for uuid in uuids:
        try:
            fd = _hold_mark(waiting_path(lock_dir, uuid))
        except ValueError:
            continue
        if fd is not None:
            fds.append(fd)
    return fds


def let_go(fds: Sequence[int]) -> None:
    """Close descriptors ``hold_waiting`` returned."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


LOCK_FILE_MODE = 0o644
# How long a probe tries for its mark while another reader's O(1) test (``mark_held``) holds
# it: microseconds, unless that reader is preempted between its flock and its close, which on
# a loaded host (32 gpudiag commands at once on 2 cores) lasts a scheduler slice or several.
# A mark not taken makes its probe look like a job to its siblings (``devices_busy``).
MARK_WAIT_S = 0.5
_MARK_PAUSE_S = (0.001, 0.02)  # first pause, longest pause (doubling between)
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
        # 0644: others lock it through a read-only descriptor (flock needs no write access)
        # and cannot write the holder record, which is for display only anyway.
        return os.open(path, flags | os.O_RDWR, LOCK_FILE_MODE)
    except PermissionError:
        return os.open(path, flags | os.O_RDONLY, LOCK_FILE_MODE)


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
        # Other users' jobs open it read-only (enough to flock it); none may write it.
        os.fchmod(fd, LOCK_FILE_MODE)


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
    # A probe (a qualification) holds its mark before the lock itself: whoever sees it hold
    # the lock sees the mark too, never a moment where a sibling probe looks like a job.
    marks = {"probe": _mark_path, "qualify": qualifying_path}
    mark = _take_mark(marks[purpose](lock_dir, uuid)) if purpose in marks else None
    try:
        lock = _try_lock_file(path, uuid, purpose, shared, mark)
    except BaseException:
        _drop_mark(mark)
        raise
    if lock is None:
        _drop_mark(mark)
    return lock


def _drop_mark(mark: tuple[int, int, int] | None) -> None:
    if mark is not None:
        with contextlib.suppress(OSError):
            os.close(mark[0])


def _try_lock_file(path: Path, uuid: str, purpose: str, shared: bool,
                   mark: tuple[int, int, int] | None) -> LockInfo | None:
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
                return LockInfo(uuid, str(path), st.st_dev, st.st_ino, fd, mark)
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


def _take_mark(path: Path) -> tuple[int, int, int] | None:
    """Hold a mark (``UUID.probing``, ``UUID.qualifying``; shared: several holders at once);
    None if unusable.

    Without a mark this probe looks like a job to the others (a GPU in use): the safe side.
    """
    fd = _hold_mark(path)
    if fd is None:
        return None
    st = os.fstat(fd)
    return fd, st.st_dev, st.st_ino


def _hold_mark(path: Path) -> int | None:
    """A shared hold of the mark file ``path`` (probe, qualifying or waiting mark), or None
    when it is unusable or stays held exclusively past ``MARK_WAIT_S``.

    Only another reader's O(1) look (``mark_held``, a qualification's watcher) holds a mark
    exclusively, for its moment, or someone who planted a lock there: tried again, with
    doubling pauses, for a bounded while.
    """
    deadline = time.monotonic() + MARK_WAIT_S
    pause, longest = _MARK_PAUSE_S
    while True:
        try:
            fd = _locked_fd(path, shared=True)
        except LockFailed:
            return None
        if fd is not None:
            with contextlib.suppress(OSError):
                _claim(fd)
            return fd
        if time.monotonic() >= deadline:
            return None
        time.sleep(pause)
        pause = min(pause * 2, longest)


def mark_held(lock_dir: Path, uuid: str, which: str = "probe") -> bool:
    """Whether anyone holds ``uuid``'s probe mark (``which="probe"``) or qualification mark
    (``"qualify"``): the O(1) attempt, let go at once. Nobody holding the probe mark means no
    holder of the GPU's lock can be a sibling probe, with no table to read."""
    path = (_mark_path if which == "probe" else qualifying_path)(lock_dir, uuid)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # unusable: cannot say nobody holds it (the caller then names holders)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return True
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True  # held (or not testable): the caller names the holders
    finally:
        os.close(fd)
    return False


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
    """What the last holder wrote into the lock file (display only: may be stale, and it
    decides nothing; who holds the lock is ``holders``, from the kernel)."""
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
        for fd, device, inode in ((lk.fd, lk.device, lk.inode), lk.mark or (-1, 0, 0)):
            with contextlib.suppress(OSError):
                st = os.fstat(fd)
                # Idempotent: a second release must not close an unrelated file that reused
                # the descriptor number.
                if (st.st_dev, st.st_ino) == (device, inode):
                    os.close(fd)


# --- is a lock held: the kernel's O(1) answer ------------------------------------------------

# What a non-blocking attempt on a fresh open file description says of a GPU's lock.
LockState = Literal["free", "shared", "exclusive"]
LOCK_FREE: LockState = "free"            # nobody holds it (our attempt got it, let go at once)
LOCK_SHARED: LockState = "shared"        # only shared holders (probes, a qualification, ...)
LOCK_EXCLUSIVE: LockState = "exclusive"  # an exclusive holder (a job, an exclusive-mode probe)


def lock_state(lock_dir: Path, uuid: str) -> LockState:
    """Whether ``uuid``'s lock is held, and how: the kernel's answer to a non-blocking
    attempt on a fresh open file description, released at once (closing it).

    O(1), and valid in any pid namespace: a lock held by a process this reader cannot see
    (another pid namespace, a sandboxed daemon's hidden /proc) still conflicts, where the
    global table (``/proc/locks``) lists only what the reader's namespace shows and costs
    time in proportion to every lock on the host. A lock file that does not exist is free;
    LockFailed names one that is not a plain regular file (its GPU cannot be locked).

    Our attempt holds the lock for the few microseconds between flock and close: a job's own
    non-blocking attempt that meets it is retried (runner/admission.py, engine/guard.py).
    """
    path = _lock_path(lock_dir, uuid)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return LOCK_FREE
    except OSError as e:
        raise LockFailed(f"cannot open lock file {path}: {e.strerror or e} (a lock file must "
                         "be a regular file, not a symlink)") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise LockFailed(f"lock file {path} is not a plain regular file (a FIFO, device "
                             "or hard link someone planted?); remove it")
        answers: tuple[tuple[int, LockState], ...] = (
            (fcntl.LOCK_EX, LOCK_FREE), (fcntl.LOCK_SH, LOCK_SHARED))
        for mode, answer in answers:
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            except OSError as e:
                raise LockFailed(f"cannot test lock {path}: {e.strerror or e}") from e
            return answer
        return LOCK_EXCLUSIVE
    finally:
        os.close(fd)  # the last descriptor of this description: our attempt's lock goes


# A lock file as the kernel names it: (major, minor, inode, ctime in ns). The change time
# tells a file from a later one that reuses its inode number; nobody can set it, and nothing
# changes the file while its exclusive holder holds it (only that holder writes its record).
LockFileKey = tuple[int, int, int, int]


def lock_file_key(lock_dir: Path, uuid: str) -> LockFileKey | None:
    """``uuid``'s lock file as named in ``lock_dir`` now; None when there is none (or the
    name is no GPU's)."""
    try:
        st = os.lstat(_lock_path(lock_dir, uuid))
    except (OSError, ValueError):
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return os.major(st.st_dev), os.minor(st.st_dev), st.st_ino, st.st_ctime_ns


def still_held(lock_dir: Path, uuid: str, key: LockFileKey) -> bool:
    """Whether ``uuid``'s lock file is still the file ``key`` names (not removed nor
    replaced) and someone holds it exclusively: the O(1) answer, valid for a holder in any
    pid namespace (a run this reader cannot see)."""
    if lock_file_key(lock_dir, uuid) != key:
        return False
    try:
        held = lock_state(lock_dir, uuid) == LOCK_EXCLUSIVE
    except LockFailed:
        return False
    return held and lock_file_key(lock_dir, uuid) == key


# --- who holds a lock: the kernel's word, to NAME a holder only -------------------------------

PROC_LOCKS = Path("/proc/locks")
# Any user can grow the kernel's global table (one user's 97,000 flocks made a reading take
# 4-14 s): it is read only to name a holder, off the loops, by one reader thread at a time,
# and given up past these bounds (the holder is then "unknown", never "no holder").
NAME_WAIT_S = 0.5               # how long a caller waits for a naming
NAMING_DEADLINE_S = 2.0         # a reading still going after this is abandoned
MAX_PROC_LOCKS_BYTES = 8 << 20  # ~130,000 locks: a larger table names nobody
_CHUNK_BYTES = 1 << 20          # /proc/locks restarts its walk at each read: read big


def read_lock_table(path: Path = PROC_LOCKS, *, deadline_s: float = NAMING_DEADLINE_S,
                    limit: int = MAX_PROC_LOCKS_BYTES,
                    clock: Callable[[], float] = time.monotonic) -> list[KernelLock] | None:
    """The locks of the table at ``path``; None when it cannot be read, is larger than
    ``limit`` bytes, or is not read whole within ``deadline_s`` (checked between reads)."""
    until = clock() + deadline_s
    parts: list[bytes] = []
    size = 0
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        while True:
            chunk = os.read(fd, _CHUNK_BYTES)
            if not chunk:
                break
            parts.append(chunk)
            size += len(chunk)
            if size > limit or clock() > until:
                return None
    except OSError:
        return None
    finally:
        os.close(fd)
    return parse_proc_locks(b"".join(parts).decode("ascii", "replace"))


class _Reading:
    """One reading of the kernel's table in flight, that callers may join."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.table: list[KernelLock] | None = None
        self.started = time.monotonic()


class _TableReader:
    """One reader thread at a time: callers join the reading in flight and wait for it no
    longer than they were told, so a table any user can grow never stalls a loop.

    A caller is answered only by a reading begun after it asked: a reading it joined that
    began earlier (one another caller, or its own earlier call, gave up waiting for) may list
    holders that have let go since and miss the ones that came since.
    """

    def __init__(self, path: Path = PROC_LOCKS) -> None:
        self.path = path
        self._guard = threading.Lock()
        self._flight: _Reading | None = None

    def read(self, wait_s: float) -> list[KernelLock] | None:
        asked = time.monotonic()
        until = asked + max(0.0, wait_s)
        while True:
            with self._guard:
                flight = self._flight
                if flight is None:
                    flight = self._flight = _Reading()
                    threading.Thread(target=self._run, args=(flight,), daemon=True,
                                     name="gpudiag-lock-names").start()
            if not flight.done.wait(max(0.0, until - time.monotonic())):
                return None
            if flight.started >= asked:
                return flight.table

    def _run(self, flight: _Reading) -> None:
        try:
            flight.table = read_lock_table(self.path)
        finally:
            with self._guard:
                self._flight = None
            flight.done.set()


_READER = _TableReader()


def kernel_locks(path: Path = PROC_LOCKS, *, wait_s: float = NAME_WAIT_S
                 ) -> list[KernelLock] | None:
    """Every lock the kernel holds now, to name holders; None when the table cannot be read
    within ``wait_s`` (or its bounds). Never the answer to "is it held?": ``lock_state``."""
    if path != PROC_LOCKS:
        return read_lock_table(path, deadline_s=wait_s)
    return _READER.read(wait_s)


@dataclass(frozen=True)
class Holder:
    """A process the kernel says holds a GPU's lock: its pid, uids and start time.

    ``pid`` is None when the kernel's locker no longer holds the file (it exited, or handed
    its descriptor to a process it started): the holder is then not named, never a dead pid.
    """

    pid: int | None
    uids: tuple[int, ...]  # real, effective, saved: () when not known
    shared: bool
    started_at: float | None  # the process's start (epoch seconds): a reused pid differs
    probing: bool  # it holds the GPU's probe mark too: a gpudiag probe proving the GPU now
    # It holds the GPU's qualification mark too, and runs as root or as the reader: a
    # gpudiag qualification (another uid's mark is its own claim, never believed).
    qualifying: bool = False
    # That qualification is `gpudiag serve`'s (its argv, believed only from the same uids).
    daemon: bool = False
    # The kernel lists the locker with pid 0: a process in another pid namespace (a host job
    # seen from a daemon under `unshare --pid`, a container's job seen from the host's).
    elsewhere: bool = False

    def of_uid(self, uids: Collection[int]) -> bool:
        """Whether every uid of the holder is one of ``uids`` (unknown: no)."""
        return bool(self.uids) and all(u in uids for u in self.uids)

    def describe(self) -> str:
        """``pid 42 (uid 0, exclusive)``, or ``a qualification by the gpudiag daemon (pid 42,
        uid 0, shared)``: for refusals and logs."""
        mode = "shared" if self.shared else "exclusive"
        if self.pid is None:
            if self.elsewhere:
                return f"a process in another pid namespace ({mode})"
            return f"a process that inherited the lock from its exited locker ({mode})"
        uid = self.uids[1] if len(self.uids) > 1 else "unknown"
        if self.qualifying:
            who = "a qualification by the gpudiag daemon" if self.daemon else "a qualification"
            return f"{who} (pid {self.pid}, uid {uid}, {mode})"
        return f"pid {self.pid} (uid {uid}, {mode}{', probing' if self.probing else ''})"

    def record(self) -> dict[str, Any]:
        return {"pid": self.pid, "uid": self.uids[1] if len(self.uids) > 1 else None,
                "shared": self.shared, "started_at": self.started_at,
                "probing": self.probing, "qualifying": self.qualifying,
                "daemon": self.daemon, "elsewhere": self.elsewhere}


def _file_key(path: Path) -> tuple[int, int, int] | None:
    """(major, minor, inode) of a regular file at ``path`` (not followed); None if none."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return os.major(st.st_dev), os.minor(st.st_dev), st.st_ino


def _holds_file(pid: int, device: int, inode: int) -> bool | None:
    """Whether ``pid`` has the file open now; None when its descriptors cannot be listed."""
    folder = f"/proc/{pid}/fd"
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return False
    except OSError:
        return None  # another user's process, to a non-root reader
    unreadable = False
    for name in names:
        try:
            st = os.stat(f"{folder}/{name}")
        except FileNotFoundError:
            continue  # closed since the listing
        except OSError:
            # Listed but not followed: a process of another user namespace (a daemon under
            # `unshare --user`, a container without CAP_SYS_PTRACE) shows its descriptors'
            # numbers only. That is "not known", never "it let go".
            unreadable = True
            continue
        if (st.st_dev, st.st_ino) == (device, inode):
            return True
    return None if unreadable else False


def _holder(lk: KernelLock, device: int, inode: int, marks: _Marks) -> Holder:
    """The Holder behind one kernel lock entry: the locker, if it still holds the file."""
    import psutil
    unnamed = Holder(None, (), lk.shared, None, False)
    if lk.pid <= 0:
        return replace(unnamed, elsewhere=True)  # outside this pid namespace
    try:
        proc = psutil.Process(lk.pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return unnamed
        uids = tuple(proc.uids())
        started = proc.create_time()
    except (psutil.Error, OSError):
        return unnamed  # the locker has exited: its heirs hold the lock
    if _holds_file(lk.pid, device, inode) is False:
        return unnamed  # a reused pid, or a locker that handed the file on and closed it
    holder = Holder(lk.pid, uids, lk.shared, started, marks.probe.held_by(lk.pid))
    # Anyone may hold a qualification mark: what it says is believed only from root or the
    # reader's own uid, whose argv no other user can set either.
    if holder.of_uid({0, os.geteuid()}) and marks.qualify.held_by(lk.pid):
        return replace(holder, qualifying=True, daemon=_serves(proc))
    return holder


def _serves(proc: psutil.Process) -> bool:
    """Whether ``proc``'s argv is ``gpudiag serve`` (``gpudiag ... serve``, ``python -m
    gpudiag serve``): the daemon, as far as a process of a trusted uid says."""
    import psutil
    try:
        argv = proc.cmdline()
    except (psutil.Error, OSError):
        return False
    for i, arg in enumerate(argv):
        if os.path.basename(arg) == "gpudiag" or (arg == "gpudiag" and argv[i - 1:i] == ["-m"]):
            rest = [a for a in argv[i + 1:] if not a.startswith("-")]
            return rest[:1] == ["serve"]
    return False


def holders(lock_dir: Path, uuid: str, table: list[KernelLock] | None = None
            ) -> list[Holder] | None:
    """Who holds ``uuid``'s lock now, as the kernel names them; None when that is not known
    (the table could not be read within its bounds: "unknown", never "no holder").

    To NAME holders only: whether the lock is held is ``lock_state`` (O(1), any pid
    namespace). ``table`` is a ``kernel_locks()`` reading to share between GPUs. A lock file
    that does not exist has no holder.
    """
    path = _lock_path(lock_dir, uuid)
    key = _file_key(path)
    if key is None:
        return [] if not os.path.lexists(path) else None
    if table is None:
        try:
            if lock_state(lock_dir, uuid) == LOCK_FREE:
                return []  # the kernel's O(1) answer: no holder, no table to read
        except LockFailed:
            return None
        table = kernel_locks()
    if table is None:
        return None
    found = flocks_on(table, *key)
    if not found:
        # The kernel lists only lockers visible in the reader's pid namespace: a lock the
        # O(1) test still finds held is held from another pid namespace (or just let go).
        try:
            state = lock_state(lock_dir, uuid)
        except LockFailed:
            return None
        if state == LOCK_FREE:
            return []
        return [Holder(None, (), state == LOCK_SHARED, None, False, elsewhere=True)]
    marks = _Marks(_Mark.of(_mark_path(lock_dir, uuid), table),
                   _Mark.of(qualifying_path(lock_dir, uuid), table))
    device = os.makedev(key[0], key[1])
    out = [_holder(lk, device, key[2], marks) for lk in found]
    if any(h.pid is None and not h.elsewhere for h in out):
        # A holder not named may only have let go between the table's reading and the look
        # at its process (a sibling probe done): the table read again says whether its lock
        # is still there, held by whoever the locker handed it to.
        again = kernel_locks()
        still = flocks_on(again, *key) if again is not None else found
        out = [h for h, lk in zip(out, found, strict=True) if h.pid is not None or lk in still]
    return out


@dataclass(frozen=True)
class _Mark:
    """A mark file (probe or qualification) and the pids a table reading lists on it."""

    key: tuple[int, int, int] | None  # (major, minor, inode); None: no such file
    listed: frozenset[int] = frozenset()

    @classmethod
    def of(cls, path: Path, table: list[KernelLock] | None) -> _Mark:
        key = _file_key(path)
        if key is None or table is None:
            return cls(key)
        return cls(key, frozenset(lk.pid for lk in flocks_on(table, *key) if lk.pid > 0))

    def held_by(self, pid: int) -> bool:
        """Whether ``pid`` holds this mark: listed in the table, else its own descriptors say
        so. The kernel's table is read a page at a time, its walk restarted at each page, so
        an entry can be skipped while other locks come and go (32 probes at once): a
        sibling's mark missing from a reading would make it look like a job."""
        if pid in self.listed:
            return True
        if self.key is None:
            return False
        return _fdinfo_holds(pid, os.makedev(self.key[0], self.key[1]), self.key[2],
                             exclusive=False) is True


@dataclass(frozen=True)
class _Marks:
    probe: _Mark
    qualify: _Mark


def holds_probe_mark(lock_dir: Path, uuid: str, pid: int) -> bool:
    """Whether process ``pid`` holds ``uuid``'s probe mark now (gpudiag proving it), as its
    own descriptors say (``/proc/PID/fdinfo``): a read of that process alone, exact at its
    moment and in any load, with no table to read. False when they cannot be read."""
    return _Mark.of(_mark_path(lock_dir, uuid), None).held_by(pid)


def describe_holders(found: Sequence[Holder] | None) -> str:
    """``pid 42 (uid 0, exclusive); ...`` or why the holders are not known."""
    if found is None:
        return "held, by holders not named (the kernel's lock table was not read within its bounds)"
    return "; ".join(h.describe() for h in found) or "no holder now"


def locked_by(lock_dir: Path, uuid: str, pid: int, table: list[KernelLock] | None = None
              ) -> bool:
    """Whether the kernel says process ``pid`` itself holds ``uuid``'s lock exclusively (as
    ``gpudiag run`` holds its GPUs): the O(1) test first (held exclusively at all?), then the
    process's own descriptors (``/proc/PID/fdinfo``: the locks each one holds, a read of that
    process alone), and only where those cannot be read (another user's process to a
    sandboxed daemon) the kernel's table, within its bounds."""
    path = _lock_path(lock_dir, uuid)
    key = _file_key(path)
    if key is None:
        return False
    try:
        if lock_state(lock_dir, uuid) != LOCK_EXCLUSIVE:
            return False  # the O(1) answer first: nobody holds it exclusively
    except LockFailed:
        return False
    own = _fdinfo_holds(pid, os.makedev(key[0], key[1]), key[2])
    if own is not None:
        return own
    table = kernel_locks() if table is None else table
    if table is None:
        return False
    return any(lk.pid == pid and not lk.shared for lk in flocks_on(table, *key))


_MAX_FDS_LOOKED_AT = 4096  # a process with more: its descriptors are not walked


def _fdinfo_holds(pid: int, device: int, inode: int, *, exclusive: bool = True
                  ) -> bool | None:
    """Whether one of ``pid``'s descriptors of the file holds a flock on it (an exclusive one
    when ``exclusive``), as its ``/proc/PID/fdinfo`` says; None when that cannot be read
    (then: the table)."""
    folder = f"/proc/{pid}/fd"
    try:
        names = os.listdir(folder)
    except OSError:
        return None
    if len(names) > _MAX_FDS_LOOKED_AT:
        return None
    for name in names:
        try:
            st = os.stat(f"{folder}/{name}")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) != (device, inode):
            continue
        held = _info_holds(f"/proc/{pid}/fdinfo/{name}", exclusive)
        if held is not False:
            return held
    return False


def _info_holds(fdinfo: str, exclusive: bool) -> bool | None:
    """Whether the open file of one ``/proc/PID/fdinfo/N`` holds a flock (an exclusive one
    when ``exclusive``): the kernel lists there the locks of that very open file description;
    None when it cannot be read."""
    try:
        with open(fdinfo, "rb") as fh:
            info = fh.read(64 << 10).decode("ascii", "replace")
    except OSError:
        return None
    for line in info.splitlines():
        if line.startswith("lock:"):
            found = parse_proc_locks(line.partition(":")[2].strip())
            if any(lk.kind == "FLOCK" and not (exclusive and lk.shared) for lk in found):
                return True
    return False


def locked_through(lock_dir: Path, uuids: Sequence[str], fds: Sequence[int]
                   ) -> tuple[str, ...]:
    """The ``uuids`` whose lock file (as named in ``lock_dir`` now) one of ``fds`` has open
    and holds exclusively: descriptors another process passed to this one (SCM_RIGHTS), read
    in this process's own ``/proc/self/fdinfo``. The kernel's word on those very open files,
    whoever sent them and from whichever pid namespace: no pid is looked up, no table read.
    A descriptor of another file, or one whose lock is shared or gone, attests nothing."""
    opened: dict[tuple[int, int], int] = {}
    for fd in fds:
        try:
            st = os.fstat(fd)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            opened.setdefault((st.st_dev, st.st_ino), fd)
    held: list[str] = []
    for uuid in dict.fromkeys(uuids):
        try:
            key = _file_key(_lock_path(lock_dir, uuid))
        except ValueError:
            continue
        mine = opened.get((os.makedev(key[0], key[1]), key[2])) if key is not None else None
        if mine is not None and _info_holds(f"/proc/self/fdinfo/{mine}", True):
            held.append(uuid)
    return tuple(held)


# --- waiting for a lock: in the kernel ---------------------------------------------------------

class _KernelWaits:
    """Threads blocked in flock(2) on lock files, one per file at a time, shared by callers.

    A blocking exclusive attempt on a fresh open file description returns when nobody else
    holds the lock: the kernel wakes it, with no table read and no poll. The thread lets the
    lock go at once (closing the description) and says so; a caller that gave up meanwhile
    leaves the thread blocked until the lock is free (a blocking flock cannot be cut short
    without a signal), so there is at most one such thread per lock file in a process.
    """

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._waiting: dict[str, threading.Event] = {}

    def wait_any(self, paths: Sequence[Path], timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> Path | None:
        """The first of ``paths`` seen free within ``timeout_s``; None when none was."""
        until = clock() + max(0.0, timeout_s)
        events: dict[Path, threading.Event] = {}
        for path in paths:
            event = self._start(path)
            if event.is_set():
                return path
            events[path] = event
        with self._changed:
            while True:
                for path, event in events.items():
                    if event.is_set():
                        return path
                left = until - clock()
                if left <= 0:
                    return None
                self._changed.wait(left)

    def _start(self, path: Path) -> threading.Event:
        with self._changed:
            event = self._waiting.get(str(path))
            if event is not None:
                return event
            event = threading.Event()
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError:
                event.set()  # gone or unusable: the next attempt says which
                return event
            self._waiting[str(path)] = event
            threading.Thread(target=self._block, args=(path, fd, event), daemon=True,
                             name="gpudiag-lock-wait").start()
            return event

    def _block(self, path: Path, fd: int, event: threading.Event) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # blocks in the kernel until nobody holds it
        except OSError:
            pass  # the next attempt says what is wrong with the file
        finally:
            os.close(fd)  # let go at once: the waiter takes the lock the ordinary way
            with self._changed:
                self._waiting.pop(str(path), None)
                event.set()
                self._changed.notify_all()


_WAITS = _KernelWaits()


def wait_for_free(lock_dir: Path, uuids: Sequence[str], timeout_s: float) -> str | None:
    """Block until one of ``uuids``' locks is free (the kernel wakes us), at most
    ``timeout_s``: that uuid, or None. Nothing is held on return; take the lock with
    ``try_lock`` (another waiter may have been quicker: then wait again)."""
    paths = {_lock_path(lock_dir, u): u for u in uuids}
    found = _WAITS.wait_any(list(paths), timeout_s)
    return None if found is None else paths[found]
