"""Which job holds which GPU, as a join: ``gpudiag_gpu_allocation_info{uuid, job_id, user,
scheduler} 1`` while an attested `gpudiag run` holds the GPU, gone when it ends.

Never a job label on a per-GPU gauge (a DCGM exporter's ``hpc_job`` label multiplied its
series by the number of jobs): one info series per allocated GPU leaf, at most one per leaf,
joined in PromQL (``* on (instance, uuid) group_left (job_id, user)
gpudiag_gpu_allocation_info``). The label is ``job_id``, never ``job``: Prometheus's own
target label ``job`` would rename it ``exported_job`` at the scrape, and every join on it
would show the scrape job's name.

The series come from attested runs alone (daemon/runs.py): a run that announced itself on
the daemon's socket, whose uid and pid the kernel named (peer credentials) and whose GPUs
the kernel says the lock descriptors it passed hold. No file decides them (the
``allocations/`` inbox that any user could plant claims in is gone: docs/security.md).
``user`` is the peer uid's name; ``job_id`` the run's Slurm job id (its word, checked for
shape), else ``pid-PID``, or ``run-ID`` (the daemon's run id) for a run in a pid namespace
the daemon cannot see; ``scheduler`` ``slurm`` with a job id, else ``none``. A run asking a
daemon with any state directory shows, for as long as it runs.
"""

from __future__ import annotations

import pwd
import threading
from collections.abc import Callable, Collection, Iterable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from gpudiag.core.environment import is_full_uuid
from gpudiag.core.records import dataclass
from gpudiag.daemon.collectors import StateCollector
from gpudiag.daemon.runs import OpenRun


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


class Allocations:
    """The attested runs' GPUs as of the last poll; ``current()`` is what the collector shows."""

    def __init__(self, runs: Callable[[], Iterable[OpenRun]], *,
                 owner_name: Callable[[int], str] = _owner_name,
                 leaves: Callable[[], Collection[str] | None] = lambda: None) -> None:
        """``runs``: the open attested runs (``RunWindows.open_runs``). ``leaves``: the GPU
        and MIG UUIDs the daemon sees now (None: not known yet, take any full UUID); a run's
        GPU outside them is not shown, so the series stay at most one per real leaf."""
        self._runs = runs
        self._leaves = leaves
        self._owner_name = owner_name
        self._lock = threading.Lock()
        self._current: tuple[Allocation, ...] = ()

    def current(self) -> tuple[Allocation, ...]:
        """The allocations as of the last poll, one per GPU leaf."""
        with self._lock:
            return self._current

    def poll(self) -> tuple[Allocation, ...]:
        """One series per GPU leaf an open attested run holds (the earliest run's)."""
        found: dict[str, Allocation] = {}
        known = self._leaves()
        for run in self._runs():
            job = run.slurm_job_id or (f"pid-{run.peer.pid}" if run.peer.pid > 0
                                       else f"run-{run.id}")
            scheduler = "slurm" if run.slurm_job_id else "none"
            user = self._owner_name(run.peer.uid)
            for uuid in run.gpus:
                if not is_full_uuid(uuid) or (known is not None and uuid not in known):
                    continue
                held = found.get(uuid)
                if held is None or run.began < held.since:
                    found[uuid] = Allocation(uuid, job, user, scheduler, run.began)
        current = tuple(found[u] for u in sorted(found))
        with self._lock:
            self._current = current
        return current


class AllocationCollector(StateCollector[tuple[Allocation, ...]]):
    """``gpudiag_gpu_allocation_info``: one series per allocated GPU leaf."""

    def render(self, state: tuple[Allocation, ...]) -> Iterable[Metric]:
        """The info family (present, possibly empty, from the first scrape)."""
        yield from _family(state)


def _family(state: Iterable[Allocation]) -> Iterator[Metric]:
    family = GaugeMetricFamily(
        "gpudiag_gpu_allocation_info",
        "1 while an attested job (gpudiag run) holds this GPU leaf; join on uuid, never a job "
        "label on a per-GPU series.", labels=["uuid", "job_id", "user", "scheduler"])
    for a in state:
        family.add_metric([a.uuid, a.job, a.user, a.scheduler], 1.0)
    yield family
