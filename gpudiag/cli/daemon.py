"""CLI commands of the daemon: ``gpudiag serve`` and ``gpudiag history``.

Heavy imports (prometheus_client, the scheduler) happen inside ``serve`` so that other
commands start fast.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from gpudiag.cli.commands import examples
from gpudiag.core.limits import DEFAULT_PORT, EXIT_FAILED, EXIT_USAGE
from gpudiag.core.redact import redact_text
from gpudiag.daemon import nvlinks
from gpudiag.daemon.config import ConfigError, DaemonConfig, load_config
from gpudiag.daemon.effective import effective_lines

if TYPE_CHECKING:
    from collections.abc import Mapping

    from gpudiag.core.readiness import GpuOccupancy
    from gpudiag.core.verdict import Verdict
    from gpudiag.daemon.app import DaemonApp
    from gpudiag.daemon.httpserver import HttpServer, WsgiApp
    from gpudiag.daemon.qualifier import Qualifier
    from gpudiag.daemon.scheduler import Scheduler

_STD_ATTRS = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message",
                                                                         "asctime"}


class _Failed(click.ClickException):
    exit_code = EXIT_FAILED


class _Unusable(click.ClickException):
    """The state directory cannot be used, or another daemon holds it: exit 2."""

    exit_code = EXIT_USAGE


class JsonFormatter(logging.Formatter):
    """One JSON object per line (journald keeps it as MESSAGE), extras as fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created).astimezone().isoformat(
                timespec="milliseconds"),
            "level": record.levelname.lower(), "logger": record.name,
            "msg": record.getMessage()}
        for k, v in vars(record).items():
            if k not in _STD_ATTRS and not k.startswith("_"):
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class _Redacting(logging.Formatter):
    """Any formatter's line with URL credentials cut out (core.redact): logs are records too."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        return redact_text(self.inner.format(record))


def setup_logging(fmt: str, level: str) -> None:
    """Structured logs to stderr; JSON for journald collectors, text for people."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Redacting(JsonFormatter() if fmt == "json" else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s")))
    root = logging.getLogger("gpudiag")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def default_state_dir() -> Path:
    """$GPUDIAG_STATE_DIR, $STATE_DIRECTORY (systemd), /var/lib/gpudiag for root, else
    ~/.local/state/gpudiag."""
    from gpudiag.engine.statedir import default_state_dir as default

    return default()


SOCKET_NAME = "gpudiag.sock"


def default_socket_path(cfg: DaemonConfig) -> str | None:
    """--socket / ``socket =``, else $RUNTIME_DIRECTORY/gpudiag.sock (systemd), else none."""
    if cfg.socket_path is not None:
        return cfg.socket_path or None
    runtime = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    return str(Path(runtime) / SOCKET_NAME) if runtime else None


def _reloaded(path: str | None, listen: str | None, socket_path: str | None) -> DaemonConfig:
    """The config file read again, with the same --listen/--socket flags (ConfigError)."""
    cfg = load_config(path)
    cfg = cfg.with_listen(listen) if listen else cfg
    return cfg.with_socket(socket_path) if socket_path is not None else cfg


def _config(path: str | None, listen: str | None, socket_path: str | None = None
            ) -> DaemonConfig:
    try:
        cfg = load_config(path)
        cfg = cfg.with_listen(listen) if listen else cfg
        return cfg.with_socket(socket_path) if socket_path is not None else cfg
    except ConfigError as e:
        raise click.UsageError(str(e)) from e


@click.command(short_help="Run the daemon: probes, XID watcher, /metrics, preflight API.",
               epilog=examples(
                   "gpudiag serve                                 # 127.0.0.1:9477",
                   "gpudiag serve --config /etc/gpudiag/gpudiag.toml --check-config",
                   "gpudiag serve --listen 0.0.0.0:9477 --state-dir /var/lib/gpudiag",
                   "curl -s localhost:9477/v1/preflight?gpus=1 | jq .ready"))
