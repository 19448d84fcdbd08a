"""The nvml probe: every GPU's NVML readings, no context made (device layer)."""

from __future__ import annotations

from gpudiag.core.backend import BackendSpec
from gpudiag.core.observation import ANY, NUMBER, SCALAR, ListOf, MapOf, Obj

ERROR = Obj({"code": ANY, "name": ANY, "message": ANY, "type": ANY, "step": ANY, "where": ANY})
_MEMORY = Obj({"total_bytes": NUMBER, "free_bytes": NUMBER, "used_bytes": NUMBER})
_PROCESSES = ListOf(Obj({"pid": NUMBER, "used_memory_bytes": NUMBER}))
_DEVICE = Obj({
    "index": int, "uuid": str, "name": str, "pci_bus_id": str, "error": ERROR,
    "recovery_action": SCALAR, "memory": _MEMORY, "processes": _PROCESSES,
    "ecc": MapOf(NUMBER), "remapped_rows": MapOf((int, float, bool)),
    "clocks_event_reasons": Obj({"reasons": ListOf(str), "mask": NUMBER}),
    "mig": Obj({"instances": ListOf(Obj({"uuid": str, "slot": NUMBER, "memory": _MEMORY,
                                         "processes": _PROCESSES, "error": ERROR}))}),
    "utilization_gpu_ratio": NUMBER, "temperature_c": NUMBER, "power_w": NUMBER,
    "retired_pages_pending": bool, "graphics_processes": _PROCESSES,
    "pcie": Obj({k: int for k in ("current_generation", "max_generation", "current_width",
                                  "max_width")}),
    "nvlinks": Obj({"active": ListOf(int), "inactive": ListOf(int)}),
    "fabric": Obj({"state": int, "status": int}),
}, required=frozenset({"index"}))

SPEC = BackendSpec(
    name="nvml", layer="driver", device_layer=True,
    summary="NVML: driver, every GPU's memory, health, processes and occupancy.",
    probe_module="gpudiag.probes.nvml",
    observation="gpudiag.core.observations:NvmlObservation",
    interval_s=15.0, timeout_s=10.0,
    shape=Obj({
        "error": ERROR, "devices": ListOf(_DEVICE), "device_count": NUMBER,
        "visibility_env": MapOf(str), "driver_version": SCALAR,
        "cuda_driver_version": SCALAR, "nvml_version": SCALAR,
    }),
)
