"""Occupancy: is a GPU leaf FREE, BUSY or UNKNOWN? A pure rule over typed NVML readings.

A leaf is what a job is given: a GPU without MIG, or one MIG instance (then not its parent).
The rule reads only what NVML listed (no CUDA context is ever needed): a leaf is BUSY when
NVML lists a compute process on it that is not one of ``ours`` (the caller's own process
tree), FREE when it lists none, and UNKNOWN whenever something it needs could not be read.
UNKNOWN is never FREE: a leaf whose state cannot be proven is never handed out.
Admission (gpudiag.runner.admission) uses it to pick GPUs; classification can use it next.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Literal, TypeAlias

from gpudiag.core.environment import is_full_uuid
from gpudiag.core.observations import (
    ErrorInfo,
    GpuProcess,
    Memory,
    MigInstance,
    NvmlDevice,
    NvmlObservation,
)
from gpudiag.core.records import dataclass

# The one spelling of a leaf's occupancy in gpudiag: the verdict record's (devices[].occupancy),
# the metrics' (gpudiag_gpu_occupancy{state}), admission's evidence and the guard's readings
# (core/readiness.py uses these too). FREE, BUSY and UNKNOWN in prose are these states.
State: TypeAlias = Literal["free", "busy", "unknown"]
FREE: State = "free"
BUSY: State = "busy"
UNKNOWN: State = "unknown"


@dataclass(frozen=True)
class Occupancy:
    """A leaf's state, the foreign PIDs that make it BUSY, and why it is not FREE."""

    state: State
    pids: tuple[int, ...] = ()
    reason: str | None = None

    @property
    def free(self) -> bool:
        return self.state == FREE


def _rule(readable: bool, uuid: str | None, memory: Memory | None,
          processes: tuple[GpuProcess, ...] | None, error: ErrorInfo | None,
          ours: Collection[int]) -> Occupancy:
    if not readable or error is not None:
        shown = error.record if error is not None else None
        return Occupancy(UNKNOWN, (), f"the device could not be read: {shown}")
    if uuid is None or not is_full_uuid(uuid):
        return Occupancy(UNKNOWN, (), f"no full UUID could be read (got {uuid!r})")
    if memory is None or memory.free_bytes is None:
        return Occupancy(UNKNOWN, (), "memory could not be read")
    if processes is None:
        return Occupancy(UNKNOWN, (), "compute processes could not be listed")
    # A process without a PID cannot be shown to be ours: it counts as foreign.
    foreign = [p for p in processes if p.pid is None or p.pid not in ours]
    if foreign:
        pids = tuple(p.pid for p in foreign if p.pid is not None)
        return Occupancy(BUSY, pids, f"{len(foreign)} compute process(es) of others: pids "
                         + ", ".join(str(p) for p in pids))
    return Occupancy(FREE)


def occupancy(unit: NvmlDevice | MigInstance, ours: Collection[int] = (), *,
              parent: NvmlDevice | None = None) -> Occupancy:
    """FREE, BUSY or UNKNOWN for a GPU or a MIG instance (``parent``: its GPU)."""
    if isinstance(unit, NvmlDevice):
        return _rule(unit.ok, unit.uuid, unit.memory, unit.processes, unit.error, ours)
    readable = parent.ok if parent is not None else True
    return _rule(readable, unit.uuid, unit.memory, unit.processes, unit.error, ours)


@dataclass(frozen=True)
class Leaf:
    """One schedulable unit: a GPU without MIG, or one MIG instance (then not its parent)."""

    uuid: str | None
    kind: str  # "gpu" | "mig"
    index: int  # NVML index of the physical GPU: evidence only, never an identity
    parent_uuid: str | None
    name: str | None
    memory_total_bytes: int | None
    memory_free_bytes: int | None
    occupancy: State
    pids: tuple[int, ...] = ()
    reason: str | None = None  # why BUSY or UNKNOWN
    mig_slot: int | None = None

    @property
    def label(self) -> str:
        return self.uuid or f"index {self.index}" + (
            f" MIG slot {self.mig_slot}" if self.mig_slot is not None else "")

    def record(self) -> dict[str, Any]:
        return {"uuid": self.uuid, "kind": self.kind, "index": self.index,
                "mig_slot": self.mig_slot, "parent_uuid": self.parent_uuid, "name": self.name,
                "memory_total_bytes": self.memory_total_bytes,
                "memory_free_bytes": self.memory_free_bytes, "occupancy": self.occupancy,
                "pids": list(self.pids), "reason": self.reason}


def _leaf(dev: NvmlDevice, unit: NvmlDevice | MigInstance, ours: Collection[int]) -> Leaf:
    occ = occupancy(unit, ours, parent=dev)
    mem = unit.memory or Memory()
    mig = isinstance(unit, MigInstance)
    return Leaf(uuid=unit.uuid, kind="mig" if mig else "gpu", index=dev.index,
                parent_uuid=dev.uuid if mig else None, name=dev.name,
                memory_total_bytes=mem.total_bytes, memory_free_bytes=mem.free_bytes,
                occupancy=occ.state, pids=occ.pids, reason=occ.reason,
                mig_slot=unit.slot if isinstance(unit, MigInstance) else None)


def leaves_from_nvml(nvml: NvmlObservation, ours: Collection[int] = ()) -> tuple[Leaf, ...]:
    """The schedulable leaves of an nvml observation (MIG instances replace their GPU)."""
    leaves: list[Leaf] = []
    for dev in nvml.devices:
        if dev.mig is not None and dev.mig.enabled:
            leaves.extend(_leaf(dev, inst, ours) for inst in dev.mig.instances)
            if not dev.mig.instances:
                leaves.append(Leaf(uuid=None, kind="mig", index=dev.index,
                                   parent_uuid=dev.uuid, name=dev.name,
                                   memory_total_bytes=None, memory_free_bytes=None,
                                   occupancy=UNKNOWN,
                                   reason="MIG is on but no instance could be read"))
            continue
        leaves.append(_leaf(dev, dev, ours))
    return tuple(leaves)
