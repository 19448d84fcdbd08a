"""Request heads and bodies parsed by h11, under gpudiag's own limits and policy.

h11 (a sans-IO HTTP/1.1 parser) owns the syntax: the request line, header lines, obs-fold,
Content-Length (ASCII digits only, duplicates that disagree refused) and Transfer-Encoding.
What h11 leaves to its caller stays here: the head size limit (h11 is only ever given
``MAX_HEAD_BYTES`` until the head is complete, so a larger head is refused whether it arrives
in one piece or a byte at a time), the header count, the methods, targets and versions the
daemon takes, the body limit, and no chunked bodies. Every refusal is a ``BadRequest`` that
names what was wrong; the transport answers it with the JSON error envelope.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import h11

from gpudiag.core.ascii_ints import ascii_int
from gpudiag.core.records import dataclass

MAX_HEAD_BYTES = 16384      # request line and headers together
MAX_HEADERS = 64
MAX_BODY_BYTES = 4096       # read and discarded; the API takes parameters in the query

_METHOD_RE = re.compile(rb"^[A-Z]{1,16}$")
_VERSIONS = frozenset({b"1.0", b"1.1"})
# h11 refuses an HTTP/1.1 head without Host (RFC 9112 says a server MUST answer 400). The
# daemon's contract has always taken one (scripts, health checks over the unix socket, where
# no name applies), so such a head is parsed again with an empty Host, which is dropped.
_NO_HOST = "Missing mandatory Host: header"
_EMPTY_HOST = b"Host: \r\n"
# h11's complaint -> (our error code, what we tell the client); first matching prefix wins.
_H11_ERRORS: tuple[tuple[str, str, str], ...] = (
    ("illegal request line", "bad_request_line", "the request line is not "
     "'METHOD /path HTTP/1.1'"),
    ("no request line", "bad_request_line", "the request line is empty"),
    ("illegal header line", "bad_header", "a header line is not 'Name: value'"),
    ("continuation line", "bad_header", "a header line starts with white space (obs-fold)"),
    ("Found multiple Host", "bad_header", "more than one Host header"),
    ("bad Content-Length", "bad_body", "Content-Length is not one ASCII number"),
    ("conflicting Content-Length", "bad_body", "Content-Length headers disagree"),
    ("Only Transfer-Encoding", "bad_body", "Transfer-Encoding bodies are not accepted; "
     "parameters go in the query string"),
    ("multiple Transfer-Encoding", "bad_body", "Transfer-Encoding bodies are not accepted; "
     "parameters go in the query string"),
)


@dataclass(frozen=True)
class Request:
    """A complete request head (and its small body) ready for the app."""

    method: str
    target: str
    version: str
    headers: tuple[tuple[str, str], ...]
    body: bytes


class BadRequest(Exception):
    """A request we answer with an error envelope straight from the selector thread."""

    def __init__(self, status: int, code: str, message: str, kind: str = "malformed") -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.kind = status, code, message, kind


def body_length(headers: Iterable[tuple[str, str]]) -> int:
    """The Content-Length to read (0 when absent); BadRequest for framing we do not take."""
    headers = tuple(headers)
    lengths = {v for k, v in headers if k == "content-length"}
    if any(k == "transfer-encoding" for k, _ in headers):
        raise BadRequest(400, "bad_body", "Transfer-Encoding bodies are not accepted; "
                         "parameters go in the query string")
    if not lengths:
        return 0
    length = ascii_int(next(iter(lengths))) if len(lengths) == 1 else None
    if length is None:
        raise BadRequest(400, "bad_body", f"Content-Length {sorted(lengths)!r} is not one number")
    return length


def too_large(buf: bytes) -> BadRequest:
    """414 when the request line alone is over the head limit, else 431."""
    line_end = buf.find(b"\n")
    if line_end < 0 or line_end > MAX_HEAD_BYTES:
        return BadRequest(414, "uri_too_long", f"the request line is over {MAX_HEAD_BYTES} "
                          "bytes", kind="head_too_large")
    return BadRequest(431, "headers_too_large", f"the request head is over {MAX_HEAD_BYTES} "
                      "bytes", kind="head_too_large")


def _refusal(error: h11.RemoteProtocolError, buf: bytes) -> BadRequest:
    """h11's complaint as our error code and a message that quotes the request line."""
    said = str(error)
    code, message = "bad_request", "the request is not HTTP/1.0 or HTTP/1.1"
    for prefix, known_code, known_message in _H11_ERRORS:
        if said.startswith(prefix):
            code, message = known_code, known_message
            break
    first = buf.split(b"\n", 1)[0].rstrip(b"\r")[:80]
    return BadRequest(400, code, f"{message} (request line {first!r}; the parser said: "
                      f"{said[:120]})")