@click.option("--listen", metavar="HOST:PORT",
              help=f"Address to serve on.  [default: the config's, else "
              f"127.0.0.1:{DEFAULT_PORT}]")
@click.option("--socket", "socket_path", metavar="PATH",
              help="Unix socket for preflight and control; \"\" for none.  [default: the "
              "config's, else $RUNTIME_DIRECTORY/gpudiag.sock under systemd]")
@click.option("--config", "config_path", metavar="PATH", type=click.Path(dir_okay=False),
              help="TOML config file (see docs/daemon.md).")
@click.option("--state-dir", metavar="DIR", type=click.Path(file_okay=False),
              help="Where the history database lives.  [default: $STATE_DIRECTORY, "
              "/var/lib/gpudiag as root, else ~/.local/state/gpudiag]")
@click.option("--check-config", is_flag=True,
              help="Validate the config, print the effective configuration, and exit.")
@click.option("--log-format", type=click.Choice(["text", "json"]),
              help="Log format on stderr.  [default: the config's, else text]")
def serve(listen: str | None, socket_path: str | None, config_path: str | None,
          state_dir: str | None, check_config: bool, log_format: str | None) -> None:
    """Run the daemon: periodic probes, XID watcher, /metrics and the preflight API."""
    cfg = _config(config_path, listen, socket_path)
    if check_config:
        click.echo(f"config OK: listen {cfg.listen_host}:{cfg.listen_port}"
                   f"{' (read-only)' if cfg.tcp_read_only else ''}, socket "
                   f"{default_socket_path(cfg) or 'none'}, backends "
                   f"{', '.join(cfg.enabled_backends) or 'none'}, default requirement "
                   f"{cfg.default_requirement}")
        click.echo(f"# effective configuration ({config_path or 'built-in defaults'}, "
                   "after --listen/--socket), as TOML:")
        for line in effective_config(cfg, state_dir or str(default_state_dir())):
            click.echo(line)
        return
    setup_logging(log_format or cfg.log_format, cfg.log_level)
    run_daemon(cfg, Path(state_dir) if state_dir else default_state_dir(), config_path,
               reload=lambda: _reloaded(config_path, listen, socket_path))
    # Everything is stopped and closed. Leave now rather than at interpreter exit, which
    # joins every thread pool's workers: one stuck in a request or a probe would hold the
    # exit for as long as it is stuck (docs/daemon.md: exit within SHUTDOWN_LIMIT_S).
    logging.shutdown()
    sys.stdout.flush()
    os._exit(0)


def effective_config(cfg: DaemonConfig, state_dir: str) -> list[str]:
    """Every setting the daemon would run with, as TOML in the config file's own layout."""
    return [*effective_lines(cfg), "", f"# not in the file: --state-dir {state_dir}, socket in "
            f"effect {default_socket_path(cfg) or 'none'}"]


