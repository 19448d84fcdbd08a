"""The busy-GPU safety rule for active probes: touch only FREE GPUs, each under its lock.

docs/design-notes.md "Busy GPUs": a probe never touches a GPU that someone else is using.
Before the cuda, jax and iree children run, the caller reads NVML (which makes no context),
works out each GPU leaf's occupancy, and claims the FREE ones here: it takes each one's
full-UUID lock (the lock ``gpudiag run`` takes) without waiting, skipping any that is taken,
and holds the locks until the children are done. A GPU not claimed is not touched: its last
active result stands.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpudiag.core import registry
from gpudiag.core.environment import (
    KnownDevice,
    is_full_uuid,
    parse_cuda_visible_devices,
    parse_nvidia_visible_devices,
    resolve,
)
from gpudiag.core.observations import NvmlObservation
from gpudiag.core.occupancy import occupancy as leaf_occupancy
from gpudiag.core.readiness import BUSY, FREE, UNKNOWN, GpuOccupancy
from gpudiag.engine.locks import LockFailed, LockInfo, lock_holder, release, try_lock
from gpudiag.engine.processes import cmdline, is_probe_child, own_process_tree


def touches_gpu(name: str, options: Mapping[str, Any] | None) -> bool:
    """Whether a probe child would make a CUDA context (its spec says, by its options): such
    probes run only on FREE GPUs."""
    spec = registry.spec(name)
    return spec is not None and spec.touches_gpu(options or {})


def occupancy_from_nvml(nvml: NvmlObservation | None, own: frozenset[int]
                        ) -> dict[str, GpuOccupancy]:
    """Each GPU leaf's occupancy from an nvml observation (core.occupancy's rule; MIG
    instances are leaves too, and a GPU is busy when any of its instances is)."""
    out: dict[str, GpuOccupancy] = {}
    if nvml is None or not nvml.ok:
        return out
    for dev in nvml.devices:
        gpu: GpuOccupancy | None = None
        if dev.uuid is not None and is_full_uuid(dev.uuid):
            occ = leaf_occupancy(dev, own)
            gpu = GpuOccupancy(dev.uuid, occ.state, occ.pids, occ.reason or "")
        for inst in dev.mig.instances if dev.mig is not None and dev.mig.enabled else ():
            if inst.uuid is None or not is_full_uuid(inst.uuid):
                continue
            occ = leaf_occupancy(inst, own, parent=dev)
            leaf = GpuOccupancy(inst.uuid, occ.state, occ.pids, occ.reason or "")
            out[leaf.uuid] = leaf
            if gpu is not None and leaf.state != FREE and gpu.state == FREE:
                gpu = GpuOccupancy(gpu.uuid, leaf.state, leaf.pids,
                                   f"a MIG instance is {leaf.state}")
        if gpu is not None:
            out[gpu.uuid] = gpu
    return out


# NVML's NOT_LOADED (9) and LIB_NOT_FOUND (12): no NVIDIA driver, so no GPU anyone could use.
_NO_DRIVER_CODES = frozenset({9, 12})


def driver_absent(nvml: NvmlObservation | None) -> bool:
    """Whether NVML says there is no NVIDIA driver at all: then no GPU can be in use, and the
    JAX and IREE probes may run as they are to name what else is missing (a plugin, a
    library). Any other NVML failure leaves every GPU UNKNOWN, never FREE."""
    if nvml is None or nvml.ok:
        return False
    return nvml.error is not None and nvml.error.code in _NO_DRIVER_CODES


def visible_uuids(nvml: NvmlObservation | None, env: Mapping[str, str]) -> list[str]:
    """The full GPU UUIDs the caller's visibility variables let it see, in their order."""
    devices = [KnownDevice(d.index, d.uuid) for d in (nvml.devices if nvml else ())
               if d.uuid is not None]
    by_index = {d.index: d.uuid for d in devices}
    seen: list[int] | None = None
    for vis in (parse_cuda_visible_devices(env.get("CUDA_VISIBLE_DEVICES")),
                parse_nvidia_visible_devices(env.get("NVIDIA_VISIBLE_DEVICES"))):
        chosen = list(resolve(vis, devices).indices)
        seen = chosen if seen is None else [i for i in seen if i in chosen]
    return [by_index[i] for i in (seen or []) if i in by_index]


@dataclass(frozen=True)
class GpuClaim:
    """The GPUs this round's active probes may touch, and why the others are left alone."""

    claimed: tuple[str, ...] = ()
    # uuid -> why it is not probed: busy, unknown, locked (a `gpudiag run` job holds it),
    # probing (another gpudiag probe is proving it right now)
    left_alone: Mapping[str, str] = field(default_factory=dict)
    locks: tuple[LockInfo, ...] = ()

    def release(self) -> None:
        """Drop the locks (idempotent)."""
        release(self.locks)

    def keep_only(self, uuid: str | None) -> None:
        """Drop every lock but ``uuid``'s (the cuda probe is done; JAX/IREE use one GPU)."""
        release([lk for lk in self.locks if lk.uuid != uuid])

    def __enter__(self) -> GpuClaim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


# How long an inline probe waits for a sibling gpudiag probe's exclusive lock (a GPU in an
# exclusive compute mode): a few cuda/JAX proofs, well inside a Slurm prolog's minute.
SIBLING_WAIT_S = 20.0


