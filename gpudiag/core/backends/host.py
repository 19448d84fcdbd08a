"""The host probe: nvidia-smi, device nodes, the kernel module, PCI (device layer)."""

from __future__ import annotations

from gpudiag.core.backend import BackendSpec
from gpudiag.core.observation import ListOf, MapOf, Obj

SPEC = BackendSpec(
    name="host", layer="visibility", device_layer=True, requirable=False,
    summary="nvidia-smi, /dev/nvidia* nodes, the kernel module and the PCI bus.",
    probe_module="gpudiag.probes.host",
    observation="gpudiag.core.observations:HostObservation",
    interval_s=60.0, timeout_s=10.0,
    shape=Obj({
        "environment": MapOf(str),
        "device_nodes": Obj({"gpu_nodes": (int, float), "permission_denied": ListOf(str),
                             "dir": str}),
        "driver_proc": Obj({"path": str, "kernel_module_version": str}),
        "nvidia_smi": Obj(), "nvidia_smi_xml": Obj(),
        "pci": Obj({"available": bool, "gpus": ListOf(Obj({"address": str, "driver": str},
                                                           required=frozenset({"address"})))}),
    }),
)
