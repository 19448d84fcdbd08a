"""One lock view: a GPU whose full-UUID lock a `gpudiag run` job holds is BUSY to the daemon.

NVML shows a job on a GPU only once the job has made a context there; a job admitted under
gpudiag's lock may not have one yet (or only between its steps). So after every NVML reading
the daemon tries each FREE GPU's lock without waiting and lets go at once: it takes no GPU
context and holds nothing. A lock another gpudiag probe holds (holder purpose ``probe``) is a
GPU being proven for a moment, not a GPU in use: it stays FREE.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from gpudiag.core.environment import is_full_uuid
from gpudiag.core.readiness import BUSY, FREE, UNKNOWN, GpuOccupancy
from gpudiag.engine.locks import JOB_LOCKED as JOB_LOCKED
from gpudiag.engine.locks import LockFailed, lock_holder, release, try_lock

log = logging.getLogger("gpudiag.daemon.joblocks")


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
        for uuid, found in occupancy.items():
            if found.state != FREE or not is_full_uuid(uuid):
                continue
            try:
                lock = try_lock(self.lock_dir, uuid, purpose="probe", shared=True)
            except LockFailed as e:
                self._say(uuid, str(e))
                out[uuid] = GpuOccupancy(uuid, UNKNOWN, why=f"its lock cannot be checked: {e}")
                continue
            if lock is not None:
                release([lock])  # free: nobody holds it, and the daemon must not either
                continue
            holder = lock_holder(self.lock_dir, uuid) or {}
            if holder.get("purpose") != "probe":
                out[uuid] = GpuOccupancy(uuid, BUSY, why=JOB_LOCKED)
        return out

    def _say(self, uuid: str, error: str) -> None:
        if error in self._said or len(self._said) >= 256:
            return
        self._said.add(error)
        log.warning("GPU %s is unknown, not free: its lock cannot be checked: %s", uuid, error,
                    extra={"uuid": uuid, "lock_dir": str(self.lock_dir)})
