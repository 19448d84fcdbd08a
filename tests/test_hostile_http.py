"""Issue 24: hostile requests against a real `gpudiag serve` (TCP and the 0666 unix socket).

Unicode digits ("²", "³", "¹") pass ``str.isdigit()`` and then make ``int()`` raise; one
such Content-Length used to end the serving thread for good while the process lived on.
Every parameter parser now takes ASCII digits only, and no exception in the serving loop can
end it (it is logged, counted as ``reason="internal"`` and costs only its own connection).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpudiag.core.ascii_ints import ascii_int
from gpudiag.daemon.httpserver import HttpServer, body_length
from tests.fakes.build import FakeDriver
from tests.support.daemon import Daemon, daemon_toml, host_env, write_config

UNICODE_DIGITS = ["\u00b2", "\u00b3", "\u00b9", "\u0663", "\uff15"]


def _exchange(address: str | tuple[str, int], data: bytes, timeout: float = 10) -> bytes:
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(address)
        s.sendall(data)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _status(reply: bytes) -> int:
    line = reply.split(b"\r\n", 1)[0].split()
    return int(line[1]) if len(line) > 1 else 0


@pytest.fixture
def daemon(fakes: FakeDriver, tmp_path: Path) -> Iterator[Daemon]:
    env = host_env(fakes, tmp_path / "host", gpus=2)
    sock = tmp_path / "run" / "gpudiag.sock"
    d = Daemon(env, write_config(tmp_path / "gpudiag.toml", daemon_toml()), tmp_path / "state",
               extra_args=("--socket", str(sock)))
    d.socket_path = str(sock)  # type: ignore[attr-defined]
    try:
        d.wait_ready()
        yield d
    finally:
        d.stop()


@pytest.mark.parametrize("digit", UNICODE_DIGITS)
def test_ascii_int_takes_ascii_digits_only(digit: str) -> None:
    assert ascii_int(digit) is None and ascii_int("1" + digit) is None
    assert ascii_int(" 42 ") == 42 and ascii_int("-1") is None and ascii_int("") is None


def test_a_unicode_digit_content_length_is_a_400_not_an_exception() -> None:
    from gpudiag.daemon.httpparse import BadRequest

    for digit in UNICODE_DIGITS:
        with pytest.raises(BadRequest):
            body_length([("content-length", digit)])
    assert body_length([("content-length", "12")]) == 12


def test_unicode_digit_requests_get_400_and_the_listeners_keep_serving(daemon: Daemon) -> None:
    host, _, port = daemon.instance.rpartition(":")
    tcp = (host, int(port))
    unix = daemon.socket_path  # type: ignore[attr-defined]
    for address in (tcp, unix):
        for byte in (b"\xb2", b"\xb3", b"\xb9"):
            reply = _exchange(address, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                              b"Content-Length: " + byte + b"\r\n\r\n")
            assert _status(reply) == 400, reply[:300]
            assert b'"code": "bad_body"' in reply or b'"bad_body"' in reply
        # The same listener still answers afterwards (it used to answer nothing, ever).
        ok = _exchange(address, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert _status(ok) == 200, ok[:300]


@pytest.mark.parametrize("query", [
    "/v1/history?limit=%C2%B2", "/v1/preflight?min_devices=%C2%B3", "/v1/preflight?gpus=%C2%B9",
    "/v1/preflight?gpus=%EF%BC%95", "/v1/history?limit=%D9%A3", "/v1/preflight?max_age_s=%C2%B2",
    "/v1/preflight?max_age_s=%D9%A3", "/v1/history?since_s=%EF%BC%95",
])
def test_unicode_digit_parameters_are_400_with_the_envelope(daemon: Daemon, query: str) -> None:
    status, body = daemon.get(query)
    assert status == 400, body
    assert body["error"]["code"] == "bad_parameter", body
    assert not any("Traceback" in line for line in daemon.lines)


class _BuggyServer(HttpServer):
    """A server with a bug in its head handling for one path: stands in for any future bug."""

    def _complete(self, conn: Any) -> Any:
        if b"/boom" in bytes(conn.buf):
            raise RuntimeError("a bug in the serving loop")
        return super()._complete(conn)


def test_no_exception_in_the_serving_loop_ends_the_listener(
        caplog: pytest.LogCaptureFixture) -> None:
    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    server = _BuggyServer(app, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    address = ("127.0.0.1", int(server.server_address[1]))
    try:
        with caplog.at_level(logging.ERROR, logger="gpudiag.daemon.app"):
            for _ in range(3):
                assert _exchange(address, b"GET /boom HTTP/1.1\r\n\r\n") == b""
        assert _status(_exchange(address, b"GET /fine HTTP/1.1\r\n\r\n")) == 200
        assert thread.is_alive()
        assert server.abuse.totals["internal"] == 3
        assert "internal error in the serving loop" in caplog.text
    finally:
        server.shutdown()


def test_a_listener_whose_loop_died_makes_the_daemon_exit_instead_of_idling() -> None:
    from gpudiag.daemon.service import wait_for_stop

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response("200 OK", [])
        return [b"ok"]

    server = HttpServer(app, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        # Break the selector under the loop: the loop itself ends (not one connection).
        time.sleep(0.3)
        server._sel.close()
        reason = wait_for_stop(threading.Event(), [server], logging.getLogger("test"))
        assert reason is not None and server.describe() in reason
        assert not server.serving
    finally:
        server.shutdown(timeout_s=1)
