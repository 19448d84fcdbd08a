"""The cuda probe: cuInit, and a context and allocation on each free GPU (device layer)."""

from __future__ import annotations

from collections.abc import Mapping

from gpudiag.core.backend import EVERY_GPU, POINT_BY_OPTION, BackendSpec

TYPE_CHECKING = False  # typing stays off the CLI's fast path (gpudiag.core.backend)
if TYPE_CHECKING:
    from typing import Any

def _always(options: Mapping[str, Any]) -> bool:
    return True


SPEC = BackendSpec(
    name="cuda", layer="cuda", device_layer=True, touches_gpu=_always, published=True,
    proves_on=EVERY_GPU, pointed_by=POINT_BY_OPTION,
    summary="The CUDA driver API: cuInit, then a context and an allocation per free GPU.",
    probe_module="gpudiag.probes.cuda",
    observation="gpudiag.core.observations:CudaObservation",
    interval_s=60.0, timeout_s=15.0,
)
