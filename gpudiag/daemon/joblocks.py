"""One lock view: a GPU whose full-UUID lock a `gpudiag run` job holds is BUSY to the daemon.

NVML shows a job on a GPU only once the job has made a context there; a job admitted under
gpudiag's lock may not have one yet (or only between its steps). So after every NVML reading
the daemon asks the kernel (``/proc/locks``) who holds each FREE GPU's lock: it takes no lock
and no GPU context. Only a sibling probe, a process of the daemon's own uid that the kernel
says holds the GPU's probe mark too, leaves the GPU FREE (being proven for a moment); any
other holder, exclusive or shared (a job, a qualification, another user's ``flock -s``, a
holder whose locker has exited), makes it BUSY. What a lock file says decides nothing: any
user who can open it could have written it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from gpudiag.core.environment import is_full_uuid
from gpudiag.core.readiness import BUSY, FREE, UNKNOWN, GpuOccupancy
from gpudiag.engine.guard import sibling_holder
from gpudiag.engine.locks import JOB_LOCKED as JOB_LOCKED
from gpudiag.engine.locks import LockFailed, check_lock_file, holders, kernel_locks

log = logging.getLogger("gpudiag.daemon.joblocks")

SHARED_LOCKED = "under a shared lock that is not a probe's (a qualification or another user)"
# Every holder holds the qualification mark (engine/locks.Holder.qualifying, the kernel's word).
QUALIFYING = "under qualification (it stops within 1 s for a job that waits for the GPU)"
# Why a GPU NVML found FREE is BUSY in the lock view: what a fresh look at the locks revises.
LOCK_VIEW_WHYS = frozenset({JOB_LOCKED, SHARED_LOCKED, QUALIFYING})


class JobLocks:
    """The daemon's view of the GPU locks in ``lock_dir``; ``mark`` runs after each reading."""

    def __init__(self, lock_dir: Path) -> None:
        self.lock_dir = lock_dir
        self._said: set[str] = set()  # lock problems already logged (once each)

    def mark(self, occupancy: Mapping[str, GpuOccupancy]) -> dict[str, GpuOccupancy]:
        """``occupancy`` with every FREE GPU whose lock a job holds marked BUSY.

        A lock file that cannot be opened (a FIFO or symlink planted in the shared folder, a
        folder this user cannot write) makes its GPU UNKNOWN: whether a job holds it is not
        known, and UNKNOWN is never FREE.
        """
        out = dict(occupancy)
        table = None
        for uuid, found in occupancy.items():
            if found.state != FREE or not is_full_uuid(uuid):
                continue
            try:
                check_lock_file(self.lock_dir, uuid)
            except LockFailed as e:
                self._say(uuid, str(e))
                out[uuid] = GpuOccupancy(uuid, UNKNOWN, why=f"its lock cannot be checked: {e}")
                continue
            table = kernel_locks() if table is None else table
            held = holders(self.lock_dir, uuid, table) if table is not None else None
            if held is None:
                out[uuid] = GpuOccupancy(uuid, UNKNOWN, why="who holds its lock cannot be "
                                         "read (the kernel's lock table)")
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
