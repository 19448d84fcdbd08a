"""How an answer leaves the daemon: written by the selector thread, never by a worker.

A real HttpServer on 127.0.0.1 port 0 with a tiny WSGI app: an answer larger than the socket
buffer still arrives whole, and a client that never reads it holds no worker (the only one
here serves others meanwhile) and is dropped at the write deadline.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from gpudiag.daemon.httpserver import HttpServer

BIG = bytes(range(256)) * (16 * 1024)  # 4 MiB: far over a loopback socket's buffer


def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    body = BIG if environ["PATH_INFO"] == "/big" else b"small"
    start_response("200 OK", [("Content-Type", "application/octet-stream"),
                              ("Content-Length", str(len(body)))])
    return [body]


@pytest.fixture
def server() -> Iterator[HttpServer]:
    httpd = HttpServer(app, "127.0.0.1", 0, workers=1, write_timeout_s=1.0)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    thread.join(5)


def fetch(port: int, path: str) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        chunks = []
        while chunk := s.recv(1 << 20):
            chunks.append(chunk)
    return b"".join(chunks).partition(b"\r\n\r\n")[2]


def test_an_answer_larger_than_the_socket_buffer_arrives_whole(server: HttpServer) -> None:
    port = int(server.server_address[1])
    assert fetch(port, "/big") == BIG
    assert fetch(port, "/small") == b"small"
    deadline = time.monotonic() + 5
    while server.open_connections and time.monotonic() < deadline:
        time.sleep(0.05)  # closed by the selector thread after the last byte
    assert server.open_connections == 0


def test_a_client_that_never_reads_holds_no_worker(server: HttpServer) -> None:
    port = int(server.server_address[1])
    stuck = socket.socket()
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stuck.connect(("127.0.0.1", port))
    stuck.sendall(b"GET /big HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    try:
        time.sleep(0.2)  # the one worker has answered it and is free again
        started = time.monotonic()
        assert fetch(port, "/small") == b"small"
        assert time.monotonic() - started < 0.5
        deadline = time.monotonic() + 5
        while server.abuse.totals["client_gone"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.abuse.totals["client_gone"] == 1  # dropped at the write deadline
    finally:
        stuck.close()
    assert fetch(port, "/small") == b"small"