def _head(event: h11.Request, hostless: bool) -> tuple[str, str, str, tuple[tuple[str, str], ...]]:
    """The checks h11 leaves to us: method, target, version, header count."""
    if not _METHOD_RE.match(event.method):
        raise BadRequest(400, "bad_method", f"method {event.method[:40]!r} is not an HTTP "
                         "method (upper-case letters)")
    if not event.target.startswith(b"/"):
        raise BadRequest(400, "bad_request_target", f"request target {event.target[:80]!r} "
                         "is not an origin-form path")
    if event.http_version not in _VERSIONS:
        raise BadRequest(400, "bad_http_version", f"version HTTP/{event.http_version!r:.20}: "
                         "accepted HTTP/1.0 and HTTP/1.1")
    items = list(event.headers)[1 if hostless else 0:]
    if len(items) > MAX_HEADERS:
        raise BadRequest(431, "too_many_headers", f"more than {MAX_HEADERS} headers",
                         kind="head_too_large")
    headers = tuple((name.decode("ascii"), value.decode("latin-1")) for name, value in items)
    return (event.method.decode("ascii"), event.target.decode("ascii"),
            "HTTP/" + event.http_version.decode("ascii"), headers)


class RequestReader:
    """One connection's request: give it the bytes received so far until it returns one."""

    def __init__(self) -> None:
        self._start(hostless=False)

    def _start(self, hostless: bool) -> None:
        # h11 never holds more than the head limit (plus the Host we may add) unparsed.
        self._h11 = h11.Connection(h11.SERVER,
                                   max_incomplete_event_size=MAX_HEAD_BYTES + len(_EMPTY_HOST))
        self._hostless = hostless
        self._fed = 0  # bytes of the client's buffer given to h11 so far
        self._head: tuple[str, str, str, tuple[tuple[str, str], ...]] | None = None
        self._body = bytearray()

    def feed(self, buf: bytes) -> Request | None:
        """``buf``: everything received on the connection; the Request once it is complete."""
        try:
            return self._advance(buf)
        except h11.RemoteProtocolError as e:
            if str(e) != _NO_HOST or self._hostless:
                raise _refusal(e, buf) from None
        self._start(hostless=True)
        try:
            return self._advance(buf)
        except h11.RemoteProtocolError as e:
            raise _refusal(e, buf) from None

    def _advance(self, buf: bytes) -> Request | None:
        while True:
            limit = len(buf) if self._head is not None else min(len(buf), MAX_HEAD_BYTES)
            if self._fed < limit:
                chunk = buf[self._fed:limit]
                if self._hostless and self._fed == 0:
                    line_end = chunk.index(b"\n") + 1  # h11 found a whole head before
                    chunk = chunk[:line_end] + _EMPTY_HOST + chunk[line_end:]
                self._h11.receive_data(chunk)
                self._fed = limit
            event = self._h11.next_event()
            if event is h11.NEED_DATA:
                if self._head is None and self._fed >= MAX_HEAD_BYTES:
                    raise too_large(buf)
                return None
            if isinstance(event, h11.Request):
                self._head = _head(event, self._hostless)
                length = body_length(self._head[3])
                # No body: done without asking h11 for its EndOfMessage (a third of its cost
                # per request). Over the limit: the app answers 413 from the header alone.
                if length == 0 or length > MAX_BODY_BYTES:
                    return Request(*self._head, b"")
            elif isinstance(event, h11.Data):
                self._body += event.data
            elif isinstance(event, h11.EndOfMessage) and self._head is not None:
                return Request(*self._head, bytes(self._body))
            else:  # nothing else can come before the end of one request; never loop on it
                raise BadRequest(400, "bad_request", f"unexpected {type(event).__name__} "
                                 "while reading the request")
