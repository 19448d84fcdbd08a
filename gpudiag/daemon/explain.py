"""``gpudiag explain``'s answer: a run's failure attribution after the fact, with its timeline.

The run is found by its closeout, its pid (the ``gpudiag run`` process or the job's own), its
Slurm job id, or given as a window and GPUs. The answer comes from the daemon's history in
the state directory when there is one (its XID timeline and blocker episodes, the same rules
as at closeout: the two agree), else from the attribution the run itself recorded (its own
watcher's events). The timeline shows what the history knows of that window: verdict
changes, XIDs, blocker episodes, clears, and which runs held which GPUs.

Issue 38: by pid or Slurm job id, only a run whose window is attested (``attested``: the
daemon saw it begin and end on its socket, or root wrote its record) is explained from the
history; of several, the one the history attributes worst (hardware first), so that no later
record of the same job hides a fault. A record nothing attests is answered with its own
attribution, ``attested: null``, never looked up in the history over the window it claims.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpudiag.core.attribution import (
    AFTER_END_S,
    APPLICATION_KIND,
    HARDWARE,
    JOB_INBOX,
    NONE,
    SOFTWARE,
    UNKNOWN,
    Attribution,
    JobRecord,
    Source,
    Window,
    attribute,
)
from gpudiag.core.clock import rfc3339
from gpudiag.core.fileio import RefusedFile, read_regular
from gpudiag.core.records import dataclass
from gpudiag.daemon.closeouts import JobRecordError, future_dated, read_job
from gpudiag.daemon.runs import BEFORE_S, attribute_window
from gpudiag.daemon.store import HistoryStore, default_path
from gpudiag.engine.statedir import default_state_dir

TIMELINE_LIMIT = 1000
# Of several attested runs of one job, the worst attribution answers: hardware first.
_WORST_FIRST = {HARDWARE: 0, SOFTWARE: 1, UNKNOWN: 2, APPLICATION_KIND: 3, NONE: 4}
# A found run: its record, who reported it (uid) and how its window is known (None: not).
Found = tuple[JobRecord, int, "str | None"]


class ExplainError(Exception):
    """The run asked about cannot be found; the message says where gpudiag looked."""


class ExplainRefused(ExplainError):
    """A run's file that gpudiag will not read (not a regular file, a link, too large)."""


@dataclass(frozen=True)
class Explanation:
    """The answer: the run (if one was named), its window, attribution and timeline."""

    job: JobRecord | None
    window: Window
    exit_code: int | None
    attribution: Attribution
    source: str  # "daemon history" or "the run's own record"
    timeline: tuple[dict[str, Any], ...]
    owner_uid: int | None = None  # who reported the run (its job record's or closeout's owner)
    # How the run's window is known: "socket" (the daemon attested it), "root" (a record only
    # root could write); None: as a record or closeout another user could write says.
    attested: str | None = None

    def record(self) -> dict[str, Any]:
        """The JSON form."""
        return {"job": self.job.record() if self.job else None,
                "window": {"start": rfc3339(self.window.start), "end": rfc3339(self.window.end),
                           "gpus": sorted(self.window.gpus)},
                "exit_code": self.exit_code, "attribution": self.attribution.record(),
                "source": self.source, "owner_uid": self.owner_uid,
                "attested": self.attested, "timeline": list(self.timeline)}


def find_job(store: HistoryStore | None, state_dir: Path, *, pid: int | None = None,
             slurm_job_id: str | None = None, job_uid: int | None = None) -> Found:
    """The run with that pid or Slurm job id, the uid that reported it and how its window
    is known: of the attested runs (history, then root's records in the inbox), the worst
    attributed; without one, the newest record nothing attests.

    ``job_uid`` (the job's owner as Slurm says, ``$SLURM_JOB_UID`` in an Epilog): only a
    record whose file that uid or root owned counts (the kernel recorded the owner); another
    user's record for the same job id is ignored. Future-dated records never count.
    """
    def ours(job: JobRecord, uid: int) -> bool:
        return (job_uid is None or uid in (job_uid, 0)) and not future_dated(job)

    found: list[Found] = []
    if store is not None:
        for entry in store.jobs(pid=pid, slurm_job_id=slurm_job_id, limit=50):
            job = JobRecord.from_record(entry.record)
            if ours(job, entry.uid):
                found.append((job, entry.uid, entry.attested))
    found += [(job, uid, "root" if uid == 0 else None)
              for job, uid in _inbox_jobs(state_dir, pid, slurm_job_id) if ours(job, uid)]
    attested = [f for f in found if f[2] is not None]
    if attested:
        return min(attested, key=lambda f: _WORST_FIRST.get(_kind(store, f[0]), 5))
    if found:
        return found[0]
    what = f"pid {pid}" if pid is not None else f"Slurm job {slurm_job_id}"
    raise ExplainError(f"no run with {what} in the history or the inbox of {state_dir} "
                       "(runs report there when they close out; pass the --state-dir the "
                       "daemon uses)")


