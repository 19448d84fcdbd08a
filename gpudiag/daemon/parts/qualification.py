"""The qualification part ([qualification]): idle GPUs measured on a schedule, and on
request (``POST /v1/qualify``; daemon/qualify_schedule.py, docs/qualify.md)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client.registry import Collector

from gpudiag.core.qualify_verdict import qualification_findings
from gpudiag.core.readiness import GpuOccupancy
from gpudiag.daemon.app import ApiError, ProbeBuckets, ProbeRateLimit, only_params
from gpudiag.daemon.part import BasePart, PartContext, Route
from gpudiag.daemon.qualify_exporter import QualificationCollector
from gpudiag.daemon.qualify_queue import (
    ALREADY_QUEUED,
    NO_GPUS,
    OVER_BUDGET,
    QUEUE_FULL,
    UNKNOWN_GPU,
    RequestRefused,
    known_gpus,
)
from gpudiag.daemon.qualify_schedule import Qualifier, QualifierState

# POST /v1/qualify's refusals (daemon/qualify_queue.py) as HTTP statuses: a name that fits
# no GPU or a request over its cap is the asker's to change (400); a GPU that has one queued
# or running conflicts with the queue's state (409); a full queue is "later" (429).
QUALIFY_REFUSALS = {UNKNOWN_GPU: 400, OVER_BUDGET: 400, ALREADY_QUEUED: 409, QUEUE_FULL: 429,
                    NO_GPUS: 503}


class QualificationPart(BasePart):
    """Its thread starts when it is built: it waits for GPUs idle long enough anyway."""

    name = "qualification"
    section: str | None = "qualification"
    metrics = tuple(f"gpudiag_gpu_qualification_{name}" for name in (
        "bytes_per_second", "flops_per_second", "ratio", "last_timestamp_seconds", "outcome",
        "gpu_seconds", "bytes", "check", "tested_bytes")) + (
        "gpudiag_qualification_runs", "gpudiag_qualification_gpu_seconds")

    def __init__(self) -> None:
        self.qualifier: Qualifier | None = None
        self._buckets: ProbeBuckets | None = None

    def build(self, context: PartContext) -> None:
        scheduler = context.scheduler
        block = context.cfg.qualification.thresholds.block

        def occupancy() -> Mapping[str, GpuOccupancy]:
            scope = scheduler.snapshot().scope
            return scope.occupancy if scope is not None else {}

        def publish(state: QualifierState) -> None:
            if not state.running:
                # The run has let go of its GPUs: jobs must see them free, from the same
                # snapshot that first shows its outcome.
                scheduler.relook_locks()
            scheduler.set_qualification(qualification_findings(state.latest.values(),
                                                               block=block))

        self.qualifier = Qualifier(context.cfg.qualification, context.state_dir, occupancy,
                                   on_change=publish,
                                   gpus=lambda: known_gpus(scheduler.snapshot()))
        # Its own bucket of on-demand requests (the app's probe budget is per backend).
        self._buckets = ProbeBuckets(ProbeRateLimit(), scheduler.clock.monotonic)
        self.qualifier.start()

    def stop(self, deadline: float) -> None:
        if self.qualifier is not None:
            self.qualifier.stop()

    def collectors(self) -> Sequence[Collector]:
        return (QualificationCollector(self.qualifier.state),) if self.qualifier else ()

    def routes(self) -> Mapping[str, Route]:
        return {"/v1/qualify": Route(("POST",), self._qualify)}

    def _qualify(self, params: Mapping[str, str], environ: Mapping[str, Any]
                 ) -> tuple[int, Any]:
        """Queue a qualification of idle GPUs now (docs/qualify.md); 202, result in /metrics."""
        only_params(params, ("gpus", "tier"))
        if self.qualifier is None or self._buckets is None:
            raise ApiError(503, "no_qualification", "this daemon runs no qualification")
        tier = params.get("tier", "quick")
        if tier not in ("quick", "full", "sdc"):
            raise ApiError(400, "bad_parameter", f"tier={tier!r}: accepted quick, full, sdc")
        gpus = [g.strip() for g in params["gpus"].split(",")] if "gpus" in params else []
        bad = [g for g in gpus if not re.fullmatch(r"[0-9]{1,3}|GPU-[0-9a-fA-F-]{36}", g)]
        if bad or ("gpus" in params and not gpus):
            raise ApiError(400, "bad_parameter", f"gpus={params['gpus']!r}: give GPU indices "
                           "or full GPU- UUIDs, comma-separated")
        retry = self._buckets.take(["qualify"])
        if retry > 0:
            raise ApiError(429, "rate_limited", f"POST /v1/qualify: retry in {retry:.1f} s",
                           retry_after_s=retry)
        try:
            req = self.qualifier.request(gpus or None, tier)
        except RequestRefused as e:
            raise ApiError(QUALIFY_REFUSALS[e.code], e.code, e.message,
                           retry_after_s=e.retry_after_s if e.code in (
                               QUEUE_FULL, NO_GPUS) else None) from e
        return 202, {"accepted": {"gpus": list(req.gpus or ()), "tier": req.tier,
                                  "uuids": list(req.uuids), "budget_gpu_s": req.budget_gpu_s},
                     "queued": len(self.qualifier.queued()),
                     "status": "queued; busy GPUs are skipped; the result is in /metrics "
                               "(gpudiag_gpu_qualification_*) and the history"}


