"""The daemon's qualification schedule: the quick tier on GPUs that have been idle a while.

A worker thread looks at the scheduler's occupancy every ``tick_s``. A GPU FREE in every
reading for ``idle_s``, whose last qualification is older than ``max_age_s``, is qualified
(engine.qualify: under its lock, aborted within 1 s when someone else appears or a job waits
for the GPU), one GPU at a time. ``POST /v1/qualify`` queues a run now, within bounds
(daemon/qualify_queue.py: one per GPU, a GPU-seconds cap, a bounded queue). The daemon itself
never holds a GPU context:
each measurement is a child. The latest result per GPU and the costs feed the metrics.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import field, replace
from pathlib import Path

from gpudiag.core.gpunames import NamedGpu
from gpudiag.core.qualify_score import Qualification, parse_qualification
from gpudiag.core.qualify_verdict import replaces
from gpudiag.core.readiness import FREE, GpuOccupancy
from gpudiag.core.records import dataclass
from gpudiag.daemon.config import QualificationConfig
from gpudiag.daemon.loop import LoopThread
from gpudiag.daemon.qualify_queue import QualifyRequest as QualifyRequest
from gpudiag.daemon.qualify_queue import check, resolve_request
from gpudiag.engine.qualify import QualifyError, QualifyOptions, QualifyReport, qualify
from gpudiag.engine.qualify_history import HistoryUnavailable, QualificationHistory

log = logging.getLogger("gpudiag.daemon.qualify_schedule")

Runner = Callable[[QualifyOptions], QualifyReport]


@dataclass(frozen=True)
class QualifierState:
    """What the metrics read: the latest outcome per GPU and what qualification cost."""

    latest: Mapping[str, Qualification] = field(default_factory=dict)
    runs: Mapping[str, int] = field(default_factory=dict)   # outcome code -> count
    gpu_seconds_total: float = 0.0
    running: bool = False


class Qualifier:
    """Runs qualifications on idle GPUs on a schedule and on request."""

    def __init__(self, config: QualificationConfig, state_dir: Path,
                 occupancy: Callable[[], Mapping[str, GpuOccupancy]], *,
                 runner: Runner = qualify, clock: Callable[[], float] = time.time,
                 lock_dir: Path | None = None,
                 on_change: Callable[[QualifierState], None] | None = None,
                 gpus: Callable[[], Sequence[NamedGpu]] | None = None) -> None:
        self.config = config
        self.state_dir = state_dir
        self._occupancy = occupancy
        self._runner = runner
        self._clock = clock
        self._lock_dir = lock_dir
        self._on_change = on_change  # the verdicts follow the latest outcomes (snapshot)
        self._lock = threading.Lock()
        self._thread = LoopThread("gpudiag-qualifier")
        self._wake, self._stop = self._thread.woken, self._thread.stopping
        self._queue: list[QualifyRequest] = []
        self._running: QualifyRequest | None = None  # what _run measures now
        # The GPUs a request may name (the daemon: its latest NVML reading); without a
        # source, the occupancy's GPUs numbered in UUID order (unit tests).
        self._gpus = gpus or self._gpus_of_occupancy
        self._free_since: dict[str, float] = {}
        # When each GPU was last qualified at all: a finding of another tier that a run
        # did not overturn (core.qualify_verdict.replaces) must not make the GPU due again.
        self._last_run: dict[str, float] = {}
        self._state = QualifierState()

    def state(self) -> QualifierState:
        return self._state

    def load(self) -> None:
        """The latest outcome per GPU from the history: a restart keeps the schedule's ages."""
        try:
            records = QualificationHistory.in_state_dir(self.state_dir).records()
        except HistoryUnavailable as e:
            log.warning("qualification history unreadable: %s", e)
            return
        latest: dict[str, Qualification] = {}
        for rec in records:
            try:
                q = parse_qualification(rec)
            except ValueError:
                continue  # a damaged line is not evidence
            if replaces(q, latest.get(q.result.uuid)):
                latest[q.result.uuid] = q
        self._publish(QualifierState(latest=latest))

    def start(self) -> None:
        self.load()
        self._thread.start(self._loop)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._thread.stop(timeout_s)

    def request(self, gpus: Sequence[str] | None, tier: str) -> QualifyRequest:
        """Queue a run now (on-demand: no idle time or age needed; busy GPUs still skipped);
        RequestRefused (daemon/qualify_queue.py) past a bound."""
        now = self._clock()
        req = resolve_request(gpus, tier, self._gpus(), now)
        with self._lock:
            check(req, self._queue, self._running, max_gpu_s=self.config.max_request_gpu_s,
                  max_queued=self.config.max_queued, now=now)
            self._queue.append(req)
        self._wake.set()
        return req

    def queued(self) -> tuple[QualifyRequest, ...]:
        """The requests waiting, oldest first."""
        with self._lock:
            return tuple(self._queue)

    def current(self) -> QualifyRequest | None:
        """The qualification running now (requested or scheduled), if any."""
        with self._lock:
            return self._running

    def _gpus_of_occupancy(self) -> list[NamedGpu]:
        uuids = sorted(u for u in self._occupancy() if u.startswith("GPU-"))
        return [NamedGpu(i, u) for i, u in enumerate(uuids)]

    def _scheduled(self, uuid: str) -> QualifyRequest:
        index = next((g.index for g in self._gpus() if g.uuid == uuid), -1)
        return QualifyRequest((uuid,), self.config.tier, (uuid,), (index,), self._clock(),
                              scheduled=True)

    def due(self, now: float) -> list[str]:
        """GPUs FREE for idle_s whose last qualification is older than max_age_s."""
        occupancy = self._occupancy()
        for uuid, occ in occupancy.items():
            if occ.state == FREE and uuid.startswith("GPU-"):
                self._free_since.setdefault(uuid, now)
            else:
                self._free_since.pop(uuid, None)
        for uuid in [u for u in self._free_since if u not in occupancy]:
            del self._free_since[uuid]
        latest = self._state.latest
        out = []
        for uuid, since in sorted(self._free_since.items()):
            last = latest.get(uuid)
            began = max((last.result.started_at or 0.0) if last is not None else 0.0,
                        self._last_run.get(uuid, 0.0))
            age = now - began if last is not None or uuid in self._last_run else float("inf")
            if now - since >= self.config.idle_s and age >= self.config.max_age_s:
                out.append(uuid)
        return out

    def _next(self) -> QualifyRequest | None:
        """The next run, marked running in the same step (request()'s check sees it)."""
        with self._lock:
            req = self._queue.pop(0) if self._queue else None
            if req is None and self.config.enabled:
                due = self.due(self._clock())
                req = self._scheduled(due[0]) if due else None
            if req is not None:
                self._running = replace(req, started_at=self._clock())
            return req

    def _loop(self) -> None:
        while not self._stop.is_set():
            req = self._next()
            if req is not None:
                try:
                    self._run(req)
                finally:
                    with self._lock:
                        self._running = None
                # Measured or found busy: either way it must be idle for idle_s again.
                for uuid in req.uuids or req.gpus or list(self._free_since):
                    self._free_since.pop(uuid, None)
                continue
            self._wake.wait(self.config.tick_s)
            self._wake.clear()

    def _run(self, req: QualifyRequest) -> None:
        # The GPUs as resolved when it was queued (what its budget counted).
        options = QualifyOptions(tier=req.tier, gpus=req.uuids or req.gpus,
                                 state_dir=self.state_dir,
                                 thresholds=self.config.thresholds, lock_dir=self._lock_dir,
                                 table=self.config.table)
        self._state = QualifierState(self._state.latest, self._state.runs,
                                     self._state.gpu_seconds_total, running=True)
        try:
            report = self._runner(options)
        except QualifyError as e:
            log.warning("qualification of %s not run: %s", req.gpus or "every GPU", e)
            report = None
        except Exception:  # a bug of ours must not end the schedule
            log.exception("qualification of %s failed", req.gpus or "every GPU")
            report = None
        latest = dict(self._state.latest)
        runs = dict(self._state.runs)
        cost = self._state.gpu_seconds_total
        for q in report.qualifications if report else ():
            if q.result.aborted is None and q.result.started_at is not None:
                self._last_run[q.result.uuid] = q.result.started_at
            if replaces(q, latest.get(q.result.uuid)):
                latest[q.result.uuid] = q  # an aborted run changes no verdict
            runs[q.code] = runs.get(q.code, 0) + 1
            cost += q.result.gpu_seconds or 0.0
            log.info("qualified %s: %s", q.result.uuid, q.code,
                     extra={"severity": q.severity, "qualification": q.message})
        if report is not None and report.history_error:
            log.warning("qualification history not kept: %s", report.history_error)
        self._publish(QualifierState(latest, runs, cost, running=False))

    def _publish(self, state: QualifierState) -> None:
        self._state = state
        if self._on_change is not None:
            try:
                self._on_change(state)
            except Exception:  # the schedule goes on; the verdicts keep the last outcomes
                log.exception("qualification outcome not published")
