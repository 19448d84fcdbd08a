"""The runs part: the runs' records and attested windows, and the GPUs they hold.

``POST /v1/runs/begin``, ``/v1/runs/end`` and ``/v1/runs/blocked`` (a run announcing itself
on the unix socket, daemon/runs.py), the jobs' inbox (daemon/closeouts.py) taken in on each
tick, and the open runs' GPUs as ``gpudiag_gpu_allocation_info`` (daemon/allocations.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

from prometheus_client.registry import Collector

from gpudiag.core.attribution import JobRecord
from gpudiag.daemon.allocations import AllocationCollector, Allocations
from gpudiag.daemon.app import ApiError, only_params
from gpudiag.daemon.closeouts import JobFailuresCollector, JobInbox, record_job
from gpudiag.daemon.httpserver import MAX_BODY_BYTES, PEER_FDS_KEY, PEER_KEY, PEER_PIDFD_KEY
from gpudiag.daemon.open_runs import OPEN_RUNS_FILE
from gpudiag.daemon.part import (
    BasePart,
    Listens,
    PartContext,
    Route,
    StartError,
    each_logged,
)
from gpudiag.daemon.parts.job_watch import JobWatchPart
from gpudiag.daemon.parts.numbers import NumbersPart
from gpudiag.daemon.recorder import HistoryRecorder
from gpudiag.daemon.runs import (
    RefusedRecordsCollector,
    RunRefused,
    RunWindows,
    hold,
    parse_block,
    parse_gpus,
    parse_report,
    parse_slurm_job_id,
    peer_of,
)
from gpudiag.daemon.scheduler import Scheduler

log = logging.getLogger("gpudiag.daemon")


class RunsPart(BasePart):
    """Needs the numbers (each job counted) and the job watch (its warnings kept)."""

    name = "runs"
    metrics = ("gpudiag_job_failures", "gpudiag_job_records_refused",
               "gpudiag_gpu_allocation_info")

    def __init__(self) -> None:
        self.jobs: JobInbox | None = None
        self.allocations: Allocations | None = None

    def build(self, context: PartContext) -> None:
        numbers = context.part(NumbersPart).numbers
        watch = context.part(JobWatchPart)
        recorder, scheduler = context.recorder, context.scheduler
        # From the attested runs alone (the runs' socket, the kernel's word): no file inbox.
        runs = RunWindows(context.lock_dir, recorder.history_store,
                          kept=context.state_dir / OPEN_RUNS_FILE,
                          mig_parents=partial(_mig_parents, scheduler))
        watch.runs = runs
        keep = partial(_record_job, recorder)
        self.jobs = jobs = JobInbox(
            context.state_dir, record=watch.watch.keeping(keep) if watch.watch else keep,
            on_job=numbers.job, on_block=numbers.blocked, runs=runs)
        try:
            jobs.prepare()
        except OSError as e:
            raise StartError(f"cannot use --state-dir {context.state_dir}: {e}") from e
        if again := runs.restore():
            log.info("%d attested run(s) from before this start still running: open again",
                     again)
        self._notes = watch.watch.end_notes if watch.watch is not None else None
        self.allocations = Allocations(runs.open_runs, leaves=partial(_leaves, scheduler))

    def listens(self) -> Listens:
        jobs, allocations = self.jobs, self.allocations
        if jobs is None or allocations is None:
            return Listens()
        return Listens(ticks=partial(each_logged, (jobs.poll, allocations.poll)))

    def collectors(self) -> Sequence[Collector]:
        if self.jobs is None or self.allocations is None:
            return ()
        return (JobFailuresCollector(self.jobs.counts),
                RefusedRecordsCollector(self.jobs.refused.counts),
                AllocationCollector(self.allocations.current))

    def routes(self) -> Mapping[str, Route]:
        return {path: Route(("POST",), partial(self._run, path))
                for path in ("/v1/runs/begin", "/v1/runs/end", "/v1/runs/blocked")}

    def _run(self, path: str, params: Mapping[str, str], environ: Mapping[str, Any]
             ) -> tuple[int, Any]:
        """POST /v1/runs/begin, /end and /blocked: a run's window or refusal, as the kernel
        attests who sent it (daemon/runs.py)."""
        jobs = self.jobs
        if jobs is None or jobs.runs is None:
            raise ApiError(503, "no_history", "this daemon keeps no job records (no "
                           "--state-dir)")
        creds = environ.get(PEER_KEY)
        if creds is None:
            raise ApiError(403, "not_attested", f"POST {path}: runs announce themselves on "
                           "the daemon's unix socket, where the kernel says who they are; "
                           "this request has no peer credentials (TCP)")
        begin, blocked = path == "/v1/runs/begin", path == "/v1/runs/blocked"
        only_params(params, ("gpus", "slurm_job_id") if begin else (
            ("code", "codes", "slurm_job_id") if blocked else ("run", "exit_code", "child_pid")))
        # Every path takes the peer's pidfd (its identity); only a begun run keeps it.
        pidfd = hold(environ[PEER_PIDFD_KEY], creds.pid)
        peer = peer_of(creds.uid, creds.pid, pidfd)
        try:
            if begin:
                run = jobs.begin_run(peer, parse_gpus(params.get("gpus")),
                                     parse_slurm_job_id(params.get("slurm_job_id")),
                                     tuple(environ.get(PEER_FDS_KEY) or ()))
                pidfd = None  # the run's now
                return 200, {"run": run.id, "began": run.began, "gpus": list(run.gpus),
                             "uid": creds.uid, "pid": creds.pid}
            if blocked:
                code, codes = parse_block(params)
                block = jobs.block_run(peer, code, codes,
                                       parse_slurm_job_id(params.get("slurm_job_id")))
                return 200, {"counted": True, "code": block.code, "uid": creds.uid}
            body = environ["wsgi.input"].read(MAX_BODY_BYTES) if environ.get("wsgi.input") \
                else b""
            job = jobs.end_run(peer, params.get("run", ""), parse_report(params, body))
        except RunRefused as e:
            raise ApiError(e.status, e.code, e.message) from e
        finally:
            if pidfd is not None:
                os.close(pidfd)  # not a run's: none was opened with it
        if job is None:
            raise ApiError(503, "history_unavailable", "the job record could not be kept "
                           "now; the run stays open and its inbox record ends it")
        notes = self._notes(params["run"]) if self._notes is not None else {}
        return 200, {"run": params["run"], "recorded": True, "started": job.started,
                     "ended": job.ended, "gpus": list(job.gpus),
                     "attribution": job.attribution.record(), **notes}


def _record_job(recorder: HistoryRecorder, job: JobRecord, uid: int, attested: str | None,
                run_id: str | None) -> bool:
    # The store as it is now: it may open late.
    return record_job(recorder.store, job, uid, attested, run_id)


def _leaves(scheduler: Scheduler) -> set[str] | None:
    """The GPU and MIG leaves the daemon sees now (None before its first reading)."""
    scope = scheduler.snapshot().scope
    return set(scope.occupancy) if scope is not None else None


def _mig_parents(scheduler: Scheduler) -> dict[str, str]:
    """Each MIG instance's physical GPU, from the latest NVML reading (none before it)."""
    result = scheduler.snapshot().result("nvml")
    nvml = result.run.nvml if result is not None else None
    return {mig: d.uuid for d in (nvml.devices if nvml else ()) if d.uuid
            for mig in d.mig_uuids}