def run_daemon(cfg: DaemonConfig, state_dir: Path, config_path: str | None = None,
               reload: Callable[[], DaemonConfig] | None = None) -> None:
    """Start everything, serve until SIGTERM/SIGINT (SIGHUP reloads), stop everything."""
    from gpudiag.core.environment import probe_environment
    from gpudiag.core.verdict import change_summary
    from gpudiag.daemon.app import DaemonApp
    from gpudiag.daemon.app import serve as http_serve
    from gpudiag.daemon.clears import ClearPoller, ClearRequest, recheck_keys
    from gpudiag.daemon.exporter import HistoryCollector
    from gpudiag.daemon.holds import HistoryAtStart, XidKeeper, restore_holds
    from gpudiag.daemon.jobs import JobFailuresCollector, JobInbox, record_job
    from gpudiag.daemon.recorder import RecorderThread, Written
    from gpudiag.daemon.reload import LockDirCollector, ReloadCollector, Reloader
    from gpudiag.daemon.scheduler import Scheduler
    from gpudiag.daemon.sdnotify import Notifier
    from gpudiag.daemon.snapshot import Snapshot
    from gpudiag.daemon.statedir import StateDirError, check_writable, lock_state_dir, start_history
    from gpudiag.daemon.store import HistoryError, HistoryStore
    from gpudiag.daemon.watcher import XidWatcher
    from gpudiag.engine.locks import SYSTEM_LOCK_DIR, choose_lock_dir
    from gpudiag.engine.processes import kill_child_groups

    log = logging.getLogger("gpudiag.daemon")
    # Answers are short and latency is what callers wait on: hand the GIL over sooner than
    # CPython's 5 ms default when a request thread wakes up beside a busy one.
    sys.setswitchinterval(0.0005)
    try:
        # The lock first: a second daemon must not even open (or move aside) the history.
        state_lock = lock_state_dir(state_dir)
        check_writable(state_dir)
    except StateDirError as e:
        raise _Unusable(f"cannot use --state-dir {state_dir}: {e}") from e
    before = HistoryAtStart.look(state_dir)  # before a damaged history is moved aside
    recorder = start_history(state_dir, retention_s=cfg.history.retention_s,
                             max_bytes=cfg.history.max_bytes)
    notifier = Notifier()
    wake: list[Any] = []
    # Each XID goes to the history (writer, started below before the watcher) so that a
    # restart holds it again; the history's holds are handed back before anything starts.
    watcher = XidWatcher(cfg.xid, probe_environment(os.environ),
                         on_change=lambda: wake[0]() if wake else None,
                         on_xid=lambda event: keep_xid(event))
    history_state = restore_holds(before, recorder, watcher, hold_s=cfg.xid.hold_s)
    late: list[Scheduler] = []

    def record_clear(request: ClearRequest, released: int) -> None:
        # The store is locked per call; it may be missing while the disk is full.
        history = recorder.store
        again = "; a restart would hold its XIDs again (run gpudiag clear once more then)"
        if not isinstance(history, HistoryStore):
            log.warning("clear of %s applied but not recorded: the history is not writable%s",
                        request.gpu or "all GPUs", again, extra={"uid": request.uid})
            return
        try:
            # Stamped with the time up to which XIDs were released (the request's), so that
            # a restart re-arms exactly the XIDs the watcher still holds (daemon/holds.py).
            history.record_clear(uid=request.uid, gpu=request.gpu, reason=request.reason,
                                 released=released,
                                 now=min(request.requested_wall, time.time()))
        except HistoryError as e:
            log.warning("clear of %s applied but not recorded: %s%s", request.gpu or "all GPUs",
                        e, again, extra={"uid": request.uid})

    clears = ClearPoller(state_dir, release=watcher.clear, record=record_clear,
                         recheck=lambda: late[0].trigger(recheck_keys(late[0].scheduled)))
    jobs = JobInbox(state_dir, record=lambda job, uid: record_job(recorder.store, job, uid))
    try:
        clears.prepare()
        jobs.prepare()
    except OSError as e:
        raise _Failed(f"cannot use --state-dir {state_dir}: {e}") from e
    def tick() -> None:
        for poll in (clears.poll, jobs.poll):  # one failing inbox must not stop the other
            try:
                poll()
            except Exception:  # a bug of ours: said, and the loop goes on
                log.exception("polling %s failed", getattr(poll, "__qualname__", poll))

    locks = choose_lock_dir(probe_environment(os.environ))
    if not locks.shared:
        # Loud: probes locking GPUs where jobs do not look can meet a job on one GPU.
        log.warning("GPU lock folder %s is not usable (%s): the daemon's probes lock GPUs in "
                    "the private %s, which `gpudiag run` jobs do not see; give the daemon "
                    "/run/gpudiag/locks (the unit's ReadWritePaths=, the DaemonSet's hostPath) "
                    "or set GPUDIAG_LOCK_DIR to the jobs' folder", SYSTEM_LOCK_DIR, locks.why,
                    locks.path, extra={"lock_dir": str(locks.path), "lock_dir_shared": False})
    scheduler = Scheduler(cfg, notifier=notifier, watcher=watcher, on_tick=tick,
                          history=history_state, lock_dir=locks.path,
                          nvlinks_file=state_dir / nvlinks.FILE_NAME)
    late.append(scheduler)
    wake.append(scheduler.wake)

    logged: list[Verdict] = []  # the verdict of the last "verdict changed" line
    last_uuids: dict[int, str] = {}  # each GPU index's last UUID: a lost GPU has none now

    def written(verdict: Verdict | None, changes: list[Written]) -> None:
        if app.store is None and isinstance(recorder.store, HistoryStore):
            app.store = recorder.store  # opened late (the disk was full at start)
        for change in changes:
            if change.verdict is not verdict:  # a kept change, said when it was made
                continue
            where: dict[str, Any] = ({"history_id": change.history_id}
                                     if change.history_id is not None
                                     else {"history_pending": True})
            # Say what changed (which GPU, which code appeared or went), not only the code.
            last_uuids.update((d.index, d.uuid) for d in change.verdict.devices if d.uuid)
            log.info("verdict changed: %s (%s)", verdict.gpu_validation_blocker,
                     change_summary(logged[0] if logged else None, verdict, last_uuids),
                     extra={**where, "ready": verdict.ready,
                            "blockers": sorted({b.code for b in verdict.blockers}),
                            "warnings": sorted({w.code for w in verdict.warnings})})
            logged[:] = [verdict]

    writer = RecorderThread(recorder, written)
    keep_xid = XidKeeper(writer)

    def record(snap: Snapshot) -> None:
        if snap.full is not None:
            writer.submit(snap.full)

    scheduler.on_snapshot(record)
    if cfg.nfd_features_file is not None:
        from gpudiag.daemon.nfd import NfdFeatureFile
        nfd = NfdFeatureFile(cfg.nfd_features_file, cfg.nfd_expiry_s)

        def label(snap: Snapshot) -> None:
            nfd.update(snap)

        scheduler.on_snapshot(label)
    store = recorder.store
    app = DaemonApp(scheduler, store if isinstance(store, HistoryStore) else None,
                    history_error=lambda: writer.health().last_error)
    app.registry.register(HistoryCollector(writer.health))
    app.registry.register(LockDirCollector(locks.shared))
    reloader = Reloader(scheduler, reload or (lambda: load_config(config_path)),
                        retune_xid=watcher.retune, notifier=notifier,
                        set_log_level=lambda level: logging.getLogger("gpudiag").setLevel(
                            level.upper()))
    app.registry.register(ReloadCollector(reloader.state))
    qualifier = start_qualifier(cfg, state_dir, scheduler, app)
    app.registry.register(JobFailuresCollector(jobs.counts))
    try:
        httpd, _thread = http_serve(app, cfg.listen_host, cfg.listen_port,
                                    read_only=cfg.tcp_read_only)
    except OSError as e:
        raise click.UsageError(f"cannot listen on {cfg.listen_host}:{cfg.listen_port}: "
                               f"{e.strerror or e}") from e
    unix_httpd = start_socket(app, cfg, httpd)
    host, port = str(httpd.server_address[0]), int(httpd.server_address[1])
    stop = threading.Event()
    wakeup = threading.Event()
    hup = threading.Event()

    def on_stop(*_: Any) -> None:
        stop.set()
        wakeup.set()

    def on_hup(*_: Any) -> None:
        # Handled on the main thread below, outside the signal handler: it takes locks.
        hup.set()
        wakeup.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_stop)
    signal.signal(signal.SIGHUP, on_hup)
    writer.start()
    watcher.start()
    scheduler.start()
    url = f"http://{host if ':' not in str(host) else f'[{host}]'}:{port}"
    log.info("listening on %s", url, extra={"url": url, "state_dir": str(state_dir),
                                            "backends": list(cfg.enabled_backends)})
    if unix_httpd is not None:
        log.info("preflight and control on unix:%s", unix_httpd.unix_path,
                 extra={"socket_url": f"unix:{unix_httpd.unix_path}"})
    notifier.ready(f"serving on {url}" + (f" and unix:{unix_httpd.unix_path}"
                                          if unix_httpd is not None else ""))
    def apply_reload() -> None:
        # SIGHUP is handled here, on the main thread, outside the signal handler: it takes
        # locks. The stop wait below wakes every STOP_POLL_S, so a reload waits at most that.
        if hup.is_set() and not stop.is_set():
            hup.clear()
            reloader.reload()

    servers = [s for s in (httpd, unix_httpd) if s is not None]
    failed = wait_for_stop(stop, servers, log, on_wake=apply_reload)
    # Armed before anything else, even the log line: a write to a stalled log (a full pipe,
    # a disk that stopped answering) blocks every thread that logs, this one included.
    ShutdownDeadline(SHUTDOWN_LIMIT_S, log).start()
    log.info("stopping")
    notifier.stopping()
    for server in servers:
        server.shutdown()
    qualifier.stop()
    scheduler.stop()
    watcher.stop()
    # A probe child still running (even hung in the driver) must not hold the exit up to
    # its deadline, nor outlive the daemon: kill each child's process group.
    killed = kill_child_groups()
    if killed:
        log.info("killed %d running probe child(ren) on the way out", killed)
    # A worker between two probes may start one more child: kill again, wait a bounded time.
    bounded(scheduler.drain, DRAIN_LIMIT_S, on_each=kill_child_groups)
    # A write stuck in the disk must not hold the exit up either: closing would wait on it.
    if writer.stop() and isinstance(recorder.store, HistoryStore):
        recorder.store.close()
    state_lock.release()
    log.info("stopped")
    if failed:
        raise _Failed(failed)


