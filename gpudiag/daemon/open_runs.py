"""The attested runs still open, kept across a daemon restart (issues 38, 49).

A run's window is attested at its begin (daemon/runs.py); a daemon restarted while the run
goes on would forget it, and the run's end (or its closeout in the inbox) would then count as
unattested. The open runs are written to ``STATE_DIR/open-runs.json`` (the daemon's own
state folder, closed to others: 0600) at every begin and end, and read back at start: each
run's id, uid, GPUs, the identity of each GPU's lock file (device, inode and change time,
as the kernel said at its begin), its pidfd's identity, and how it is recognised (``seen_by``).

What is read back is the daemon's own earlier word, and the kernel checks it again before a
run is open once more:
- a run this daemon could see by its pid (``seen_by: pid``): the process still holds a lock
  of one of its GPUs (a run holds its GPU locks until its job and every descendant ended), its
  start time is unchanged where this daemon can see it (a reused pid has another), its new
  pidfd's identity is the one kept, and a pidfd is taken of it now;
- a run this daemon cannot see (pid 0: begun from another pid namespace; ``seen_by: locks``):
  one of its lock files is still the very file it locked (same device, inode and change time:
  not removed nor replaced) and is held exclusively now (the O(1) test, valid whoever holds
  it, in any pid namespace). No pid is looked up. Its end is then recognised by its pidfd's
  identity, as before the restart, and it is closed once none of those locks is held.
A run that fails these ended while the daemon was down: it is closed as such (``ended``:
kept among the recently ended runs, so that the inbox record it left, naming its run id,
still closes it; daemon/runs.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpudiag.core.environment import is_full_uuid
from gpudiag.core.fileio import RefusedFile, atomic_write, read_regular
from gpudiag.core.records import dataclass
from gpudiag.engine.locks import LockFileKey, locked_by, still_held

log = logging.getLogger("gpudiag.daemon.runs")
OPEN_RUNS_FILE = "open-runs.json"
SCHEMA = "gpudiag.open_runs/1"
# 256 open runs (runs.MAX_OPEN_RUNS) of at most a few hundred bytes each.
MAX_FILE_BYTES = 1 << 20


@dataclass(frozen=True)
class Restored:
    """An open run read back and checked again: its process, a pidfd of it taken now."""

    id: str
    uid: int
    pid: int
    started_at: float | None
    pidfd: int | None
    began: float
    gpus: tuple[str, ...]  # those of its GPUs whose lock it still holds
    slurm_job_id: str | None
    identity: int | None = None  # its pidfd's identity (pidfs inode), kept from its begin
    # Each GPU's lock file as the kernel named it at the run's begin (device, inode and
    # change time: engine/locks.LockFileKey).
    locks: tuple[tuple[str, LockFileKey], ...] = ()

    @property
    def seen_by(self) -> str:
        """How the run is recognised after a restart: its pid, else its lock files."""
        return "pid" if self.pid > 0 else "locks"


def save(path: Path, runs: Iterable[Restored]) -> None:
    """Write the open runs (atomically; a failure is logged, the runs stay attested here)."""
    entries = [{"id": r.id, "uid": r.uid, "pid": r.pid, "started_at": r.started_at,
                "began": r.began, "gpus": list(r.gpus), "slurm_job_id": r.slurm_job_id,
                "identity": r.identity, "seen_by": r.seen_by,
                "locks": {gpu: list(key) for gpu, key in r.locks}}
               for r in runs]
    try:
        atomic_write(path, json.dumps({"schema": SCHEMA, "runs": entries}), 0o600)
    except OSError as e:
        log.warning("cannot keep the open runs in %s (%s): a restart would forget them",
                    path, e, extra={"error": str(e)})


def restore(path: Path, lock_dir: Path, start_time: Callable[[int], float | None],
            identity: Callable[[int | None], int | None] = lambda fd: None
            ) -> tuple[list[Restored], list[Restored]]:
    """The runs of ``path`` the kernel says are still running (above), each with a pidfd
    taken now where it has a pid here; and those that ended while the daemon was down."""
    try:
        raw, _ = read_regular(path, MAX_FILE_BYTES)
    except RefusedFile as e:
        if path.exists():
            log.warning("open runs in %s not read back (%s)", path, e)
        return [], []
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        data = None
    entries = data.get("runs") if isinstance(data, dict) and data.get("schema") == SCHEMA \
        else None
    if not isinstance(entries, list):
        log.warning("open runs in %s not read back: not a %s file", path, SCHEMA)
        return [], []
    back: list[Restored] = []
    ended: list[Restored] = []
    for entry in entries:
        if not _well_formed(entry):
            continue
        kept = _kept(entry)
        run = _by_locks(kept, lock_dir) if kept.pid == 0 else _by_pid(
            kept, lock_dir, start_time, identity)
        if run is None:
            log.info("run %s (uid %d, pid %d) ended while the daemon was down: closed",
                     kept.id, kept.uid, kept.pid)
            ended.append(kept)
        elif run.gpus:
            back.append(run)
    return back, ended


def _kept(entry: dict[str, Any]) -> Restored:
    """An entry as save() wrote it (checked by _well_formed)."""
    locks = entry.get("locks")
    locks = locks if isinstance(locks, dict) else {}
    ident = entry.get("identity")
    return Restored(entry["id"], int(entry["uid"]), int(entry["pid"]), entry["started_at"],
                    None, float(entry["began"]), tuple(entry["gpus"]), entry["slurm_job_id"],
                    ident if isinstance(ident, int) and not isinstance(ident, bool) else None,
                    tuple((gpu, (key[0], key[1], key[2], key[3])) for gpu, key in locks.items()
                          if gpu in entry["gpus"] and _key(key)))


def _by_locks(run: Restored, lock_dir: Path) -> Restored | None:
    """A run this daemon cannot see: open again while one of its very lock files is held
    exclusively (no pid involved); None when none is."""
    held = tuple(gpu for gpu, key in run.locks if still_held(lock_dir, gpu, key))
    return replace(run, gpus=held) if held else None


def _by_pid(run: Restored, lock_dir: Path, start_time: Callable[[int], float | None],
            identity: Callable[[int | None], int | None]) -> Restored | None:
    """A run seen by its pid: open again while that process (same start time, same pidfd
    identity) holds one of its GPU locks; None when it ended; no GPUs when it cannot be
    attested again (neither held nor seen)."""
    pid, started = run.pid, run.started_at
    held = tuple(g for g in run.gpus if locked_by(lock_dir, g, pid))
    now = start_time(pid)
    if not held or (started is not None and now is not None and now != started):
        return None
    fd = None
    with contextlib.suppress(OSError, AttributeError):
        fd = os.pidfd_open(pid)
    ident = identity(fd)
    if run.identity is not None and ident is not None and ident != run.identity:
        if fd is not None:
            os.close(fd)
        return None  # another process with the run's pid
    if fd is None and (started is None or now is None):
        return replace(run, gpus=())  # neither held nor seen: it cannot be attested again
    return replace(run, pidfd=fd, gpus=held, identity=ident or run.identity)


def _key(value: object) -> bool:
    return isinstance(value, list) and len(value) == 4 and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)


def _well_formed(entry: object) -> bool:
    """Whether an entry has the types save() writes (the file is the daemon's own, but a
    disk or an earlier version may have spoilt it)."""
    if not isinstance(entry, dict):
        return False
    ints = all(isinstance(entry.get(k), int) and not isinstance(entry.get(k), bool)
               and entry[k] >= 0 for k in ("uid", "pid"))
    gpus = entry.get("gpus")
    # pid 0: a run this daemon could not see, recognised by its lock files alone.
    locks = entry.get("locks")
    seen = entry["pid"] > 0 if ints else False
    if ints and not seen and not (isinstance(locks, dict) and locks):
        return False
    return (ints and isinstance(entry.get("id"), str)
            and 0 < len(entry["id"]) <= 64 and isinstance(entry.get("began"), (int, float))
            and (entry.get("started_at") is None
                 or isinstance(entry.get("started_at"), (int, float)))
            and isinstance(gpus, list) and 0 < len(gpus) <= 512
            and all(isinstance(g, str) and is_full_uuid(g) for g in gpus)
            and (entry.get("slurm_job_id") is None or isinstance(entry["slurm_job_id"], str)))
