"""Which probe children a requirement needs, with their options and deadlines."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from gpudiag.core import registry
from gpudiag.core.verdict import Requirement

__all__ = ["probes_for"]


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
    # The device layer (host, nvml, cuda) is chosen above; each other backend runs once,
    # with the options its spec derives from the requirement's entries of it.
    for spec in registry.specs():
        entries = [b for b in requirement.backends if b.name == spec.name]
        if entries and not spec.device_layer:
            requests.append((spec.name, spec.options(entries)))
    return requests if only is None else [r for r in requests if r[0] in only]
