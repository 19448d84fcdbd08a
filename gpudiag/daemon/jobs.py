"""Runs that closed out on this node: the job-closeouts inbox, counted and kept in the history.

Every ``gpudiag run`` drops one ``gpudiag.job/1`` record (who ran what, when, on which GPUs,
and its failure attribution) into ``STATE_DIR/job-closeouts/``. The daemon takes them in on
each loop: it counts each failed or GPU-faulted run in ``gpudiag_job_failures_total
{attribution}``, stores the record in the history (``gpudiag explain --pid`` and
``--slurm-job`` find runs there), and deletes the file. The folder is sticky and writable by
everyone but listable by nobody else (1733), like a mail spool: any user's runs can report,
none can read or remove another's record, and the uid comes from the file's owner as the
kernel recorded it. The daemon opens each file without following links or blocking, and
only regular files of at most 64 KiB.
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
from gpudiag.daemon.store import HistoryError, HistoryStore

log = logging.getLogger("gpudiag.daemon.jobs")
MAX_RECORD_BYTES = 64 * 1024
# Records taken in per loop: a flood of planted records costs loops, never a stalled one.
MAX_RECORDS_PER_POLL = 64
# A run's window ends now at the latest: a record that ends later (beyond clock skew) is
# planted (it would claim XIDs still to come), and refused.
FUTURE_SLACK_S = 300.0


def future_dated(job: JobRecord, now: float | None = None) -> bool:
    """Whether a record's window is impossible: it ends in the future or before it began."""
    now = time.time() if now is None else now
    return job.ended > now + FUTURE_SLACK_S or job.started > job.ended
INBOX_MODE = 0o1733
COUNTED_KINDS = tuple(k for k in KINDS if k != NONE)


class JobRecordError(ValueError):
    """An inbox file that is not a job record; the message says what was wrong."""


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
    """Takes in the inbox's records; ``poll()`` runs on each scheduler loop."""

    def __init__(self, state_dir: Path, *, record: Callable[[JobRecord, int], bool],
                 on_job: Callable[[JobRecord], object] | None = None,
                 on_block: Callable[[BlockRecord], object] | None = None) -> None:
        """``record`` keeps a record in the history; False when it could not. ``on_job``
        gets each job once, as it is counted; ``on_block`` each refused run's record."""
        self.folder = state_dir / JOB_INBOX
        self._record = record
        self._on_job = on_job or (lambda job: None)
        self._on_block = on_block or (lambda block: None)
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

    def poll(self) -> list[JobRecord]:
        """Take in the records present, oldest first, at most MAX_RECORDS_PER_POLL of them
        (the rest on the next loops); returns them."""
        taken: list[JobRecord] = []
        for name in inbox_names(self.folder, self._refused)[:MAX_RECORDS_PER_POLL]:
            path = self.folder / name
            try:
                found, uid = read_inbox_file(path)
                if isinstance(found, JobRecord) and future_dated(found):
                    raise JobRecordError(f"its window ({found.started:.0f} .. "
                                         f"{found.ended:.0f}) ends in the future or before "
                                         "it began")
            except JobRecordError as e:
                log.warning("job record %s refused: %s; deleted", path, e,
                            extra={"record": str(path), "error": str(e)})
                try:
                    path.unlink()
                except OSError:
                    self._refused.add(name)  # cannot remove it: at least do not retry it
                continue
            if isinstance(found, BlockRecord):
                self._on_block(found)  # counted once: the file goes now
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            job = found
            if name not in self._counted:
                self._counted.add(name)
                self._on_job(job)
                if job.attribution.kind in self._counts:
                    with self._lock:
                        self._counts[job.attribution.kind] += 1
                taken.append(job)
            # A record the history could not keep stays in the inbox (`gpudiag explain`
            # reads it there) and is offered again on the next loop, counted once.
            if self._record(job, uid):
                self._counted.discard(name)
                with contextlib.suppress(OSError):
                    path.unlink()
        return taken


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


def record_job(history: object, job: JobRecord, uid: int) -> bool:
    """Keep a taken-in record in the history; False (said at debug level, as it repeats
    each loop) when the history is not open or the write failed."""
    if not isinstance(history, HistoryStore):
        log.debug("job record of pid %d waits in the inbox: the history is not open", job.pid)
        return False
    try:
        history.record_job(ts=job.ended, uid=uid, pid=job.pid, slurm_job_id=job.slurm_job_id,
                           started=job.started, ended=job.ended,
                           attribution=job.attribution.kind, record=job.record())
    except HistoryError as e:
        log.debug("job record of pid %d waits in the inbox: %s", job.pid, e)
        return False
    return True
