"""The busy-GPU safety rule for active probes: touch only FREE GPUs, each under its lock.

docs/design-notes.md "Busy GPUs": a probe never touches a GPU that someone else is using.
Before the cuda, jax and iree children run, the caller reads NVML (which makes no context),
works out each GPU leaf's occupancy (engine/occupancy_view.py), and claims the FREE ones
here: it takes each one's full-UUID lock (the lock ``gpudiag run`` takes) without waiting,
skipping any that is taken, and holds the locks until the children are done. A GPU not
claimed is not touched: its last active result stands.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import field
from pathlib import Path
from typing import Any

from gpudiag.core import registry
from gpudiag.core.environment import KnownDevice, is_full_uuid, job_view
from gpudiag.core.observations import NvmlObservation
from gpudiag.core.readiness import BUSY, UNKNOWN, GpuOccupancy
from gpudiag.core.records import dataclass
from gpudiag.engine.locks import (
    LOCK_FREE,
    Holder,
    LockFailed,
    LockInfo,
    holders,
    lock_state,
    mark_held,
    release,
    try_lock,
)
from gpudiag.engine.occupancy_view import sibling_holder


def touches_gpu(name: str, options: Mapping[str, Any] | None) -> bool:
    """Whether a probe child would make a CUDA context (its spec says, by its options): such
    probes run only on FREE GPUs."""
    spec = registry.spec(name)
    return spec is not None and spec.touches_gpu(options or {})


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
    return [by_index[i] for i in job_view(env, devices).indices if i in by_index]


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
# A try that met a lock the O(1) test then finds free (let go, or another reader's test held
# it for its moment: microseconds, or a scheduler slice or several when that reader is
# preempted on a loaded host) is tried again for this long, whatever the sibling wait.
_RACE_WAIT_S = 0.5
_RACE_PAUSE_S = 0.002


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
               sleep: Callable[[float], None] = time.sleep,
               purpose: str = "probe") -> GpuClaim:
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
    ``purpose`` ``qualify`` (minutes of work, engine/qualify.py) holds no probe mark, so that
    the daemon and jobs see the GPU in use rather than being proven for a moment.

    Whether a lock is held is the kernel's O(1) answer (engine/locks.lock_state); who holds
    it, the kernel's table, read within a bound only when it is held (engine/locks.holders):
    a shared lock held beside ours by anyone but a sibling probe (a qualification, another
    user's ``flock -s``, a holder not named in time) leaves the GPU alone, as ``locked``.
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
                              clock=clock, sleep=sleep, purpose=purpose)
        if isinstance(outcome, LockInfo):
            locks.append(outcome)
            claimed.append(uuid)
        else:
            left[uuid] = outcome
    return GpuClaim(tuple(claimed), left, tuple(locks))


def _lock_probe(lock_dir: Path, uuid: str, *, shared: bool, deadline: float,
                clock: Callable[[], float], sleep: Callable[[float], None],
                purpose: str = "probe") -> LockInfo | str:
    """A probe's lock on ``uuid``, or why not: ``locked`` (a job, a qualification or another
    user holds it), ``probing`` (a sibling probe held it past the wait) or ``unknown`` (the
    lock file is unusable)."""
    race_deadline = clock() + _RACE_WAIT_S
    while True:
        try:
            before = lock_state(lock_dir, uuid)
            lock = try_lock(lock_dir, uuid, purpose=purpose, shared=shared)
        except LockFailed:
            return UNKNOWN
        if lock is not None:
            # Ours exclusively, or shared where nobody held it a moment before (the kernel's
            # O(1) answer): nobody else to name. Shared beside holders already there: named
            # (a bounded read of the kernel's table), and only sibling probes may be there.
            if not shared or before == LOCK_FREE:
                return lock
            found = holders(lock_dir, uuid)
            others = [h for h in found or () if h.pid != os.getpid()]
            if found is not None and all(sibling_holder(h) for h in others):
                return lock
            release([lock])  # a shared lock beside someone's use of the GPU (or not named)
            if _unnamed(found) and clock() < deadline:
                # Not named within the naming bound (a loaded host: many probes at once), or
                # a holder that let go while it was being named: unknown is never "a
                # sibling", so not shared now; named again within the sibling wait, as a
                # sibling's own lock would be waited for.
                sleep(_SIBLING_POLL_S)
                continue
            return "locked"
        if lock_state(lock_dir, uuid) == LOCK_FREE and clock() < race_deadline:
            # Let go between our try and the look, or another reader's O(1) test held it for
            # its moment: try again (for a bounded while, whatever the sibling wait).
            sleep(_RACE_PAUSE_S)
            continue
        if not mark_held(lock_dir, uuid):
            return "locked"  # no probe mark held (O(1)): no holder is a sibling probe
        found = holders(lock_dir, uuid)
        # No holder now (it let go between our try and the kernel's table), or one not named
        # (within the naming bound, or it let go meanwhile) while a probe mark is held: look
        # again within the wait.
        if (found == [] or _unnamed(found)) and clock() < deadline:
            sleep(_SIBLING_POLL_S)
            continue
        # Held exclusively: by a sibling gpudiag probe (exclusive compute mode, the kernel
        # says it holds the probe mark) it stays FREE and is waited for; anyone else (a
        # `gpudiag run` job, another user, a bare flock, a holder not named in time) makes
        # it busy.
        if not found or not all(sibling_holder(h) for h in found):
            return "locked"
        if clock() >= deadline:
            return "probing"
        sleep(_SIBLING_POLL_S)


def _unnamed(found: Sequence[Holder] | None) -> bool:
    """Whether some holder is not known: the table was not read in time, or a locker in this
    pid namespace let go between the reading and the look at its process (a sibling probe
    done). Unknown is never a sibling; it is named again, never taken for a job at once."""
    return found is None or any(h.pid is None and not h.elsewhere for h in found)


def rotated(candidates: Sequence[str], round_index: int) -> list[str]:
    """``candidates`` starting at position ``round_index`` (wrapping): the daemon's JAX and
    IREE rounds try the GPUs in turn, so over rounds each free GPU proves the backend."""
    if not candidates:
        return []
    start = round_index % len(candidates)
    return [*candidates[start:], *candidates[:start]]
