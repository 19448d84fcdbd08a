"""The daemon client: ask the local daemon for a verdict (short connect timeout).

engine/route.py falls back to inline probes when no daemon answers. The verdict says where it
came from (``source: daemon``) and how old it is (``age_s``).
The job's own CUDA_/NVIDIA_VISIBLE_DEVICES travel with the question, so the daemon answers for
what the job will see, not for what the daemon sees.

The daemon is reached on its unix socket by default (``unix:PATH``), and an answer there is
trusted only from a peer running as the daemon's user (SO_PEERCRED): any local user can bind
a free TCP port and answer, but not run as that user. ``http://HOST:PORT`` stays accepted
(an explicit choice, e.g. a daemon on another address), without a peer check.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import socket
import stat
from collections.abc import Mapping
from dataclasses import dataclass, replace

from gpudiag.core.limits import DEFAULT_PORT
from gpudiag.core.numbers import ascii_int
from gpudiag.core.peercred import peer_credentials
from gpudiag.core.verdict import RecordError, Requirement, Verdict

# typing.TYPE_CHECKING without importing typing (the daemon-answered CLI call never needs it).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

# The daemon's socket under systemd (RuntimeDirectory=gpudiag/daemon) and in the Kubernetes
# DaemonSet (a hostPath folder). Its own folder: /run/gpudiag/locks belongs to `gpudiag run`,
# and systemd removes a RuntimeDirectory when the service stops.
DEFAULT_SOCKET = "/run/gpudiag/daemon/gpudiag.sock"
DEFAULT_URL = f"unix:{DEFAULT_SOCKET}"
TCP_URL = f"http://127.0.0.1:{DEFAULT_PORT}"
CONNECT_TIMEOUT_S = 0.25
MAX_ANSWER_BYTES = 64 * 2**20
# The status line and the one header the client reads. The exchange is written here rather
# than with http.client, whose imports (email, ssl, ...) cost a daemon-answered CLI call more
# than the answer itself; one request per connection, framed by Content-Length or the close.
_STATUS = re.compile(rb"HTTP/1\.[01] ([0-9]{3})(?: [^\r\n]*)?\r\n")
_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*([0-9]{1,12})[ \t]*\r\n", re.IGNORECASE)
_UNSAFE = re.compile(r"[\x00-\x20\x7f]")
_CHUNKED = re.compile(rb"\r\ntransfer-encoding:", re.IGNORECASE)
ACCEPTED = f"unix:/ABSOLUTE/PATH (e.g. {DEFAULT_URL}) or http://HOST:PORT (e.g. {TCP_URL})"


class DaemonUrlError(ValueError):
    """A daemon URL that is neither unix:PATH nor http://HOST:PORT."""


class DaemonUserError(DaemonUrlError):
    """GPUDIAG_DAEMON_USER names no user of this host."""


@dataclass(frozen=True)
class DaemonAnswer:
    """Why the daemon was not used, when it was not (for logs and --verbose output)."""

    verdict: Verdict | None
    reason: str
    url: str = ""
    refused: bool = False  # something answered, but not as the daemon's user

    def fallback(self, verdict: Verdict) -> Verdict:
        """The inline verdict with why the daemon was not used in its evidence."""
        if self.verdict is not None or not self.url:
            return verdict
        note = {"url": self.url, "used": False, "refused": self.refused, "reason": self.reason}
        return replace(verdict, evidence={**verdict.evidence, "daemon": note})


@dataclass(frozen=True)
class DaemonAddress:
    """Where the daemon listens: a unix socket path, or a TCP host and port."""

    url: str
    socket_path: str | None = None
    host: str = ""
    port: int = 0
    prefix: str = ""


def default_url(env: Mapping[str, str] | None = None) -> str:
    """GPUDIAG_DAEMON_URL, else the daemon's unix socket (never a TCP fallback)."""
    environ = os.environ if env is None else env
    return environ.get("GPUDIAG_DAEMON_URL") or DEFAULT_URL


def parse_daemon_url(url: str) -> DaemonAddress:
    """``unix:/path``, ``unix:///path`` or ``http://HOST[:PORT][/prefix]``; else DaemonUrlError."""
    if url.startswith("unix:"):
        path = url[len("unix:"):]
        if path.startswith("//"):
            path = path[2:]
        if not path.startswith("/") or "\0" in path or len(path.encode()) > 107:
            raise DaemonUrlError(f"daemon URL {url!r}: the socket path must be absolute and "
                                 f"at most 107 bytes; accepted: {ACCEPTED}")
        return DaemonAddress(url, socket_path=path)
    from urllib.parse import urlsplit  # only here: it imports ipaddress (1-2 ms a CLI call)

    try:
        parts = urlsplit(url)
        port, hostname = parts.port, parts.hostname
    except ValueError:  # "http://[::1" (unclosed bracket), a port that is not a number
        raise DaemonUrlError(f"daemon URL {url!r} is not understood; accepted: "
                             f"{ACCEPTED}") from None
    if parts.scheme != "http" or not hostname:
        raise DaemonUrlError(f"daemon URL {url!r} is not understood; accepted: {ACCEPTED}")
    return DaemonAddress(url, host=hostname, port=port or DEFAULT_PORT,
                         prefix=parts.path.rstrip("/"))


