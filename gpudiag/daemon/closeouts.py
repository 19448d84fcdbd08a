"""Runs that closed out on this node: the job-closeouts inbox, counted and kept in the history.

A ``gpudiag run`` that asked this daemon on its unix socket hands its closeout over there
(``POST /v1/runs/end``, daemon/runs.py), and a refused one its refusal (``POST
/v1/runs/blocked``): its window is attested. The inbox is only the fallback of a run that
asked no daemon (or reached none): it drops one ``gpudiag.job/1`` record (who ran what, when,
on which GPUs, its failure attribution) or ``gpudiag.block/1`` record into
``STATE_DIR/job-closeouts/``. The daemon takes both in: it counts each
failed or GPU-faulted run in ``gpudiag_job_failures_total{attribution}``, stores the record in
the history (``gpudiag explain --pid`` and ``--slurm-job`` find runs there) and deletes the
file. An inbox record counts only when it ends a run the daemon attested, or when root wrote
it (the kernel says root owns the file); any other is refused, deleted and counted in
``gpudiag_job_records_refused_total{reason}`` (issue 38: a file decides nothing).

The folder is sticky and writable by everyone but listable by nobody else (1733), like a mail
spool: any user's runs can report, none can read or remove another's record, and the uid
comes from the file's owner as the kernel recorded it. The daemon opens each file without
following links or blocking, only regular files of at most 64 KiB, looks at most
MAX_INBOX_SCAN names and takes in at most MAX_RECORDS_PER_POLL records per loop.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from prometheus_client.core import CounterMetricFamily

from gpudiag.core.attribution import JOB_INBOX, KINDS, NONE, JobRecord
from gpudiag.core.fileio import RefusedFile, inbox_names, read_regular
from gpudiag.core.usage import BLOCK_SCHEMA, BlockRecord
from gpudiag.daemon.collectors import StateCollector
from gpudiag.daemon.runs import OpenRun, Peer, RefusedRecords, RunReport, RunWindows
from gpudiag.daemon.store import HistoryError, HistoryStore

log = logging.getLogger("gpudiag.daemon.closeouts")
MAX_RECORD_BYTES = 64 * 1024
# Records taken in per loop: a flood of planted records costs loops, never a stalled one.
MAX_RECORDS_PER_POLL = 64
# Names looked at per loop: a folder of a million planted files costs one bounded listing.
MAX_INBOX_SCAN = 4096
# A run's window ends now at the latest: a record that ends later (beyond clock skew) is
# planted (it would claim XIDs still to come), and refused.
FUTURE_SLACK_S = 300.0
REFUSAL_LOG_S = 60.0  # a refusal reason is logged at most this often (then at debug level)


def future_dated(job: JobRecord, now: float | None = None) -> bool:
    """Whether a record's window is impossible: it ends in the future or before it began."""
    now = time.time() if now is None else now
    return job.ended > now + FUTURE_SLACK_S or job.started > job.ended


INBOX_MODE = 0o1733
COUNTED_KINDS = tuple(k for k in KINDS if k != NONE)


# How a kept record's window is known (store.ATTESTED_BY) and its run's id: the history's.
Keep = Callable[[JobRecord, int, "str | None", "str | None"], bool]


class JobRecordError(ValueError):
    """An inbox file that is not a job record; the message says what was wrong."""

    reason = "malformed"


class FutureDated(JobRecordError):
    """A record whose window ends in the future or before it began."""

    reason = "future_dated"


def read_job(path: Path) -> tuple[JobRecord, int]:
    """One inbox file's job record and its owner's uid."""
    found, uid = read_inbox_file(path)
    if not isinstance(found, JobRecord):
        raise JobRecordError(f"a {BLOCK_SCHEMA} record, not a job's")
    return found, uid


