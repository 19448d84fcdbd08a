"""The attested runs still open, kept across a daemon restart (issue 38, class 3).

A run's window is attested at its begin (daemon/runs.py); a daemon restarted while the run
goes on would forget it, and the run's end (or its closeout in the inbox) would then count as
unattested. The open runs are written to ``STATE_DIR/open-runs.json`` (the daemon's own
state folder, closed to others: 0600) at every begin and end, and read back at start.

What is read back is the daemon's own earlier word, and the kernel checks it again before a
run is open once more: the run's process still holds a lock of one of its GPUs (``/proc/
locks``: a run holds its GPU locks until its job and every descendant ended), its start time
is unchanged where this daemon can see it (a reused pid has another), and a pidfd is taken
of it now. A run that fails any of these ended while the daemon was away: it is dropped, and
its closeout, when it comes, is refused as any unattested record is.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from gpudiag.core.environment import is_full_uuid
from gpudiag.core.fileio import RefusedFile, atomic_write, read_regular
from gpudiag.core.records import dataclass
from gpudiag.engine.locks import locked_by

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


def save(path: Path, runs: Iterable[Restored]) -> None:
    """Write the open runs (atomically; a failure is logged, the runs stay attested here)."""
    entries = [{"id": r.id, "uid": r.uid, "pid": r.pid, "started_at": r.started_at,
                "began": r.began, "gpus": list(r.gpus), "slurm_job_id": r.slurm_job_id}
               for r in runs]
    try:
        atomic_write(path, json.dumps({"schema": SCHEMA, "runs": entries}), 0o600)
    except OSError as e:
        log.warning("cannot keep the open runs in %s (%s): a restart would forget them",
                    path, e, extra={"error": str(e)})


def restore(path: Path, lock_dir: Path, start_time: Callable[[int], float | None]
            ) -> list[Restored]:
    """The runs of ``path`` whose process the kernel says is still the run's (above)."""
    try:
        raw, _ = read_regular(path, MAX_FILE_BYTES)
    except RefusedFile as e:
        if path.exists():
            log.warning("open runs in %s not read back (%s)", path, e)
        return []
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        data = None
    entries = data.get("runs") if isinstance(data, dict) and data.get("schema") == SCHEMA \
        else None
    if not isinstance(entries, list):
        log.warning("open runs in %s not read back: not a %s file", path, SCHEMA)
        return []
    back: list[Restored] = []
    for entry in entries:
        if not _well_formed(entry):
            continue
        pid, started = int(entry["pid"]), entry["started_at"]
        held = [g for g in entry["gpus"] if locked_by(lock_dir, g, pid)]
        now = start_time(pid)
        if not held or (started is not None and now is not None and now != started):
            log.info("run %s (pid %d) ended while the daemon was away: dropped", entry["id"],
                     pid)
            continue
        fd = None
        with contextlib.suppress(OSError, AttributeError):
            fd = os.pidfd_open(pid)
        if fd is None and (started is None or now is None):
            continue  # neither held nor seen: it cannot be attested again
        back.append(Restored(entry["id"], int(entry["uid"]), pid, started, fd,
                             float(entry["began"]), tuple(held), entry["slurm_job_id"]))
    return back


def _well_formed(entry: object) -> bool:
    """Whether an entry has the types save() writes (the file is the daemon's own, but a
    disk or an earlier version may have spoilt it)."""
    if not isinstance(entry, dict):
        return False
    ints = all(isinstance(entry.get(k), int) and not isinstance(entry.get(k), bool)
               and entry[k] >= 0 for k in ("uid", "pid"))
    gpus = entry.get("gpus")
    return (ints and entry["pid"] > 0 and isinstance(entry.get("id"), str)
            and 0 < len(entry["id"]) <= 64 and isinstance(entry.get("began"), (int, float))
            and (entry.get("started_at") is None
                 or isinstance(entry.get("started_at"), (int, float)))
            and isinstance(gpus, list) and 0 < len(gpus) <= 512
            and all(isinstance(g, str) and is_full_uuid(g) for g in gpus)
            and (entry.get("slurm_job_id") is None or isinstance(entry["slurm_job_id"], str)))