def not_foreign(nvml: NvmlObservation | None) -> frozenset[int]:
    """The PIDs that do not make a GPU busy: this process tree, and other gpudiag probe
    children (a sibling's probe is proving the GPU, not using it: docs/design-notes.md
    "Siblings are not users"). Only PIDs NVML lists are looked at: a few /proc reads."""
    ours = own_process_tree()
    listed: set[int] = set()
    for d in nvml.devices if nvml is not None and nvml.ok else ():
        lists = [d.processes, *(i.processes for i in (d.mig.instances if d.mig else ()))]
        listed.update(p.pid for procs in lists for p in (procs or ()) if p.pid is not None)
    listed -= ours
    return ours | frozenset(pid for pid in listed if is_probe_child(cmdline(pid)))


def why_unclaimed(claim: GpuClaim) -> str:
    """Why no GPU was free to prove a backend on, for the verdict (``3 busy, 5 locked``)."""
    counts: dict[str, int] = {}
    for why in claim.left_alone.values():
        counts[why] = counts.get(why, 0) + 1
    words = {"busy": "in use", "locked": "locked by a gpudiag run job",
             "probing": "held by a sibling gpudiag probe past the wait", "unknown":
             "of unknown occupancy"}
    said = ", ".join(f"{n} {words.get(w, w)}" for w, n in sorted(counts.items()))
    return f"no free GPU to prove it on ({said or 'no visible GPU'})"


# NVML compute modes in which a second process cannot make a context beside the first
# (1 EXCLUSIVE_THREAD, 3 EXCLUSIVE_PROCESS): there sibling probes take turns.
_EXCLUSIVE_MODES = frozenset({1, 3})
# How often a probe waiting for a sibling's exclusive probe lock looks again.
_SIBLING_POLL_S = 0.05


def exclusive_gpus(nvml: NvmlObservation | None) -> frozenset[str]:
    """The GPUs whose compute mode lets one process at a time make a context."""
    if nvml is None or not nvml.ok:
        return frozenset()
    return frozenset(d.uuid for d in nvml.devices
                     if d.uuid is not None and d.compute_mode in _EXCLUSIVE_MODES)


def claim_free(occupancy: Mapping[str, GpuOccupancy], candidates: Iterable[str], *,
               lock_dir: Path, probe_busy: bool = False,
               limit: int | None = None, exclusive: Collection[str] = (),
               sibling_wait_s: float = 0.0, held: Collection[str] = (),
               clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], None] = time.sleep) -> GpuClaim:
    """Lock FREE GPUs among ``candidates`` (full UUIDs, in order), at most ``limit`` of them
    (JAX and IREE need one: a monitor holds no more locks than it uses, since a `gpudiag run`
    job waits for a locked GPU).

    Siblings are not users (docs/design-notes.md, "Proven or not ready"): probes take a
    *shared* lock, so gpudiag probes started together prove a GPU side by side, and only a
    job's exclusive lock keeps them off. On a GPU in an exclusive compute mode (``exclusive``)
    only one context fits, so there probes lock exclusively and a probe that finds a
    sibling's probe lock waits for it up to ``sibling_wait_s``; a job's lock is never waited
    for. ``probe_busy`` (config ``probe_busy_gpus``, off by default) lets a site probe BUSY
    GPUs too; UNKNOWN is never probed. A lock file that cannot be opened at all leaves the
    GPU alone: the monitor must not be the one to break a job. ``held`` are GPUs the caller
    itself holds under a job's lock (admission proving what it admits): claimed as they are.
    """
    claimed: list[str] = []
    locks: list[LockInfo] = []
    left: dict[str, str] = {}
    deadline = clock() + max(0.0, sibling_wait_s)
    for uuid in candidates:
        if limit is not None and len(claimed) >= limit:
            break
        found = occupancy.get(uuid)
        state = found.state if found is not None else UNKNOWN
        if not is_full_uuid(uuid):
            left[uuid] = UNKNOWN
            continue
        if uuid in held:
            claimed.append(uuid)
            continue
        if state == UNKNOWN or (state == BUSY and not probe_busy):
            left[uuid] = state
            continue
        outcome = _lock_probe(lock_dir, uuid, shared=uuid not in exclusive, deadline=deadline,
                              clock=clock, sleep=sleep)
        if isinstance(outcome, LockInfo):
            locks.append(outcome)
            claimed.append(uuid)
        else:
            left[uuid] = outcome
    return GpuClaim(tuple(claimed), left, tuple(locks))


def _lock_probe(lock_dir: Path, uuid: str, *, shared: bool, deadline: float,
                clock: Callable[[], float], sleep: Callable[[float], None]
                ) -> LockInfo | str:
    """A probe's lock on ``uuid``, or why not: ``locked`` (a job holds it), ``probing``
    (a sibling probe held it past the wait) or ``unknown`` (the lock file is unusable)."""
    while True:
        try:
            lock = try_lock(lock_dir, uuid, purpose="probe", shared=shared)
        except LockFailed:
            return UNKNOWN
        if lock is not None:
            return lock
        # Held exclusively: by another gpudiag's probe (exclusive compute mode) it stays FREE
        # and is waited for; anyone else (a `gpudiag run` job, a bare flock) makes it busy.
        holder = lock_holder(lock_dir, uuid) or {}
        if holder.get("purpose") != "probe":
            return "locked"
        if clock() >= deadline:
            return "probing"
        sleep(_SIBLING_POLL_S)


def rotated(candidates: Sequence[str], round_index: int) -> list[str]:
    """``candidates`` starting at position ``round_index`` (wrapping): the daemon's JAX and
    IREE rounds try the GPUs in turn, so over rounds each free GPU proves the backend."""
    if not candidates:
        return []
    start = round_index % len(candidates)
    return [*candidates[start:], *candidates[:start]]
