"""What remediation acts through: an ``Actuator`` for one platform (Slurm: daemon/slurmctl.py).

Remediation's decisions are the platform's business nowhere (gpudiag/core/remediation.py
decides, gpudiag/daemon/remediation.py gathers the facts and carries a decision out); only
these four calls touch the platform: this node's view, the fleet guard's view, a drain and a
resume. Each failure is an ``ActuatorError`` whose ``kind`` (absent, timeout, failed,
unknown_node, unparsable) is the metric's label. A platform is one module declaring an
``ActuatorSpec`` and one line in daemon/actuators.py (docs/design-notes.md, "Remediation").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from gpudiag.core.records import dataclass
from gpudiag.core.remediation import Fleet, NodeView
from gpudiag.core.remediation_config import RemediationConfig


class ActuatorError(Exception):
    """The platform could not answer or act; ``kind`` says how."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class NodeInfo:
    """This node as the platform shows it: the view the policy reads, and its partitions
    (the fleet guard's default scope)."""

    view: NodeView
    partitions: tuple[str, ...]


class Actuator(Protocol):
    """The platform calls remediation makes, for one node."""

    @property
    def node(self) -> str: ...

    def show_node(self) -> NodeInfo: ...

    def fleet(self, partitions: Sequence[str], *, now_wall: float, window_s: float
              ) -> Fleet: ...

    def drain(self, reason: str) -> None: ...

    def resume(self) -> None: ...


@dataclass(frozen=True)
class ActuatorSpec:
    """One platform: ``[remediation] scheduler = NAME``."""

    name: str
    title: str  # in log lines and messages: "node n1 is idle in Slurm"
    make: Callable[[RemediationConfig, str], Actuator]  # (config, node name)
    # Why the configured executables must not be run as the daemon (None: they may).
    unsafe: Callable[[RemediationConfig], str | None] = lambda cfg: None
