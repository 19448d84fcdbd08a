"""The processes on a GPU as a person reads them (nvidia-smi's process table): one row per
process, its GPU memory summed over the GPU's MIG instances, its name and user when seen."""

from __future__ import annotations

from collections.abc import Iterable

from gpudiag.core.observations import GpuProcess
from gpudiag.core.verdict import DeviceProcess


def device_processes(procs: Iterable[GpuProcess]) -> tuple[DeviceProcess, ...]:
    """NVML's per-GPU (and per-MIG-instance) process entries, one per pid, by pid."""
    merged: dict[int, DeviceProcess] = {}
    for p in procs:
        if p.pid is None:
            continue
        used = None if p.used_memory_bytes is None else int(p.used_memory_bytes)
        seen = merged.get(p.pid)
        if seen is not None and seen.used_memory_bytes is not None and used is not None:
            used += seen.used_memory_bytes
        merged[p.pid] = DeviceProcess(p.pid, used, p.name or (seen.name if seen else None),
                                      p.user or (seen.user if seen else None))
    return tuple(merged[pid] for pid in sorted(merged))
