"""The h11-based request reader: what h11 parses and what gpudiag's own limits add.

Pure (no socket): the transport's behaviour over real sockets is in test_http_abuse.py and
test_hostile_http.py; here each refusal's status and code, the reader fed byte by byte, and
a property over any bytes cut anywhere.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpudiag.daemon.httpparse import (
    _H11_ERRORS,
    MAX_BODY_BYTES,
    MAX_HEAD_BYTES,
    MAX_HEADERS,
    BadRequest,
    Request,
    RequestReader,
)


def read(data: bytes, step: int | None = None) -> Request | None:
    """Feed ``data`` whole or ``step`` bytes at a time, as recv() would hand it over."""
    reader = RequestReader()
    step = step or len(data)
    result = None
    for end in range(step, len(data) + step, step):
        result = reader.feed(data[:end])
        if result is not None:
            return result
    return result


def refusal(data: bytes) -> BadRequest:
    with pytest.raises(BadRequest) as caught:
        read(data)
    return caught.value


@pytest.mark.parametrize("step", [None, 1, 7])
def test_a_request_is_complete_only_with_its_whole_body(step: int | None) -> None:
    data = (b"POST /v1/probe?backend=nvml HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Length: 5\r\nX-A: 1\r\nx-a: 2\r\n\r\nhello")
    assert read(data[:-1], step) is None
    request = read(data, step)
    assert request == Request("POST", "/v1/probe?backend=nvml", "HTTP/1.1",
                              (("host", "127.0.0.1"), ("content-length", "5"), ("x-a", "1"),
                               ("x-a", "2")), b"hello")


def test_an_http_1_1_head_without_host_is_served_without_one() -> None:
    # h11 refuses it (RFC 9112); the daemon's contract takes it, and adds no Host of its own.
    for data in (b"GET /healthz HTTP/1.1\r\n\r\n", b"GET /healthz HTTP/1.1\n\n",
                 b"GET /healthz HTTP/1.1\r\nAccept: */*\r\n\r\n"):
        request = read(data, 3)
        assert request is not None and request.target == "/healthz"
        assert "host" not in dict(request.headers)
    assert read(b"GET /healthz HTTP/1.1\r\nHost:\r\n\r\n") == Request(
        "GET", "/healthz", "HTTP/1.1", (("host", ""),), b"")


def test_a_folded_header_line_is_joined_to_the_one_above() -> None:
    request = read(b"GET / HTTP/1.1\r\nHost: a\r\nX-Long: one\r\n  two\r\n\r\n")
    assert request is not None and dict(request.headers)["x-long"] == "one two"


def test_a_body_over_the_limit_is_not_waited_for() -> None:
    request = read(b"POST /v1/probe HTTP/1.1\r\nContent-Length: %d\r\n\r\n" %
                   (MAX_BODY_BYTES + 1))
    assert request is not None and request.body == b""


@pytest.mark.parametrize("step", [None, 1000])
def test_a_head_over_the_limit_is_refused_whole_or_in_pieces(step: int | None) -> None:
    big_header = b"GET / HTTP/1.1\r\nX-Big: " + b"b" * MAX_HEAD_BYTES + b"\r\n\r\n"
    long_line = b"GET /" + b"a" * MAX_HEAD_BYTES + b" HTTP/1.1\r\n\r\n"
    for data, status in ((big_header, 431), (long_line, 414)):
        with pytest.raises(BadRequest) as caught:
            read(data, step)
        assert caught.value.status == status and caught.value.kind == "head_too_large"


def test_a_head_just_under_the_limit_with_a_body_is_taken() -> None:
    head = b"POST / HTTP/1.1\r\nContent-Length: 10\r\nX-Pad: "
    head += b"p" * (MAX_HEAD_BYTES - len(head) - 4) + b"\r\n\r\n"
    assert len(head) == MAX_HEAD_BYTES
    request = read(head + b"0123456789")
    assert request is not None and request.body == b"0123456789"


def test_the_header_count_is_limited() -> None:
    lines = b"".join(b"X-H%d: 1\r\n" % i for i in range(MAX_HEADERS))
    assert read(b"GET / HTTP/1.1\r\n" + lines + b"\r\n") is not None
    e = refusal(b"GET / HTTP/1.1\r\nHost: a\r\n" + lines + b"\r\n")
    assert (e.status, e.code) == (431, "too_many_headers")


# One request per row of h11's complaints we translate, so a row cannot go untested, plus the
# checks of our own that h11 leaves to its caller.
REFUSED = [
    (b"GARBAGE\r\n\r\n", "bad_request_line"),
    (b"\r\n\r\n", "bad_request_line"),
    (b"GET / HTTP/1.1\r\nNo colon here\r\n\r\n", "bad_header"),
    (b"GET / HTTP/1.1\r\n folded: header\r\n\r\n", "bad_header"),
    (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", "bad_header"),
    (b"POST / HTTP/1.1\r\nContent-Length: \xb2\r\n\r\n", "bad_body"),
    (b"POST / HTTP/1.1\r\nContent-Length: \xef\xbc\x95\r\n\r\n", "bad_body"),
    (b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", "bad_body"),
    (b"POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!", "bad_body"),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", "bad_body"),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n",
     "bad_body"),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", "bad_body"),
    (b"get / HTTP/1.1\r\n\r\n", "bad_method"),
    (b"GET http://evil/metrics HTTP/1.1\r\n\r\n", "bad_request_target"),
    (b"GET * HTTP/1.1\r\n\r\n", "bad_request_target"),
    (b"GET /caf\xe9 HTTP/1.1\r\n\r\n", "bad_request_line"),  # percent-encode it
    (b"GET / HTTP/9.9\r\n\r\n", "bad_http_version"),
    (b"GET / HTTP/2.0\r\n\r\n", "bad_http_version"),
]


@pytest.mark.parametrize("data, code", REFUSED)
def test_refusals_are_400_with_a_code_and_the_request_line(data: bytes, code: str) -> None:
    e = refusal(data)
    assert (e.status, e.code, e.kind) == (400, code, "malformed")
    assert e.message


def test_every_h11_complaint_we_translate_is_met_by_a_case() -> None:
    codes = {code for _, code, _ in _H11_ERRORS}
    assert codes <= {code for _, code in REFUSED}
    met = set()
    for data, _ in REFUSED:
        said = refusal(data).message
        met |= {prefix for prefix, _, _ in _H11_ERRORS if f"parser said: {prefix}" in said}
    assert met == {prefix for prefix, _, _ in _H11_ERRORS}


# As tests/test_properties.py: a fixed set of examples in CI, GPUDIAG_PROPERTY_EXAMPLES=N to hunt.
_HUNT = int(os.environ.get("GPUDIAG_PROPERTY_EXAMPLES", "0"))
PROPERTY = settings(max_examples=_HUNT or 300, deadline=None, derandomize=not _HUNT)
PARTS = [b"GET", b"POST", b"get", b" ", b"/", b"/v1/preflight?require=cuda", b"*",
         b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"\r\n", b"\n", b"\r\n\r\n", b"Host: a",
         b"Host:", b"Content-Length: 3", b"Content-Length: 03", b"Content-Length: \xb2",
         b"Transfer-Encoding: chunked", b":", b"abc", b"\x00", b"\t", b"X-A: b", b"\xff"]
HEADISH = st.lists(st.sampled_from(PARTS) | st.binary(max_size=6), max_size=40).map(b"".join)


def _outcome(pieces: list[bytes]) -> object:
    reader, buf = RequestReader(), b""
    try:
        for piece in pieces:
            buf += piece
            request = reader.feed(buf)
            if request is not None:
                return request
    except BadRequest as e:
        assert e.status in (400, 414, 431) and e.code and e.message
        return (e.status, e.code)
    return None


@PROPERTY
@given(data=HEADISH, cuts=st.lists(st.integers(1, 600), max_size=8))
def test_any_bytes_are_a_request_or_a_refusal_however_they_are_cut(data: bytes,
                                                                    cuts: list[int]) -> None:
    points = sorted({c for c in cuts if c < len(data)})
    pieces = [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]
    assert _outcome(pieces) == _outcome([data])
