"""The busy-GPU safety rule for active probes: touch only FREE GPUs, each under its lock.

DESIGN "Busy GPUs": a probe never touches a GPU that someone else is using. Before the cuda,
jax and iree children run, the caller reads NVML (which makes no context), works out each GPU
leaf's occupancy, and claims the FREE ones here: it takes each one's full-UUID lock (the lock
``gpudiag run`` takes) without waiting, skipping any that is taken, and holds the locks until
the children are done. A GPU not claimed is not touched: its last active result stands.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gpudiag.core.environment import is_full_uuid
from gpudiag.engine.locks import LockFailed, LockInfo, release, try_lock

FREE, BUSY, UNKNOWN = "free", "busy", "unknown"


@dataclass(frozen=True)
class GpuClaim:
    """The GPUs this round's active probes may touch, and why the others are left alone."""

    claimed: tuple[str, ...] = ()
    # uuid -> why it is not probed: busy, unknown, locked (a job of gpudiag run holds it)
    left_alone: Mapping[str, str] = field(default_factory=dict)
    locks: tuple[LockInfo, ...] = ()

    def release(self) -> None:
        """Drop the locks (idempotent)."""
        release(self.locks)

    def __enter__(self) -> GpuClaim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def claim_free(occupancy: Mapping[str, str], candidates: Iterable[str], *, lock_dir: Path,
               probe_busy: bool = False) -> GpuClaim:
    """Lock every FREE GPU among ``candidates`` (full UUIDs, in order) without waiting.

    ``probe_busy`` (config ``probe_busy_gpus``, off by default) lets a site probe BUSY GPUs
    too; UNKNOWN is never probed. A lock file that cannot be opened at all leaves the GPU
    alone: the monitor must not be the one to break a job.
    """
    claimed: list[str] = []
    locks: list[LockInfo] = []
    left: dict[str, str] = {}
    for uuid in candidates:
        state = occupancy.get(uuid, UNKNOWN)
        if not is_full_uuid(uuid):
            left[uuid] = UNKNOWN
            continue
        if state == UNKNOWN or (state == BUSY and not probe_busy):
            left[uuid] = state
            continue
        try:
            lock = try_lock(lock_dir, uuid)
        except LockFailed:
            left[uuid] = UNKNOWN
            continue
        if lock is None:
            left[uuid] = "locked"
            continue
        locks.append(lock)
        claimed.append(uuid)
    return GpuClaim(tuple(claimed), left, tuple(locks))


def rotate(claimed: tuple[str, ...], round_index: int) -> str | None:
    """The one GPU on which JAX and IREE prove their backend this round (rotating)."""
    if not claimed:
        return None
    return claimed[round_index % len(claimed)]
