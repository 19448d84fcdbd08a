"""The daemon as one object: ``DaemonService(cfg, state_dir)``, ``start()``, ``stop()``.

``gpudiag serve`` (cli/daemon.py) only parses its flags and calls ``serve_forever()``: signal
handlers, ``start()``, a timed wait for SIGTERM/SIGINT (SIGHUP reloads on the way), ``stop()``.
Tests start and stop the same object in-process.

``start()`` builds the pieces in the order each needs the ones before it:

    state-dir lock > history (recorder, its writer thread, the XID keeper) > XID watcher, with
    the history's holds handed back > `gpudiag clear` and job inboxes > scheduler > WSGI app
    (collectors, reloader, qualifier) > listeners (TCP, then the unix socket)

Three callbacks point the other way, from a piece to one built after it. Each is a method
here that does nothing while that piece is missing, rather than a closure over a name not yet
assigned: ``_xid_changed`` (the watcher wakes the scheduler), ``_recheck`` (a clear re-runs
the scheduler's probes) and ``_written`` (a history opened late reaches the app).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from gpudiag.core.attribution import JobRecord
from gpudiag.core.environment import CACHE_VARIABLE, probe_environment
from gpudiag.core.findings import XidEvent
from gpudiag.core.limits import EXIT_FAILED, EXIT_USAGE
from gpudiag.core.qualify_verdict import qualification_findings
from gpudiag.core.readiness import GpuOccupancy
from gpudiag.core.verdict import Verdict, change_summary
from gpudiag.daemon import nvlinks
from gpudiag.daemon.allocations import AllocationCollector, Allocations
from gpudiag.daemon.app import DaemonApp
from gpudiag.daemon.app import serve as http_serve
from gpudiag.daemon.bootid import boot_id
from gpudiag.daemon.clears import ClearPoller, ClearRequest, recheck_keys
from gpudiag.daemon.closeouts import JobFailuresCollector, JobInbox, record_job
from gpudiag.daemon.config import DaemonConfig, load_config
from gpudiag.daemon.effective import default_socket_path
from gpudiag.daemon.exporter import HistoryCollector
from gpudiag.daemon.gpu_reset import GpuResetter
from gpudiag.daemon.gpu_reset_part import start_gpu_reset
from gpudiag.daemon.holds import HistoryAtStart, XidKeeper, restore_holds
from gpudiag.daemon.httpserver import HttpServer
from gpudiag.daemon.httpserver import start as start_http
from gpudiag.daemon.incidents import IncidentTracker
from gpudiag.daemon.job_watch import JobWatch
from gpudiag.daemon.nfd import NfdFeatureFile
from gpudiag.daemon.numbers import Numbers, NumbersCollector
from gpudiag.daemon.open_runs import OPEN_RUNS_FILE
from gpudiag.daemon.qualify_exporter import QualificationCollector
from gpudiag.daemon.qualify_queue import RequestRefused, known_gpus
from gpudiag.daemon.qualify_schedule import Qualifier, QualifierState
from gpudiag.daemon.reboots import (
    FRESH_PROBES,
    QUALIFY_TIER,
    RebootHealer,
    note_boot,
    reboot_candidates,
)
from gpudiag.daemon.recorder import HistoryRecorder, RecorderThread, Written
from gpudiag.daemon.reload import LockDirCollector, ReloadCollector, Reloader
from gpudiag.daemon.remediation import Remediator
from gpudiag.daemon.remediation_exporter import RemediationCollector
from gpudiag.daemon.runs import OpenRun, RefusedRecordsCollector, RunWindows
from gpudiag.daemon.scheduler import Scheduler
from gpudiag.daemon.sdnotify import Notifier
from gpudiag.daemon.slurmctl import SlurmError, check_executable
from gpudiag.daemon.snapshot import Snapshot, verdict_for
from gpudiag.daemon.statedir import (
    StateDirError,
    StateDirLock,
    check_writable,
    lock_state_dir,
    start_history,
)
from gpudiag.daemon.store import HistoryError, HistoryStore
from gpudiag.daemon.watcher import XidWatcher
from gpudiag.engine.forkclient import close_shared_fork_servers
from gpudiag.engine.locks import SYSTEM_LOCK_DIR, LockDirChoice, choose_lock_dir
from gpudiag.engine.processes import kill_child_groups

log = logging.getLogger("gpudiag.daemon")

# The daemon exits within this many seconds of SIGTERM/SIGINT, whatever a thread is stuck on
# (systemd's TimeoutStopSec=30s in the unit leaves room for it). docs/daemon.md says so.
SHUTDOWN_LIMIT_S = 15.0
DRAIN_LIMIT_S = 5.0
STOP_POLL_S = 0.5
PROBE_CACHE = "probe-cache"  # in the state directory: the probe children's private cache
# Answers are short and latency is what callers wait on: hand the GIL over sooner than
# CPython's 5 ms default when a request thread wakes up beside a busy one.
SWITCH_INTERVAL_S = 0.0005


class StartError(Exception):
    """The daemon cannot start; ``exit_code`` is what ``gpudiag serve`` exits with."""

    exit_code = EXIT_FAILED


class StateDirUnusable(StartError):
    """The state directory cannot be used, or another daemon holds it."""

    exit_code = EXIT_USAGE


class RemediationUnusable(StartError):
    """[remediation] names a node Slurm does not know, or an unsafe executable."""

    exit_code = EXIT_USAGE


class CannotListen(StartError):
    """The address or the socket cannot be served on (the CLI says it as a usage error)."""

    exit_code = EXIT_USAGE


@dataclass(frozen=True)
class _Parts:
    """What ``start()`` built and ``stop()`` takes down."""

    lock: StateDirLock
    notifier: Notifier
    recorder: HistoryRecorder
    writer: RecorderThread
    watcher: XidWatcher
    scheduler: Scheduler
    reloader: Reloader
    qualifier: Qualifier
    servers: tuple[HttpServer, ...]  # TCP first, then the unix socket if one is configured
    remediator: Remediator | None = None  # [remediation] mode observe or act
    job_watch: JobWatch | None = None  # [jobs]: hung collectives and stragglers
    gpu_reset: GpuResetter | None = None  # [gpu_reset] enabled: the reset rung


class DaemonService:
    """Probes, XID watcher, history, /metrics and the preflight API, built from one config.

    One start and one stop per object: a restart is a new DaemonService.
    """

    def __init__(self, cfg: DaemonConfig, state_dir: Path, config_path: str | None = None,
                 reload: Callable[[], DaemonConfig] | None = None, *,
                 env: Mapping[str, str] | None = None) -> None:
        """``reload`` reads the config again on SIGHUP (default: ``config_path`` again);
        ``env`` is the process environment the daemon and its probe children see."""
        self.cfg = cfg
        self.state_dir = state_dir
        self._load = reload or partial(load_config, config_path)
        self._env: Mapping[str, str] = os.environ if env is None else env
        self._stop = threading.Event()  # SIGTERM/SIGINT or request_stop()
        self._hup = threading.Event()   # SIGHUP: applied by wait(), on the main thread
        self._verdicts = VerdictLog()
        self._numbers = Numbers()  # time to detect, catch rate, false blockers (numbers.py)
        # Built by start(); the three callbacks that point back at them check for None.
        self._scheduler: Scheduler | None = None
        self._app: DaemonApp | None = None
        self._remediator: Remediator | None = None
        self._runs: RunWindows | None = None
        self._parts: _Parts | None = None
        self.url = ""  # http://HOST:PORT once listening

    # -- lifecycle -------------------------------------------------------------------------
    def serve_forever(self) -> str | None:
        """Start, serve until SIGTERM/SIGINT (SIGHUP reloads), stop; why it failed, or None."""
        self._handle_signals()
        self.start()
        failed = self.wait()
        # Armed before anything else, even the log line: a write to a stalled log (a full
        # pipe, a disk that stopped answering) blocks every thread that logs, this one too.
        ShutdownDeadline(SHUTDOWN_LIMIT_S, log).start()
        self.stop()
        return failed

    def start(self) -> None:
        """Lock the state dir, build every piece, listen, start the threads, say ready."""
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        with ExitStack() as undo:  # what a failed start takes down again
            lock = self._lock_state_dir()
            undo.callback(lock.release)
            before = HistoryAtStart.look(self.state_dir)  # before a damaged one is moved aside
            recorder = start_history(self.state_dir, retention_s=self.cfg.history.retention_s,
                                     max_bytes=self.cfg.history.max_bytes)
            undo.callback(_close_history, recorder)
            parts = self._build(lock, before, recorder)
            undo.pop_all()
        self._parts = parts
        parts.writer.start()
        parts.watcher.start()
        parts.scheduler.start()
        if parts.remediator is not None:
            parts.remediator.start()
        if parts.job_watch is not None:
            parts.job_watch.start()
        if parts.gpu_reset is not None:
            parts.gpu_reset.start()
        self._say_ready(parts)

    def request_stop(self) -> None:
        """Make ``wait()`` return (what SIGTERM and SIGINT do)."""
        self._stop.set()

    def wait(self) -> str | None:
        """Serve until ``request_stop()``; the reason to exit non-zero if a listener died."""
        servers = list(self._parts.servers) if self._parts is not None else []
        return wait_for_stop(self._stop, servers, log, on_wake=self._apply_reload)

    def stop(self) -> None:
        """Stop every piece, kill probe children, close the history, drop the lock."""
        parts, self._parts = self._parts, None
        if parts is None:
            return
        log.info("stopping")
        parts.notifier.stopping()
        for server in parts.servers:
            server.shutdown()
        parts.qualifier.stop()
        if parts.remediator is not None:
            parts.remediator.stop()
        if parts.job_watch is not None:
            parts.job_watch.stop()
        if parts.gpu_reset is not None:
            parts.gpu_reset.stop()
        parts.scheduler.stop()
        parts.watcher.stop()
        # A probe child still running (even hung in the driver) must not hold the exit up to
        # its deadline, nor outlive the daemon: kill each child's process group.
        killed = close_shared_fork_servers() + kill_child_groups()
        if killed:
            log.info("killed %d running probe child(ren) on the way out", killed)
        # A worker between two probes may start one more child: kill again, bounded wait.
        bounded(parts.scheduler.drain, DRAIN_LIMIT_S, on_each=kill_child_groups)
        close_shared_fork_servers()  # one the drain's last probe may have started again
        # A write stuck in the disk must not hold the exit up either: closing would wait on it.
        if parts.writer.stop():
            _close_history(parts.recorder)
        parts.lock.release()
        log.info("stopped")

    # -- building ----------------------------------------------------------------------------
    def _lock_state_dir(self) -> StateDirLock:
        # The lock first: a second daemon must not even open (or move aside) the history.
        try:
            lock = lock_state_dir(self.state_dir)
        except StateDirError as e:
            raise StateDirUnusable(f"cannot use --state-dir {self.state_dir}: {e}") from e
        try:
            check_writable(self.state_dir)
        except StateDirError as e:
            lock.release()
            raise StateDirUnusable(f"cannot use --state-dir {self.state_dir}: {e}") from e
        return lock

    def _build(self, lock: StateDirLock, before: HistoryAtStart, recorder: HistoryRecorder
               ) -> _Parts:
        """Every piece, wired in dependency order, and listening; of the threads, only the
        qualifier's and the listeners' run yet."""
        cfg = self.cfg
        notifier = Notifier(self._env)
        writer = RecorderThread(recorder, partial(self._written, recorder))
        # Each XID goes to the history (its writer starts before the watcher) so that a
        # restart holds it again; the history's holds are handed back before anything starts.
        numbers = self._numbers
        watcher = XidWatcher(cfg.xid, probe_environment(self._env),
                             on_change=self._xid_changed,
                             on_xid=partial(_each_xid, (XidKeeper(writer), numbers.fault)))
        history_state = restore_holds(before, recorder, watcher, hold_s=cfg.xid.hold_s)
        if isinstance(recorder.store, HistoryStore):
            with contextlib.suppress(HistoryError):  # intervals then start afresh
                numbers.seed_incidents(recorder.store.incident_times())
        locks = self._lock_dir()
        job_watch = JobWatch(cfg.jobs, probe_environment(self._env), self._open_runs)
        clears, jobs = self._inboxes(recorder, watcher, locks.path, job_watch)
        # From the attested runs alone (the runs' socket, the kernel's word): no file inbox.
        runs = jobs.runs
        allocations = Allocations(runs.open_runs if runs is not None else tuple,
                                  leaves=self._leaves)
        self._scheduler = scheduler = Scheduler(
            cfg, env=probe_cache_environment(self._env, self.state_dir), notifier=notifier,
            watcher=watcher,
            on_tick=partial(_poll_inboxes, (clears.poll, jobs.poll, allocations.poll)),
            history=history_state,
            lock_dir=locks.path, nvlinks_file=self.state_dir / nvlinks.FILE_NAME,
            runtimes_dir=self.state_dir / "runtimes")
        scheduler.on_snapshot(numbers.verdict)
        scheduler.on_snapshot(partial(_record, writer))
        incidents = IncidentTracker(self.state_dir, partial(_open_store, recorder))
        scheduler.on_snapshot(incidents.offer)
        if cfg.nfd_features_file is not None:
            scheduler.on_snapshot(partial(_label, NfdFeatureFile(
                cfg.nfd_features_file, cfg.nfd_expiry_s, incident=incidents.id_for)))
        store = recorder.store
        self._app = app = DaemonApp(scheduler, store if isinstance(store, HistoryStore) else None,
                                    history_error=lambda: writer.health().last_error)
        app.registry.register(HistoryCollector(writer.health))
        app.registry.register(LockDirCollector(locks.shared))
        app.registry.register(incidents.collector())
        app.health_evidence["incident"] = incidents.evidence
        reloader = Reloader(scheduler, self._load, retune_xid=watcher.retune, notifier=notifier,
                            set_log_level=_set_log_level)
        app.registry.register(ReloadCollector(reloader.state))
        qualifier = self._start_qualifier(scheduler, app)
        app.registry.register(JobFailuresCollector(jobs.counts))
        app.registry.register(RefusedRecordsCollector(jobs.refused.counts))
        app.jobs = jobs
        app.registry.register(NumbersCollector(numbers.state))
        app.registry.register(AllocationCollector(allocations.current))
        app.registry.register(job_watch.collector())
        app.health_evidence["runs"] = job_watch.evidence
        app.run_end_notes.append(job_watch.end_notes)
        remediator = self._start_remediation(scheduler, app, qualifier)
        self._start_healer(recorder, watcher, scheduler, clears, qualifier)
        gpu_reset = start_gpu_reset(
            cfg.gpu_reset, self.state_dir, locks.path, self._env,
            on_snapshot=scheduler.on_snapshot, registry=app.registry,
            health_evidence=app.health_evidence, submit=clears.submit,
            store=partial(_open_store, recorder), incident=incidents.id_for)
        try:
            servers = self._listen(app)
        except BaseException:
            qualifier.stop()
            raise
        return _Parts(lock, notifier, recorder, writer, watcher, scheduler, reloader,
                      qualifier, servers, remediator, job_watch, gpu_reset)

    def _start_healer(self, recorder: HistoryRecorder, watcher: XidWatcher,
                      scheduler: Scheduler, clears: ClearPoller, qualifier: Qualifier) -> None:
        """Reboot-class holds from an earlier boot: released by the first clean fresh pass
        (daemon/reboots.py). The boot is noted before the watcher starts, so every XID it
        keeps from now on is of this boot."""
        started = time.time()
        boot = note_boot(recorder.store, boot_id(self._env), started)
        candidates = reboot_candidates(recorder.store, watcher.state().recent, boot.boot_id)
        if not candidates:
            return
        log.info("the node rebooted since XID(s) %s were held (boot %s): released once a "
                 "fresh pass finds no fault", ", ".join(sorted({f"{x.xid} on GPU "
                                                                 f"{x.device_index}"
                                                                 for x in candidates})),
                 boot.boot_id, extra={"boot_id": boot.boot_id})
        qualify = self.cfg.qualification.enabled

        def judge(snap: Snapshot) -> Verdict | None:
            return verdict_for(snap, scheduler.ready_requirement, now_wall=time.time(),
                               policy=scheduler.policy)

        def ask(gpus: Sequence[str]) -> bool:
            try:
                qualifier.request(list(gpus), QUALIFY_TIER)
            except RequestRefused as e:
                log.warning("quick qualification after the reboot refused: %s", e)
                return False
            return True

        def passed(uuid: str, since: float) -> bool | None:
            q = qualifier.state().latest.get(uuid)
            if q is None or (q.result.started_at or 0.0) <= since or q.severity == "aborted":
                return None
            return q.severity != "blocker"

        healer = RebootHealer(candidates, boot, started, judge=judge, submit=clears.submit,
                              qualify=ask if qualify else None,
                              qualified=passed if qualify else None,
                              probes=[b for b in FRESH_PROBES
                                      if b in self.cfg.enabled_backends])
        scheduler.on_snapshot(healer.offer)

    def _start_remediation(self, scheduler: Scheduler, app: DaemonApp, qualifier: Qualifier
                           ) -> Remediator | None:
        """[remediation]: the actor on the scheduler's snapshots, its metrics and evidence;
        the node name is checked against Slurm first (docs/operations.md)."""
        cfg = self.cfg.remediation
        if cfg.mode == "off":
            return None
        for path in (cfg.scontrol, cfg.sinfo):
            unsafe = check_executable(path)
            if unsafe is not None and os.path.exists(path):
                qualifier.stop()
                raise RemediationUnusable(f"[remediation]: {unsafe}; refusing to run it as the "
                                          "daemon")
        self._remediator = remediator = Remediator(cfg, self.state_dir)
        try:
            info = remediator.check_node()
            log.info("remediation %s: node %s is %s in Slurm", cfg.mode, remediator.slurm.node,
                     info.view.state, extra={"node": remediator.slurm.node,
                                             "remediation_mode": cfg.mode})
        except SlurmError as e:
            if e.kind == "unknown_node":
                qualifier.stop()
                raise RemediationUnusable(
                    f"[remediation] node_name {remediator.slurm.node!r}: {e}; set node_name "
                    "to this node's Slurm NodeName") from e
            # Slurm may be down now: the actor asks again before any action.
            log.warning("remediation %s: cannot check node %s in Slurm yet (%s); retrying "
                        "before any action", cfg.mode, remediator.slurm.node, e,
                        extra={"error": str(e)})
        scheduler.on_snapshot(remediator.offer)
        app.registry.register(RemediationCollector(remediator.report))
        app.remediation = remediator.report
        return remediator

    def _inboxes(self, recorder: HistoryRecorder, watcher: XidWatcher, lock_dir: Path,
                 job_watch: JobWatch) -> tuple[ClearPoller, JobInbox]:
        """The `gpudiag clear` requests and the jobs' records the loop takes in each tick;
        the runs' attested windows are checked against the GPU locks in ``lock_dir``, and
        their records kept with the job watch's warnings."""
        clears = ClearPoller(self.state_dir, release=watcher.clear,
                             record=partial(self._cleared, recorder), recheck=self._recheck)
        runs = RunWindows(lock_dir, partial(_open_store, recorder),
                          kept=self.state_dir / OPEN_RUNS_FILE, mig_parents=self._mig_parents)
        self._runs = runs
        jobs = JobInbox(self.state_dir, record=job_watch.keeping(partial(_record_job, recorder)),
                        on_job=self._numbers.job, on_block=self._numbers.blocked, runs=runs)
        try:
            clears.prepare()
            jobs.prepare()
        except OSError as e:
            raise StartError(f"cannot use --state-dir {self.state_dir}: {e}") from e
        if again := runs.restore():
            log.info("%d attested run(s) from before this start still running: open again",
                     again)
        return clears, jobs

    def _lock_dir(self) -> LockDirChoice:
        """Where the probes lock GPUs: the jobs' shared folder, or a loud private one."""
        locks = choose_lock_dir(probe_environment(self._env))
        if not locks.shared:
            # Loud: probes locking GPUs where jobs do not look can meet a job on one GPU.
            log.warning("GPU lock folder %s is not usable (%s): the daemon's probes lock GPUs "
                        "in the private %s, which `gpudiag run` jobs do not see; give the "
                        "daemon /run/gpudiag/locks (the unit's ReadWritePaths=, the "
                        "DaemonSet's hostPath) or set GPUDIAG_LOCK_DIR to the jobs' folder",
                        SYSTEM_LOCK_DIR, locks.why, locks.path,
                        extra={"lock_dir": str(locks.path), "lock_dir_shared": False})
        return locks

    def _start_qualifier(self, scheduler: Scheduler, app: DaemonApp) -> Qualifier:
        """The qualification schedule on idle GPUs, its metrics and POST /v1/qualify."""
        block = self.cfg.qualification.thresholds.block

        def occupancy() -> Mapping[str, GpuOccupancy]:
            scope = scheduler.snapshot().scope
            return scope.occupancy if scope is not None else {}

        def publish(state: QualifierState) -> None:
            if not state.running:
                # The run has let go of its GPUs: jobs must see them free, from the same
                # snapshot that first shows its outcome.
                scheduler.relook_locks()
            scheduler.set_qualification(qualification_findings(state.latest.values(),
                                                               block=block))

        qualifier = Qualifier(self.cfg.qualification, self.state_dir, occupancy,
                              on_change=publish,
                              gpus=lambda: known_gpus(scheduler.snapshot()))
        app.qualifier = qualifier
        app.registry.register(QualificationCollector(qualifier.state))
        qualifier.start()
        return qualifier

    def _listen(self, app: DaemonApp) -> tuple[HttpServer, ...]:
        """The TCP listener, then the unix socket beside it if one is configured."""
        cfg = self.cfg
        try:
            httpd, _thread = http_serve(app, cfg.listen_host, cfg.listen_port,
                                        read_only=cfg.tcp_read_only)
        except OSError as e:
            raise CannotListen(f"cannot listen on {cfg.listen_host}:{cfg.listen_port}: "
                               f"{e.strerror or e}") from e
        unix = start_socket(app, cfg, httpd, self._env)
        return (httpd,) if unix is None else (httpd, unix)

    def _say_ready(self, parts: _Parts) -> None:
        """The "listening on" lines, and READY=1 to systemd."""
        tcp = parts.servers[0]
        unix = parts.servers[1] if len(parts.servers) > 1 else None
        host, port = str(tcp.server_address[0]), int(tcp.server_address[1])
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
        log.info("listening on %s", self.url,
                 extra={"url": self.url, "state_dir": str(self.state_dir),
                        "backends": list(self.cfg.enabled_backends)})
        if unix is not None:
            log.info("preflight and control on unix:%s", unix.unix_path,
                     extra={"socket_url": f"unix:{unix.unix_path}"})
        parts.notifier.ready(f"serving on {self.url}" + (f" and unix:{unix.unix_path}"
                                                          if unix is not None else ""))

    # -- signals and the callbacks that point back at later pieces ---------------------------
    def _handle_signals(self) -> None:
        """SIGTERM/SIGINT stop, SIGHUP reloads (Python lets only the main thread do this)."""
        def on_stop(*_: Any) -> None:
            self.request_stop()

        def on_hup(*_: Any) -> None:
            # Handled by wait(), on the main thread, outside the signal handler: it takes locks.
            self._hup.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_stop)
        signal.signal(signal.SIGHUP, on_hup)

    def _apply_reload(self) -> None:
        # The stop wait wakes every STOP_POLL_S, so a reload waits at most that.
        if self._hup.is_set() and not self._stop.is_set() and self._parts is not None:
            self._hup.clear()
            self._parts.reloader.reload()

    def _xid_changed(self) -> None:
        """The watcher's news wakes the scheduler; before it exists (holds restored at start)
        there is nothing to wake: its first snapshot reads the watcher."""
        if self._scheduler is not None:
            self._scheduler.wake()

    def _leaves(self) -> set[str] | None:
        """The GPU and MIG leaves the daemon sees now (None before its first reading)."""
        scope = self._scheduler.snapshot().scope if self._scheduler is not None else None
        return set(scope.occupancy) if scope is not None else None

    def _open_runs(self) -> list[OpenRun]:
        """The attested runs open now (none before the runs are built)."""
        return self._runs.opened() if self._runs is not None else []

    def _mig_parents(self) -> dict[str, str]:
        """Each MIG instance's physical GPU, from the latest NVML reading (none before it)."""
        result = self._scheduler.snapshot().result("nvml") if self._scheduler else None
        nvml = result.run.nvml if result is not None else None
        return {mig: d.uuid for d in (nvml.devices if nvml else ()) if d.uuid
                for mig in d.mig_uuids}

    def _recheck(self) -> None:
        """A clear re-runs the probes (it comes from the scheduler's own tick, so it exists)."""
        if self._scheduler is not None:
            self._scheduler.trigger(recheck_keys(self._scheduler.scheduled))
            self._scheduler.prove_again()  # a repair: every runtime's backends again too

    def _cleared(self, recorder: HistoryRecorder, request: ClearRequest, released: int) -> None:
        """An applied clear: counted (false blockers when nothing was repaired), kept in the
        history, and remediation's recovery boundary moves."""
        codes = self._numbers.cleared(request.gpu, request.no_repair)
        record_clear(recorder, request, released, codes)
        if self._remediator is not None:
            self._remediator.cleared(request.gpu, min(request.requested_wall, time.time()),
                                     by_person=not request.automatic)

    def _written(self, recorder: HistoryRecorder, verdict: Verdict | None,
                 changes: list[Written]) -> None:
        """The history writer's report: a history opened late reaches the app; each kept
        change is said."""
        app = self._app
        if app is not None and app.store is None and isinstance(recorder.store, HistoryStore):
            app.store = recorder.store  # opened late (the disk was full at start)
        self._verdicts.say(verdict, changes)