def _kind(store: HistoryStore | None, job: JobRecord) -> str:
    """The attribution the history gives the job's window (without one, its own)."""
    if store is None:
        return job.attribution.kind
    return attribute_window(store, job.window, job.exit_code)[0].kind


def _inbox_jobs(state_dir: Path, pid: int | None, slurm_job_id: str | None
                ) -> list[tuple[JobRecord, int]]:
    """The inbox's records of that pid or Slurm job id (no daemon took them in), newest
    first."""
    inbox = state_dir / JOB_INBOX
    try:
        names = sorted(os.listdir(inbox), reverse=True)[:1000]
    except OSError:
        names = []
    out = []
    for name in names:
        if not name.endswith(".json"):
            continue
        try:
            job, uid = read_job(inbox / name)
        except JobRecordError:
            continue
        if (pid is not None and pid in (job.pid, job.child_pid)) or (
                slurm_job_id is not None and job.slurm_job_id == slurm_job_id):
            out.append((job, uid))
    return out


def explain_in(state_dir: Path | None, *, run: Path | None = None, pid: int | None = None,
               slurm_job_id: str | None = None, window: Window | None = None,
               job_uid: int | None = None, all_gpus: bool = False) -> Explanation:
    """Find the run (or take the window) and explain it from the state dir's history;
    ``all_gpus``: the timeline shows every GPU's events, not only the window's GPUs."""
    folder = default_state_dir() if state_dir is None else state_dir
    path = default_path(folder)
    store = HistoryStore(path, readonly=True) if path.is_file() else None
    why = None if store is not None else f"no history at {path} (no daemon used this state dir)"
    try:
        job, code, owner, attested = None, None, None, None
        if run is not None:
            job, code, owner = _job_of_run(run)
        elif pid is not None or slurm_job_id is not None:
            job, owner, attested = find_job(store, folder, pid=pid, slurm_job_id=slurm_job_id,
                                            job_uid=job_uid)
            if attested is None:
                # Its window is its writer's word: never looked up in the history.
                return Explanation(job, job.window, job.exit_code, job.attribution,
                                   "the run's own record", (), owner, None)
            code = job.exit_code
        if job is not None:
            window = job.window
        assert window is not None
        return replace(explain(store, window, code, job, why, all_gpus=all_gpus),
                       owner_uid=owner, attested=attested)
    finally:
        if store is not None:
            store.close()


# A closeout is a few KiB (its evidence is bounded); result.json less. Larger is not ours.
MAX_CLOSEOUT_BYTES = 4 << 20
MAX_RESULT_BYTES = 1 << 20


def _read_json(file: Path, limit: int) -> tuple[Any, int]:
    """A JSON file of a run folder (anyone's: regular, not followed, non-blocking, within
    ``limit``) and its owner uid; ExplainError in one line otherwise."""
    try:
        raw, st = read_regular(file, limit)
        return json.loads(raw.decode("utf-8")), st.st_uid
    except RefusedFile as e:
        if isinstance(e.__cause__, FileNotFoundError):
            raise ExplainError(f"cannot read {file}: {e}") from e
        raise ExplainRefused(f"cannot read {file}: {e}") from e
    except (ValueError, RecursionError) as e:
        raise ExplainError(f"cannot read {file}: not JSON ({type(e).__name__})") from e


def _job_of_run(path: Path) -> tuple[JobRecord, int | None, int]:
    job, code = job_from_closeout(path)
    file = path / "closeout.json" if path.is_dir() else path
    return job, code, os.lstat(file).st_uid


