"""Occupancy and the two questions a verdict answers: job readiness and node health.

docs/design-notes.md "Busy GPUs". Active probes touch only FREE GPUs; what they could not
touch keeps its last active result. This module turns the GPU-level findings of classify
into the answer:

- Job readiness with ``gpus=N``: ready when at least N GPUs within the caller's visibility are
  healthy and FREE; the verdict names them (``devices[].selected``). A fault on another GPU is
  a warning (``gpu_fault_outside_selection``) naming that GPU. Healthy but not free:
  ``devices_busy`` (or ``device_state_unknown``).
- Job readiness without ``gpus``: every visible GPU must be usable now, so a BUSY one is
  ``devices_busy`` and an UNKNOWN one ``device_state_unknown``.
- Node health: is anything broken? Busy GPUs are healthy in use; occupancy never blocks.

In every question, a context failure that means "in use" (46, out of memory) on a GPU that
other processes use is occupancy, not a fault. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import field, replace

from gpudiag.core.findings import Findings
from gpudiag.core.occupancy import BUSY as BUSY  # re-exported: one spelling package-wide
from gpudiag.core.occupancy import FREE as FREE
from gpudiag.core.occupancy import UNKNOWN as UNKNOWN
from gpudiag.core.records import dataclass
from gpudiag.core.verdict import (
    UNPROVEN,
    BackendRequirement,
    BackendStatus,
    DeviceInfo,
    Finding,
    Requirement,
)

# What a context creation answers on a GPU that someone else holds or has filled.
IN_USE_CODES = frozenset({"cuda_devices_unavailable", "cuda_out_of_memory"})
# Blockers about one GPU that mean it is broken (not the host's stack, not occupancy).
GPU_FAULT_LAYERS = frozenset({"device", "cuda"})


@dataclass(frozen=True)
class GpuOccupancy:
    """One GPU leaf's occupancy and the evidence for it."""

    uuid: str
    state: str  # free | busy | unknown
    pids: tuple[int, ...] = ()  # other processes seen on it
    why: str = ""  # e.g. "2 other processes", "locked by a gpudiag run job"

    def describe(self) -> str:
        """A short phrase for messages: ``busy (pids 4242, 4243)``."""
        pids = f" (pids {', '.join(map(str, self.pids))})" if self.pids else ""
        why = f": {self.why}" if self.why and not self.pids else ""
        return f"{self.state}{pids}{why}"


@dataclass(frozen=True)
class ProbeScope:
    """What the active probes were allowed to touch this round, and what is remembered."""

    occupancy: Mapping[str, GpuOccupancy] = field(default_factory=dict)
    # Full UUIDs on which the cuda probe made a context this round.
    probed: frozenset[str] = frozenset()
    # jax / iree -> the UUID they proved their backend on; None when no GPU was free.
    backend_gpu: Mapping[str, str | None] = field(default_factory=dict)
    # uuid -> RFC 3339 time of the last successful active probe on it (daemon memory).
    last_proven: Mapping[str, str] = field(default_factory=dict)

    def state(self, uuid: str | None) -> str:
        """FREE, BUSY or UNKNOWN for a GPU (UNKNOWN when nothing was read)."""
        found = self.occupancy.get(uuid or "")
        return found.state if found is not None else UNKNOWN


def settle(f: Findings, devices: Sequence[DeviceInfo], requirement: Requirement,
           scope: ProbeScope, *, checked_at: str,
           nic_trouble: Mapping[str, tuple[str, ...]] | None = None
           ) -> tuple[DeviceInfo, ...]:
    """Apply occupancy to the findings (in place) and return the devices as reported;
    ``nic_trouble``: GPU label -> its NICs down, flapping or degraded (core.nic)."""
    _in_use_is_occupancy(f, scope)
    faulty = {b.device for b in f.blockers if b.device and b.layer in GPU_FAULT_LAYERS}
    reported = [_device(d, scope, faulty, checked_at) for d in devices]
    if requirement.node_health:
        return tuple(reported)
    if requirement.gpus is not None:
        return tuple(_choose(f, reported, requirement.gpus, scope, nic_trouble or {}))
    _every_visible_gpu(f, reported, scope)
    return tuple(reported)


def _in_use_is_occupancy(f: Findings, scope: ProbeScope) -> None:
    """46 or out of memory on a GPU that other processes use says "busy", not "broken"."""
    f.blockers[:] = [b for b in f.blockers
                     if not (b.code in IN_USE_CODES and scope.state(b.device) == BUSY)]


def label_of(d: DeviceInfo) -> str:
    """The label findings use for a GPU: its UUID, or ``index N`` where none could be read."""
    return d.uuid or f"index {d.index}"


def _device(d: DeviceInfo, scope: ProbeScope, faulty: set[str], checked_at: str
            ) -> DeviceInfo:
    healthy = label_of(d) not in faulty
    proven = (checked_at if healthy and d.uuid in scope.probed
              else scope.last_proven.get(d.uuid or ""))
    return replace(d, occupancy=scope.state(d.uuid), healthy=healthy, last_proven_at=proven)


