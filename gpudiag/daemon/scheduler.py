"""Periodic probes with jitter, deadlines, single-flight and backoff; publishes snapshots.

Probes run in worker threads (each one a child process via ``isolation.run_probe``); the loop
thread only decides what is due, so it never blocks and its keep-alive to systemd stops only
when the loop itself is wedged.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import field, replace
from pathlib import Path
from typing import Any, Protocol

from gpudiag.core import registry
from gpudiag.core.backend import ONE_GPU
from gpudiag.core.clock import rfc3339
from gpudiag.core.environment import probe_environment
from gpudiag.core.identity import LastIdentities
from gpudiag.core.nic import NicMemory, NicObservation
from gpudiag.core.nic import advance as advance_nic
from gpudiag.core.nvml_health import NvmlHistory, advance
from gpudiag.core.probe_run import ProbeRun
from gpudiag.core.qualify_verdict import QualificationFindings
from gpudiag.core.readiness import GpuOccupancy, ProbeScope
from gpudiag.core.records import dataclass
from gpudiag.core.requirement import parse_requirement
from gpudiag.core.runtime import OWN_RUNTIME, Runtime
from gpudiag.core.verdict import BackendRequirement, Requirement, Verdict
from gpudiag.core.xids import fatal_xid
from gpudiag.daemon import nvlinks
from gpudiag.daemon.config import SETTINGS_VARIABLE, DaemonConfig, backend_settings_json
from gpudiag.daemon.loop import LoopThread
from gpudiag.daemon.runtime_health import (
    node_health,
    not_checked,
    required_by,
    runtime_findings,
    runtime_verdicts,
)
from gpudiag.daemon.runtime_proofs import (
    RuntimeProofs,
    device_epoch,
    environment_backends,
    run_in_runtime,
)
from gpudiag.daemon.sdnotify import Notifier
from gpudiag.daemon.snapshot import (
    OUTCOMES,
    BackendStats,
    HistoryState,
    ProbeKey,
    ProbeResult,
    Snapshot,
    VerdictPolicy,
    WatcherState,
    keys_for,
    outcome_of,
    verdict_for,
)
from gpudiag.engine.forkclient import shared_fork_server
from gpudiag.engine.isolation import run_probe
from gpudiag.engine.locks import default_lock_dir
from gpudiag.engine.occupancy_view import OccupancyView, occupancy_view, relook
from gpudiag.engine.round import RoundPolicy, is_active, prove_round

log = logging.getLogger("gpudiag.daemon.scheduler")


def scheduled_options(name: str) -> dict[str, Any] | None:
    """The options of a scheduled probe child (the same as a plain requirement of it)."""
    spec = registry.spec(name)
    options = spec.scheduled_options if spec is not None else None
    return dict(options) if options is not None else None


class Clock(Protocol):
    """Time source seam: tests pass a fake."""

    def monotonic(self) -> float: ...

    def time(self) -> float: ...


class SystemClock:
    """The real clocks."""

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()


ProbeRunner = Callable[[str, Mapping[str, str], float, Mapping[str, Any] | None], ProbeRun]
# A runtime's probe: (runtime, probe archive, backend, env, deadline, options) -> its run.
RuntimeRunner = Callable[[Runtime, Path, str, Mapping[str, str], float,
                          Mapping[str, Any] | None], ProbeRun]


def isolated_runner(backend: str, env: Mapping[str, str], timeout_s: float,
                    options: Mapping[str, Any] | None) -> ProbeRun:
    """The real runner: one isolated child per probe, forked by the daemon's fork server."""
    return run_probe(backend, env=env, timeout_s=timeout_s, options=options,
                     forker=shared_fork_server(env))


class WatcherSource(Protocol):
    """What the scheduler needs from the XID watcher."""

    def state(self) -> WatcherState: ...


@dataclass
class Flight:
    """One probe run in progress; callers wait on ``done``."""

    started_wall: float
    done: threading.Event = field(default_factory=threading.Event)


