"""The NIC part: gpudiag_nic_* from the snapshot's NIC probe (daemon/nic_exporter.py)."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client.registry import Collector

from gpudiag.daemon.nic_exporter import NicCollector
from gpudiag.daemon.part import BasePart, PartContext


class NicPart(BasePart):
    """Reads the scheduler's snapshots; nothing of its own runs."""

    name = "nic"
    metrics = ("gpudiag_nic_port_up", "gpudiag_nic_port_expected", "gpudiag_nic_rate_gbps",
               "gpudiag_nic_errors")

    def __init__(self) -> None:
        self._collectors: tuple[Collector, ...] = ()

    def build(self, context: PartContext) -> None:
        self._collectors = (NicCollector(context.scheduler.snapshot),)

    def collectors(self) -> Sequence[Collector]:
        return self._collectors
