"""The jax probe: JAX's backend comes up on the required platform and computes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gpudiag.core import fingerprint_inputs
from gpudiag.core.backend import BackendSpec

TYPE_CHECKING = False  # typing stays off the CLI's fast path (gpudiag.core.backend)
if TYPE_CHECKING:
    from typing import Any

    from gpudiag.core.verdict import BackendRequirement


def _options(entries: Sequence[BackendRequirement]) -> dict[str, Any]:
    return {"platform": entries[0].platform or "gpu"}


def _touches_gpu(options: Mapping[str, Any]) -> bool:
    return str(options.get("platform") or "gpu") not in ("cpu",)


SPEC = BackendSpec(
    name="jax", layer="jax",
    classify="gpudiag.core.classify_jax:classify_jax", published=True,
    summary="JAX initializes on the GPU (no CPU fallback) and a tiny computation is right.",
    probe_module="gpudiag.probes.jax_probe",
    observation="gpudiag.core.observations:JaxObservation",
    interval_s=3600.0, timeout_s=60.0,
    platforms=("gpu", "cuda", "cpu"), platform_aliases={"cuda": "gpu"},
    platform_word="JAX platform",
    options=_options, scheduled_options={"platform": "gpu"}, touches_gpu=_touches_gpu,
    version_labels={"jax": ("jax",), "jaxlib": ("jaxlib",)},
    environment=fingerprint_inputs.JAX,
)