def scheduled_keys(config: DaemonConfig, ready: Requirement) -> tuple[ProbeKey, ...]:
    """Every enabled backend in the daemon's own environment, what the default requirement
    needs (gpudiag_ready must always be computable, even with its backend switched off), and
    each configured runtime's environment-dependent backends."""
    scheduled = [ProbeKey.of(n, scheduled_options(n)) for n in config.enabled_backends]
    scheduled += [k for k in keys_for(ready) if k not in scheduled]
    in_runtimes = [k for k in scheduled if k.backend in environment_backends()]
    for runtime in config.runtimes:
        keys = [_on_its_platform(k, runtime).in_runtime(runtime.name) for k in in_runtimes]
        scheduled += [k for k in keys if k not in scheduled]
    return tuple(scheduled)


def _on_its_platform(key: ProbeKey, runtime: Runtime) -> ProbeKey:
    """``key`` with the platform the runtime's ``require`` names for its backend (a runtime
    that serves CPU jobs, ``require = "jax:cpu"``, is proven on the CPU)."""
    platform = runtime.platform_of(key.backend)
    spec = registry.spec(key.backend)
    if platform is None or spec is None:
        return key
    return ProbeKey.of(key.backend, spec.options([BackendRequirement(key.backend, platform)]))


def full_requirement(config: DaemonConfig) -> Requirement:
    """Every enabled backend, as the node-health question (drives gpudiag_blocker): a busy
    GPU is healthy in use, so no blocker series and no alert fires because a node is busy."""
    # The device layer: the node's own facts. The backends proven in a job's environment
    # count per runtime (Scheduler._runtime_health), never from the daemon's own Python alone.
    names = [n for n in config.enabled_backends
             if n != "host" and n not in environment_backends()]
    if not names:
        return Requirement(backends=(), min_devices=0, node_health=True)
    return Requirement(backends=tuple(BackendRequirement(n) for n in names), node_health=True)


# The daemon waits less for a sibling probe's exclusive lock than an inline run does: it
# proves the GPU again next round, and its other probes wait behind its guard meanwhile.
DAEMON_SIBLING_WAIT_S = 5.0


def _installation_only(run: ProbeRun) -> bool:
    """Whether a jax/iree run only read the installation (no GPU was free to prove it on)."""
    obs = run.jax or run.iree
    return obs is not None and obs.static is not None


def _installation(run: ProbeRun) -> tuple[object, ...]:
    """What a jax/iree run says is installed: versions (and the JAX plugins found)."""
    jax, iree = run.jax, run.iree
    if jax is not None:
        return (jax.installed, tuple(sorted(jax.versions.items())), jax.plugins)
    if iree is not None:
        return (iree.installed, tuple(sorted(iree.versions.items())))
    return ()


def failure_signature(run: ProbeRun) -> str | None:
    """None when the probe found the host healthy; else what failed, to detect repeats."""
    if not run.ok:
        return f"{outcome_of(run)}:{run.exit_code}:{run.signal}"
    obs = run.parsed
    if obs is None:
        return None
    if obs.ok is False:
        nvml = run.nvml
        return f"obs:{nvml.error.code if nvml is not None and nvml.error else None}"
    cuda = run.cuda
    if cuda is not None and cuda.init is not None and cuda.init.ok is False:
        return f"init:{cuda.init.code}"
    return None


