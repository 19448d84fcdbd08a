"""The busy-GPU safety rule for active probes: touch only FREE GPUs, each under its lock.

DESIGN "Busy GPUs": a probe never touches a GPU that someone else is using. Before the cuda,
jax and iree children run, the caller reads NVML (which makes no context), works out each GPU
leaf's occupancy, and claims the FREE ones here: it takes each one's full-UUID lock (the lock
``gpudiag run`` takes) without waiting, skipping any that is taken, and holds the locks until
the children are done. A GPU not claimed is not touched: its last active result stands.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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

# The probes that make a CUDA context (and so may only run on FREE GPUs), by their options.
ACTIVE_PROBES = ("cuda", "jax", "iree")


def touches_gpu(name: str, options: Mapping[str, Any] | None) -> bool:
    """Whether a probe child would make a CUDA context: cuda always, jax/iree on a GPU."""
    opts = options or {}
    if name == "cuda":
        return True
    if name == "jax":
        return str(opts.get("platform") or "gpu") not in ("cpu",)
    if name == "iree":
        return any(d in ("cuda", "hip") for d in opts.get("drivers") or ["cuda"])
    return False


# core.occupancy's states, as the verdict and the metrics write them.
_STATE = {"FREE": FREE, "BUSY": BUSY, "UNKNOWN": UNKNOWN}


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
            gpu = GpuOccupancy(dev.uuid, _STATE[occ.state], occ.pids, occ.reason or "")
        for inst in dev.mig.instances if dev.mig is not None and dev.mig.enabled else ():
            if inst.uuid is None or not is_full_uuid(inst.uuid):
                continue
            occ = leaf_occupancy(inst, own, parent=dev)
            leaf = GpuOccupancy(inst.uuid, _STATE[occ.state], occ.pids, occ.reason or "")
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


def claim_free(occupancy: Mapping[str, GpuOccupancy], candidates: Iterable[str], *,
               lock_dir: Path, probe_busy: bool = False,
               limit: int | None = None) -> GpuClaim:
    """Lock FREE GPUs among ``candidates`` (full UUIDs, in order) without waiting, at most
    ``limit`` of them (JAX and IREE need one: a monitor holds no more locks than it uses,
    since a `gpudiag run` job waits for a locked GPU).

    ``probe_busy`` (config ``probe_busy_gpus``, off by default) lets a site probe BUSY GPUs
    too; UNKNOWN is never probed. A lock file that cannot be opened at all leaves the GPU
    alone: the monitor must not be the one to break a job.
    """
    claimed: list[str] = []
    locks: list[LockInfo] = []
    left: dict[str, str] = {}
    for uuid in candidates:
        if limit is not None and len(claimed) >= limit:
            break
        found = occupancy.get(uuid)
        state = found.state if found is not None else UNKNOWN
        if not is_full_uuid(uuid):
            left[uuid] = UNKNOWN
            continue
        if state == UNKNOWN or (state == BUSY and not probe_busy):
            left[uuid] = state
            continue
        try:
            lock = try_lock(lock_dir, uuid, purpose="probe")
        except LockFailed:
            left[uuid] = UNKNOWN
            continue
        if lock is None:
            # Another gpudiag's probe proving it this moment leaves it FREE (not ours to
            # probe now); anyone else holding it (a `gpudiag run` job) makes it busy.
            holder = lock_holder(lock_dir, uuid) or {}
            left[uuid] = "probing" if holder.get("purpose") == "probe" else "locked"
            continue
        locks.append(lock)
        claimed.append(uuid)
    return GpuClaim(tuple(claimed), left, tuple(locks))


def rotated(candidates: Sequence[str], round_index: int) -> list[str]:
    """``candidates`` starting at position ``round_index`` (wrapping): the daemon's JAX and
    IREE rounds try the GPUs in turn, so over rounds each free GPU proves the backend."""
    if not candidates:
        return []
    start = round_index % len(candidates)
    return [*candidates[start:], *candidates[:start]]
