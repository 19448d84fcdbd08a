"""The platforms remediation can act through, one line each (``[remediation] scheduler``).

Read through the functions below at call time, as the backend registry is, so that a test
that appends a spec sees it in the config's validation and in the daemon.
"""

from __future__ import annotations

from gpudiag.core.remediation_config import RemediationConfig
from gpudiag.daemon import slurmctl
from gpudiag.daemon.actuator import Actuator, ActuatorSpec

ACTUATORS: list[ActuatorSpec] = [
    slurmctl.SPEC,
]


def names() -> tuple[str, ...]:
    """What ``[remediation] scheduler`` may name."""
    return tuple(s.name for s in ACTUATORS)


def spec(name: str) -> ActuatorSpec:
    """The platform ``name`` (the config's validation accepted only registered names)."""
    for found in ACTUATORS:
        if found.name == name:
            return found
    raise LookupError(f"no actuator {name!r}; registered: {', '.join(names())}")


def actuator_for(cfg: RemediationConfig, node: str) -> Actuator:
    """The configured platform's actuator for ``node``."""
    return spec(cfg.scheduler).make(cfg, node)
