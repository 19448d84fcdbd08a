"""Layer 2. Probes: each runs INSIDE a child process and returns a JSON-able observation.

Heavy imports (pynvml, ctypes on libcuda, jax, iree) happen inside the probe functions, in
the child, never in the daemon. ``python -m gpudiag.probes NAME [OPTIONS-JSON]`` runs one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

Observation = dict[str, Any]
ProbeFunction = Callable[[Mapping[str, Any]], Observation]

# name -> module; each module has `probe(options) -> Observation`.
PROBE_MODULES: dict[str, str] = {
    "host": "gpudiag.probes.host",
    "nvml": "gpudiag.probes.nvml",
    "cuda": "gpudiag.probes.cuda",
    "jax": "gpudiag.probes.jax_probe",
    "iree": "gpudiag.probes.iree_probe",
    # Not a verdict probe (core.limits.PROBES): GPU qualification, run by engine.qualify.
    "qualify": "gpudiag.probes.qualify",
}


def load(name: str) -> ProbeFunction:
    """The probe function of one backend (imports its module, not its library)."""
    module = importlib.import_module(PROBE_MODULES[name])
    fn: ProbeFunction = module.probe
    return fn
