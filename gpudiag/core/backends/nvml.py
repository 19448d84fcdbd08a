"""The nvml probe: every GPU's NVML readings, no context made (device layer)."""

from __future__ import annotations

from gpudiag.core.backend import BackendSpec

SPEC = BackendSpec(
    name="nvml", layer="driver", device_layer=True,
    summary="NVML: driver, every GPU's memory, health, processes and occupancy.",
    probe_module="gpudiag.probes.nvml",
    observation="gpudiag.core.observations:NvmlObservation",
    interval_s=15.0, timeout_s=10.0,
)
