"""The daemon's wire: its URL, who may answer, and one HTTP GET as bytes, without dataclasses.

``gpudiag.engine.client`` reads these answers into typed verdicts; the console entry's fast
path (``gpudiag.cli.entry``) prints a daemon-answered verdict from them directly. Neither
``http.client`` (email, ssl) nor ``urllib.parse`` (ipaddress) nor ``dataclasses`` nor even
``socket`` (its enums; the C module ``_socket`` does) is imported on the unix-socket path:
each costs a daemon-answered CLI call more than the answer itself (docs/benchmarks.md, "CLI
start").

The daemon is reached on its unix socket by default (``unix:PATH``), and an answer there is
trusted only from a peer running as the daemon's user (SO_PEERCRED): any local user can bind
a free TCP port and answer, but not run as that user. ``http://HOST:PORT`` stays accepted
(an explicit choice, e.g. a daemon on another address), without a peer check.
"""

from __future__ import annotations

import _socket  # not ``socket``: see connect
import os
import pwd
import re
import stat
from collections.abc import Mapping, Sequence

from gpudiag.core.ascii_ints import ascii_int
from gpudiag.core.limits import DEFAULT_PORT
from gpudiag.core.peercred import peer_credentials
from gpudiag.core.visibility import VISIBILITY_VARIABLES

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


class DaemonAddress:
    """Where the daemon listens: a unix socket path, or a TCP host and port.

    A plain class with slots rather than a frozen dataclass: the daemon-answered CLI call
    parses its URL, and importing dataclasses would cost it more than the answer (7 ms).
    """

    __slots__ = ("url", "socket_path", "host", "port", "prefix")

    def __init__(self, url: str, *, socket_path: str | None = None, host: str = "",
                 port: int = 0, prefix: str = "") -> None:
        self.url = url
        self.socket_path = socket_path
        self.host = host
        self.port = port
        self.prefix = prefix

    def __repr__(self) -> str:
        return (f"DaemonAddress(url={self.url!r}, socket_path={self.socket_path!r}, "
                f"host={self.host!r}, port={self.port}, prefix={self.prefix!r})")


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


def connect(address: DaemonAddress, env: Mapping[str, str], timeout_s: float
             ) -> tuple[_socket.socket | None, str, bool]:
    """A connected socket to a trusted daemon, or None with why (and whether refused).

    The unix socket is the C module's (``_socket``, which ``socket.socket`` extends):
    importing ``socket`` costs a daemon-answered CLI call about 2 ms (it builds enums of
    every constant), and this path needs nothing it adds."""
    url = address.url
    if address.socket_path is None:
        import socket  # TCP: its name resolution (create_connection)

        try:
            tcp = socket.create_connection((address.host, address.port), timeout=timeout_s)
        except OSError as e:
            return None, f"no daemon at {url}: {e.strerror or e}", False
        return tcp, "", False
    configured = configured_daemon_user(env)  # a typo is an error even with no daemon up
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
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


def visibility_params(env: Mapping[str, str]) -> dict[str, str]:
    """The job's own CUDA_/NVIDIA_VISIBLE_DEVICES as the daemon's parameters: it answers for
    what the job will see, not for what the daemon sees."""
    return {name.lower(): env[name] for name in VISIBILITY_VARIABLES if name in env}


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


# One answer of the daemon as bytes: (status, body, why there is none, refused); status None
# when there is no answer, refused True when something answered but not as the daemon's user.
RawReply = tuple[int | None, bytes, str, bool]


def get(url: str, endpoint: str, params: Mapping[str, str], *, env: Mapping[str, str],
        connect_timeout_s: float = CONNECT_TIMEOUT_S, read_timeout_s: float = 60.0
        ) -> RawReply:
    """GET ``endpoint?params`` of the daemon at ``url``: its status and body bytes.

    On a unix socket the peer must run as the daemon's user, or its answer is refused
    before the question is even sent. DaemonUrlError for a URL that is not understood.
    """
    return request(url, "GET", endpoint, params, env=env, connect_timeout_s=connect_timeout_s,
                   read_timeout_s=read_timeout_s)


def request(url: str, method: str, endpoint: str, params: Mapping[str, str], *,
            env: Mapping[str, str], body: bytes = b"",
            connect_timeout_s: float = CONNECT_TIMEOUT_S, read_timeout_s: float = 60.0,
            fds: Sequence[int] = ()) -> RawReply:
    """``method endpoint?params`` (with ``body``) to the daemon at ``url``, as ``get``;
    ``fds``: descriptors passed with the request (SCM_RIGHTS; a unix socket only, else the
    request is not sent)."""
    address = parse_daemon_url(url)
    path = f"{address.prefix}{endpoint}?{query_string(params)}"
    if fds and address.socket_path is None:
        return None, b"", f"descriptors cannot be passed to {url}: not a unix socket", False
    sock, why, refused = connect(address, env, connect_timeout_s)
    if sock is None:
        return None, b"", why, refused
    # Host for a unix socket: "localhost", a name the daemon's HTTP checks accept.
    host = address.host or "localhost"
    if ":" in host:
        host = f"[{host}]"  # an IPv6 literal, as in its URL
    if address.port:
        host = f"{host}:{address.port}"
    sock.settimeout(read_timeout_s)
    try:
        status, data = exchange(sock, host, path, method, body, fds)
    except (OSError, ValueError) as e:
        return None, b"", f"daemon at {url} did not answer: {e}", False
    finally:
        sock.close()
    return status, data, "", False


def exchange(sock: _socket.socket, host: str, path: str, method: str = "GET",
             body: bytes = b"", fds: Sequence[int] = ()) -> tuple[int, bytes]:
    """One request on a connected socket: (status, body); ValueError for an answer not
    HTTP. ``fds`` go with the request's first bytes (SCM_RIGHTS), where the daemon reads
    them: the kernel's own copies of the sender's open files (daemon/runs.py)."""
    if _UNSAFE.search(path) or _UNSAFE.search(host):
        raise ValueError(f"the request target {path!r} holds spaces or control characters")
    sized = f"Content-Length: {len(body)}\r\n" if body or method != "GET" else ""
    request = (f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nAccept: application/json\r\n"
               f"Accept-Encoding: identity\r\n{sized}Connection: close\r\n\r\n"
               .encode("ascii") + body)
    sent = 0
    if fds:  # a run's begin only: ``socket`` stays off the daemon-answered call's path
        import socket

        sent = socket.send_fds(sock, [request], list(fds))  # type: ignore[arg-type]
    sock.sendall(request[sent:])
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
