"""How the daemon process lives and ends: its listeners, its probe children's cache and
lock folder, the stop wait and the shutdown deadline (the core's helpers, daemon/service.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from gpudiag.core.environment import CACHE_VARIABLE, probe_environment
from gpudiag.core.limits import EXIT_FAILED, EXIT_USAGE
from gpudiag.core.records import dataclass
from gpudiag.daemon.app import DaemonApp
from gpudiag.daemon.app import serve as http_serve
from gpudiag.daemon.config import DaemonConfig
from gpudiag.daemon.effective import default_socket_path
from gpudiag.daemon.httpserver import HttpServer
from gpudiag.daemon.httpserver import start as start_http
from gpudiag.daemon.nvlinks import FILE_NAME as NVLINKS_FILE
from gpudiag.daemon.part import StartError
from gpudiag.daemon.statedir import StateDirError, StateDirLock, check_writable, lock_state_dir
from gpudiag.engine.forkclient import close_shared_fork_servers
from gpudiag.engine.locks import SYSTEM_LOCK_DIR, LockDirChoice, choose_lock_dir
from gpudiag.engine.processes import kill_child_groups

log = logging.getLogger("gpudiag.daemon")

Servers = tuple[HttpServer, ...]  # TCP first, then the unix socket if one is configured
DRAIN_LIMIT_S = 5.0
STOP_POLL_S = 0.5
PROBE_CACHE = "probe-cache"  # in the state directory: the probe children's private cache


class StateDirUnusable(StartError):
    """The state directory cannot be used, or another daemon holds it."""

    exit_code = EXIT_USAGE


class CannotListen(StartError):
    """The address or the socket cannot be served on (the CLI says it as a usage error)."""

    exit_code = EXIT_USAGE


def hold_state_dir(state_dir: Path) -> StateDirLock:
    """The state directory's lock, first: a second daemon must not even open (or move aside)
    the history."""
    try:
        lock = lock_state_dir(state_dir)
    except StateDirError as e:
        raise StateDirUnusable(f"cannot use --state-dir {state_dir}: {e}") from e
    try:
        check_writable(state_dir)
    except StateDirError as e:
        lock.release()
        raise StateDirUnusable(f"cannot use --state-dir {state_dir}: {e}") from e
    return lock


@dataclass(frozen=True)
class StateFiles:
    """Where the scheduler keeps its files in the state directory."""

    nvlinks: Path   # the NVLink baseline (daemon/nvlinks.py)
    runtimes: Path  # the runtimes' proofs (daemon/runtime_proofs.py)


def state_files(state_dir: Path) -> StateFiles:
    """The scheduler's files in ``state_dir``."""
    return StateFiles(state_dir / NVLINKS_FILE, state_dir / "runtimes")


def listen(app: DaemonApp, cfg: DaemonConfig, env: Mapping[str, str]) -> Servers:
    """The TCP listener, then the unix socket beside it if one is configured."""
    try:
        httpd, _thread = http_serve(app, cfg.listen_host, cfg.listen_port,
                                    read_only=cfg.tcp_read_only)
    except OSError as e:
        raise CannotListen(f"cannot listen on {cfg.listen_host}:{cfg.listen_port}: "
                           f"{e.strerror or e}") from e
    unix = start_socket(app, cfg, httpd, env)
    return (httpd,) if unix is None else (httpd, unix)


def lock_dir(env: Mapping[str, str]) -> LockDirChoice:
    """Where the probes lock GPUs: the jobs' shared folder, or a loud private one."""
    locks = choose_lock_dir(probe_environment(env))
    if not locks.shared:
        # Loud: probes locking GPUs where jobs do not look can meet a job on one GPU.
        log.warning("GPU lock folder %s is not usable (%s): the daemon's probes lock GPUs "
                    "in the private %s, which `gpudiag run` jobs do not see; give the "
                    "daemon /run/gpudiag/locks (the unit's ReadWritePaths=, the "
                    "DaemonSet's hostPath) or set GPUDIAG_LOCK_DIR to the jobs' folder",
                    SYSTEM_LOCK_DIR, locks.why, locks.path,
                    extra={"lock_dir": str(locks.path), "lock_dir_shared": False})
    return locks


def end_probe_children(drain: Callable[[], object]) -> None:
    """Kill every probe child, let the scheduler's workers drain (bounded), kill again.

    A probe child still running (even hung in the driver) must not hold the exit up to its
    deadline, nor outlive the daemon: each child's process group is killed.
    """
    killed = close_shared_fork_servers() + kill_child_groups()
    if killed:
        log.info("killed %d running probe child(ren) on the way out", killed)
    # A worker between two probes may start one more child: kill again, bounded wait.
    bounded(drain, DRAIN_LIMIT_S, on_each=kill_child_groups)
    close_shared_fork_servers()  # one the drain's last probe may have started again


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