def _split(url: str) -> tuple[str, int, str]:
    address = parse_daemon_url(url)
    return address.host, address.port, address.prefix


def configured_daemon_user(env: Mapping[str, str]) -> tuple[int, str] | None:
    """GPUDIAG_DAEMON_USER (a name or uid) as (uid, where from); None when unset."""
    raw = (env.get("GPUDIAG_DAEMON_USER") or "").strip()
    if not raw:
        return None
    uid = ascii_int(raw)
    if uid is not None:
        return uid, f"GPUDIAG_DAEMON_USER={raw}"
    try:
        return pwd.getpwnam(raw).pw_uid, f"GPUDIAG_DAEMON_USER={raw}"
    except KeyError:
        raise DaemonUserError(f"GPUDIAG_DAEMON_USER={raw!r} is no user on this host; give "
                              "the user name or uid the gpudiag daemon runs as") from None


def socket_folder_owner(socket_path: str) -> tuple[int, str]:
    """The owner of the socket's folder, the daemon's user by default, and where from.

    Trusted only when that folder's parent may be written by root or that owner alone (as
    /run/gpudiag): otherwise anyone could have made the folder, and would own it.
    """
    folder = os.path.dirname(socket_path) or "/"  # absolute: parse_daemon_url checked it
    parent_folder = os.path.dirname(folder) or "/"
    st = os.stat(folder)
    parent = os.stat(parent_folder)
    if parent.st_uid not in (0, st.st_uid) or parent.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(f"the owner of {folder} (uid {st.st_uid}) is not trusted as the "
                              f"daemon's user: its parent {parent_folder} may be written by "
                              "others; set GPUDIAG_DAEMON_USER to the daemon's user")
    return st.st_uid, f"the owner of {folder}"


def _connect(address: DaemonAddress, env: Mapping[str, str], timeout_s: float
             ) -> tuple[socket.socket | None, str, bool]:
    """A connected socket to a trusted daemon, or None with why (and whether refused)."""
    url = address.url
    if address.socket_path is None:
        try:
            tcp = socket.create_connection((address.host, address.port), timeout=timeout_s)
        except OSError as e:
            return None, f"no daemon at {url}: {e.strerror or e}", False
        return tcp, "", False
    configured = configured_daemon_user(env)  # a typo is an error even with no daemon up
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(address.socket_path)
    except OSError as e:
        sock.close()
        return None, f"no daemon at {url}: {e.strerror or e}", False
    try:
        peer = peer_credentials(sock)
        want, why = configured or socket_folder_owner(address.socket_path)
    except OSError as e:
        sock.close()
        return None, f"refused the answer at {url}: cannot check who answers: {e}", True
    if peer.uid != want:
        sock.close()
        return None, (f"refused the answer at {url}: the peer runs as uid {peer.uid} "
                      f"(pid {peer.pid}), "
                      f"not as the daemon's user, uid {want} ({why}); if the daemon runs as "
                      "another user, set GPUDIAG_DAEMON_USER"), True
    return sock, "", False


def query_for(requirement: Requirement, env: Mapping[str, str],
              max_age_s: float | None = None) -> dict[str, str]:
    """The /v1/preflight parameters for a requirement and the job's visibility variables."""
    q = {"require": ",".join(b.spec() for b in requirement.backends), "visibility": "1"}
    if requirement.devices is not None:
        q["devices"] = ",".join(requirement.devices)
    # The node-health question (GET /v1/health) takes no counts or memory floors.
    if requirement.min_devices is not None and not requirement.node_health:
        q["min_devices"] = str(requirement.min_devices)
    if requirement.min_free_memory_bytes is not None and not requirement.node_health:
        q["min_free_memory"] = str(requirement.min_free_memory_bytes)
    if requirement.gpus is not None:
        q["gpus"] = str(requirement.gpus)
    if max_age_s is not None:
        q["max_age_s"] = f"{max_age_s:g}"
    for name in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
        if name in env:
            q[name.lower()] = env[name]
    return q


# RFC 3986's unreserved bytes: everything else in a query value is percent-encoded.
_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")