def read_inbox_file(path: Path) -> tuple[JobRecord | BlockRecord, int]:
    """One inbox file's record (a job's closeout, or a refused run's block) and its owner."""
    try:
        raw, st = read_regular(path, MAX_RECORD_BYTES)
    except RefusedFile as e:
        raise JobRecordError(str(e)) from e
    try:
        data = json.loads(raw)
        if isinstance(data, dict) and data.get("schema") == BLOCK_SCHEMA:
            return BlockRecord.from_record(data), st.st_uid
        return JobRecord.from_record(data), st.st_uid
    except (ValueError, RecursionError) as e:
        raise JobRecordError(str(e)) from e


class JobInbox:
    """Takes in the runs' records: the inbox's on each loop (``poll()``), and those the
    attested runs hand over on the socket (``begin_run``/``end_run``)."""

    def __init__(self, state_dir: Path, *, record: Keep,
                 on_job: Callable[[JobRecord], object] | None = None,
                 on_block: Callable[[BlockRecord], object] | None = None,
                 runs: RunWindows | None = None) -> None:
        """``record`` keeps a record in the history (with how its window is known and its
        run's id); False when it could not. ``on_job`` gets each job once, as it is
        counted; ``on_block`` each refused run's record. ``runs``: the attested windows
        (None: nothing is attested, and only root's records count)."""
        self.folder = state_dir / JOB_INBOX
        self._record = record
        self._on_job = on_job or (lambda job: None)
        self._on_block = on_block or (lambda block: None)
        self.runs = runs
        self.refused = RefusedRecords()
        self._counted: set[str] = set()
        self._refused: set[str] = set()
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(COUNTED_KINDS, 0)

    def prepare(self) -> None:
        """Create the inbox: every user's runs may drop a record, none may read another's."""
        self.folder.mkdir(exist_ok=True)
        with contextlib.suppress(OSError):
            if self.folder.stat().st_uid == os.getuid():
                self.folder.chmod(INBOX_MODE)

    def counts(self) -> dict[str, int]:
        """Runs taken in per attribution kind since the daemon started (none excluded)."""
        with self._lock:
            return dict(self._counts)

    def begin_run(self, peer: Peer, gpus: tuple[str, ...], slurm_job_id: str | None,
                  fds: tuple[int, ...] = ()) -> OpenRun:
        """POST /v1/runs/begin: open an attested run on the GPUs whose lock the descriptors
        it passed (``fds``) hold (RunRefused when it cannot be)."""
        assert self.runs is not None
        return self.runs.begin(peer, gpus, slurm_job_id, fds)

    def block_run(self, peer: Peer, code: str, codes: tuple[str, ...],
                  slurm_job_id: str | None) -> BlockRecord:
        """POST /v1/runs/blocked: a run gpudiag refused before its start, counted once per
        process (RunRefused past the limits); its codes are its word (other outside the
        catalog)."""
        assert self.runs is not None
        self.runs.blocked(peer)
        record = BlockRecord(peer.pid, code, codes, time.time(), slurm_job_id)
        self._on_block(record)
        return record

    def end_run(self, peer: Peer, run_id: str, report: RunReport) -> JobRecord | None:
        """POST /v1/runs/end: the run's job record, counted and kept; None when the history
        could not keep it (the run stays open: its inbox record may still end it)."""
        assert self.runs is not None
        run, job = self.runs.end(peer, run_id, report)
        if not self._record(job, run.peer.uid, "socket", run.id):
            return None  # counted when its inbox record ends it
        self.runs.recorded(run, job.ended)
        self._count(job)
        return job

    def _count(self, job: JobRecord) -> None:
        self._on_job(job)
        if job.attribution.kind in self._counts:
            with self._lock:
                self._counts[job.attribution.kind] += 1

    def poll(self) -> list[JobRecord]:
        """Take in the records present, oldest first, at most MAX_RECORDS_PER_POLL of them
        (the rest on the next loops); returns those counted."""
        if self.runs is not None:
            self.runs.poll()
        taken: list[JobRecord] = []
        for name in inbox_names(self.folder, self._refused, MAX_INBOX_SCAN)[:MAX_RECORDS_PER_POLL]:
            path = self.folder / name
            try:
                found, uid = read_inbox_file(path)
                if isinstance(found, JobRecord) and future_dated(found):
                    raise FutureDated(f"its window ({found.started:.0f} .. {found.ended:.0f}) "
                                      "ends in the future or before it began")
            except JobRecordError as e:
                self._refuse(path, e.reason, str(e))
                continue
            if isinstance(found, BlockRecord):
                if uid not in (0, os.geteuid()):
                    # Only root's or the daemon's own user's word counts (the file's owner,
                    # as the kernel recorded it): anyone else's decides no metric.
                    self._refuse(path, "foreign", f"uid {uid}'s block record of pid "
                                 f"{found.pid} decides nothing: not root's")
                    continue
                self._on_block(found)  # counted once: the file goes now
                self._unlink(path)
                continue
            job = self._attest(path, name, found, uid)
            if job is not None:
                taken.append(job)
        return taken

    def _attest(self, path: Path, name: str, found: JobRecord, uid: int) -> JobRecord | None:
        """Keep one inbox record if an attested run (or root) stands behind it; the record
        counted (None when it was refused, or counted on an earlier loop)."""
        how, job, run_id = ("root", found, None) if self.runs is None and uid == 0 else (
            ("unattested", None, None) if self.runs is None else self.runs.match(found, uid))
        if job is None:
            self._refuse(path, how, f"uid {uid}'s record of pid {found.pid}"
                         + (f" (Slurm job {found.slurm_job_id})" if found.slurm_job_id
                            else "") + f" decides nothing: {how}")
            return None
        counted = None
        if name not in self._counted:
            self._counted.add(name)
            self._count(job)
            counted = job
        # A record the history could not keep stays in the inbox (`gpudiag explain` reads
        # it there) and is offered again on the next loop, counted once.
        if self._record(job, uid, how, run_id):
            self._counted.discard(name)
            if run_id is not None and self.runs is not None:
                self.runs.close_matched(run_id, job.ended)
            self._unlink(path)
        return counted

    def _refuse(self, path: Path, reason: str, why: str) -> None:
        # One line per reason a minute at most: a flood of planted records is not a log flood
        # (the counter has every one).
        now = time.monotonic()
        said = self.refused.add(reason, now, REFUSAL_LOG_S)
        log.log(logging.WARNING if said else logging.DEBUG,
                "job record %s refused (%s): %s; deleted (gpudiag_job_records_refused_total "
                "counts every one)", path, reason, why,
                extra={"record": str(path), "reason": reason, "error": why})
        if not self._unlink(path):
            self._refused.add(path.name)  # cannot remove it: at least do not retry it

    @staticmethod
    def _unlink(path: Path) -> bool:
        try:
            path.unlink()
        except OSError:
            return False
        return True