class Scheduler:
    """Runs the probes on their intervals and on demand; owns the current Snapshot."""

    def __init__(self, config: DaemonConfig, *, env: Mapping[str, str] | None = None,
                 clock: Clock | None = None, runner: ProbeRunner = isolated_runner,
                 rng: random.Random | None = None, notifier: Notifier | None = None,
                 watcher: WatcherSource | None = None, max_workers: int = 8,
                 on_tick: Callable[[], object] | None = None,
                 lock_dir: Path | None = None, history: HistoryState | None = None,
                 nvlinks_file: Path | None = None, runtimes_dir: Path | None = None,
                 runtime_runner: RuntimeRunner = run_in_runtime) -> None:
        self.config = config
        self.clock: Clock = clock or SystemClock()
        self._runner = runner
        self._rng = rng or random.Random()
        self._notifier = notifier or Notifier(env={})
        self._watcher = watcher
        self._on_tick = on_tick
        self._env = probe_environment(os.environ if env is None else env)
        # A backend's own settings ([backends.nic] expect, ...) reach its child as the
        # daemon checked them, never read again from a file (gpudiag.probes.nic_probe).
        self._env[SETTINGS_VARIABLE] = backend_settings_json(config)
        self._lock_dir = lock_dir or default_lock_dir(self._env)
        self._locks_said: set[str] = set()  # lock files found unusable, logged once each
        # The job environments this node serves (docs/design-notes.md, "Whose environment is
        # proven"): their interpreters, fingerprints and proof on change.
        self._runtimes = RuntimeProofs(config.runtimes, self._env, runtimes_dir)
        self._runtime_runner = runtime_runner
        self._runtimes.refresh(OWN_RUNTIME)  # in this process: a few folder reads
        self._runtime_said: dict[str, tuple[str, ...]] = {}  # each runtime's last logged codes
        # Busy GPUs (docs/design-notes.md): the latest occupancy, where each backend last
        # proved itself, and a round counter per backend so that JAX and IREE rotate over the
        # free GPUs.
        self._occupancy: dict[str, GpuOccupancy] = {}
        self._nvml_occupancy: dict[str, GpuOccupancy] = {}  # the latest reading, unmarked
        self._last_seen = LastIdentities()  # a lost GPU's verdict row keeps its last UUID
        self._last_proven: dict[tuple[str, str], float] = {}
        self._backend_gpu: dict[tuple[str, str], str | None] = {}  # (backend, runtime)
        self._rounds: dict[ProbeKey, int] = {}
        # NVLink counts seen survive a restart in the state directory (daemon.nvlinks).
        self._nvlinks_file = nvlinks_file
        self._nvml_history = NvmlHistory(
            nvlinks_active=nvlinks.load(nvlinks_file) if nvlinks_file else {})
        # The nic backend's memory since this boot (core.nic): which ports were up, link
        # changes within the flap window, error counters' growth.
        self._nic_memory: NicMemory | None = None
        self._guard = threading.Lock()  # one active-probe claim at a time
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="probe")
        self._lock = threading.Lock()
        self._thread = LoopThread("scheduler")
        self._wake, self._stop = self._thread.woken, self._thread.stopping
        self.policy = VerdictPolicy(xid_hold_s=config.xid.hold_s,
                                    gap_warning_s=config.xid.gap_warning_s,
                                    expected_gpus=config.expected_gpus, history=history,
                                    nvml=config.nvml, xid_rules=config.xid.rules)
        self.full_requirement = full_requirement(config)
        # gpudiag_ready answers the node-health question for the default requirement.
        self.ready_requirement = parse_requirement(config.default_requirement,
                                                   node_health=True)
        self.scheduled: tuple[ProbeKey, ...] = scheduled_keys(config, self.ready_requirement)
        self._interval = {k: config.backends[k.backend].interval_s for k in self.scheduled}
        self._due: dict[ProbeKey, float] = {}
        self._inflight: dict[ProbeKey, Flight] = {}
        self._results: dict[ProbeKey, ProbeResult] = {}
        self._stats: dict[ProbeKey, BackendStats] = {}
        self._failures: dict[ProbeKey, tuple[str, int]] = {}
        self._heartbeat = self.clock.monotonic()
        self._listeners: list[Callable[[Snapshot], None]] = []
        self._qualification = QualificationFindings()
        self._snapshot = Snapshot(seq=0, published_wall=self.clock.time(), results={},
                                  stats={}, scheduled=self.scheduled,
                                  watcher=self._watcher_state(), full=None, ready=None)

    # -- reading -----------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """The latest published snapshot (a plain attribute read: never waits)."""
        return self._snapshot

    def alive(self, limit_s: float | None = None) -> bool:
        """Whether the loop ran recently (healthz)."""
        limit = limit_s if limit_s is not None else max(5.0, 10 * self.config.tick_s)
        return self._thread.running and self.clock.monotonic() - self._heartbeat < limit

    def on_snapshot(self, listener: Callable[[Snapshot], None]) -> None:
        """Call ``listener`` (in the publishing thread) after each new snapshot."""
        self._listeners.append(listener)

    def due_in(self, key: ProbeKey) -> float | None:
        """Seconds until the key's next scheduled run (None: not scheduled)."""
        with self._lock:
            due = self._due.get(key)
        return None if due is None else due - self.clock.monotonic()

    def deadline_of(self, backend: str) -> float:
        cfg = self.config.backends.get(backend)
        return cfg.deadline_s if cfg is not None else 60.0

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        """Start the loop; every scheduled probe is due at once (the first round)."""
        now = self.clock.monotonic()
        with self._lock:
            for key in self.scheduled:
                self._due.setdefault(key, now)
        self._thread.start(self._loop)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the loop; running probe children finish or die at their deadlines."""
        self._thread.stop(timeout_s)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def drain(self) -> None:
        """Wait for the worker threads to finish (after stop(); children already killed)."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def wake(self) -> None:
        """Make the loop look at its state now (the watcher calls this on events)."""
        self._wake.set()

    # -- on demand ---------------------------------------------------------------------
    def running(self, key: ProbeKey) -> bool:
        """Whether a run of ``key`` is in flight (a caller joining it starts nothing)."""
        with self._lock:
            return key in self._inflight

    def trigger(self, keys: Sequence[ProbeKey]) -> dict[ProbeKey, Flight]:
        """Run these probes now unless one is already running (single-flight)."""
        return {k: self._launch(k) for k in keys}

    def ensure_fresh(self, keys: Sequence[ProbeKey], max_age_s: float | None,
                     wait_s: float) -> bool:
        """Run the probes that are missing or older than max_age_s; wait at most wait_s.

        Returns whether every needed result is now present and fresh enough.
        """
        now_wall = self.clock.time()
        results = self._snapshot.results
        stale = [k for k in keys if k not in results or (
            max_age_s is not None and now_wall - results[k].started_wall > max_age_s)]
        if not stale:
            return True
        flights = [self._launch(k) for k in stale]
        end = self.clock.monotonic() + wait_s
        for f in flights:
            if not f.done.wait(max(0.0, end - self.clock.monotonic())):
                return False
        return True

    # -- internals ---------------------------------------------------------------------
    def _watcher_state(self) -> WatcherState:
        return self._watcher.state() if self._watcher is not None else WatcherState()

    def _launch(self, key: ProbeKey) -> Flight:
        with self._lock:
            flight = self._inflight.get(key)
            if flight is not None:
                return flight
            flight = Flight(started_wall=self.clock.time())
            self._inflight[key] = flight
        try:
            self._pool.submit(self._run, key, flight)
        except RuntimeError:  # the pool is shut down: the daemon is stopping
            with self._lock:
                self._inflight.pop(key, None)
            flight.done.set()
        return flight

    def _env_of(self, runtime: str) -> Mapping[str, str]:
        """The child environment of a runtime's probes ("": the daemon's own)."""
        return self._runtimes.env_of(runtime) if runtime else self._env

    def _call(self, backend: str, env: Mapping[str, str], options: Mapping[str, Any] | None,
              runtime: str = "") -> ProbeRun:
        try:
            if runtime:
                return self._runtime_runner(self._runtimes.runtimes[runtime],
                                            self._runtimes.archive(), backend, env,
                                            self.deadline_of(backend), options)
            return self._runner(backend, env, self.deadline_of(backend), options)
        except Exception as e:  # the runner itself failed: a probe_error, not a dead worker
            log.exception("probe %s could not run", f"{backend}@{runtime}" if runtime
                          else backend)
            return ProbeRun(backend, None, 0.0, error=f"gpudiag could not run the probe: "
                            f"{type(e).__name__}: {e}")

    def _run(self, key: ProbeKey, flight: Flight) -> None:
        options = key.options_dict()
        if key.runtime:
            self._runtimes.ensure(key.runtime)  # its fingerprint, before its first proof
            if key.runtime in self._runtimes.refused():
                # Another user may write what it imports: nothing of it runs (its proofs
                # were dropped when it was refused; the snapshot says why).
                with self._lock:
                    self._results.pop(key, None)
                    self._schedule_next(key, None)
                    self._inflight.pop(key, None)
                    snapshot = self._publish_locked()
                flight.done.set()
                self._notify(snapshot)
                return
        if is_active(key.backend, options):
            run = self._run_guarded(key, options)
            if _installation_only(run) and not self._static_news(key, run):
                # No free GPU for jax/iree and the installation reads as before: the last
                # proof stands (with its time); nothing new to publish.
                with self._lock:
                    self._schedule_next(key, None)
                    self._inflight.pop(key, None)
                flight.done.set()
                return
        else:
            run = self._call(key.backend, self._env_of(key.runtime), options, key.runtime)
        if self._stop.is_set():
            # Stopping: the daemon kills running children on its way out, and that kill is
            # not the host's doing; published, it would be recorded as a probe_crashed
            # episode left open in the history until the next start.
            with self._lock:
                self._inflight.pop(key, None)
            flight.done.set()
            return
        finished = self.clock.time()
        result = ProbeResult(key, run, flight.started_wall, finished)
        with self._lock:
            previous = self._results.get(key)
            self._results[key] = result
            if key.backend == "nvml":
                self._remember_nvml(run, finished)
            if key.backend == "nic" and isinstance(run.parsed, NicObservation):
                self._nic_memory = advance_nic(self._nic_memory, run.parsed, finished)
            self._record_stats(key, result)
            self._schedule_next(key, run)
            self._learn(key, run, finished)
            self._inflight.pop(key, None)
            snapshot = self._publish_locked()
        # A runtime's probe names its runtime (jax@train): the daemon's own and each
        # runtime's children are different environments, failing for their own reasons.
        said = f"{key.backend}@{key.runtime}" if key.runtime else key.backend
        if previous is None or previous.outcome != result.outcome:
            log.info("probe %s: child %s in %.2f s", said, result.outcome, run.duration_s,
                     extra={"backend": key.backend, "runtime": key.runtime_name,
                            "outcome": result.outcome,
                            "duration_s": round(run.duration_s, 4), "error": run.error})
        else:
            log.debug("probe %s %s", said, result.outcome)
        flight.done.set()
        self._notify(snapshot)
        if key.backend == "nvml":  # after the answer: a runtime's re-read may take seconds
            self._proof_on_change(run)

    def _remember_nvml(self, run: ProbeRun, finished: float) -> None:
        before = self._nvml_history.nvlinks_active
        self._nvml_history = advance(self._nvml_history, run.nvml, finished)
        if self._nvlinks_file is not None and self._nvml_history.nvlinks_active != before:
            nvlinks.save(self._nvlinks_file, self._nvml_history.nvlinks_active)

    def _record_stats(self, key: ProbeKey, result: ProbeResult) -> None:
        old = self._stats.get(key) or BackendStats(runs_by_outcome=dict.fromkeys(OUTCOMES, 0))
        runs = dict(old.runs_by_outcome)
        runs[result.outcome] = runs.get(result.outcome, 0) + 1
        ok = failure_signature(result.run) is None
        self._stats[key] = BackendStats(
            runs_by_outcome=runs, last_duration_s=result.run.duration_s,
            last_success_wall=result.finished_wall if ok else old.last_success_wall,
            consecutive_failures=0 if ok else old.consecutive_failures + 1)

    def _schedule_next(self, key: ProbeKey, run: ProbeRun | None) -> None:
        interval = self._interval.get(key)
        if interval is None:  # an on-demand variant (e.g. jax:cpu): no schedule of its own
            return
        signature = failure_signature(run) if run is not None else None
        streak = 0
        if signature is not None:
            prev_sig, prev_n = self._failures.get(key, ("", 0))
            streak = prev_n + 1 if prev_sig == signature else 1
            self._failures[key] = (signature, streak)
        else:
            self._failures.pop(key, None)
        delay = interval
        if streak >= 2:
            # Failing the same way again: back off, but never below the plain interval.
            delay = min(interval * 2 ** (streak - 1), max(interval, self.config.backoff_max_s))
        jitter = self.config.jitter_ratio
        delay *= 1.0 + self._rng.uniform(-jitter, jitter)
        self._due[key] = self.clock.monotonic() + delay

    def _publish_locked(self) -> Snapshot:
        old = self._snapshot
        watcher = self._watcher_state()
        now = self.clock.time()
        base = Snapshot(seq=old.seq + 1, published_wall=now, results=dict(self._results),
                        stats=dict(self._stats), scheduled=self.scheduled, watcher=watcher,
                        full=None, ready=None, scope=self._scope(),
                        last_proven=dict(self._last_proven),
                        nvml_history=self._nvml_history, qualification=self._qualification,
                        last_seen=self._last_seen.current(),
                        runtimes=tuple(self._runtimes.runtimes.values()),
                        fingerprints=self._runtimes.fingerprints(),
                        runtime_gpu=dict(self._backend_gpu), nic_memory=self._nic_memory)
        device = verdict_for(base, self.full_requirement, now_wall=now, policy=self.policy)
        enabled = [n for n in self.config.enabled_backends if n in environment_backends()]
        required = {name: required_by(r, self._runtimes.installed(name), enabled)
                    for name, r in self._runtimes.runtimes.items()}
        health = runtime_verdicts(base, self.full_requirement, required, now_wall=now,
                                  policy=self.policy)
        full = None if device is None else node_health(
            device, health, required, not_checked(enabled, required),
            own=lambda name: name == OWN_RUNTIME)
        ready = verdict_for(base, self.ready_requirement, now_wall=now, policy=self.policy)
        self._snapshot = replace(base, full=full, ready=ready, runtime_health=health,
                                 runtime_refused=self._runtimes.refused())
        self._say_runtimes(health)
        return self._snapshot

    def _say_runtimes(self, health: Mapping[str, Verdict]) -> None:
        """One log line per runtime whose own blockers changed, naming the runtime (the
        node's own verdict changes are said by the service's VerdictLog)."""
        for name, verdict in health.items():
            codes = tuple(sorted({b.code for b in runtime_findings(verdict)}))
            before = self._runtime_said.get(name)
            self._runtime_said[name] = codes
            if before is None and not codes or before == codes:
                continue
            log.info("runtime %s: verdict changed: %s (was %s)", name,
                     ", ".join(codes) or "none",
                     "unknown" if before is None else ", ".join(before) or "none",
                     extra={"runtime": name, "blockers": list(codes)})

    # -- proof on change ---------------------------------------------------------------
    def _proof_on_change(self, nvml_run: ProbeRun) -> None:
        """After an NVML round: a runtime whose packages changed, or a changed device layer
        (a GPU appeared or was lost, the driver, an XID), makes its proofs due now."""
        # Only a fatal XID (one whose code is a device blocker: 48, 62, 64, 74, 79, 95...)
        # is a device-layer change; a job's application XID (13, 31, 43, 45) says nothing
        # about the runtimes' environments and proves none of them again. Folded XIDs (a
        # storm's repeats) change nothing about the device layer either.
        xids = sum(c.count - c.folded for c in self._watcher_state().xid_counts
                   if fatal_xid(c.xid))
        due: set[ProbeKey] = set()
        if self._runtimes.device_changed(device_epoch(nvml_run.nvml, xids)):
            due.update(k for k in self.scheduled if k.backend in environment_backends())
        refused_before = self._runtimes.refused()
        for name in self._runtimes.changed_runtimes():
            changed = self._runtimes.refresh(name)
            runtime = "" if name == OWN_RUNTIME else name
            due.update(k for k in self.scheduled
                       if k.runtime == runtime and k.backend in changed)
        refused = self._runtimes.refused()
        if refused != refused_before:
            with self._lock:  # a refused runtime's proofs answer nobody any more
                self._results = {k: r for k, r in self._results.items()
                                 if k.runtime not in refused}
                snapshot = self._publish_locked()
            self._notify(snapshot)
            due = {k for k in due if k.runtime not in refused}
        if due:
            self.prove_again(due)

    def prove_again(self, keys: set[ProbeKey] | None = None) -> None:
        """Make these proofs (default: every runtime's) due now: a clear, a device change."""
        wanted = keys if keys is not None else {
            k for k in self.scheduled if k.backend in environment_backends()}
        now = self.clock.monotonic()
        with self._lock:
            wanted = {key for key in wanted if key in self._due}
            for key in wanted:
                self._due[key] = now
        if not wanted:
            return  # nothing proven in a job's environment here: nothing to say
        log.info("proving again: %s", ", ".join(sorted(
            f"{k.backend}@{k.runtime_name}" for k in wanted)))
        self._wake.set()

    # -- busy GPUs ---------------------------------------------------------------------
    def _static_news(self, key: ProbeKey, run: ProbeRun) -> bool:
        """Whether an installation-only reading is worth publishing: nothing was proven yet
        (the verdict then says unproven instead of waiting for a GPU that jobs may hold for
        days), or the installation changed since the last reading (a plugin went missing)."""
        with self._lock:
            previous = self._results.get(key)
        if previous is None or _installation_only(previous.run):
            return True
        return _installation(previous.run) != _installation(run)

    def _run_guarded(self, key: ProbeKey, options: Mapping[str, Any] | None
                     ) -> ProbeRun:
        """Run an active probe (cuda, jax, iree on a GPU) through the one busy-GPU round
        (engine/round.py): NVML is read first (no context), then the probe touches only the
        FREE GPUs it claimed, under their locks.

        The daemon's own active probes run one at a time (``self._guard``), so a GPU lock
        that is taken is always someone else's (a `gpudiag run` job, another preflight).
        The one-GPU backends (JAX, IREE) try the free GPUs in turn from round to round.
        """
        backend, runtime = key.backend, key.runtime
        base = self._env_of(runtime)
        with self._guard:
            nvml_run = self._call("nvml", self._env, None)
            with self._lock:
                round_index = self._rounds.get(key, 0)
                self._rounds[key] = round_index + 1

            def run(requests: Sequence[tuple[str, Mapping[str, Any] | None]],
                    pinned: Mapping[str, Mapping[str, str]]) -> dict[str, ProbeRun]:
                return {name: self._call(name, {**base, **pinned.get(name, {})}, opts, runtime)
                        for name, opts in requests}

            done = prove_round(nvml_run, [(backend, options)], visibility_env=self._env,
                               lock_dir=self._lock_dir, run=run, policy=RoundPolicy(
                                   rotation=round_index,
                                   probe_busy=self.config.probe_busy_gpus,
                                   sibling_wait_s=DAEMON_SIBLING_WAIT_S))
            # The round's lock view dates from its claim: a qualification or a job may have
            # let go meanwhile (published busy, it would stay so until the next reading).
            occupancy = self._relooked(done.occupancy)
            with self._lock:
                self._occupancy = occupancy
                if backend in done.backend_gpu:
                    self._backend_gpu[(backend, runtime)] = done.backend_gpu[backend]
            return done.runs[backend]

    def _learn(self, key: ProbeKey, run: ProbeRun, finished_wall: float) -> None:
        """Remember occupancy (every nvml run) and where active probes proved a GPU."""
        backend = key.backend
        if backend == "nvml" and run.ok and run.nvml is not None:
            self._last_seen.learn(run.nvml)
            # NVML's reading, siblings not users, and the GPUs that `gpudiag run` jobs hold
            # under their locks (a job may have no process on its GPU yet): the one view
            # (engine/occupancy_view.py), kept between readings.
            view = self._said(occupancy_view(run.nvml, lock_dir=self._lock_dir))
            self._nvml_occupancy, self._occupancy = dict(view.by_nvml), dict(view.gpus)
        elif backend == "cuda" and run.ok and run.cuda is not None:
            for dev in run.cuda.devices:
                if dev.context is not None and dev.context.ok and dev.alloc is not None \
                        and dev.alloc.ok and dev.uuid is not None:
                    self._last_proven[(dev.uuid, "cuda")] = finished_wall
        elif _proves_on_one_gpu(backend) and failure_signature(run) is None:
            gpu = self._backend_gpu.get((backend, key.runtime))
            if gpu is not None:
                self._last_proven[(gpu, backend)] = finished_wall

    def _scope(self) -> ProbeScope:
        proven = {uuid: rfc3339(wall) for (uuid, b), wall in self._last_proven.items()
                  if b == "cuda"}
        own = {b: gpu for (b, runtime), gpu in self._backend_gpu.items() if not runtime}
        return ProbeScope(occupancy=dict(self._occupancy), backend_gpu=own,
                          last_proven=proven)

    def reconfigure(self, config: DaemonConfig) -> Snapshot:
        """Apply a reloaded config live: intervals, enabled backends, deadlines, thresholds.

        Results, statistics and runs in flight are kept; a newly scheduled probe is due at
        once, and a shortened interval takes effect from now rather than after the old one.
        """
        # What the history gave back at start stays said in every verdict after a reload.
        policy = replace(self.policy, xid_hold_s=config.xid.hold_s,
                         gap_warning_s=config.xid.gap_warning_s,
                         expected_gpus=config.expected_gpus, nvml=config.nvml,
                         xid_rules=config.xid.rules)
        ready = parse_requirement(config.default_requirement, node_health=True)
        scheduled = scheduled_keys(config, ready)
        now = self.clock.monotonic()
        with self._lock:
            self.config, self.policy = config, policy
            self.full_requirement, self.ready_requirement = full_requirement(config), ready
            self.scheduled = tuple(scheduled)
            self._interval = {k: config.backends[k.backend].interval_s for k in scheduled}
            self._due = {k: min(self._due.get(k, now), now + self._interval[k])
                         for k in scheduled}
            snapshot = self._publish_locked()
        self._notify(snapshot)
        self._wake.set()
        return snapshot

    def relook_locks(self) -> Snapshot:
        """The lock view again now, without waiting for the next NVML reading: a
        qualification just let go of its GPU, and a job asking in the meantime must not be
        told ``devices_busy`` for an interval (nvml's 15 s by default)."""
        with self._lock:
            current = dict(self._occupancy)
        relooked = self._relooked(current)  # /proc reads, outside the lock
        with self._lock:
            if self._occupancy == current:  # no newer reading came in the meantime
                self._occupancy = relooked
            snapshot = self._publish_locked()
        self._notify(snapshot)
        return snapshot

    def _relooked(self, occupancy: Mapping[str, GpuOccupancy]) -> dict[str, GpuOccupancy]:
        """``occupancy`` with its lock view taken now (engine/occupancy_view.relook)."""
        with self._lock:
            base = dict(self._nvml_occupancy)
        return dict(self._said(relook(occupancy, base, lock_dir=self._lock_dir)).gpus)

    def _said(self, view: OccupancyView) -> OccupancyView:
        """``view``, its unusable lock files logged (once each: it is read every interval)."""
        for uuid, error in view.unusable.items():
            if error not in self._locks_said and len(self._locks_said) < 256:
                self._locks_said.add(error)
                log.warning("GPU %s is unknown, not free: its lock cannot be checked: %s",
                            uuid, error, extra={"uuid": uuid, "lock_dir": str(self._lock_dir)})
        return view

    def set_qualification(self, findings: QualificationFindings) -> Snapshot:
        """What the qualifier found enters the verdicts from the next snapshot (this one)."""
        with self._lock:
            self._qualification = findings
            snapshot = self._publish_locked()
        self._notify(snapshot)
        return snapshot

    def republish(self) -> Snapshot:
        """Publish a new snapshot from the current state (watcher news, expiring holds)."""
        with self._lock:
            snapshot = self._publish_locked()
        self._notify(snapshot)
        return snapshot

    def _notify(self, snapshot: Snapshot) -> None:
        for listener in self._listeners:
            try:
                listener(snapshot)
            except Exception:  # a broken listener must not stop probing
                log.exception("snapshot listener failed")

    def _loop(self) -> None:
        gap_flag = False
        while not self._stop.is_set():
            tick = self.config.tick_s  # read each round: a reload may change it
            now = self.clock.monotonic()
            self._heartbeat = now
            self._notifier.watchdog()
            with self._lock:
                due = [k for k, t in self._due.items() if t <= now and k not in self._inflight]
                for k in due:
                    # Pushed out now; the finished run sets the real next time.
                    self._due[k] = now + self._interval[k]
            for k in due:
                self._launch(k)
            if self._on_tick is not None:
                try:
                    self._on_tick()  # e.g. pending `gpudiag clear` requests
                except Exception:  # a broken hook must not stop probing
                    log.exception("scheduler tick hook failed")
            watcher = self._watcher_state()
            snap = self._snapshot
            wall = self.clock.time()
            over = watcher.enabled and watcher.gap_s(wall) > self.policy.gap_warning_s
            if watcher != snap.watcher or over != gap_flag:
                gap_flag = over
                self.republish()
            with self._lock:
                next_due = min(self._due.values(), default=now + tick)
            wait = min(tick, max(0.0, next_due - self.clock.monotonic()))
            self._wake.wait(wait)
            self._wake.clear()


def _proves_on_one_gpu(backend: str) -> bool:
    """Whether a backend's round proves it on one claimed GPU (jax, iree: their spec says)."""
    spec = registry.spec(backend)
    return spec is not None and spec.proves_on == ONE_GPU and not spec.device_layer
