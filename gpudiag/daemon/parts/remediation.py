"""The remediation part ([remediation]): the actor on the snapshots, its metrics and its
/v1/health evidence; the node name is checked against the platform (``scheduler``, an
``Actuator``: Slurm) first (docs/operations.md)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client.registry import Collector

from gpudiag.daemon.actuator import ActuatorError
from gpudiag.daemon.actuators import spec
from gpudiag.daemon.part import (
    BasePart,
    Cleared,
    ConfigUnusable,
    Evidence,
    Listens,
    PartContext,
)
from gpudiag.daemon.remediation import Remediator
from gpudiag.daemon.remediation_exporter import RemediationCollector

log = logging.getLogger("gpudiag.daemon")


class RemediationUnusable(ConfigUnusable):
    """[remediation] names a node the platform does not know, or an unsafe executable."""


class RemediationPart(BasePart):
    """Off (declares nothing) unless ``[remediation] mode`` is observe or act."""

    name = "remediation"
    section: str | None = "remediation"
    metrics = ("gpudiag_remediation_actions", "gpudiag_remediation_latency_seconds",
               "gpudiag_remediation_command_failures", "gpudiag_remediation_drained",
               "gpudiag_remediation_needs_person", "gpudiag_remediation_refused",
               "gpudiag_remediation_scontrol_failing", "gpudiag_remediation_incidents",
               "gpudiag_remediation_recovered", "gpudiag_remediation_needs_person_incidents",
               "gpudiag_remediation_needs_person_per_100_incidents",
               "gpudiag_remediation_mode")

    def __init__(self) -> None:
        self.remediator: Remediator | None = None

    def build(self, context: PartContext) -> None:
        cfg = context.cfg.remediation
        if cfg.mode == "off":
            return
        platform = spec(cfg.scheduler)
        unsafe = platform.unsafe(cfg)
        if unsafe is not None:
            raise RemediationUnusable(f"[remediation]: {unsafe}; refusing to run it as the "
                                      "daemon")
        self.remediator = remediator = Remediator(cfg, context.state_dir)
        node, title = remediator.slurm.node, platform.title
        try:
            info = remediator.check_node()
            log.info("remediation %s: node %s is %s in %s", cfg.mode, node, info.view.state,
                     title, extra={"node": node, "remediation_mode": cfg.mode})
        except ActuatorError as e:
            if e.kind == "unknown_node":
                raise RemediationUnusable(
                    f"[remediation] node_name {node!r}: {e}; set node_name to this node's "
                    f"{title} NodeName") from e
            # The platform may be down now: the actor asks again before any action.
            log.warning("remediation %s: cannot check node %s in %s yet (%s); retrying "
                        "before any action", cfg.mode, node, title, e,
                        extra={"error": str(e)})

    def start(self) -> None:
        if self.remediator is not None:
            self.remediator.start()

    def stop(self, deadline: float) -> None:
        if self.remediator is not None:
            self.remediator.stop()

    def listens(self) -> Listens:
        if self.remediator is None:
            return Listens()
        return Listens(snapshots=self.remediator.offer, clears=self._cleared)

    def collectors(self) -> Sequence[Collector]:
        if self.remediator is None:
            return ()
        return (RemediationCollector(self.remediator.report),)

    def evidence(self) -> Mapping[str, Evidence]:
        return {"remediation": self._evidence} if self.remediator is not None else {}

    def _evidence(self) -> tuple[int, dict[str, Any]]:
        """What remediation did and how Slurm answers it, in every node-health answer."""
        assert self.remediator is not None
        report = self.remediator.report()
        return report.version, report.evidence()

    def _cleared(self, cleared: Cleared) -> Sequence[str]:
        """A clear moves remediation's recovery boundary."""
        assert self.remediator is not None
        self.remediator.cleared(cleared.gpu, cleared.at_wall, by_person=cleared.by_person)
        return ()
