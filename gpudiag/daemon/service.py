"""The daemon as one object: ``DaemonService(cfg, state_dir)``, ``start()``, ``stop()``.

``gpudiag serve`` (cli/daemon.py) only parses its flags and calls ``serve_forever()``: signal
handlers, ``start()``, a timed wait for SIGTERM/SIGINT (SIGHUP reloads on the way), ``stop()``.
Tests start and stop the same object in-process.

This is the core; every feature is a part (daemon/part.py, the list in daemon/parts/), and
no part is named here. ``start()`` builds the pieces in the order each needs the ones before:

    state-dir lock > history (recorder, its writer thread, the XID keeper) > XID watcher, with
    the history's holds handed back > scheduler > WSGI app (core collectors, reloader) > the
    parts, in list order (each registers its listeners, collectors, routes and evidence) >
    listeners (TCP, then the unix socket)

Callbacks that point the other way, from a piece to one built after it, do nothing while
that piece is missing: ``_xid_changed`` (the watcher wakes the scheduler), the parts' XID,
tick and clear listeners (``BuiltParts``: empty until every part is built) and
``_history_opened`` (a history opened late reaches the app).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

from gpudiag.core.environment import probe_environment
from gpudiag.core.records import dataclass
from gpudiag.daemon.app import DaemonApp
from gpudiag.daemon.config import DaemonConfig, load_config
from gpudiag.daemon.history import DaemonHistory
from gpudiag.daemon.lifecycle import (
    PROBE_CACHE,
    CannotListen,
    Servers,
    ShutdownDeadline,
    StateDirUnusable,
    end_probe_children,
    hold_state_dir,
    listen,
    lock_dir,
    probe_cache_environment,
    state_files,
    wait_for_stop,
)
from gpudiag.daemon.part import Part, PartContext, StartError
from gpudiag.daemon.parts import BuiltParts
from gpudiag.daemon.reload import LockDirCollector, ReloadCollector, Reloader
from gpudiag.daemon.scheduler import Scheduler
from gpudiag.daemon.sdnotify import Notifier
from gpudiag.daemon.statedir import StateDirLock
from gpudiag.daemon.store import HistoryStore
from gpudiag.daemon.watcher import XidWatcher

__all__ = ["PROBE_CACHE", "CannotListen", "DaemonService", "StartError", "StateDirUnusable",
           "probe_cache_environment", "wait_for_stop"]

log = logging.getLogger("gpudiag.daemon")

# The daemon exits within this many seconds of SIGTERM/SIGINT, whatever a thread is stuck on
# (systemd's TimeoutStopSec=30s in the unit leaves room for it). docs/daemon.md says so.
SHUTDOWN_LIMIT_S = 15.0
# Answers are short and latency is what callers wait on: hand the GIL over sooner than
# CPython's 5 ms default when a request thread wakes up beside a busy one.
SWITCH_INTERVAL_S = 0.0005


@dataclass(frozen=True)
class _Built:
    """What ``start()`` built and ``stop()`` takes down."""

    lock: StateDirLock
    notifier: Notifier
    history: DaemonHistory
    watcher: XidWatcher
    scheduler: Scheduler
    reloader: Reloader
    servers: Servers


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
        # Built by start(); the callbacks that point back at them check for None / nothing.
        self._scheduler: Scheduler | None = None
        self._app: DaemonApp | None = None
        self._parts = BuiltParts()  # the parts' listeners are empty until they are built
        self._keep_xid: Callable[[Any], None] = lambda event: None  # the history's, once open
        self._built: _Built | None = None
        self.url = ""  # http://HOST:PORT once listening

    @property
    def parts(self) -> tuple[Part, ...]:
        """The parts ``start()`` built, in list order (none before)."""
        return self._parts.parts

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
            lock = hold_state_dir(self.state_dir)
            undo.callback(lock.release)
            history = DaemonHistory(self.state_dir, self.cfg.history)
            undo.callback(history.close)
            built = self._build(lock, history)
            undo.pop_all()
        self._built = built
        built.history.writer.start()
        built.watcher.start()
        built.scheduler.start()
        self._parts.start()
        self._say_ready(built)

    def request_stop(self) -> None:
        """Make ``wait()`` return (what SIGTERM and SIGINT do)."""
        self._stop.set()

    def wait(self) -> str | None:
        """Serve until ``request_stop()``; the reason to exit non-zero if a listener died."""
        servers = list(self._built.servers) if self._built is not None else []
        return wait_for_stop(self._stop, servers, log, on_wake=self._apply_reload)

    def stop(self) -> None:
        """Stop every piece, kill probe children, close the history, drop the lock."""
        built, self._built = self._built, None
        if built is None:
            return
        log.info("stopping")
        built.notifier.stopping()
        for server in built.servers:
            server.shutdown()
        self._parts.stop()
        built.scheduler.stop()
        built.watcher.stop()
        end_probe_children(built.scheduler.drain)
        # A write stuck in the disk must not hold the exit up either: closing would wait on it.
        if built.history.writer.stop():
            built.history.close()
        built.lock.release()
        log.info("stopped")

    # -- building ----------------------------------------------------------------------------
    def _build(self, lock: StateDirLock, history: DaemonHistory) -> _Built:
        """Every piece, wired in dependency order, and listening; of the threads, only the
        listeners' (and any a part starts when built: the qualifier's) run yet."""
        cfg = self.cfg
        notifier = Notifier(self._env)
        # Each XID goes to the history (its writer starts before the watcher) so that a
        # restart holds it again; the history's holds are handed back before anything starts.
        watcher = XidWatcher(cfg.xid, probe_environment(self._env),
                             on_change=self._xid_changed, on_xid=self._xid)
        history_state = history.restore_holds(watcher, cfg.xid.hold_s)
        locks, files = lock_dir(self._env), state_files(self.state_dir)
        self._scheduler = scheduler = Scheduler(
            cfg, env=probe_cache_environment(self._env, self.state_dir), notifier=notifier,
            watcher=watcher, on_tick=self._parts.tick, history=history_state,
            lock_dir=locks.path, nvlinks_file=files.nvlinks, runtimes_dir=files.runtimes)
        scheduler.on_snapshot(history.record)
        self._app = app = DaemonApp(scheduler, history.store(),
                                    history_error=history.last_error)
        history.when_opened(self._history_opened)
        app.registry.register(history.collector())
        app.registry.register(LockDirCollector(locks.shared))
        reloader = Reloader(scheduler, self._load, retune_xid=watcher.retune, notifier=notifier,
                            set_log_level=_set_log_level)
        app.registry.register(ReloadCollector(reloader.state))
        self._keep_xid = history.keep_xid
        self._parts.build(PartContext(cfg, self.state_dir, self._env, scheduler, watcher,
                                      history.recorder, history.writer, locks.path,
                                      announce_clear=self._parts.cleared), app)
        try:
            servers = listen(app, cfg, self._env)
        except BaseException:
            self._parts.stop()
            raise
        return _Built(lock, notifier, history, watcher, scheduler, reloader, servers)

    def _say_ready(self, built: _Built) -> None:
        """The "listening on" lines, and READY=1 to systemd."""
        tcp = built.servers[0]
        unix = built.servers[1] if len(built.servers) > 1 else None
        host, port = str(tcp.server_address[0]), int(tcp.server_address[1])
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
        log.info("listening on %s", self.url,
                 extra={"url": self.url, "state_dir": str(self.state_dir),
                        "backends": list(self.cfg.enabled_backends)})
        if unix is not None:
            log.info("preflight and control on unix:%s", unix.unix_path,
                     extra={"socket_url": f"unix:{unix.unix_path}"})
        built.notifier.ready(f"serving on {self.url}" + (f" and unix:{unix.unix_path}"
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
        if self._hup.is_set() and not self._stop.is_set() and self._built is not None:
            self._hup.clear()
            self._built.reloader.reload()

    def _xid_changed(self) -> None:
        """The watcher's news wakes the scheduler; before it exists (holds restored at start)
        there is nothing to wake: its first snapshot reads the watcher."""
        if self._scheduler is not None:
            self._scheduler.wake()

    def _xid(self, event: Any) -> None:
        """Each XID to the history's keeper, then to every part that listens to XIDs."""
        self._keep_xid(event)
        self._parts.xid(event)

    def _history_opened(self, store: HistoryStore) -> None:
        """A history opened late (the disk was full at start) reaches the app."""
        if self._app is not None and self._app.store is None:
            self._app.store = store


def _set_log_level(level: str) -> None:
    logging.getLogger("gpudiag").setLevel(level.upper())
