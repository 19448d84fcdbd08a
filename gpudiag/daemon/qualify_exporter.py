"""Metrics of GPU qualification, built fresh on every scrape from the qualifier's state.

Per GPU: the measured figures (``gpudiag_gpu_qualification_bytes_per_second`` for
bandwidths, ``..._flops_per_second`` for matmuls, label ``measure``), the ratio to each
reference (``..._ratio{measure,reference}``), the last time, the outcome (every code present,
1 for the current), and what the last run cost (GPU-seconds, bytes). docs/reference.md lists
them; docs/qualify.md says how to read them.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gpudiag.core.catalog import QUALIFICATION
from gpudiag.core.qualify import PASSED
from gpudiag.core.qualify_score import coverage
from gpudiag.core.sdc import CHECKS, FAIL, PASS, UNKNOWN
from gpudiag.daemon.collectors import StateCollector
from gpudiag.daemon.qualify_schedule import QualifierState

GPU = ["gpu", "uuid"]
OUTCOME_CODES = (PASSED, *QUALIFICATION)
CHECK_STATUSES = (PASS, FAIL, UNKNOWN)


class QualificationCollector(StateCollector[QualifierState]):
    """Collects from ``state()`` at scrape time (any callable returning a QualifierState)."""

    def render(self, state: QualifierState) -> Iterator[Metric]:
        """The qualification's per-GPU gauges and its run counters."""
        prefix = "gpudiag_gpu_qualification_"
        bw = GaugeMetricFamily(prefix + "bytes_per_second",
                               "Bandwidth measured by the last qualification.", labels=[
                                   *GPU, "measure"])
        fl = GaugeMetricFamily(prefix + "flops_per_second",
                               "Matmul throughput measured by the last qualification.",
                               labels=[*GPU, "measure"])
        ratio = GaugeMetricFamily(prefix + "ratio", "Measured value over the reference "
                                  "(table, peers, history); absent when there is none.",
                                  labels=[*GPU, "measure", "reference"])
        last = GaugeMetricFamily(prefix + "last_timestamp_seconds",
                                 "When the GPU's last qualification that measured began.",
                                 labels=GPU)
        outcome = GaugeMetricFamily(prefix + "outcome", "1 for the GPU's current qualification "
                                    "outcome (none when it passed), 0 for the others.",
                                    labels=[*GPU, "code"])
        held = GaugeMetricFamily(prefix + "gpu_seconds", "Seconds the last qualification held "
                                 "the GPU.", labels=GPU)
        used = GaugeMetricFamily(prefix + "bytes", "The most GPU memory the last qualification "
                                 "held at once.", labels=GPU)
        check = GaugeMetricFamily(prefix + "check", "1 for the status of each sdc check of the "
                                  "GPU's latest outcome (pass, fail, unknown), 0 for the others.",
                                  labels=[*GPU, "check", "status"])
        tested = GaugeMetricFamily(prefix + "tested_bytes", "GPU memory the latest outcome's "
                                   "memory checks covered.", labels=GPU)
        for uuid, q in sorted(state.latest.items()):
            labels = [str(q.result.index if q.result.index is not None else ""), uuid]
            for s in q.scores:
                if s.value is not None:
                    (fl if s.unit == "flops_per_second" else bw).add_metric(
                        [*labels, s.measure], s.value)
                for r in s.references:
                    if r.ratio is not None:
                        ratio.add_metric([*labels, s.measure, r.reference], r.ratio)
            if q.result.started_at is not None:
                last.add_metric(labels, q.result.started_at)
            for code in OUTCOME_CODES:
                outcome.add_metric([*labels, code], 1.0 if q.code == code else 0.0)
            held.add_metric(labels, q.result.gpu_seconds or 0.0)
            used.add_metric(labels, float(q.result.bytes_used or 0))
            statuses = {c.check: c.status for c in q.result.checks}
            for name in CHECKS if statuses else ():
                for status in CHECK_STATUSES:
                    check.add_metric([*labels, name, status],
                                     1.0 if statuses.get(name) == status else 0.0)
            tested.add_metric(labels, float(coverage(q.result).bytes_tested))
        yield from (bw, fl, ratio, last, outcome, held, used, check, tested)
        runs = CounterMetricFamily("gpudiag_qualification_runs", "GPU qualifications run by "
                                   "this daemon, by outcome.", labels=["outcome"])
        for code in OUTCOME_CODES:
            runs.add_metric([code], float(state.runs.get(code, 0)))
        yield runs
        yield CounterMetricFamily("gpudiag_qualification_gpu_seconds",
                                  "GPU-seconds spent qualifying since the daemon started.",
                                  value=state.gpu_seconds_total)