class VerdictLog:
    """Says each kept verdict change in one log line: which GPU, which code came or went."""

    def __init__(self) -> None:
        self._logged: Verdict | None = None  # the verdict of the last "verdict changed" line
        self._last_uuids: dict[int, str] = {}  # each GPU index's last UUID: a lost GPU has none

    def say(self, verdict: Verdict | None, changes: list[Written]) -> None:
        """Log the changes that belong to ``verdict`` (None: a retry; said when made)."""
        for change in changes:
            if verdict is None or change.verdict is not verdict:
                continue  # a kept change, said when it was made
            where: dict[str, Any] = ({"history_id": change.history_id}
                                     if change.history_id is not None
                                     else {"history_pending": True})
            self._last_uuids.update((d.index, d.uuid) for d in verdict.devices if d.uuid)
            log.info("verdict changed: %s (%s)", verdict.gpu_validation_blocker,
                     change_summary(self._logged, verdict, self._last_uuids),
                     extra={**where, "ready": verdict.ready,
                            "blockers": sorted({b.code for b in verdict.blockers}),
                            "warnings": sorted({w.code for w in verdict.warnings})})
            self._logged = verdict


def _each_xid(callbacks: tuple[Callable[[XidEvent], object], ...], event: XidEvent) -> None:
    """Hand one XID to each callback (the history's keeper, the numbers)."""
    for callback in callbacks:
        callback(event)