class JobFailuresCollector(StateCollector[dict[str, int]]):
    """``gpudiag_job_failures_total{attribution}``, every kind present from the start."""

    def render(self, state: dict[str, int]) -> Iterator[CounterMetricFamily]:
        """The one counter, a sample per kind."""
        family = CounterMetricFamily(
            "gpudiag_job_failures",
            "Runs that closed out on this node having failed or met a GPU fault, by who "
            "failed them (hardware, software, application, unknown).", labels=["attribution"])
        for kind in COUNTED_KINDS:
            family.add_metric([kind], float(state.get(kind, 0)))
        yield family


def record_job(history: object, job: JobRecord, uid: int, attested: str | None = None,
               run_id: str | None = None) -> bool:
    """Keep a taken-in record in the history; False (said at debug level, as it repeats
    each loop) when the history is not open or the write failed."""
    if not isinstance(history, HistoryStore):
        log.debug("job record of pid %d waits: the history is not open", job.pid)
        return False
    try:
        history.record_job(ts=job.ended, uid=uid, pid=job.pid, slurm_job_id=job.slurm_job_id,
                           started=job.started, ended=job.ended,
                           attribution=job.attribution.kind, record=job.record(),
                           attested=attested, run_id=run_id)
    except HistoryError as e:
        log.debug("job record of pid %d waits: %s", job.pid, e)
        return False
    return True
