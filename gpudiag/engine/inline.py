"""Inline runs: pick the probes a requirement needs and run them as isolated children."""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping

from gpudiag.core.clock import now_rfc3339
from gpudiag.core.environment import probe_environment
from gpudiag.core.probe_run import ProbeRun
from gpudiag.core.verdict import Requirement
from gpudiag.engine.isolation import run_probes
from gpudiag.engine.plan import DEFAULT_TIMEOUTS_S, probes_for


def run_inline(requirement: Requirement, *, env: Mapping[str, str] | None = None,
               timeout_s: float | None = None,
               timeouts: Mapping[str, float] | None = None, only: Collection[str] | None = None
               ) -> tuple[dict[str, ProbeRun], str]:
    """Run the probes a requirement needs; returns the runs and the time they started."""
    checked_at = now_rfc3339()
    requests = probes_for(requirement, only=only)
    limits = dict(DEFAULT_TIMEOUTS_S)
    limits.update(timeouts or {})
    if timeout_s is not None:
        limits = {k: timeout_s for k in limits}
    # nvidia-smi hangs with a hung driver too: its own deadline must end before the host
    # probe's, so the host observation still arrives and says that nvidia-smi timed out.
    smi_timeout = {"nvidia_smi_timeout_s": round(min(5.0, limits["host"] * 0.5), 3)}
    requests = [(name, smi_timeout if name == "host" else opts) for name, opts in requests]
    child_env = probe_environment(os.environ if env is None else env)
    return run_probes(requests, env=child_env, timeouts=limits), checked_at
