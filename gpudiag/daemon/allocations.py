"""Which job holds which GPU, as a join: ``gpudiag_gpu_allocation_info{uuid, job_id, user,
scheduler} 1`` while a `gpudiag run` holds the GPU, gone when it closes out.

Never a job label on a per-GPU gauge (a DCGM exporter's ``hpc_job`` label multiplied its
series by the number of jobs): one info series per allocated GPU leaf, at most one per leaf,
joined in PromQL (``* on (instance, uuid) group_left (job_id, user)
gpudiag_gpu_allocation_info``). The label is ``job_id``, never ``job``: Prometheus's own
target label ``job`` would rename it ``exported_job`` at the scrape, and every join on it
would show the scrape job's name.

Each run drops a ``gpudiag.allocation/1`` file into ``STATE_DIR/allocations/`` (sticky and
writable by everyone, listable by nobody else: the job-closeouts inbox's mode) once its GPUs
are locked, and removes it at closeout. The file is a claim: the daemon shows it only while
its pid lives and is owned by the file's owner (the kernel's word for both), so a run killed
by SIGKILL drops out at the next loop and its file is removed. ``user`` is the file owner's
name, never the file's content; ``job_id`` and ``scheduler`` are the run's word (display).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pwd
import threading
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.core import GaugeMetricFamily, Metric

from gpudiag.core.environment import is_full_uuid
from gpudiag.core.fileio import RefusedFile, inbox_names, read_regular
from gpudiag.core.usage import ALLOCATION_INBOX, AllocationRecord
from gpudiag.daemon.collectors import StateCollector

log = logging.getLogger("gpudiag.daemon.allocations")
INBOX_MODE = 0o1733
MAX_FILE_BYTES = 16 * 1024
MAX_FILES = 1024  # read per loop: anyone may write here, nobody may make the loop crawl


@dataclass(frozen=True)
class Allocation:
    """One GPU leaf held by one job, as shown."""

    uuid: str
    job: str
    user: str
    scheduler: str
    since: float


def _owner_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:  # a container's or a dynamic user's uid
        return str(uid)


def _proc_uid(pid: int, proc: Path) -> int | None:
    """The uid owning process ``pid`` (None: no such process)."""
    try:
        return (proc / str(pid)).stat().st_uid
    except OSError:
        return None


class Allocations:
    """Reads the allocation files on each loop; ``current()`` is what the collector shows."""

    def __init__(self, state_dir: Path, *, proc: Path = Path("/proc"),
                 owner_name: Callable[[int], str] = _owner_name,
                 leaves: Callable[[], Collection[str] | None] = lambda: None) -> None:
        """``leaves``: the GPU and MIG UUIDs the daemon sees now (None: not known yet, take
        any full UUID); a claim on any other UUID is not shown, so the series stay at most
        one per real leaf whatever the files say."""
        self.folder = state_dir / ALLOCATION_INBOX
        self._leaves = leaves
        self._proc = proc
        self._owner_name = owner_name
        self._lock = threading.Lock()
        self._current: tuple[Allocation, ...] = ()
        self._refused: set[str] = set()

    def prepare(self) -> None:
        """Create the folder: every user's runs may drop a file, none may read another's."""
        self.folder.mkdir(exist_ok=True)
        with contextlib.suppress(OSError):
            if self.folder.stat().st_uid == os.getuid():
                self.folder.chmod(INBOX_MODE)

    def current(self) -> tuple[Allocation, ...]:
        """The allocations as of the last poll, one per GPU leaf."""
        with self._lock:
            return self._current

    def poll(self) -> tuple[Allocation, ...]:
        """Read every file; keep those whose run lives; remove the others' files."""
        found: dict[str, Allocation] = {}
        known = self._leaves()
        for name in inbox_names(self.folder, self._refused)[:MAX_FILES]:
            path = self.folder / name
            try:
                raw, st = read_regular(path, MAX_FILE_BYTES)
                record = AllocationRecord.from_record(json.loads(raw))
            except (RefusedFile, ValueError, RecursionError) as e:
                log.warning("allocation file %s refused: %s", path, e,
                            extra={"record": str(path), "error": str(e)})
                self._drop(path, name)
                continue
            if _proc_uid(record.pid, self._proc) != st.st_uid:
                self._drop(path, name)  # the run is gone (or the pid is not its owner's)
                continue
            user = self._owner_name(st.st_uid)
            job = record.job or f"pid-{record.pid}"
            for uuid in record.gpus:
                if not is_full_uuid(uuid) or (known is not None and uuid not in known):
                    continue
                held = found.get(uuid)
                # At most one series per leaf: the earliest claim (the lock's first holder).
                if held is None or record.since < held.since:
                    found[uuid] = Allocation(uuid, job, user, record.scheduler, record.since)
        current = tuple(found[u] for u in sorted(found))
        with self._lock:
            self._current = current
        return current

    def _drop(self, path: Path, name: str) -> None:
        try:
            path.unlink()
        except OSError:
            self._refused.add(name)  # cannot remove it: at least do not read it again


class AllocationCollector(StateCollector[tuple[Allocation, ...]]):
    """``gpudiag_gpu_allocation_info``: one series per allocated GPU leaf."""

    def render(self, state: tuple[Allocation, ...]) -> Iterable[Metric]:
        """The info family (present, possibly empty, from the first scrape)."""
        yield from _family(state)


def _family(state: Iterable[Allocation]) -> Iterator[Metric]:
    family = GaugeMetricFamily(
        "gpudiag_gpu_allocation_info",
        "1 while a job (gpudiag run) holds this GPU leaf; join on uuid, never a job label on "
        "a per-GPU series.", labels=["uuid", "job_id", "user", "scheduler"])
    for a in state:
        family.add_metric([a.uuid, a.job, a.user, a.scheduler], 1.0)
    yield family

