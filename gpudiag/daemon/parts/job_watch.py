"""The job watch part ([jobs]): hung collectives and stragglers (daemon/job_watch.py)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from prometheus_client.registry import Collector

from gpudiag.core.environment import probe_environment
from gpudiag.daemon.job_watch import JobWatch
from gpudiag.daemon.part import BasePart, Evidence, PartContext
from gpudiag.daemon.runs import OpenRun, RunWindows

STOP_LIMIT_S = 5.0


class JobWatchPart(BasePart):
    """Follows the attested runs (the runs part's windows, read at call time)."""

    name = "job_watch"
    section: str | None = "jobs"
    metrics = ("gpudiag_job_stalled", "gpudiag_gpu_straggler_suspect",
               "gpudiag_job_watch_running")

    def __init__(self) -> None:
        self.watch: JobWatch | None = None
        self.runs: RunWindows | None = None  # set by the runs part, built after this one

    def build(self, context: PartContext) -> None:
        self.watch = JobWatch(context.cfg.jobs, probe_environment(context.env), self._open_runs)

    def start(self) -> None:
        if self.watch is not None:
            self.watch.start()

    def stop(self, deadline: float) -> None:
        if self.watch is not None:
            self.watch.stop(max(0.0, min(STOP_LIMIT_S, deadline - time.monotonic())))

    def collectors(self) -> Sequence[Collector]:
        return (self.watch.collector(),) if self.watch is not None else ()

    def evidence(self) -> Mapping[str, Evidence]:
        return {"runs": self.watch.evidence} if self.watch is not None else {}

    def _open_runs(self) -> list[OpenRun]:
        """The attested runs open now (none before the runs are built)."""
        return self.runs.opened() if self.runs is not None else []