def record_clear(recorder: HistoryRecorder, request: ClearRequest, released: int,
                 codes: Sequence[str] = ()) -> None:
    """Keep an applied ``gpudiag clear`` in the history, or say why it is not kept."""
    # The store is locked per call; it may be missing while the disk is full.
    history = recorder.store
    again = "; a restart would hold its XIDs again (run gpudiag clear once more then)"
    if not isinstance(history, HistoryStore):
        log.warning("clear of %s applied but not recorded: the history is not writable%s",
                    request.gpu or "all GPUs", again, extra={"uid": request.uid})
        return
    try:
        # Stamped with the time up to which XIDs were released (the request's), so that a
        # restart re-arms exactly the XIDs the watcher still holds (daemon/holds.py).
        history.record_clear(uid=request.uid, gpu=request.gpu, reason=request.reason,
                             released=released, now=min(request.requested_wall, time.time()),
                             no_repair=request.no_repair, codes=codes)
    except HistoryError as e:
        log.warning("clear of %s applied but not recorded: %s%s", request.gpu or "all GPUs",
                    e, again, extra={"uid": request.uid})


def _record_job(recorder: HistoryRecorder, job: JobRecord, uid: int, attested: str | None,
                run_id: str | None) -> bool:
    # The store as it is now: it may open late.
    return record_job(recorder.store, job, uid, attested, run_id)


