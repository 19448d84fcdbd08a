"""Layer 2. Probes: each runs INSIDE a child process and returns a JSON-able observation.

Heavy imports (pynvml, ctypes on libcuda, jax, iree) happen inside the probe functions, in
the child, never in the daemon. ``python -m gpudiag.probes NAME [OPTIONS-JSON]`` runs one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from gpudiag.core import registry

Observation = dict[str, Any]
ProbeFunction = Callable[[Mapping[str, Any]], Observation]

# Not a verdict probe (gpudiag.core.registry): GPU qualification, run by engine.qualify.
EXTRA_PROBES: dict[str, str] = {"qualify": "gpudiag.probes.qualify"}


def probe_modules() -> dict[str, str]:
    """name -> module of every probe child; each module has ``probe(options) -> dict``."""
    return {**{s.name: s.probe_module for s in registry.specs()}, **EXTRA_PROBES}


def load(name: str) -> ProbeFunction:
    """The probe function of one backend (imports its module, not its library)."""
    module = importlib.import_module(probe_modules()[name])
    fn: ProbeFunction = module.probe
    return fn
