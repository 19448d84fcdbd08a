"""Which probe children a requirement needs, with their options and deadlines."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from gpudiag.core.limits import PROBE_TIMEOUTS_S as DEFAULT_TIMEOUTS_S
from gpudiag.core.verdict import Requirement

__all__ = ["DEFAULT_TIMEOUTS_S", "probes_for"]


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