def _open_store(recorder: HistoryRecorder) -> HistoryStore | None:
    """The history as it is now (it may open late), for attributing a run's window."""
    store = recorder.store
    return store if isinstance(store, HistoryStore) else None


def _poll_inboxes(polls: tuple[Callable[[], object], ...]) -> None:
    """The scheduler's tick: take in clears and job records."""
    for poll in polls:  # one failing inbox must not stop the other
        try:
            poll()
        except Exception:  # a bug of ours: said, and the loop goes on
            log.exception("polling %s failed", getattr(poll, "__qualname__", poll))


def _record(writer: RecorderThread, snap: Snapshot) -> None:
    if snap.full is not None:
        writer.submit(snap.full)


def _label(nfd: NfdFeatureFile, snap: Snapshot) -> None:
    nfd.update(snap)


def _close_history(recorder: HistoryRecorder) -> None:
    if isinstance(recorder.store, HistoryStore):
        recorder.store.close()


def _set_log_level(level: str) -> None:
    logging.getLogger("gpudiag").setLevel(level.upper())


def start_socket(app: DaemonApp, cfg: DaemonConfig, tcp: HttpServer,
                 env: Mapping[str, str] | None = None) -> HttpServer | None:
    """Serve the same API on the unix socket, if one is configured; the HttpServer or None.

    It shares the TCP server's abuse counters (one gpudiag_http_rejected_total). Mode 0666:
    any local user may connect; clients check the peer's credentials (docs/security.md).
    """
    path = default_socket_path(cfg, env)
    if path is None:
        if cfg.tcp_read_only:
            log.warning("tcp_read_only is set but no socket is configured: nothing serves "
                        "/v1/preflight or POST /v1/probe (set socket = PATH or --socket)")
        else:
            # Clients ask the socket by default and never fall back to TCP on their own.
            log.info("no unix socket (--socket PATH or socket = in the config): clients "
                     "reach this daemon only with GPUDIAG_DAEMON_URL=http://HOST:PORT")
        return None
    try:
        Path(path).parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        server, _thread = start_http(app, "", 0, register=False, abuse=tcp.abuse,
                                     unix_path=path)
    except OSError as e:
        tcp.shutdown()
        raise CannotListen(f"cannot serve on socket {path}: {e.strerror or e}") from e
    return server


