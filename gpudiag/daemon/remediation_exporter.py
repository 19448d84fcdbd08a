"""gpudiag_remediation_*: the remediation actor's report as Prometheus metrics, per scrape.

docs/reference.md lists them; prometheus/gpudiag.rules.yml alerts on ``refused``,
``needs_person`` and ``scontrol_failing``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from gpudiag.daemon.remediation import LATENCY_BUCKETS, RemediationReport


class RemediationCollector:
    """gpudiag_remediation_*: read from the actor's report on each scrape."""

    def __init__(self, report: Callable[[], RemediationReport]) -> None:
        self._report = report

    def collect(self) -> Iterator[Metric]:
        r = self._report()
        actions = CounterMetricFamily(
            "gpudiag_remediation_actions", "Drains and resumes remediation did, would have "
            "done (observe, killswitch) or refused (fleet guard, an operator's drain).",
            labels=["action", "mode", "code", "outcome"])
        for (action, mode, code, outcome), n in sorted(r.actions.items()):
            actions.add_metric([action, mode, code, outcome], n)
        yield actions
        latency = HistogramMetricFamily(
            "gpudiag_remediation_latency_seconds",
            "From the fault's evidence (the XID, the NVML reading) to the drain done.")
        cumulative = [(f"{le:g}", n) for le, n in zip(LATENCY_BUCKETS, r.latency_buckets,
                                                      strict=True)]
        latency.add_metric([], [*cumulative, ("+Inf", r.latency_count)], r.latency_sum_s)
        yield latency
        failures = CounterMetricFamily(
            "gpudiag_remediation_command_failures",
            "scontrol/sinfo calls that failed (kind: absent, timeout, failed, unknown_node, "
            "unparsable); each is retried with backoff.", labels=["command", "kind"])
        for (command, kind), n in sorted(r.command_failures.items()):
            failures.add_metric([command, kind], n)
        yield failures
        for name, value, text in (
                ("gpudiag_remediation_drained", r.drain is not None and not r.drain.observed,
                 "1 while a drain gpudiag made on this node stands."),
                ("gpudiag_remediation_needs_person", r.needs_person,
                 "1 while gpudiag's drain says a person is needed (the attempt cap was met)."),
                ("gpudiag_remediation_refused", r.refused,
                 "1 while a fault that drains is not drained: the fleet guard refused it."),
                ("gpudiag_remediation_scontrol_failing", r.last_error is not None,
                 "1 while scontrol or sinfo keeps failing (retried with backoff).")):
            yield GaugeMetricFamily(name, text, value=1.0 if value else 0.0)
        t = r.tally
        yield CounterMetricFamily(
            "gpudiag_remediation_incidents", "Incidents gpudiag drained this node for (act), "
            "kept across restarts.", value=float(t.incidents))
        recovered = CounterMetricFamily(
            "gpudiag_remediation_recovered", "Incidents gpudiag resumed: by=gpudiag with no "
            "person (a hold expired, or a reboot and a clean fresh pass healed it), by=person "
            "after a `gpudiag clear`.", labels=["by"])
        recovered.add_metric(["gpudiag"], float(t.recovered_unattended))
        recovered.add_metric(["person"], float(t.recovered_after_clear))
        yield recovered
        yield CounterMetricFamily(
            "gpudiag_remediation_needs_person_incidents", "Incidents whose drain said a person "
            "is needed (the attempt cap was met).", value=float(t.needs_person))
        yield GaugeMetricFamily(
            "gpudiag_remediation_needs_person_per_100_incidents", "needs_person incidents per "
            "100 incidents gpudiag drained for (0 before the first).",
            value=t.needs_person_per_100)
        modes = GaugeMetricFamily("gpudiag_remediation_mode",
                                 "The configured remediation mode (1 for the current one).",
                                 labels=["mode"])
        for m in ("observe", "act"):
            modes.add_metric([m], 1.0 if r.mode == m else 0.0)
        yield modes
