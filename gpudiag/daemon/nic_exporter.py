"""gpudiag_nic_*: the node's network ports as the latest nic probe saw them, per scrape.

docs/reference.md lists them. Rebuilt from the snapshot at each scrape (no state carries
over); nothing when the nic backend is off or has not run yet.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gpudiag.core.nic import (
    ERROR_COUNTERS,
    NicObservation,
    expected_ports,
    shown_ports,
    with_memory,
)
from gpudiag.daemon.snapshot import Snapshot


class NicCollector:
    """gpudiag_nic_port_up, _rate_gbps, _expected and _errors_total, per port."""

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self._snapshot = snapshot

    def describe(self) -> list[Metric]:
        return []  # registration must not call collect()

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        result = snap.result("nic")
        obs = result.run.parsed if result is not None else None
        if not isinstance(obs, NicObservation):
            return
        obs = with_memory(obs, snap.nic_memory)
        expected = set(expected_ports(obs))
        up = GaugeMetricFamily("gpudiag_nic_port_up", "1 when the port is ACTIVE/LinkUp (IB) "
                               "or has carrier (netdev), else 0.", labels=["port", "kind"])
        wanted = GaugeMetricFamily(
            "gpudiag_nic_port_expected", "1 when the port's faults count: named in "
            "[backends.nic] expect, else an RDMA port up since this boot.", labels=["port"])
        rate = GaugeMetricFamily("gpudiag_nic_rate_gbps", "The port's link rate in Gb/s "
                                 "(IB rate; netdev speed / 1000).", labels=["port"])
        errors = CounterMetricFamily(
            "gpudiag_nic_errors", "The port's error counters as the kernel keeps them "
            "(resets to 0 on a counter reset or a reboot).", labels=["port", "counter"])
        for port in shown_ports(obs):  # RDMA and expected ports: no series per pod veth
            up.add_metric([port.name, port.kind], 1.0 if port.up else 0.0)
            wanted.add_metric([port.name], 1.0 if port.name in expected else 0.0)
            if port.rate_gbps is not None:
                rate.add_metric([port.name], port.rate_gbps)
            for name in ERROR_COUNTERS:
                if name in port.counters:
                    errors.add_metric([port.name, name], float(port.counters[name]))
        yield from (up, wanted, rate, errors)
