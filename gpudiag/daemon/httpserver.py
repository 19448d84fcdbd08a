"""A small HTTP/1.1 server for a WSGI app that stays up under abusive clients.

One selector thread accepts connections and collects request heads without a thread per
connection, so slow clients that trickle bytes, idle connections and floods of connections cost
a file descriptor and a bounded buffer each, never a thread; h11 parses the heads under our
limits (httpparse.py). A request whose answer is at hand (the app's ``answer_now``: a cached
verdict, nothing to wait for) is answered there and then; any other complete request goes to a
bounded worker pool (one pool for the endpoints that may wait for probes, one for the rest, so
a waiting preflight never holds up /metrics). Answers are sent without blocking; only what a
slow reader has not taken yet waits for the selector. Every limit answers with the JSON error
envelope or closes the connection; abuse is logged once per kind and then summarised at most
once a minute. One request per connection (``Connection: close``): scrapers and the client
reconnect anyway.
"""

from __future__ import annotations

import array
import contextlib
import functools
import io
import ipaddress
import logging
import os
import queue
import selectors
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import field
from typing import Any
from urllib.parse import unquote

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from gpudiag.core.peercred import PeerCredentials, peer_credentials, peer_pidfd
from gpudiag.core.records import dataclass
from gpudiag.daemon import envelope
from gpudiag.daemon.envelope import status_line, wire_bytes
from gpudiag.daemon.httpparse import MAX_BODY_BYTES as MAX_BODY_BYTES
from gpudiag.daemon.httpparse import MAX_HEAD_BYTES as MAX_HEAD_BYTES
from gpudiag.daemon.httpparse import BadRequest, Request, RequestReader
from gpudiag.daemon.httpparse import body_length as body_length

log = logging.getLogger("gpudiag.daemon.app")

HEAD_TIMEOUT_S = 10.0       # the whole head (and body) must arrive within this
WRITE_TIMEOUT_S = 30.0      # the whole response must be taken within this
MAX_PENDING = 512           # connections still sending their head; past it the oldest goes
# Client connections open at once, in every state. Under systemd's default soft limit of 1024
# file descriptors, with room for the daemon's own (SQLite, probe pipes, the watcher).
MAX_CONNECTIONS = 768
ACCEPT_PAUSE_S = 0.1        # after EMFILE: stop accepting briefly instead of spinning
WORKERS = 8                 # threads per pool
MAX_QUEUED = 512            # complete requests waiting for a worker per pool; past it: 503
SUMMARY_INTERVAL_S = 60.0
# The serving loop sleeps until its next deadline or an event; with nothing due it still
# wakes this often, so a deadline some future change forgets to report is late, not lost.
IDLE_WAKE_S = 5.0
MAX_INTERNAL_TRACEBACKS = 5  # then internal errors are counted only
# Every endpoint that can wait runs on the slow pool, so that waiting answers never take the
# threads of /metrics, /healthz and /readyz: preflight and health wait for probes (max_age_s,
# wait_s); history waits for the history's lock while a write fsyncs (SQLite busy_timeout).
# A run's end writes its job record (an fsync) the same way.
SLOW_PATHS = frozenset({"/v1/preflight", "/v1/health", "/v1/history", "/v1/runs/end"})
# What a read-only listener (TCP with tcp_read_only) serves: monitoring that never starts a
# probe. Preflight (it may start probes) and POST /v1/probe are for the unix socket.
READ_ONLY_PATHS = frozenset({"/metrics", "/healthz", "/readyz", "/v1/history"})
READ_ONLY_METHODS = frozenset({"GET", "HEAD"})
SOCKET_MODE = 0o666         # any local user may connect; clients check who answers
# WSGI environ keys: the unix-socket client's PeerCredentials (None over TCP), and a callable
# that opens a pidfd of that client process (None when the kernel gives none).
PEER_KEY = "gpudiag.peer"
PEER_PIDFD_KEY = "gpudiag.open_peer_pidfd"
# The descriptors the unix-socket client passed with its request's first bytes (SCM_RIGHTS),
# a tuple of ints the server owns and closes with the connection: a run's GPU lock files,
# for the kernel's word on which locks those very open files hold (daemon/runs.py).
PEER_FDS_KEY = "gpudiag.peer_fds"
# At most this many per request (a run's GPU leaves: 8 MIG instances on each of 8 GPUs), and
# this many held at once over every connection; past either they are closed on arrival (a
# client cannot fill the daemon's descriptor table). Descriptors sent after the first bytes
# of a request are dropped by the kernel (they are read with recv, without room for them).
MAX_PASSED_FDS = 64
MAX_HELD_FDS = 256

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]
# An app's optional ``answer_now``: the answer when it needs no wait, else None (the pool).
AnswerNow = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes] | None]

