"""The caller's side of the probe fork server (gpudiag.probes.forkserver).

One server per caller process tree: the daemon keeps one for its life, an inline run one for
the run. It is started with the probe environment and serves only requests whose environment
matches it but for the variables read at run time (the visibility variables): what the
dynamic loader and Python read once at start (``LD_LIBRARY_PATH``, ``PYTHONPATH``, ...) must
be the child's own. Anything else, or a server that cannot start or is gone, means None from
``fork`` and the caller spawns the probe as before: never a different verdict, never a hang.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Mapping
from typing import Any

from gpudiag.core.environment import PREALLOCATION_OFF, SYSTEMD_ONLY
from gpudiag.core.records import dataclass
from gpudiag.core.visibility import VISIBILITY_VARIABLES

# GPUDIAG_PROBE_FORK_SERVER=0 in the probe environment: spawn every probe (the old path);
# =exec: a server is always exec'd, never forked from its caller (the path before that).
OFF_SWITCH = "GPUDIAG_PROBE_FORK_SERVER"
# Read by the probe child at run time (after the fork), so a request may differ in them.
RUNTIME_KEYS = frozenset({*VISIBILITY_VARIABLES, "GPUDIAG_PROBE_PARENT_PID"})
# Only read in a probe child (by JAX and XLA, after the fork), or only by sd_notify: a fork
# server forked from its caller serves a probe environment that adds or drops them
# (probe_environment) though the caller's own start environment did not.
PROBE_ONLY_KEYS = frozenset({*PREALLOCATION_OFF, *SYSTEMD_ONLY})
# The room the server's argv leaves for a child's (python -m gpudiag.probes NAME OPTIONS).
# Neither the server nor a child shows it: each rewrites its cmdline to its own argv
# (probes.forkserver.cmdline_text), so ps prints no run of padding.
ARGV_ROOM_BYTES = 16 * 1024
# A server that died is started again at most this often; meanwhile probes are spawned.
RESTART_AFTER_S = 30.0
# How long a caller waits for a started server to take a request before spawning instead.
PID_WAIT_S = 10.0
# How long a caller waits for a killed child's pipes to end and its status to come.
AFTER_KILL_WAIT_S = 5.0


@dataclass(frozen=True)
class ForkedChild:
    """A probe child the server forked: its pid (its group's id) and the caller's pipe ends;
    ``asked_at``: when it was asked for ahead (``ForkServer.ask_ahead``; its deadline counts
    from then), else None."""

    pid: int
    stdout: int
    stderr: int
    status: int
    asked_at: float | None = None


@dataclass(frozen=True)
class _Ahead:
    """A child asked for ahead and not yet claimed: its request and the caller's pipe ends."""

    backend: str
    options: dict[str, Any]
    env: dict[str, str]
    stdout: int
    stderr: int
    status: int
    asked_at: float

    def close(self) -> None:
        for fd in (self.stdout, self.stderr, self.status):
            os.close(fd)


def server_argv(probes: Collection[str] | None = None) -> list[str]:
    """The server's argv: the probes it imports for (default every backend), then the room
    a child's argv is written into."""
    names = "*" if probes is None else ",".join(probes)
    return [sys.executable, "-m", "gpudiag.probes.forkserver", names, " " * ARGV_ROOM_BYTES]


def startup_env(env: Mapping[str, str]) -> dict[str, str]:
    """What of ``env`` a forked child inherits from the server's start, unchangeable."""
    return {k: v for k, v in env.items() if k not in RUNTIME_KEYS}


def exec_environment() -> dict[str, str]:
    """The environment this process was started with (what its loader and Python read then),
    as the kernel keeps it: later changes to ``os.environ`` are not in it."""
    try:
        with open("/proc/self/environ", "rb") as f:
            block = f.read()
    except OSError:
        return {}
    pairs = (entry.partition(b"=") for entry in block.split(b"\0") if b"=" in entry)
    return {os.fsdecode(k): os.fsdecode(v) for k, _, v in pairs}


def probe_only(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` less what only a probe child reads (after the fork) and what the probe
    environment adds or drops (gpudiag.core.environment.probe_environment)."""
    return {k: v for k, v in startup_env(env).items() if k not in PROBE_ONLY_KEYS}


class _ForkedServerProcess:
    """The fork server this process forked from itself: the part of ``Popen`` used here."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """Its exit code once it ended (reaped here), else None."""
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = -1
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def kill(self) -> None:
        """SIGKILL it, unless already reaped (its pid may be another's by now)."""
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` s for it to end; its exit code, or TimeoutExpired."""
        end = time.monotonic() + timeout
        while self.poll() is None:
            left = end - time.monotonic()
            if left < 0:
                raise subprocess.TimeoutExpired(cmd=["fork server", str(self.pid)], timeout=timeout)
            self._until_ended(min(left, 0.005))
        return self.returncode

    def _until_ended(self, timeout: float) -> None:
        """Sleep until it ends (its pidfd reads ready), or ``timeout`` s at most: a poll every
        5 ms cost a killed server's caller 4 ms at the end of every inline run. Not reaped
        yet, its pid is still its own."""
        try:
            pidfd = os.pidfd_open(self.pid)
        except OSError:  # a kernel before 5.3
            time.sleep(timeout)
            return
        try:
            select.select([pidfd], [], [], timeout)
        finally:
            os.close(pidfd)


def _fork_server_here(control: socket.socket,
                      probes: Collection[str] | None) -> _ForkedServerProcess | None:
    """Fork this process into a fork server on ``control``; None when it may not be
    (``forked_here_refusal``), or the fork failed: the caller starts one by exec."""
    from gpudiag.probes import forkserver as server

    if server.forked_here_refusal() is not None:
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        pid = os.fork()
    except OSError:
        return None
    if pid == 0:
        server.serve_forked(control.fileno(), probes)  # never returns
    return _ForkedServerProcess(pid)


class ForkServer:
    """A fork server for probe children started with ``env`` (lazily, at the first fork);
    ``probes``: the ones it imports for ahead (default every backend; others still work).

    ``fork_here``: ``start()`` forks this process itself into the server, without an exec,
    when that is safe (``gpudiag.probes.forkserver.forked_here_refusal``) and ``env`` is
    this process's start environment but for what only a probe child reads (an inline run
    from the CLI); otherwise, and for any restart, the server is exec'd as before."""

    def __init__(self, env: Mapping[str, str], probes: Collection[str] | None = None, *,
                 fork_here: bool = False) -> None:
        self._env = dict(env)
        self._probes = None if probes is None else tuple(probes)
        self._startup = startup_env(env)
        self._fork_here = fork_here
        self._in_flight = 0  # children asked for or handed out, not yet ``done``
        self._ahead: list[_Ahead] = []  # asked for ahead, not yet claimed by ``fork``
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | _ForkedServerProcess | None = None
        self._sock: socket.socket | None = None
        self._failed_at: float | None = None
        self._closed = False

    def serves(self, env: Mapping[str, str]) -> bool:
        """Whether a child with ``env`` may be forked here (else it is spawned)."""
        return env.get(OFF_SWITCH) != "0" and startup_env(env) == self._startup

    @property
    def pid(self) -> int | None:
        """The server's pid while it runs (tests kill it)."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    @property
    def forked_here(self) -> bool:
        """Whether the running server was forked from this process (not exec'd)."""
        return isinstance(self._proc, _ForkedServerProcess) and self.pid is not None

    def start(self) -> None:
        """Start the server now, while the caller is still single-threaded (the first fork
        would start it anyway, from a worker thread: too late to fork the caller)."""
        with self._lock:
            self._connection()

    def _start(self) -> socket.socket | None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        if (self._fork_here and self._env.get(OFF_SWITCH) != "exec"
                and probe_only(self._env) == probe_only(exec_environment())):
            self._fork_here = False  # once: a restart is exec'd
            self._proc = _fork_server_here(theirs, self._probes)
            if self._proc is not None:
                theirs.close()
                self._sock = ours
                return ours
        try:
            self._proc = subprocess.Popen(  # noqa: S603 - fixed argv, no shell
                server_argv(self._probes),
                env={**self._env, "GPUDIAG_PROBE_PARENT_PID": str(os.getpid())},
                stdin=theirs.fileno(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True, close_fds=True)
        except OSError:
            ours.close()
            return None
        finally:
            theirs.close()
        self._sock = ours
        return ours

    def _connection(self) -> socket.socket | None:
        """The live server's socket, starting it when due; None: spawn instead."""
        if self._closed:
            return None
        if self._sock is not None and self._proc is not None and self._proc.poll() is None:
            return self._sock
        self._drop()
        if self._failed_at is not None and time.monotonic() - self._failed_at < RESTART_AFTER_S:
            return None
        self._failed_at = time.monotonic()
        return self._start()

    def _drop(self) -> int:
        # Killed, not asked: it would only exit after Python's shutdown, holding nothing.
        # Its probe children first (each leads its own group): killed after it, they would
        # be orphans this process no longer sees. Returns how many were killed.
        killed = 0
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            # Every child handed out ended with its group killed: no walk of every process
            # on the host (a few ms at the end of every inline run), nor psutil's import
            # (7 ms of a CLI's probe run).
            if self._in_flight:
                from gpudiag.engine.processes import kill_group_leaders_below

                killed = kill_group_leaders_below(self._proc.pid)
            with contextlib.suppress(OSError):
                self._proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=1.0)
            self._proc = None
        # Unclaimed children asked for ahead: killed with the server's other children above
        # (or never forked by a server that was killed first).
        for ahead in self._ahead:
            ahead.close()
            self._in_flight -= 1
        self._ahead = []
        return killed

    def ask_ahead(self, backend: str, options: Mapping[str, Any] | None,
                  env: Mapping[str, str]) -> bool:
        """Ask the server for a child now, without waiting for it: the server forks it as
        soon as it can (after its own imports) while the caller does other work, and the
        caller's ``fork`` of the same request (backend, options, env) later takes it, its
        deadline counted from now. An inline run's first probe (nvml) runs while the CLI
        imports the classifier. False when the server cannot take it (``fork`` then forks
        or the caller spawns, as without). An unclaimed one is killed at ``close``."""
        if not self.serves(env):
            return False
        pipes = [os.pipe() for _ in range(3)]
        request = json.dumps({"backend": backend, "options": dict(options or {}),
                              "env": dict(env)}).encode()
        with self._lock:
            sock = self._connection()
            try:
                if sock is None:
                    raise OSError("no fork server")
                socket.send_fds(sock, [request], [w for _, w in pipes])
            except OSError:
                for r, _ in pipes:
                    os.close(r)
                return False
            finally:
                for _, w in pipes:
                    os.close(w)
            self._in_flight += 1
            (out_r, _), (err_r, _), (status_r, _) = pipes
            self._ahead.append(_Ahead(backend, dict(options or {}), dict(env), out_r, err_r,
                                      status_r, time.monotonic()))
        return True

    def _claim(self, backend: str, options: Mapping[str, Any] | None,
               env: Mapping[str, str]) -> _Ahead | None:
        """The child asked for ahead with exactly this request, taken off the list."""
        with self._lock:
            for i, ahead in enumerate(self._ahead):
                if (ahead.backend, ahead.options, ahead.env) == (backend, dict(options or {}),
                                                                 dict(env)):
                    return self._ahead.pop(i)
        return None

    def fork(self, backend: str, options: Mapping[str, Any] | None,
             env: Mapping[str, str]) -> ForkedChild | None:
        """Fork a probe child with exactly ``env``; None when the server cannot (spawn)."""
        if not self.serves(env):
            return None
        ahead = self._claim(backend, options, env)
        if ahead is not None:
            pid = _read_pid(ahead.status)
            if pid is None:  # the server died or refused it: spawn, as for any fork
                ahead.close()
                self.done()
                return None
            return ForkedChild(pid, ahead.stdout, ahead.stderr, ahead.status, ahead.asked_at)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        status_r, status_w = os.pipe()
        request = json.dumps({"backend": backend, "options": dict(options or {}),
                              "env": dict(env)}).encode()
        try:
            with self._lock:
                self._in_flight += 1  # from before the request: a close meanwhile kills it
                sock = self._connection()
                if sock is None:
                    raise OSError("no fork server")
                socket.send_fds(sock, [request], [out_w, err_w, status_w])
        except OSError:
            for fd in (out_r, err_r, status_r):
                os.close(fd)
            self.done()
            return None
        finally:
            for fd in (out_w, err_w, status_w):
                os.close(fd)
        pid = _read_pid(status_r)
        if pid is None:
            for fd in (out_r, err_r, status_r):
                os.close(fd)
            self.done()
            return None
        return ForkedChild(pid, out_r, err_r, status_r)

    def done(self) -> None:
        """A child ``fork`` gave has ended and its group was killed (or none was forked)."""
        with self._lock:
            self._in_flight -= 1

    def close(self) -> int:
        """Stop the server and kill the probe children it forked; returns how many."""
        with self._lock:
            self._closed = True
            return self._drop()

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class Collected:
    """What a forked child's pipes gave so far: its output, and its wait status once reaped
    (``server_gone``: the status pipe ended without one, the server died)."""

    out: bytes = b""
    err: bytes = b""
    status: int | None = None
    server_gone: bool = False


def collect(child: ForkedChild, deadline: float, prior: Collected | None = None) -> Collected:
    """Read a forked child's stdout, stderr and status until all three end or ``deadline``
    (``time.monotonic``) passes: the forked form of ``Popen.communicate``."""
    got = {child.stdout: bytearray(prior.out if prior else b""),
           child.stderr: bytearray(prior.err if prior else b""),
           child.status: bytearray()}
    status, gone = (prior.status, prior.server_gone) if prior else (None, False)
    open_fds = [fd for fd in got if fd != child.status or (status is None and not gone)]
    with selectors.DefaultSelector() as sel:
        for fd in open_fds:
            sel.register(fd, selectors.EVENT_READ)
        while open_fds:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _ in sel.select(left):
                fd = int(key.fd)
                chunk = os.read(fd, 65536)
                if chunk:
                    got[fd] += chunk
                    continue
                sel.unregister(fd)
                open_fds.remove(fd)
            if child.status not in open_fds and status is None and not gone:
                status, gone = _exit_status(bytes(got[child.status]))
    return Collected(bytes(got[child.stdout]), bytes(got[child.stderr]), status, gone)


def _exit_status(text: bytes) -> tuple[int | None, bool]:
    """The server's ``exit W`` line (the status pipe ended): (W, False), or (None, True)."""
    word, _, value = text.decode(errors="replace").strip().partition(" ")
    if word == "exit" and value.lstrip("-").isdigit():
        return int(value), False
    return None, True


def _read_pid(status_r: int) -> int | None:
    """The first line of the status pipe: ``pid N``; None for an error or a dead server."""
    line = b""
    end = time.monotonic() + PID_WAIT_S
    while not line.endswith(b"\n"):
        left = end - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([status_r], [], [], left)
        if not ready:
            return None
        chunk = os.read(status_r, 1)
        if not chunk:
            return None
        line += chunk
    word, _, value = line.decode(errors="replace").strip().partition(" ")
    return int(value) if word == "pid" and value.isascii() and value.isdigit() else None


_SHARED: dict[frozenset[tuple[str, str]], ForkServer] = {}
_SHARED_LOCK = threading.Lock()


def shared_fork_server(env: Mapping[str, str]) -> ForkServer:
    """This process's fork server for children started with ``env`` (the daemon's: one for
    its life, started at its first probe; it ends when this process does)."""
    key = frozenset(startup_env(env).items())
    with _SHARED_LOCK:
        server = _SHARED.get(key)
        if server is None:
            server = _SHARED[key] = ForkServer(env)
        return server


def close_shared_fork_servers() -> int:
    """Stop this process's shared fork servers, reaped (a daemon's stop: no server outlives
    it, nor stays a zombie in a process that goes on, such as a test's); returns how many
    probe children they had running, killed with them."""
    with _SHARED_LOCK:
        servers = list(_SHARED.values())
        _SHARED.clear()
    return sum(server.close() for server in servers)