def probe_cache_environment(env: Mapping[str, str], state_dir: Path) -> dict[str, str]:
    """The probe children's environment: their compiled-module cache (the IREE probe's) in
    the daemon's own state directory, unless the operator named one (design notes)."""
    return {**env,
            CACHE_VARIABLE: env.get(CACHE_VARIABLE) or str((state_dir / PROBE_CACHE).absolute())}


def wait_for_stop(stop: threading.Event, servers: list[HttpServer], log: logging.Logger,
                  on_wake: Callable[[], None] | None = None) -> str | None:
    """Wait for SIGTERM/SIGINT; the reason to exit non-zero if a listener died instead.

    A timed wait, on purpose: CPython runs a signal's Python handler only when the main thread
    executes bytecode, so a main thread blocked in an untimed ``Event.wait()`` never sees a
    signal that the kernel handed to another thread (it then hangs with no "stopping" line).
    Each wake also checks the serving threads: a listener that died must end the process, so
    systemd or Kubernetes restarts it, instead of a daemon that keeps its port and answers
    nothing.
    """
    while not stop.wait(STOP_POLL_S):
        if on_wake is not None:
            on_wake()  # e.g. a reload asked for by SIGHUP
        dead = [s.describe() for s in servers if not s.serving]
        if dead:
            message = (f"the HTTP listener on {', '.join(dead)} stopped serving; exiting so "
                       "that the service manager restarts the daemon")
            log.critical(message)
            return message
    return None


