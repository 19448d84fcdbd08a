"""Pure nic classification: the nic probe's observation (with the daemon's memory) -> findings.

Which ports count and what each finding means is gpudiag.core.nic's (``assess``); this
module turns those findings into the verdict's blockers and warnings and the backend's
status. A port's finding names the port in ``device`` (``mlx5_0/1``, ``eth2``): a NIC is
the node's, not a GPU's, so it stands in node health and every job's readiness alike.
"""

from __future__ import annotations

from dataclasses import replace

from gpudiag.core.findings import Findings, GpuContext
from gpudiag.core.nic import (
    NicMemory,
    NicObservation,
    assess,
    expected_ports,
    port_summary,
    shown_ports,
)
from gpudiag.core.probe_run import ProbeRun
from gpudiag.core.verdict import BackendRequirement, BackendStatus

TYPE_CHECKING = False  # BackendRun is a Protocol for the type checker only
if TYPE_CHECKING:
    from gpudiag.core.backend import BackendRun

BACKEND = "nic"


def classify_nic(run: BackendRun, req: BackendRequirement, gpu: GpuContext,
                 f: Findings) -> BackendStatus:
    """ok when every expected port is up at its rate, steady and without growing errors."""
    obs = run.parsed if isinstance(run.parsed, NicObservation) else None
    if obs is None or not run.ok:
        # A failed child is the probe layer's finding already (classify._probe_layer).
        return BackendStatus("blocked", round(run.duration_s, 4), {}, {"error": run.error})
    blocked = False
    for finding in assess(obs):
        if finding.blocker:
            blocked = True
            f.block(finding.code, finding.message, backend=BACKEND, device=finding.port)
        else:
            f.warn(finding.code, finding.message, backend=BACKEND, device=finding.port)
    firmware = sorted({p.fw_ver for p in obs.ports if p.fw_ver})
    return BackendStatus(
        "blocked" if blocked else "ok", round(run.duration_s, 4),
        {"fw_ver": ", ".join(firmware) if firmware else None},
        {"expected": list(expected_ports(obs)),
         "expect_configured": obs.policy.expect is not None,
         "remembered": obs.memory is not None,
         "ports": port_summary(shown_ports(obs))})


def remembered(run: ProbeRun, memory: NicMemory | None) -> ProbeRun:
    """The nic run as the daemon classifies it: its memory since this boot attached (the
    ports up since boot, link changes, counter growth); a one-shot run has none."""
    if memory is None or run.observation is None or not isinstance(run.parsed, NicObservation):
        return run
    return replace(run, observation={**run.observation, "memory": memory.record()})
