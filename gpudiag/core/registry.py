"""The backend registry: every backend's spec, in run and report order, and what derives from it.

Add a backend with one module under gpudiag.core.backends and one line in ``BACKENDS``
(docs/design-notes.md, "The backend registry"). The probe names, requirable names, deadlines,
the daemon's defaults, the typed observations, the classifiers and the render order are
all read from this list, never written out again; read it through the functions below (at
call time), so a test that appends a spec sees it everywhere.
"""

from __future__ import annotations

from gpudiag.core.backend import BackendSpec
from gpudiag.core.backends import cuda, host, iree, jax, nic, nvml

TYPE_CHECKING = False  # typing stays off the CLI's fast path (gpudiag.core.backend)
if TYPE_CHECKING:
    from typing import Any

    from gpudiag.core.observations import Malformed, ProbeObservation

# Run and report order: the device layer first (its findings are the root causes), then the
# backends that build on it.
BACKENDS: list[BackendSpec] = [
    host.SPEC,
    nvml.SPEC,
    cuda.SPEC,
    jax.SPEC,
    iree.SPEC,
    nic.SPEC,
]


def specs() -> tuple[BackendSpec, ...]:
    """Every registered backend, in run and report order."""
    return tuple(BACKENDS)


def spec(name: str) -> BackendSpec | None:
    """The spec of ``name``; None for a name no backend has."""
    return next((s for s in BACKENDS if s.name == name), None)


def environment_dependent(name: str) -> bool:
    """Whether a backend is proven in the job's environment (JAX, IREE: its spec declares an
    environment), not the node's (host, nvml, cuda)."""
    found = spec(name)
    return found is not None and found.environment is not None


def probe_names() -> tuple[str, ...]:
    """The probe children gpudiag runs (``gpudiag probe --backend``, the daemon's schedule)."""
    return tuple(s.name for s in BACKENDS)


def requirable() -> tuple[str, ...]:
    """What a requirement (``--require``) may name, in report order."""
    return tuple(s.name for s in BACKENDS if s.requirable)


def timeouts_s() -> dict[str, float]:
    """Each probe child's default deadline in seconds."""
    return {s.name: s.timeout_s for s in BACKENDS}


def order(name: str) -> int:
    """A backend's place in report order (unknown names last)."""
    names = probe_names()
    return names.index(name) if name in names else len(names)


def gpu_touching() -> frozenset[str]:
    """The probes that make a GPU context when run as the daemon schedules them."""
    return frozenset(s.name for s in BACKENDS if s.touches_gpu(s.scheduled_options or {}))


def published() -> tuple[str, ...]:
    """The backends whose node-health proof is published (metrics, NFD labels, fleet)."""
    return tuple(s.name for s in BACKENDS if s.published)


def observation_problem(backend: str, observation: Any) -> str | None:
    """Why a probe's observation is malformed; None when gpudiag can read it."""
    found = parse_observation(backend, observation)
    return getattr(found, "problem", None)


def parse_observation(backend: str, value: Any) -> ProbeObservation | Malformed:
    """The typed observation of ``backend``'s JSON, or why it is malformed (never raises)."""
    # Imported here, not at the top: the observation models are what a requirement's
    # parsing (the CLI's daemon-answered path) must not pay for; nothing cyclic is hidden.
    from gpudiag.core.decode import SchemaError, decode
    from gpudiag.core.observations import Malformed, OtherObservation

    found = spec(backend)
    try:
        parsed: ProbeObservation = decode(
            found.observation_type() if found is not None else OtherObservation, value)
    except SchemaError as e:
        return Malformed(str(e))
    return parsed