# What each rejection means, for the log line the first time it happens.
ABUSE_KINDS: dict[str, str] = {
    "slow_client": "a client sent no complete request within the head timeout",
    "head_too_large": "a request line or headers over the size limit",
    "malformed": "a malformed request line, header or body framing",
    "connection_cap": "more connections sending heads than the cap; the oldest was dropped",
    "busy": "every worker busy and the queue full; answered 503",
    "client_gone": "a client disconnected before taking the whole response",
    "cross_site": "a browser request from another site (Origin on a POST, or a Host that is "
                  "not loopback: DNS rebinding); answered 403",
    "read_only": "a request for a control endpoint on the read-only TCP listener; answered 403",
    "internal": "an internal error while serving a connection (a gpudiag bug; traceback "
                "logged); that connection was closed and the listener went on",
}


class AbuseLog:
    """Counts rejected or broken requests; logs each kind once, then a summary per interval."""

    def __init__(self, interval_s: float = SUMMARY_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic,
                 logger: logging.Logger = log) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._log = logger
        self._lock = threading.Lock()
        self.totals: dict[str, int] = dict.fromkeys(ABUSE_KINDS, 0)
        self._since: dict[str, int] = {}
        self._seen: set[str] = set()
        self._last_summary = clock()

    def note(self, kind: str, peer: str) -> None:
        """Count one occurrence; the first of its kind is logged at once."""
        with self._lock:
            self.totals[kind] = self.totals.get(kind, 0) + 1
            first = kind not in self._seen
            if first:
                self._seen.add(kind)
            else:
                self._since[kind] = self._since.get(kind, 0) + 1
        if first:
            self._log.warning("http: %s (from %s); further ones are counted in "
                              "gpudiag_http_rejected_total and summarised at most every %g s",
                              ABUSE_KINDS.get(kind, kind), peer, self.interval_s,
                              extra={"abuse": kind, "peer": peer})

    def summary_in_s(self) -> float | None:
        """Seconds until counts waiting for a summary are due (None: nothing waits)."""
        with self._lock:
            if not self._since:
                return None
            return max(0.0, self._last_summary + self.interval_s - self._clock())

    def flush(self) -> None:
        """Log the counts since the last summary, at most once per interval."""
        now = self._clock()
        with self._lock:
            if not self._since or now - self._last_summary < self.interval_s:
                return
            counts, self._since = self._since, {}
            self._last_summary = now
        self._log.warning("http: rejected or broken requests in the last %.0f s: %s",
                          self.interval_s,
                          ", ".join(f"{k} {v}" for k, v in sorted(counts.items())),
                          extra={"abuse_counts": counts})


class AbuseCollector(Collector):
    """``gpudiag_http_rejected_total{reason}``, read from the AbuseLog on each scrape."""

    def __init__(self, abuse: AbuseLog) -> None:
        self.abuse = abuse

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily("gpudiag_http_rejected",
                                     "HTTP requests rejected or broken off, by reason",
                                     labels=["reason"])
        for kind, n in sorted(self.abuse.totals.items()):
            family.add_metric([kind], float(n))
        yield family


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def cross_site(request: Request, loopback: bool) -> str | None:
    """Why a browser-borne request is refused (CSRF, DNS rebinding), or None.

    Programs (Prometheus, curl, the gpudiag client) send no Origin and name the address they
    dialled in Host; a web page can only make a browser send a POST with its Origin, or, after
    DNS rebinding, a request whose Host is the page's own domain name.
    """
    headers = dict(request.headers)
    origin = headers.get("origin")
    if origin is not None and request.method not in ("GET", "HEAD"):
        return (f"{request.method} with Origin {origin[:100]!r}: web pages may not drive the "
                "daemon; call it from a program (no Origin header)")
    host = headers.get("host")
    if loopback and host is not None:
        name = host.strip()
        if name.startswith("["):
            name = name[1:].partition("]")[0]
        elif name.count(":") == 1:
            name = name.partition(":")[0]
        if name.lower() not in ("localhost", "localhost.") and not _is_ip_address(name):
            return (f"Host {host[:100]!r}: a daemon on loopback answers only to an IP "
                    "address or localhost (DNS rebinding defence)")
    return None


