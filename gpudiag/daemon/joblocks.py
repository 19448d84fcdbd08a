"""One lock view: a GPU whose full-UUID lock a `gpudiag run` job holds is BUSY to the daemon.

NVML shows a job on a GPU only once the job has made a context there; a job admitted under
gpudiag's lock may not have one yet (or only between its steps). So after every NVML reading
the daemon asks the kernel whether each FREE GPU's lock is held: a non-blocking attempt on a
fresh open file description, released at once (engine/locks.lock_state: O(1), and true in
any pid namespace, where ``/proc/locks`` hides the host's lockers from a daemon under
``unshare --pid``). A lock nobody holds leaves the GPU FREE without any table read, and a held
lock whose GPU has no probe or qualification mark held (the same O(1) attempt on the marks) is
BUSY without one: no holder can then be a sibling probe. Only otherwise is the kernel's table
read, to name the holder, within a bound: only a sibling
probe, a process of the daemon's own uid that the kernel says holds the GPU's probe mark too,
leaves the GPU FREE (being proven for a moment); any other holder, exclusive or shared (a
job, a qualification, another user's ``flock -s``, a holder whose locker has exited, one in
another pid namespace), and a holder not named in time, make it BUSY. What a lock file says
decides nothing: any user who can open it could have written it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from gpudiag.core.environment import is_full_uuid
from gpudiag.core.readiness import BUSY, FREE, UNKNOWN, GpuOccupancy
from gpudiag.engine.guard import sibling_holder
from gpudiag.engine.locks import JOB_LOCKED as JOB_LOCKED
from gpudiag.engine.locks import (
    LOCK_EXCLUSIVE,
    LOCK_FREE,
    KernelLock,
    LockFailed,
    holders,
    kernel_locks,
    lock_state,
    mark_held,
)

log = logging.getLogger("gpudiag.daemon.joblocks")

SHARED_LOCKED = "under a shared lock that is not a probe's (a qualification or another user)"
# Every holder holds the qualification mark (engine/locks.Holder.qualifying, the kernel's word).
QUALIFYING = "under qualification (it stops within 1 s for a job that waits for the GPU)"
# Held, by a holder the kernel's table did not name in time (too large, too slow): never FREE.
HELD_UNNAMED = "its lock is held by a holder not named in time (the kernel's lock table)"
# Why a GPU NVML found FREE is BUSY in the lock view: what a fresh look at the locks revises.
LOCK_VIEW_WHYS = frozenset({JOB_LOCKED, SHARED_LOCKED, QUALIFYING, HELD_UNNAMED})


class JobLocks:
    """The daemon's view of the GPU locks in ``lock_dir``; ``mark`` runs after each reading."""

    def __init__(self, lock_dir: Path) -> None:
        self.lock_dir = lock_dir
        self._said: set[str] = set()  # lock problems already logged (once each)

    def mark(self, occupancy: Mapping[str, GpuOccupancy]) -> dict[str, GpuOccupancy]:
        """``occupancy`` with every FREE GPU whose lock a job holds marked BUSY.

        A lock file that cannot be opened (a FIFO or symlink planted in the shared folder, a
        folder this user cannot write) makes its GPU UNKNOWN: whether a job holds it is not
        known, and UNKNOWN is never FREE. A held lock whose holder the kernel's table does not
        name within its bounds is BUSY.
        """
        out = dict(occupancy)
        table: list[KernelLock] | None = None
        read = False
        for uuid, found in occupancy.items():
            if found.state != FREE or not is_full_uuid(uuid):
                continue
            try:
                state = lock_state(self.lock_dir, uuid)
            except LockFailed as e:
                self._say(uuid, str(e))
                out[uuid] = GpuOccupancy(uuid, UNKNOWN, why=f"its lock cannot be checked: {e}")
                continue
            if state == LOCK_FREE:
                continue  # the kernel's O(1) answer: nobody holds it, nothing to name
            if not mark_held(self.lock_dir, uuid) and not mark_held(self.lock_dir, uuid,
                                                                    "qualify"):
                # No probe or qualification mark held (O(1) each): no holder can be a
                # sibling probe or a qualification, so there is nothing to name.
                out[uuid] = GpuOccupancy(uuid, BUSY, why=(
                    JOB_LOCKED if state == LOCK_EXCLUSIVE else SHARED_LOCKED))
                continue
            if not read:  # one bounded reading per view, only when a lock is held
                table, read = kernel_locks(), True
            held = holders(self.lock_dir, uuid, table) if table is not None else None
            if held is None:
                why = JOB_LOCKED if state == LOCK_EXCLUSIVE else HELD_UNNAMED
                out[uuid] = GpuOccupancy(uuid, BUSY, why=why)
                continue
            users = [h for h in held if not sibling_holder(h)]
            if users:
                exclusive = any(not h.shared for h in users)
                why = (QUALIFYING if all(h.qualifying for h in users) else
                       JOB_LOCKED if exclusive else SHARED_LOCKED)
                out[uuid] = GpuOccupancy(uuid, BUSY, why=why)
        return out

    def _say(self, uuid: str, error: str) -> None:
        if error in self._said or len(self._said) >= 256:
            return
        self._said.add(error)
        log.warning("GPU %s is unknown, not free: its lock cannot be checked: %s", uuid, error,
                    extra={"uuid": uuid, "lock_dir": str(self.lock_dir)})