# The daemon exits within this many seconds of SIGTERM/SIGINT, whatever a thread is stuck on
# (systemd's TimeoutStopSec=30s in the unit leaves room for it). docs/daemon.md says so.
SHUTDOWN_LIMIT_S = 15.0
DRAIN_LIMIT_S = 5.0
STOP_POLL_S = 0.5


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


def start_qualifier(cfg: DaemonConfig, state_dir: Path, scheduler: Scheduler,
                    app: DaemonApp) -> Qualifier:
    """The qualification schedule on idle GPUs, its metrics and POST /v1/qualify."""
    from gpudiag.core.qualify_verdict import qualification_findings
    from gpudiag.daemon.qualifier import Qualifier, QualifierState
    from gpudiag.daemon.qualify_exporter import QualificationCollector

    def occupancy() -> Mapping[str, GpuOccupancy]:
        scope = scheduler.snapshot().scope
        return scope.occupancy if scope is not None else {}

    def publish(state: QualifierState) -> None:
        scheduler.set_qualification(qualification_findings(
            state.latest.values(), block=cfg.qualification.thresholds.block))

    qualifier = Qualifier(cfg.qualification, state_dir, occupancy, on_change=publish)
    app.qualifier = qualifier
    app.registry.register(QualificationCollector(qualifier.state))
    qualifier.start()
    return qualifier