@functools.lru_cache(maxsize=64)
def _is_ip_address(name: str) -> bool:
    """Whether ``name`` is an IP address; kept, as clients name the same address every time."""
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def read_only_refusal(request: Request, where: str) -> str | None:
    """Why a read-only listener refuses this request, or None when it serves it."""
    path = request.target.partition("?")[0]
    if request.method in READ_ONLY_METHODS and path in READ_ONLY_PATHS:
        return None
    return (f"{request.method} {path[:100]}: {where} is read-only (tcp_read_only = true) and "
            f"serves only GET {', '.join(sorted(READ_ONLY_PATHS))}; preflight and probe "
            "requests go to the daemon's unix socket (GPUDIAG_DAEMON_URL=unix:PATH)")


class SocketInUse(OSError):
    """The unix socket path is a live socket (another daemon answers there) or not a socket."""


def bind_unix(path: str, mode: int = SOCKET_MODE) -> socket.socket:
    """A listening unix socket at ``path`` with ``mode``; a stale socket there is replaced.

    A socket file nobody listens on is what a killed daemon leaves behind; a live one means
    another daemon serves there, and any other kind of file is not ours to remove.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise SocketInUse(f"{path} exists and is not a socket; remove it or choose another "
                              "--socket path")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # nobody listens: a stale socket
        else:
            raise SocketInUse(f"{path}: another process already serves on this socket "
                              "(a second gpudiag serve?)")
        finally:
            probe.close()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(path)
        # After bind: until then the umask decides, which only ever narrows the mode.
        os.chmod(path, mode)
        listener.listen(1024)
        listener.setblocking(False)
    except OSError:
        listener.close()
        raise
    return listener


def error_response(status: int, code: str, message: str) -> bytes:
    """A complete HTTP response carrying the JSON error envelope (503: retry after 1 s)."""
    return wire_bytes(*envelope.error_response(status, code, message,
                                               retry_after_s=1 if status == 503 else None))


@dataclass
class _Conn:
    sock: socket.socket
    peer: str
    deadline: float
    buf: bytearray = field(default_factory=bytearray)
    out: memoryview | None = None
    reader: RequestReader = field(default_factory=RequestReader)
    # With the selector: unregistering a socket that is not raises KeyError with the socket's
    # repr (about 10 us), which every answer sent at once used to pay.
    registered: bool = False
    # On the unix socket: who connected, as the kernel recorded it (None over TCP).
    creds: PeerCredentials | None = None
    # The descriptors passed with its first bytes (None: not read yet, or TCP).
    fds: tuple[int, ...] | None = None


class _Pool:
    """A worker pool with a bounded number of requests running or queued."""

    def __init__(self, name: str, workers: int, queued: int) -> None:
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self._slots = threading.BoundedSemaphore(workers + queued)

    def submit(self, fn: Callable[[], None]) -> bool:
        if not self._slots.acquire(blocking=False):
            return False

        def run() -> None:
            try:
                fn()
            finally:
                self._slots.release()

        try:
            self._executor.submit(run)
        except RuntimeError:  # shut down
            self._slots.release()
            return False
        return True

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class HttpServer:
    """Serves a WSGI app on one address; ``serve_forever`` in a thread, ``shutdown`` to stop.

    Workers only run the app; reading heads and writing responses happen on the selector
    thread without blocking, so a client that never reads cannot hold a worker either.
    """

    def __init__(self, app: WsgiApp, host: str, port: int, *,
                 head_timeout_s: float = HEAD_TIMEOUT_S,
                 write_timeout_s: float = WRITE_TIMEOUT_S, max_pending: int = MAX_PENDING,
                 workers: int = WORKERS, max_queued: int = MAX_QUEUED,
                 max_connections: int = MAX_CONNECTIONS,
                 abuse: AbuseLog | None = None, unix_path: str | None = None,
                 unix_mode: int = SOCKET_MODE, read_only: bool = False) -> None:
        self.app = app
        # Asked on the selector thread first: it must never wait (DaemonApp.answer_now).
        self._answer_now: AnswerNow | None = getattr(app, "answer_now", None)
        self.read_only = read_only
        self.unix_path = unix_path
        self.max_connections = max_connections
        self.open_connections = 0
        self._accept_resume: float | None = None
        self.head_timeout_s = head_timeout_s
        self.write_timeout_s = write_timeout_s
        self.max_pending = max_pending
        self.abuse = abuse or AbuseLog()
        if unix_path is not None:
            self._listen = bind_unix(unix_path, unix_mode)
            self._unix_inode: int | None = os.stat(unix_path).st_ino
            self.server_address: tuple[Any, ...] = (unix_path, 0)
            # No browser reaches a unix socket: no DNS-rebinding Host check there.
            self.loopback = False
        else:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            self._listen = socket.socket(family, socket.SOCK_STREAM)
            try:
                self._listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                self._listen.bind((host, port))
                self._listen.listen(1024)
                self._listen.setblocking(False)
            except OSError:
                self._listen.close()
                raise
            self._unix_inode = None
            self.server_address = self._listen.getsockname()
            self.loopback = _is_loopback(host)
        self._held_fds = 0  # passed descriptors held by open connections (selector thread)
        self._pending: dict[int, _Conn] = {}   # reading a head, oldest first
        self._writing: dict[int, _Conn] = {}   # writing a response, oldest first
        self._outbox: queue.SimpleQueue[tuple[_Conn, bytes]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._fast = _Pool("http", workers, max_queued)
        self._slow = _Pool("http-wait", workers, max_queued)
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._sel = selectors.DefaultSelector()

    def describe(self) -> str:
        """Where this server listens, for messages: ``unix:PATH`` or ``HOST:PORT``."""
        if self.unix_path is not None:
            return f"unix:{self.unix_path}"
        host = str(self.server_address[0])
        return f"{f'[{host}]' if ':' in host else host}:{self.server_address[1]}"

    @property
    def serving(self) -> bool:
        """False once ``serve_forever`` has ended (after ``shutdown``, or by a failure)."""
        return not self._stopped.is_set()

    @property
    def pending(self) -> int:
        """Connections still sending their request head."""
        return len(self._pending)

    def serve_forever(self, poll_interval: float = IDLE_WAKE_S) -> None:
        """Accept, read heads, dispatch and write responses until ``shutdown``.

        The loop sleeps until an event (a connection, data, a worker's answer through the
        wake socket, ``shutdown``) or its next deadline (``_next_wake_s``), at most
        ``poll_interval``: an idle daemon's selector no longer wakes five times a second.
        """
        self._sel.register(self._listen, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, self._wake_r)
        try:
            while not self._stop.is_set():
                for key, _ in self._sel.select(timeout=self._next_wake_s(poll_interval)):
                    self._guarded(self._event, key)
                self._guarded(self._housekeeping)
        except Exception:
            # The selector itself failed: said here (with the traceback); the daemon sees
            # ``serving`` go False and exits so that it is restarted.
            log.critical("http: the serving loop on %s ended by an error", self.describe(),
                         exc_info=True)
        finally:
            for conn in [*self._pending.values(), *self._writing.values()]:
                self._drop(conn)
            self._sel.close()
            self._stopped.set()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop serving; requests still running in workers are dropped."""
        self._stop.set()
        self._wake()
        self._stopped.wait(timeout_s)
        self._listen.close()
        self._remove_socket_file()
        self._fast.shutdown()
        self._slow.shutdown()
        self._wake_r.close()
        self._wake_w.close()

    def server_close(self) -> None:
        self._listen.close()
        self._remove_socket_file()

    def _remove_socket_file(self) -> None:
        # Only our own socket: a successor may already have replaced it.
        if self.unix_path is None or self._unix_inode is None:
            return
        try:
            if os.lstat(self.unix_path).st_ino == self._unix_inode:
                os.unlink(self.unix_path)
        except OSError:
            pass
        self._unix_inode = None

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:  # full (the loop will wake anyway) or closed
            pass

    # -- selector thread -----------------------------------------------------------------
    def _guarded(self, step: Callable[..., None], *args: Any) -> None:
        """Run one step of the loop; a bug in it costs that connection, never the listener.

        An exception that escaped here used to end ``serve_forever`` while the process lived
        on, kept the port and answered nothing. It is logged with its traceback, counted in
        ``gpudiag_http_rejected_total{reason="internal"}``, and the connection it concerned
        is closed; the loop goes on.
        """
        try:
            step(*args)
        except Exception:
            data = getattr(args[0], "data", None) if args else None
            conn = data if isinstance(data, _Conn) else None
            peer = conn.peer if conn is not None else "-"
            # The traceback the first few times; after that a persistent bug is only counted
            # (and summarised by the AbuseLog), never a flood of tracebacks.
            if self.abuse.totals.get("internal", 0) < MAX_INTERNAL_TRACEBACKS:
                log.exception("http: internal error in the serving loop (from %s); the "
                              "connection is closed and the listener goes on", peer)
            self.abuse.note("internal", peer)
            if conn is not None:
                with contextlib.suppress(Exception):
                    self._drop(conn)

    def _event(self, key: selectors.SelectorKey) -> None:
        if key.data is None:
            self._accept()
        elif key.data is self._wake_r:
            self._drain_outbox()
        elif key.data.out is not None:
            self._write(key.data)
        else:
            self._read(key.data)

    def _next_wake_s(self, longest_s: float) -> float:
        """Seconds until the first thing ``_housekeeping`` must do, at most ``longest_s``.

        Every deadline it keeps: the oldest head still arriving and the oldest response still
        being taken (each dict is in deadline order), the accept pause after EMFILE and the
        abuse summary. Only this thread adds to them, so none appears while it sleeps.
        """
        now = time.monotonic()
        due = [longest_s]
        for conns in (self._pending, self._writing):
            if conns:
                due.append(next(iter(conns.values())).deadline - now)
        if self._accept_resume is not None:
            due.append(self._accept_resume - now)
        summary = self.abuse.summary_in_s()
        if summary is not None:
            due.append(summary)
        return max(0.0, min(due))

    def _housekeeping(self) -> None:
        self._expire()
        self.abuse.flush()
        if self._accept_resume is not None and time.monotonic() >= self._accept_resume:
            self._accept_resume = None
            self._sel.register(self._listen, selectors.EVENT_READ, None)

    def _accept(self) -> None:
        for _ in range(256):
            try:
                sock, addr = self._listen.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                # EMFILE and friends: the listener stays readable, so pause instead of spinning.
                log.debug("accept failed: %s", e)
                self._sel.unregister(self._listen)
                self._accept_resume = time.monotonic() + ACCEPT_PAUSE_S
                return
            sock.setblocking(False)
            creds = self._creds(sock)
            peer = (f"unix pid {creds.pid} uid {creds.uid}" if creds is not None
                    else "unix" if self.unix_path is not None else self._peer(addr))
            if self.open_connections >= self.max_connections:
                if not self._pending:  # everyone has sent a request: the newcomer waits
                    self.abuse.note("connection_cap", peer)
                    sock.close()
                    continue
                oldest = next(iter(self._pending.values()))
                self.abuse.note("connection_cap", oldest.peer)
                self._drop(oldest)
            elif len(self._pending) >= self.max_pending:
                # Slowloris defence: the connection that has waited longest gives way, so a
                # client that sends its request promptly is still served.
                oldest = next(iter(self._pending.values()))
                self.abuse.note("connection_cap", oldest.peer)
                self._drop(oldest)
            conn = _Conn(sock, peer, time.monotonic() + self.head_timeout_s, creds=creds)
            self.open_connections += 1
            self._pending[sock.fileno()] = conn
            self._sel.register(sock, selectors.EVENT_READ, conn)
            conn.registered = True

    def _creds(self, sock: socket.socket) -> PeerCredentials | None:
        """On the unix socket, the client's credentials as the kernel recorded them."""
        if self.unix_path is None:
            return None
        try:
            return peer_credentials(sock)
        except OSError:
            return None

    @staticmethod
    def _peer(addr: Any) -> str:
        """A TCP client for logs: its address."""
        return str(addr[0]) if isinstance(addr, tuple) else str(addr)

    def _receive(self, conn: _Conn) -> bytes:
        """The next bytes of a request; the first read of a unix-socket client takes the
        descriptors passed with them too (close-on-exec: probe children never inherit
        them), within MAX_PASSED_FDS and MAX_HELD_FDS."""
        if conn.creds is None or conn.fds is not None:
            return conn.sock.recv(65536)
        data, ancillary, _flags, _addr = conn.sock.recvmsg(
            65536, socket.CMSG_SPACE(MAX_PASSED_FDS * 4), socket.MSG_CMSG_CLOEXEC)
        fds = [fd for level, kind, raw in ancillary
               if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS
               for fd in array.array("i", raw[:len(raw) - len(raw) % 4])]
        room = max(0, MAX_HELD_FDS - self._held_fds)
        for fd in fds[room:]:
            os.close(fd)
        conn.fds = tuple(fds[:room])
        self._held_fds += len(conn.fds)
        return data

    def _read(self, conn: _Conn) -> None:
        try:
            data = self._receive(conn)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        if not data:
            self._drop(conn)
            return
        conn.buf += data
        try:
            request = self._complete(conn)
        except BadRequest as e:
            self.abuse.note(e.kind, conn.peer)
            self._answer_and_drop(conn, error_response(e.status, e.code, e.message))
            return
        if request is not None:
            self._dispatch(conn, request)

    def _complete(self, conn: _Conn) -> Request | None:
        return conn.reader.feed(bytes(conn.buf))

    def _dispatch(self, conn: _Conn, request: Request) -> None:
        self._forget(conn)
        conn.buf = bytearray()
        refusal = cross_site(request, self.loopback)
        if refusal is not None:
            self.abuse.note("cross_site", conn.peer)
            self._answer_and_drop(conn, error_response(403, "cross_site_request", refusal))
            return
        if self.read_only:
            refusal = read_only_refusal(request, self.describe())
            if refusal is not None:
                self.abuse.note("read_only", conn.peer)
                self._answer_and_drop(conn, error_response(403, "read_only", refusal))
                return
        path = request.target.partition("?")[0]
        if self._answer_now is not None and path in SLOW_PATHS:
            # A cached answer costs tens of microseconds here, against the same again and a
            # thread wake or two for each hand-off to a worker and back.
            data = self._run_app(conn, request, self._answer_now)
            if data is not None:
                self._start_write(conn, data)
                return
        pool = self._slow if path in SLOW_PATHS else self._fast
        if not pool.submit(lambda: self._handle(conn, request)):
            self.abuse.note("busy", conn.peer)
            self._answer_and_drop(conn, error_response(503, "busy",
                                                       "every worker is busy; retry"))

    def _drain_outbox(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            return
        while True:
            try:
                conn, data = self._outbox.get_nowait()
            except queue.Empty:
                return
            self._start_write(conn, data)

    def _start_write(self, conn: _Conn, data: bytes) -> None:
        """Send what the socket takes now; a slow reader's remainder waits for the selector."""
        if conn.sock.fileno() < 0:  # closed meanwhile (shutdown)
            return
        conn.out = memoryview(data)
        if not self._write(conn):
            return  # all sent (or the client went): closed already
        if len(self._writing) >= self.max_pending:
            oldest = next(iter(self._writing.values()))
            self.abuse.note("client_gone", oldest.peer)
            self._drop(oldest)
        conn.deadline = time.monotonic() + self.write_timeout_s
        self._writing[conn.sock.fileno()] = conn
        try:
            self._sel.register(conn.sock, selectors.EVENT_WRITE, conn)
        except (ValueError, OSError):  # closed meanwhile
            self._writing.pop(conn.sock.fileno(), None)
            self._close(conn)
            return
        conn.registered = True

    def _write(self, conn: _Conn) -> bool:
        """Send without blocking; whether some of the answer is still to send."""
        assert conn.out is not None
        try:
            sent = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            self.abuse.note("client_gone", conn.peer)
            self._drop(conn)
            return False
        conn.out = conn.out[sent:]
        if len(conn.out):
            return True
        try:
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        self._drop(conn)
        return False

    def _expire(self) -> None:
        now = time.monotonic()
        for conn in list(self._pending.values()):
            if conn.deadline > now:
                break  # insertion order is deadline order
            self.abuse.note("slow_client", conn.peer)
            self._answer_and_drop(conn, error_response(
                408, "request_timeout",
                f"no complete request within {self.head_timeout_s:g} s"))
        for conn in list(self._writing.values()):
            if conn.deadline > now:
                break
            self.abuse.note("client_gone", conn.peer)
            self._drop(conn)

    def _forget(self, conn: _Conn) -> None:
        fd = conn.sock.fileno()
        self._pending.pop(fd, None)
        self._writing.pop(fd, None)
        if not conn.registered:
            return
        conn.registered = False
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass

    def _close(self, conn: _Conn) -> None:
        # Every client socket is closed here, on the selector thread: the count stays exact.
        if conn.sock.fileno() >= 0:
            self.open_connections -= 1
            conn.sock.close()
        if conn.fds:
            fds, conn.fds = conn.fds, ()
            self._held_fds -= len(fds)
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _drop(self, conn: _Conn) -> None:
        self._forget(conn)
        self._close(conn)

    def _answer_and_drop(self, conn: _Conn, data: bytes) -> None:
        # Best effort and never blocking: an error answer is small enough for the socket
        # buffer, and a client that does not read it is not waited for.
        self._forget(conn)
        try:
            conn.sock.send(data)
        except OSError:
            pass
        self._close(conn)

    # -- worker threads ------------------------------------------------------------------
    def _handle(self, conn: _Conn, request: Request) -> None:
        data = self._run_app(conn, request, self.app)
        assert data is not None  # a WSGI app always answers
        self._outbox.put((conn, data))
        self._wake()

    def _run_app(self, conn: _Conn, request: Request, app: AnswerNow) -> bytes | None:
        """The app's answer as response bytes (None: ``answer_now`` declined)."""
        path, _, query = request.target.partition("?")
        environ: dict[str, Any] = {
            "REQUEST_METHOD": request.method, "PATH_INFO": unquote(path, "latin-1"),
            "QUERY_STRING": query, "SERVER_PROTOCOL": request.version,
            "SERVER_NAME": str(self.server_address[0]),
            "SERVER_PORT": str(self.server_address[1]), "REMOTE_ADDR": conn.peer,
            "SCRIPT_NAME": "", "CONTENT_LENGTH": "", "CONTENT_TYPE": "",
            "wsgi.version": (1, 0), "wsgi.url_scheme": "http",
            "wsgi.input": io.BytesIO(request.body), "wsgi.errors": sys.stderr,
            "wsgi.multithread": True, "wsgi.multiprocess": False, "wsgi.run_once": False,
            # The kernel's word on who asks (unix socket only): attested runs (daemon/runs.py).
            PEER_KEY: conn.creds, PEER_PIDFD_KEY: functools.partial(peer_pidfd, conn.sock),
            PEER_FDS_KEY: conn.fds or (),
        }
        for name, value in request.headers:
            if name == "content-length":
                environ["CONTENT_LENGTH"] = value
            elif name == "content-type":
                environ["CONTENT_TYPE"] = value
            else:
                key = "HTTP_" + name.upper().replace("-", "_")
                environ[key] = f"{environ[key]},{value}" if key in environ else value
        started: dict[str, Any] = {}

        def start_response(status: str, headers: list[tuple[str, str]],
                           exc_info: Any = None) -> Callable[[bytes], None]:
            started["status"], started["headers"] = status, headers
            return lambda _data: None

        try:
            answer = app(environ, start_response)
            if answer is None:
                return None
            body = b"".join(answer)
        except Exception:  # the app's bug: still the envelope, never a hung connection
            log.exception("request failed: %s %s", request.method, path)
            return error_response(500, "internal",
                                  "gpudiag failed to answer; see the daemon log")
        return wire_bytes(started.get("status", status_line(500)), started.get("headers", []),
                          body)


def register_metrics(app: object, abuse: AbuseLog) -> None:
    """Expose the rejection counters on the app's registry, when it has one."""
    registry = getattr(app, "registry", None)
    if registry is not None:
        registry.register(AbuseCollector(abuse))


def start(app: WsgiApp, host: str, port: int, *, register: bool = True, **options: Any
          ) -> tuple[HttpServer, threading.Thread]:
    """Bind and serve in a background thread; returns the server and its thread.

    ``register=False`` for a second listener that shares the first one's AbuseLog (the
    counters are on the app's registry once).
    """
    server = HttpServer(app, host, port, **options)
    if register:
        register_metrics(app, server.abuse)
    name = "http-unix" if server.unix_path is not None else "http"
    thread = threading.Thread(target=server.serve_forever, name=name, daemon=True)
    thread.start()
    return server, thread