def bounded(step: Callable[[], object], limit_s: float,
            on_each: Callable[[], object] | None = None) -> bool:
    """Run ``step`` on a helper thread; give up waiting after ``limit_s``. True if it ended."""
    worker = threading.Thread(target=step, name=f"stop-{getattr(step, '__name__', 'step')}",
                              daemon=True)
    worker.start()
    end = time.monotonic() + limit_s
    while worker.is_alive() and time.monotonic() < end:
        worker.join(0.2)
        if on_each is not None:
            on_each()
    return not worker.is_alive()


class ShutdownDeadline(threading.Thread):
    """Ends the process when the orderly shutdown overruns its limit, saying what was stuck.

    The last line of defence for the documented stop time: thread pools' workers are joined
    at interpreter exit, so one request or probe stuck in the kernel would otherwise keep a
    stopping daemon alive for as long as it is stuck.
    """

    def __init__(self, limit_s: float, log: logging.Logger) -> None:
        super().__init__(name="shutdown-deadline", daemon=True)
        self.limit_s, self._log = limit_s, log

    def run(self) -> None:
        time.sleep(self.limit_s)
        # Said from a helper thread and waited for at most a second: the log itself may be
        # what is stuck.
        threading.Thread(target=self._say, name="shutdown-said", daemon=True).start()
        time.sleep(1.0)
        os._exit(EXIT_FAILED)

    def _say(self) -> None:
        stuck = sorted(t.name for t in threading.enumerate()
                       if t.is_alive() and t is not threading.current_thread()
                       and t is not self)
        self._log.error("shutdown took more than %g s; exiting now (threads still running: "
                        "%s)", self.limit_s, ", ".join(stuck) or "none",
                        extra={"threads": stuck})