def start_socket(app: WsgiApp, cfg: DaemonConfig, tcp: HttpServer) -> HttpServer | None:
    """Serve the same API on the unix socket, if one is configured; the HttpServer or None.

    It shares the TCP server's abuse counters (one gpudiag_http_rejected_total). Mode 0666:
    any local user may connect; clients check the peer's credentials (docs/security.md).
    """
    from gpudiag.daemon.httpserver import start as start_http

    path = default_socket_path(cfg)
    if path is None:
        log = logging.getLogger("gpudiag.daemon")
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
        raise click.UsageError(f"cannot serve on socket {path}: {e.strerror or e}") from e
    return server


_SINCE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([smhdw]?)\s*$")
_SINCE_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_since(text: str) -> float:
    """``90``, ``30m``, ``1h``, ``2d`` -> seconds."""
    m = _SINCE_RE.match(text)
    if not m:
        raise click.UsageError(f"--since {text!r} is not a duration; accepted: seconds or a "
                               "number with s, m, h, d or w (e.g. 1h, 30m, 2d)")
    return float(m.group(1)) * _SINCE_UNITS[m.group(2)]


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts).astimezone().isoformat(timespec="seconds")


@click.command(short_help="Show the daemon's verdict changes and blocker episodes.",
               epilog=examples(
                   "gpudiag history                     # the last 50 changes",
                   "gpudiag history --since 1h --blocked",
                   "gpudiag history --state-dir /var/lib/gpudiag --format json | jq .episodes"))
