"""The host probe: nvidia-smi, device nodes, the kernel module, PCI (device layer)."""

from __future__ import annotations

from gpudiag.core.backend import BackendSpec

SPEC = BackendSpec(
    name="host", layer="visibility", device_layer=True, requirable=False,
    summary="nvidia-smi, /dev/nvidia* nodes, the kernel module and the PCI bus.",
    probe_module="gpudiag.probes.host",
    observation="gpudiag.core.observations:HostObservation",
    interval_s=60.0, timeout_s=10.0,
)