def query_string(params: Mapping[str, str]) -> str:
    """``k=v&...`` with every byte but the unreserved ones as %XX (what parse_qsl undoes).

    Written here rather than with urllib.parse.urlencode: importing urllib.parse costs a
    daemon-answered CLI call 1-2 ms (it imports ipaddress), more than the answer itself.
    """
    return "&".join(f"{_percent(k)}={_percent(v)}" for k, v in params.items())


def _percent(text: str) -> str:
    return "".join(chr(b) if b in _UNRESERVED else f"%{b:02X}" for b in text.encode())


@dataclass(frozen=True)
class DaemonReply:
    """One JSON answer of the daemon: the status and body, or None with why there is none."""

    status: int | None
    data: Any  # the parsed JSON body
    why: str
    refused: bool = False


def daemon_get(url: str, endpoint: str, params: Mapping[str, str], *,
               env: Mapping[str, str] | None = None,
               connect_timeout_s: float = CONNECT_TIMEOUT_S,
               read_timeout_s: float = 60.0) -> DaemonReply:
    """GET ``endpoint?params`` of the daemon at ``url`` and read its JSON answer.

    On a unix socket the peer must run as the daemon's user, or its answer is refused
    before the question is even sent.
    """
    address = parse_daemon_url(url)
    environ = os.environ if env is None else env
    path = f"{address.prefix}{endpoint}?{query_string(params)}"
    sock, why, refused = _connect(address, environ, connect_timeout_s)
    if sock is None:
        return DaemonReply(None, None, why, refused)
    # Host for a unix socket: "localhost", a name the daemon's HTTP checks accept.
    host = address.host or "localhost"
    if ":" in host:
        host = f"[{host}]"  # an IPv6 literal, as in its URL
    if address.port:
        host = f"{host}:{address.port}"
    sock.settimeout(read_timeout_s)
    try:
        status, body = _exchange(sock, host, path)
    except (OSError, ValueError) as e:
        return DaemonReply(None, None, f"daemon at {url} did not answer: {e}")
    finally:
        sock.close()
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return DaemonReply(None, None, f"daemon at {url} answered {status} without JSON")
    if status != 200:
        err = data.get("error") if isinstance(data, dict) else None
        err = err if isinstance(err, dict) else {}
        return DaemonReply(status, data, f"daemon at {url} answered {status} "
                           f"{err.get('code')}: {err.get('message')}")
    return DaemonReply(status, data, "daemon")


def ask_daemon(url: str, requirement: Requirement, *, env: Mapping[str, str] | None = None,
               connect_timeout_s: float = CONNECT_TIMEOUT_S, read_timeout_s: float = 60.0,
               max_age_s: float | None = None) -> DaemonAnswer:
    """The daemon's verdict, or None with the reason (not listening, not ready, bad answer)."""
    environ = os.environ if env is None else env
    # The node-health question has its own endpoint; job readiness is /v1/preflight.
    endpoint = "/v1/health" if requirement.node_health else "/v1/preflight"
    reply = daemon_get(url, endpoint, query_for(requirement, environ, max_age_s), env=environ,
                       connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s)
    if reply.status != 200:
        return DaemonAnswer(None, reply.why, url, reply.refused)
    try:
        return DaemonAnswer(Verdict.from_record(reply.data), "daemon", url)
    except RecordError as e:
        return DaemonAnswer(None, f"daemon at {url} sent an unusable verdict: {e}", url)


def _exchange(sock: socket.socket, host: str, path: str) -> tuple[int, bytes]:
    """One GET on a connected socket: (status, body); ValueError for an answer not HTTP."""
    if _UNSAFE.search(path) or _UNSAFE.search(host):
        raise ValueError(f"the request target {path!r} holds spaces or control characters")
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nAccept: application/json\r\n"
                 "Accept-Encoding: identity\r\nConnection: close\r\n\r\n".encode("ascii"))
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk or len(data) > 65536:
            raise ValueError("the connection closed before a complete HTTP answer head"
                             if not chunk else "the HTTP answer head is too large")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    head += b"\r\n"
    status = _STATUS.match(head)
    if status is None:
        raise ValueError(f"not an HTTP answer: {head[:60]!r}")
    if _CHUNKED.search(head):
        raise ValueError("a Transfer-Encoding answer to a one-shot request")
    length = _LENGTH.search(head)
    want = int(length.group(1)) if length else MAX_ANSWER_BYTES
    if want > MAX_ANSWER_BYTES:
        raise ValueError(f"an answer of {want} bytes (at most {MAX_ANSWER_BYTES})")
    chunks = [body]
    got = len(body)
    while got < want:
        chunk = sock.recv(min(1 << 20, want - got))
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    body = b"".join(chunks)[:want]
    if length is not None and len(body) < want:
        raise ValueError(f"the connection closed after {len(body)} of {want} bytes")
    return int(status.group(1)), body
