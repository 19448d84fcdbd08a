"""The iree probe: IREE's HAL drivers create a device and run a tiny kernel."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gpudiag.core import fingerprint_inputs
from gpudiag.core.backend import BackendSpec
from gpudiag.core.limits import IREE_DRIVERS

TYPE_CHECKING = False  # typing stays off the CLI's fast path (gpudiag.core.backend)
if TYPE_CHECKING:
    from typing import Any

    from gpudiag.core.verdict import BackendRequirement


def _options(entries: Sequence[BackendRequirement]) -> dict[str, Any]:
    return {"drivers": [b.platform or "cuda" for b in entries]}


def _touches_gpu(options: Mapping[str, Any]) -> bool:
    return any(d in ("cuda", "hip") for d in options.get("drivers") or ["cuda"])


SPEC = BackendSpec(
    name="iree", layer="iree",
    classify="gpudiag.core.classify_iree:classify_iree", published=True,
    summary="IREE's HAL driver creates a device, compiles and runs a tiny kernel.",
    probe_module="gpudiag.probes.iree_probe",
    observation="gpudiag.core.observations:IreeObservation",
    interval_s=3600.0, timeout_s=90.0,
    platforms=IREE_DRIVERS, platform_word="IREE driver",
    platform_help="is not one IREE has; accepted: iree:DRIVER with DRIVER one of {choices}",
    options=_options, scheduled_options={"drivers": ["cuda"]}, touches_gpu=_touches_gpu,
    version_labels={"iree": ("iree-base-runtime", "iree")},
    environment=fingerprint_inputs.IREE,
)