@click.option("--state-dir", metavar="DIR", type=click.Path(file_okay=False),
              help="The daemon's state dir.  [default: as for `gpudiag serve`]")
@click.option("--since", "since_text", metavar="DURATION",
              help="Only changes in the last DURATION (e.g. 1h, 30m, 2d).")
@click.option("--blocked", is_flag=True, help="Only verdicts that were blocked.")
@click.option("--limit", type=click.IntRange(1, 100000), default=50, show_default=True,
              metavar="N", help="At most this many verdict changes and episodes.")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default=None,
              help="Output format: text for people, json (verdicts, episodes, clears).  "
              "[default: text]")
@click.option("--json", "as_json", is_flag=True, help="Same as --format json.")
def history(state_dir: str | None, since_text: str | None, blocked: bool, limit: int,
            fmt: str | None, as_json: bool) -> None:
    """Show the daemon's verdict changes and blocker episodes (works while it runs)."""
    if as_json and fmt not in (None, "json"):
        raise click.UsageError(f"--json and --format {fmt} disagree; give one of them")
    as_json = as_json or fmt == "json"
    from gpudiag.daemon.statedir import damaged_histories
    from gpudiag.daemon.store import HistoryError, HistoryStore, default_path

    since = time.time() - parse_since(since_text) if since_text else None
    folder = Path(state_dir) if state_dir else default_state_dir()
    path = default_path(folder)
    damaged = damaged_histories(folder)
    if not path.is_file() and not damaged:
        # No daemon ever ran with this state dir (or it uses another one): a usage problem.
        raise _Unusable(f"no history at {path}: no daemon has used this state dir; start one "
                        "(`gpudiag serve`) or pass the --state-dir it uses (`gpudiag serve "
                        "--check-config` prints it)")
    try:
        store = HistoryStore(path, readonly=True)
        try:
            entries = store.verdicts(since=since, blocked=blocked, limit=limit)
            episodes = store.episodes(since=since, limit=limit)
            clears = store.clears(since=since, limit=limit)
        finally:
            store.close()
    except HistoryError as e:
        raise _Failed(str(e)) from e
    if as_json:
        click.echo(json.dumps({"verdicts": [v.record() for v in entries],
                               "episodes": [ep.record() for ep in episodes],
                               "clears": [c.record() for c in clears],
                               "damaged": [str(folder / n) for n in damaged]}, indent=2))
        return
    for name in damaged:
        # Earlier history lives on in that file (readable with sqlite3 if not too damaged).
        click.echo(f"note: a damaged history was moved aside to {folder / name}; the history "
                   "below starts after it", err=True)
    if not entries:
        click.echo("no verdict changes" + (" in that time" if since_text else ""))
    for entry in entries:
        extra = f"  warnings: {','.join(entry.warnings)}" if entry.warnings else ""
        click.echo(f"{_when(entry.ts)}  {entry.gpu_validation_blocker:<26} "
                   f"blockers: {','.join(entry.blockers) or '-'}{extra}")
    if episodes:
        click.echo("\nblocker episodes:")
    for ep in episodes:
        end = "ongoing" if ep.ended is None else _when(ep.ended)
        where = "/".join(x for x in (ep.backend, ep.device) if x) or "-"
        click.echo(f"{_when(ep.started)} .. {end}  {ep.code}  {where}: {ep.message}")
    if clears:
        click.echo("\nclears (gpudiag clear):")
    for c in clears:
        click.echo(f"{_when(c.ts)}  {c.gpu or 'all GPUs'}  by uid {c.uid}: "
                   f"{c.reason or '(no reason)'}; {c.released} held XID(s) released")
