"""Inline preflight: pick the probes a requirement needs, run them as children, classify."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Collection, Mapping
from datetime import datetime, timezone
from typing import Any

from gpudiag.classify import classify
from gpudiag.environment import probe_environment
from gpudiag.isolation import ProbeRun, run_probes
from gpudiag.requirement import parse_requirement
from gpudiag.verdict import Requirement, Verdict

# Deadlines per probe in seconds: generous for a healthy host, short enough for a prolog.
DEFAULT_TIMEOUTS_S: dict[str, float] = {
    "host": 10.0, "nvml": 10.0, "cuda": 15.0, "jax": 60.0, "iree": 90.0,
}


def rfc3339(wall: float) -> str:
    """A wall-clock time as RFC 3339 UTC with milliseconds."""
    dt = datetime.fromtimestamp(wall, timezone.utc)
    return dt.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def now_rfc3339() -> str:
    """The current UTC time, RFC 3339 with a Z."""
    return rfc3339(time.time())


def probes_for(requirement: Requirement, *, only: Collection[str] | None = None
               ) -> list[tuple[str, dict[str, Any] | None]]:
    """The probe children a requirement needs, with their options.

    A GPU requirement also runs host, nvml and cuda so the root cause gets named; a CPU-only
    requirement (jax:cpu, iree:local-task) runs only its own backend, so nothing else can
    block it. ``only`` (``gpudiag probe --backend``) runs exactly the probes named.
    """
    requests: list[tuple[str, dict[str, Any] | None]] = []
    if requirement.needs_gpu:
        requests += [("host", None), ("nvml", None)]
        if any(b.name != "nvml" for b in requirement.backends):
            requests.append(("cuda", None))
    if only is not None:
        requests = [(name, None) for name in ("host", "nvml", "cuda") if name in only]
    jax = requirement.backend("jax")
    if jax is not None:
        requests.append(("jax", {"platform": jax.platform or "gpu"}))
    iree = [b.platform or "cuda" for b in requirement.backends if b.name == "iree"]
    if iree:
        requests.append(("iree", {"drivers": iree}))
    return requests if only is None else [r for r in requests if r[0] in only]


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


def preflight_inline(requirement: Requirement, *, env: Mapping[str, str] | None = None,
                     timeout_s: float | None = None) -> Verdict:
    """The verdict for a requirement from probes run here and now."""
    runs, checked_at = run_inline(requirement, env=env, timeout_s=timeout_s)
    return classify(runs, requirement, host=socket.gethostname(), checked_at=checked_at)


def preflight(require: str | Requirement = "cuda", *, devices: str | None = None,
              min_devices: int | None = None, min_free_memory: str | int | None = None,
              env: Mapping[str, str] | None = None, timeout_s: float | None = None,
              daemon_url: str | None = None, use_daemon: bool = True) -> Verdict:
    """The verdict for a requirement (Python API): the local daemon first, else inline probes.

    ``require`` uses the CLI syntax (``"cuda,jax"``, ``"jax:cpu"``, ``"iree:local-task"``).
    ``env`` is the environment the job would run with (default: this process's); its
    visibility variables travel to the daemon. The verdict's ``source`` says which answered.
    """
    from gpudiag.client import preflight as daemon_first

    requirement = require if isinstance(require, Requirement) else parse_requirement(
        require, devices=devices, min_devices=min_devices, min_free_memory=min_free_memory)
    return daemon_first(requirement, url=daemon_url, use_daemon=use_daemon, env=env,
                        timeout_s=timeout_s)
