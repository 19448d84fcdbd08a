"""The daemon's parts, in build order: one line each (docs/design-notes.md, "Daemon parts").

Read it through ``parts()`` (at call time), as the backend registry is read, so that a test
that appends a part sees it in the daemon. A part built later may use one built earlier
(``PartContext.part``); ``BuiltParts`` starts them in this order and stops them in reverse.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack

from gpudiag.core.findings import XidEvent
from gpudiag.daemon.app import DaemonApp
from gpudiag.daemon.part import Cleared, Listens, Part, PartContext, each_logged
from gpudiag.daemon.parts.clears import ClearsPart
from gpudiag.daemon.parts.gpu_reset import GpuResetPart
from gpudiag.daemon.parts.incidents import IncidentsPart
from gpudiag.daemon.parts.job_watch import JobWatchPart
from gpudiag.daemon.parts.nfd import NfdPart
from gpudiag.daemon.parts.nic import NicPart
from gpudiag.daemon.parts.numbers import NumbersPart
from gpudiag.daemon.parts.qualification import QualificationPart
from gpudiag.daemon.parts.reboots import RebootsPart
from gpudiag.daemon.parts.remediation import RemediationPart
from gpudiag.daemon.parts.runs import RunsPart

PARTS: list[Callable[[], Part]] = [
    NicPart,
    NumbersPart,
    RemediationPart,
    JobWatchPart,
    ClearsPart,
    RunsPart,
    QualificationPart,
    RebootsPart,
    IncidentsPart,
    GpuResetPart,
    NfdPart,
]
STOP_LIMIT_S = 5.0  # every part's stop(deadline): at most this from when the stop began


def parts() -> list[Part]:
    """A fresh instance of every part, in build order (one daemon's)."""
    return [make() for make in PARTS]


class BuiltParts:
    """One daemon's parts: built into the core, fed its events, started and stopped."""

    def __init__(self) -> None:
        self.parts: tuple[Part, ...] = ()
        self._listens: tuple[Listens, ...] = ()  # empty until every part is built

    def build(self, context: PartContext, app: DaemonApp) -> None:
        """Build each part in list order and register what it declares: its snapshot
        listener, collectors, routes and /v1/health evidence. A part that fails stops the
        ones built before it."""
        with ExitStack() as undo:
            undo.callback(stop_parts, context.built)
            for part in parts():
                part.build(context)
                context.built.append(part)
                listens = part.listens()
                if listens.snapshots is not None:
                    context.scheduler.on_snapshot(listens.snapshots)
                for collector in part.collectors():
                    app.registry.register(collector)
                for path, route in part.routes().items():
                    app.add_route(path, route)
                app.health_evidence.update(part.evidence())
            undo.pop_all()
        self.parts = tuple(context.built)
        self._listens = tuple(part.listens() for part in self.parts)

    def start(self) -> None:
        for part in self.parts:
            part.start()

    def stop(self) -> None:
        stop_parts(self.parts)

    # -- the core's events, to the parts that listen (nothing before they are built) --------
    def xid(self, event: XidEvent) -> None:
        for listens in self._listens:
            if listens.xids is not None:
                listens.xids(event)

    def tick(self) -> None:
        each_logged([listens.ticks for listens in self._listens if listens.ticks is not None])

    def cleared(self, cleared: Cleared) -> list[str]:
        """An applied clear to every part that listens to clears; the codes they cleared."""
        codes: list[str] = []
        for listens in self._listens:
            if listens.clears is not None:
                codes.extend(listens.clears(cleared))
        return codes


def stop_parts(built: list[Part] | tuple[Part, ...]) -> None:
    """Stop the parts in reverse build order, each by one shared deadline."""
    deadline = time.monotonic() + STOP_LIMIT_S
    for part in reversed(built):
        part.stop(deadline)