def job_from_closeout(path: Path) -> tuple[JobRecord, int | None]:
    """The run of a closeout.json (or of the artifacts folder holding it)."""
    file = path / "closeout.json" if path.is_dir() else path
    try:
        closeout, _ = _read_json(file, MAX_CLOSEOUT_BYTES)
    except ExplainRefused as e:
        raise ExplainRefused(f"the closeout is not read: {e}") from e
    except ExplainError as e:
        raise ExplainError(f"cannot read the closeout: {e}") from e
    rec = closeout.get("attribution") if isinstance(closeout, dict) else None
    attribution = Attribution.from_record(rec)
    window = rec.get("window") if isinstance(rec, dict) else None
    if attribution is None or not isinstance(window, dict):
        raise ExplainError(f"{file} has no attribution (a run that never launched, or a "
                           "gpudiag older than failure attribution)")
    code = closeout.get("exit_code")
    try:
        result, _ = _read_json(file.parent / "result.json", MAX_RESULT_BYTES)
    except ExplainError:
        result = {}
    child = result.get("pid") if isinstance(result, dict) else None
    argv = result.get("argv") if isinstance(result, dict) else None
    try:
        job = JobRecord(-1, child if isinstance(child, int) else None,
                        tuple(str(a) for a in argv or ()) if isinstance(argv, list) else (),
                        None, str(closeout.get("host") or ""),
                        float(window["start"]), float(window["end"]),
                        code if isinstance(code, int) else -1,
                        tuple(str(g) for g in window.get("gpus") or []), attribution, str(file))
    except (KeyError, TypeError, ValueError) as e:
        raise ExplainError(f"{file}: its attribution window is unreadable: {e}") from e
    return job, code if isinstance(code, int) else None


def explain(store: HistoryStore | None, window: Window, exit_code: int | None,
            job: JobRecord | None = None, store_why: str | None = None, *,
            all_gpus: bool = False) -> Explanation:
    """Attribute ``window`` from the history (else from the job's own record). The timeline
    holds the node's rows and those of the window's GPUs (``all_gpus``: every GPU's)."""
    if store is None:
        if job is not None:
            return Explanation(job, window, exit_code, job.attribution, "the run's own record",
                               ())
        missing = Source("daemon history", False, store_why or "no history")
        return Explanation(None, window, exit_code, attribute(exit_code, window, [], [missing]),
                           "daemon history", ())
    since, until = window.start - BEFORE_S, window.end + AFTER_END_S
    got, window = attribute_window(store, window, exit_code, every_gpu=job is None)
    rows = timeline(store, since, until)
    if window.gpus and not all_gpus:  # another GPU's XID is not this run's story
        rows = [r for r in rows if r["gpu"] is None or r["gpu"] in window.gpus]
    return Explanation(job, window, exit_code, got, "daemon history", tuple(rows))


def timeline(store: HistoryStore, since: float, until: float) -> list[dict[str, Any]]:
    """What the history knows of [since, until], oldest first."""
    rows: list[dict[str, Any]] = []
    for v in store.verdicts(since=since, limit=TIMELINE_LIMIT):
        if v.ts <= until:
            rows.append(_row(v.ts, "verdict", None, f"{v.gpu_validation_blocker}"
                             + (f" (warnings: {', '.join(v.warnings)})" if v.warnings else "")))
    for x in store.xids(since=since, until=until, limit=TIMELINE_LIMIT):
        rows.append(_row(x.ts, "xid", x.uuid, f"XID {x.xid} on GPU {x.gpu_index}"))
    for e in store.episodes(since=since, limit=TIMELINE_LIMIT):
        if since <= e.started <= until:
            rows.append(_row(e.started, "blocker_began", e.device, f"{e.code}: {e.message}"))
        if e.ended is not None and since <= e.ended <= until:
            rows.append(_row(e.ended, "blocker_ended", e.device, e.code))
    for c in store.clears(since=since, limit=TIMELINE_LIMIT):
        if c.ts <= until:
            rows.append(_row(c.ts, "clear", c.gpu, f"by uid {c.uid}: {c.reason}"))
    for j in store.jobs(since=since, limit=TIMELINE_LIMIT):
        try:
            job = JobRecord.from_record(j.record)
        except ValueError:
            continue
        if job.started <= until:
            who = (f"pid {job.pid} (child {job.child_pid}) uid {j.uid}"
                   + (f" Slurm job {job.slurm_job_id}" if job.slurm_job_id else "")
                   + f": {' '.join(job.argv)[:200]}")
            for gpu in job.gpus:
                rows.append(_row(job.started, "job_began", gpu, who))
                rows.append(_row(job.ended, "job_ended", gpu,
                                 f"pid {job.pid} exit {job.exit_code}, "
                                 f"{job.attribution.kind}"))
            # The job watch's warnings on the run (job_stalled, gpu_straggler_suspect).
            rows += [_row(w.since, w.code, w.gpu, w.message) for w in job.warnings]
    return sorted(rows, key=lambda r: (r["ts"], r["what"]))


def _row(ts: float, what: str, gpu: str | None, detail: str) -> dict[str, Any]:
    return {"at": rfc3339(ts), "ts": ts, "what": what, "gpu": gpu, "detail": detail}


def window_of(since: float, until: float, gpus: Sequence[str]) -> Window:
    """A window given by hand (``--since/--until [--gpus]``)."""
    return Window(since, until, frozenset(gpus))