def _choose(f: Findings, devices: list[DeviceInfo], n: int, scope: ProbeScope,
            nic_trouble: Mapping[str, tuple[str, ...]]) -> list[DeviceInfo]:
    """Job readiness on N GPUs: pick N healthy FREE ones; faults elsewhere become warnings."""
    ready = [d for d in devices if d.healthy and d.occupancy == FREE]
    # The healthiest first: a GPU whose NICs are up before one whose nearest NIC is down,
    # flapping or slow (its job's traffic would cross the node or crawl: issue 51); then a
    # GPU without a warning (a narrowed PCIe link, throttling, ECC) before one with; then
    # the GPUs the backends were proven on (the verdict names what was proven); then the
    # most free memory; then the device order.
    proven = {g for g in scope.backend_gpu.values() if g}
    warned: dict[str, list[str]] = {}
    for w in f.warnings:
        if w.device:
            warned.setdefault(w.device, []).append(w.code)
    ready.sort(key=lambda d: (label_of(d) in nic_trouble, label_of(d) in warned,
                              d.uuid not in proven, -(d.memory_free_bytes or 0), d.index))
    why = {label_of(d): _why(d, warned, proven, rank, n, nic_trouble.get(label_of(d)))
           for rank, d in enumerate(ready)}
    devices = [replace(d, selection=why.get(label_of(d), _passed_over(d))) for d in devices]
    if len(ready) >= n:
        chosen = {label_of(d) for d in ready[:n]}
        kept: list[Finding] = []
        for b in f.blockers:
            if b.device and b.layer in GPU_FAULT_LAYERS and b.device not in chosen:
                f.warn("gpu_fault_outside_selection",
                       f"{b.code} on {b.device}, which the job does not use: {b.message}",
                       backend=b.backend, device=b.device)
            elif not (b.code == "insufficient_devices" and b.device is None):
                kept.append(b)
        f.blockers[:] = kept
        return [replace(d, selected=label_of(d) in chosen) for d in devices]
    healthy = [d for d in devices if d.healthy]
    busy = [d for d in healthy if d.occupancy == BUSY]
    unknown = [d for d in healthy if d.occupancy == UNKNOWN]
    if len(healthy) >= n:
        code = "devices_busy" if len(ready) + len(busy) >= n or not unknown else (
            "device_state_unknown")
        others = busy if code == "devices_busy" else unknown
        f.block(code, f"{len(ready)} healthy free GPU(s) of {len(devices)} visible; the job "
                f"asks for {n}; in use: " + ", ".join(_label(d) for d in others))
    else:
        f.block("insufficient_devices",
                f"{len(healthy)} healthy GPU(s) of {len(devices)} visible "
                f"({len(ready)} free); the job asks for {n}")
    return [replace(d, selected=False) for d in devices]


def _why(d: DeviceInfo, warned: Mapping[str, list[str]], proven: set[str], rank: int,
         n: int, nics_down: tuple[str, ...] | None = None) -> str:
    """Why a healthy FREE GPU ranks where it does among them (``devices[].selection``)."""
    codes = warned.get(label_of(d))
    parts = [f"warnings: {', '.join(dict.fromkeys(codes))}" if codes else "no warning"]
    if nics_down:
        parts.insert(0, f"its NIC {', '.join(nics_down)} down or degraded")
    if d.uuid in proven:
        parts.append("backends proven on it")
    if d.memory_free_bytes is not None:
        parts.append(f"{d.memory_free_bytes / 2**30:.1f} GiB free")
    verb = "chosen" if rank < n else "not chosen"
    return f"{verb}: healthy and free, {', '.join(parts)}; #{rank + 1} by health, then memory"


def _passed_over(d: DeviceInfo) -> str:
    """Why a GPU was not among the candidates at all."""
    if not d.healthy:
        return "not chosen: a fault on it (see blockers or warnings)"
    return f"not chosen: {d.occupancy or 'unknown'}, not free"


def _every_visible_gpu(f: Findings, devices: Sequence[DeviceInfo], scope: ProbeScope) -> None:
    """Without ``gpus``: every visible GPU must be usable now, so none may be in use."""
    for d in devices:
        if not d.healthy or d.occupancy == FREE:
            continue
        found = scope.occupancy.get(d.uuid or "")
        detail = found.describe() if found is not None else d.occupancy or UNKNOWN
        if d.occupancy == BUSY:
            f.block("devices_busy", f"GPU {d.index} ({d.uuid}) is {detail}", device=d.uuid)
        else:
            f.block("device_state_unknown", f"GPU {d.index} ({d.uuid}): occupancy {detail}",
                    device=d.uuid)


def with_proof_gpu(status: BackendStatus, req: BackendRequirement,
                   scope: ProbeScope | None) -> BackendStatus:
    """A GPU backend's status with the GPU it was proven on (``detail.proven_on``)."""
    gpu = scope.backend_gpu.get(req.name) if scope is not None else None
    if not req.needs_gpu or gpu is None or status.status != "ok":
        return status
    return replace(status, detail={**status.detail, "proven_on": gpu})


def require_proof(f: Findings, requirement: Requirement,
                  backends: Mapping[str, BackendStatus]) -> None:
    """Proven or not ready: a required backend left unproven blocks, whatever the question.

    Job readiness is then not ready (wait, or let admission prove it under its lock). Node
    health reads the same code as "nothing known broken, X unproven": the Slurm and NPD
    checks do not drain on ``backend_unproven`` (docs/design-notes.md).
    """
    for b in requirement.backends:
        status = backends.get(b.name)
        if status is None or status.status != UNPROVEN:
            continue
        reason = str(status.detail.get("reason") or "it was not tried")
        meaning = ("nothing known is broken; " if requirement.node_health
                   else "the job cannot be told it is ready; ")
        f.block("backend_unproven", f"{b.spec()} is unproven ({meaning}{reason})",
                backend=b.name)


def _label(d: DeviceInfo) -> str:
    return f"GPU {d.index} ({d.uuid}, {d.occupancy})"
