"""The GPU reset rung as a daemon part: built from ``[gpu_reset]``, fed the scheduler's
snapshots, its metrics (``gpudiag_gpu_reset*``, per scrape), its /v1/health evidence and its
history rows (daemon/gpu_reset.py does the work).

Every outcome and reason is present from the start (0), so alerts need no absent();
docs/reference.md lists them, prometheus/gpudiag.rules.yml alerts on a reset that did not
repair its GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpudiag.core.gpu_reset import LEFT_ALONE_REASONS, OUTCOMES
from gpudiag.daemon.gpu_reset import GpuResetter, ResetReport
from gpudiag.daemon.part import BasePart, Evidence, Listens, PartContext
from gpudiag.daemon.parts.clears import ClearsPart
from gpudiag.daemon.parts.incidents import IncidentsPart
from gpudiag.daemon.slurmctl import check_executable
from gpudiag.daemon.store import HistoryError, HistoryStore

log = logging.getLogger("gpudiag.daemon.gpu_reset")


class GpuResetCollector:
    """gpudiag_gpu_reset*: read from the resetter's report on each scrape."""

    def __init__(self, report: Callable[[], ResetReport]) -> None:
        self._report = report

    def collect(self) -> Iterator[Metric]:
        r = self._report()
        resets = CounterMetricFamily(
            "gpudiag_gpu_resets", "GPU resets the daemon made ([gpu_reset]), by what the "
            "fresh pass after each found (recovered, still_faulty), or failed, unverified.",
            labels=["outcome"])
        for outcome in OUTCOMES:
            resets.add_metric([outcome], r.resets.get(outcome, 0))
        yield resets
        left = CounterMetricFamily(
            "gpudiag_gpu_reset_left_alone", "Faulty GPUs a reset would repair that the daemon "
            "left alone, once per GPU incident and reason (busy, domain_busy, mig, ...).",
            labels=["reason"])
        for reason in LEFT_ALONE_REASONS:
            left.add_metric([reason], r.left_alone.get(reason, 0))
        yield left
        yield GaugeMetricFamily("gpudiag_gpu_reset_enabled",
                                "1 when the GPU reset rung is on ([gpu_reset] enabled).",
                                value=1.0 if r.enabled else 0.0)
        yield GaugeMetricFamily("gpudiag_gpu_reset_pending",
                                "GPUs reset whose verifying fresh pass is not in yet.",
                                value=float(len(r.pending)))


def keep_in_history(store: Callable[[], HistoryStore | None]
                    ) -> Callable[[str, str, str, float], None]:
    """``record`` for GpuResetter: the outcome into the history's ``resets`` (the history
    as it is now: it may open late), or a log line saying why not."""
    def record(gpu: str, outcome: str, detail: str, at: float) -> None:
        history = store()
        if history is None:
            log.warning("GPU reset of %s (%s) not recorded: the history is not writable", gpu,
                        outcome, extra={"uuid": gpu})
            return
        try:
            history.record_reset(gpu=gpu, outcome=outcome, detail=detail, ts=at)
        except HistoryError as e:
            log.warning("GPU reset of %s (%s) not recorded: %s", gpu, outcome, e,
                        extra={"uuid": gpu})
    return record


class GpuResetPart(BasePart):
    """``[gpu_reset]`` enabled: the resetter on the scheduler's snapshots, its metrics and
    /v1/health evidence; it submits its clears through the clears part and names the open
    incident (both built before it). A tool the daemon must not run (not an executable,
    writable by others) keeps the rung off, loudly."""

    name = "gpu_reset"
    section = "gpu_reset"
    metrics = ("gpudiag_gpu_resets", "gpudiag_gpu_reset_left_alone",
               "gpudiag_gpu_reset_enabled", "gpudiag_gpu_reset_pending")

    def __init__(self) -> None:
        self.resetter: GpuResetter | None = None

    def build(self, context: PartContext) -> None:
        cfg = context.cfg.gpu_reset
        if not cfg.enabled:
            return
        unsafe = check_executable(cfg.nvidia_smi)
        if unsafe is not None:
            log.error("[gpu_reset] is enabled but %s: the GPU reset rung stays off", unsafe,
                      extra={"nvidia_smi": cfg.nvidia_smi})
            cfg = replace(cfg, enabled=False)
        clears = context.part(ClearsPart).poller
        tracker = context.part(IncidentsPart).tracker
        assert clears is not None
        self.resetter = GpuResetter(cfg, context.state_dir, context.lock_dir,
                                    submit=clears.submit, record=keep_in_history(context.store),
                                    env=context.env,
                                    incident=tracker.id_for if tracker is not None else None)
        log.info("GPU reset rung %s: %s resets idle GPUs with gpu_reset_required",
                 "on" if cfg.enabled else "off", cfg.nvidia_smi,
                 extra={"nvidia_smi": cfg.nvidia_smi})

    def start(self) -> None:
        if self.resetter is not None:
            self.resetter.start()

    def stop(self, deadline: float) -> None:
        if self.resetter is not None:
            self.resetter.stop(max(0.0, deadline - time.monotonic()))

    def listens(self) -> Listens:
        return Listens(snapshots=self.resetter.offer) if self.resetter is not None \
            else Listens()

    def collectors(self) -> Sequence[Collector]:
        return (GpuResetCollector(self.resetter.report),) if self.resetter is not None else ()

    def evidence(self) -> Mapping[str, Evidence]:
        return {"gpu_reset": self.resetter.evidence} if self.resetter is not None else {}
