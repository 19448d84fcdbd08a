"""Missing GPUs: NVIDIA GPUs on the PCI bus (or expected by the operator) that NVML lacks.

A GPU that falls off the bus can vanish from NVML without any XID: the node then looks
healthy with 7 of 8 GPUs. The host probe counts NVIDIA display/3D controllers in sysfs; this
compares that with NVML's and cuInit's counts and with the configured ``expected_gpus``.
Without ``expected_gpus`` only PCI against NVML decides (cuInit honours
CUDA_VISIBLE_DEVICES, so its count is only compared when that is unset).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from gpudiag.core.findings import Findings
from gpudiag.core.visibility import CUDA_VISIBLE_DEVICES, NVIDIA_VISIBLE_DEVICES

_BUS_ID = re.compile(r"^([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-7])$")
# Kernel drivers that mean "deliberately not for NVML here" (passed through to a VM).
_PASSTHROUGH_DRIVERS = frozenset({"vfio-pci", "pci-stub", "nvgrace_gpu_vfio_pci"})


def pci_address(bus_id: str) -> str | None:
    """NVML's ``00000000:18:00.0`` or sysfs's ``0000:18:00.0`` -> ``0000:18:00.0``."""
    m = _BUS_ID.match(bus_id.strip())
    if m is None:
        return None
    domain, bus, dev, fn = m.groups()
    return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{fn}"


def missing_gpu_findings(host: Mapping[str, Any] | None, nvml: Mapping[str, Any] | None,
                         cuda: Mapping[str, Any] | None, expected_gpus: int | None,
                         f: Findings) -> None:
    """Block with ``gpu_missing`` when PCI, NVML, cuInit or expected_gpus disagree."""
    env = (host or {}).get("environment") or {}
    pci = (host or {}).get("pci") or {}
    pci_addrs: list[str] | None = None
    # In a container handed a subset of the GPUs, sysfs still shows all of the host's.
    subset = env.get(NVIDIA_VISIBLE_DEVICES) not in (None, "", "all")
    if pci.get("available") and not subset:
        pci_addrs = sorted(str(g["address"]) for g in pci.get("gpus") or []
                           if g.get("driver") not in _PASSTHROUGH_DRIVERS)
    nvml_ok = bool(nvml and nvml.get("ok"))
    nvml_count = int((nvml or {}).get("device_count") or 0) if nvml_ok else None
    nvml_addrs = {a for d in ((nvml or {}).get("devices") or []) if d.get("pci_bus_id")
                  if (a := pci_address(str(d["pci_bus_id"]))) is not None}
    cuda_count: int | None = None
    if (cuda and (cuda.get("init") or {}).get("ok")
            and env.get(CUDA_VISIBLE_DEVICES) is None):
        cuda_count = int(cuda.get("device_count") or 0)
    counts = {"PCI": None if pci_addrs is None else len(pci_addrs), "NVML": nvml_count,
              "cuInit": cuda_count}
    unseen = [a for a in (pci_addrs or []) if a not in nvml_addrs] if nvml_ok else []
    why: list[str] = []
    if pci_addrs is not None and nvml_count is not None and nvml_count < len(pci_addrs):
        why.append(f"{len(pci_addrs)} NVIDIA GPU(s) on the PCI bus, NVML shows {nvml_count}")
    if expected_gpus is not None:
        short = [f"{k} {v}" for k, v in counts.items() if v is not None and v < expected_gpus]
        if short:
            why.append(f"expected_gpus is {expected_gpus}, but only " + ", ".join(short))
    if not why:
        return
    seen = ", ".join(f"{k} {v}" for k, v in counts.items() if v is not None)
    names = f"; not shown by NVML: {' '.join(unseen)}" if unseen else ""
    f.block("gpu_missing", f"{'; '.join(why)} ({seen}){names}", backend="nvml")


def sysfs_bus_ids(host: Mapping[str, Any] | None, nvml: Mapping[str, Any] | None
                  ) -> dict[int, str]:
    """NVML index -> PCI bus id from sysfs, for GPUs whose id NVML could not read (lost ones).

    NVML numbers GPUs in PCI bus order. When sysfs lists exactly NVML's count of NVIDIA GPUs
    and every id NVML did read sits at its own index in that order, the GPU at an unread
    index is the one at that place on the bus; otherwise nothing is inferred.
    """
    pci = (host or {}).get("pci") or {}
    devices = [d for d in ((nvml or {}).get("devices") or []) if isinstance(d, Mapping)]
    if not pci.get("available") or not (nvml or {}).get("ok"):
        return {}
    addrs = sorted(str(g["address"]) for g in pci.get("gpus") or []
                   if g.get("driver") not in _PASSTHROUGH_DRIVERS)
    if len(addrs) != int((nvml or {}).get("device_count") or 0):
        return {}
    unread: dict[int, str] = {}
    for d in devices:
        index = d.get("index")
        if not isinstance(index, int) or not 0 <= index < len(addrs):
            return {}
        read = d.get("pci_bus_id")
        if read:
            if pci_address(str(read)) != addrs[index]:
                return {}  # not in bus order: no guess
        else:
            unread[index] = nvml_bus_id(addrs[index])
    return unread


def nvml_bus_id(address: str) -> str:
    """sysfs's ``0000:18:00.0`` -> NVML's ``00000000:18:00.0`` (upper-case hex)."""
    domain, bus, rest = address.split(":", 2)
    return f"{int(domain, 16):08X}:{bus.upper()}:{rest.upper()}"
