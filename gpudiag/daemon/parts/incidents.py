"""The incidents part: one fault episode, one id (daemon/incidents.py), carried by the
history, /v1/health's ``evidence.incident``, the metrics, NFD and NPD (issue 52)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from prometheus_client.registry import Collector

from gpudiag.daemon.incidents import IncidentTracker
from gpudiag.daemon.part import BasePart, Evidence, Listens, PartContext


class IncidentsPart(BasePart):
    """Built before the parts that name the open incident (NFD, the reset rung)."""

    name = "incidents"
    metrics = ("gpudiag_incident_open", "gpudiag_incident_started_timestamp_seconds",
               "gpudiag_incidents_opened")

    def __init__(self) -> None:
        self.tracker: IncidentTracker | None = None

    def build(self, context: PartContext) -> None:
        self.tracker = IncidentTracker(context.state_dir, context.store)

    def listens(self) -> Listens:
        return Listens(snapshots=self.tracker.offer) if self.tracker is not None else Listens()

    def collectors(self) -> Sequence[Collector]:
        return (self.tracker.collector(),) if self.tracker is not None else ()

    def evidence(self) -> Mapping[str, Evidence]:
        return {"incident": self.tracker.evidence} if self.tracker is not None else {}
