"""The daemon's HTTP server under abuse, over real sockets on 127.0.0.1 (port 0).

Slow clients, oversized heads, floods of connections, malformed requests, clients that vanish
mid-response: others keep being served, threads and memory stay bounded, nothing answers 500,
and the abuse is logged once per kind, not per request. Also the on-demand probe rate limit.
"""

from __future__ import annotations

import json
import logging
import random
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeAlias

import pytest

from gpudiag.daemon.app import DaemonApp, ProbeRateLimit, serve
from gpudiag.daemon.httpserver import MAX_HEAD_BYTES, AbuseLog, HttpServer
from gpudiag.daemon.scheduler import Scheduler
from gpudiag.daemon.snapshot import ProbeKey
from tests.fakes.build import FakeDriver
from tests.support.daemon import (
    Daemon,
    Replay,
    Runs,
    daemon_toml,
    host_env,
    quick_config,
    real_runs,
    wait_for,
    write_config,
    wsgi,
)


@pytest.fixture(scope="module")
def healthy_runs(fakes: FakeDriver, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return real_runs(host_env(fakes, tmp_path_factory.mktemp("host"), FAKE_NVML_DEVICE_COUNT=2))


# The server fixture: the HTTP server and the replay behind it.
Served: TypeAlias = tuple[HttpServer, Replay]


@pytest.fixture
def server(healthy_runs: Runs) -> Iterator[Served]:
    """A started scheduler replaying real runs, served with short timeouts for the tests."""
    replay = Replay(dict(healthy_runs))
    sched = Scheduler(quick_config(), runner=replay, env={})
    sched.start()
    app = DaemonApp(sched)
    wait_for(lambda: sched.snapshot().round_complete, 5)
    httpd, thread = serve(app, "127.0.0.1", 0, head_timeout_s=1.0, write_timeout_s=1.0,
                          max_pending=200, workers=8, max_queued=512)
    yield httpd, replay
    httpd.shutdown()
    thread.join(5)
    sched.stop()


def _port(httpd: HttpServer) -> int:
    return int(httpd.server_address[1])


def raw(port: int, data: bytes, timeout: float = 5.0) -> tuple[int, dict[str, str], bytes]:
    """Send raw bytes, read until the server closes; (status, headers, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        if data:
            s.sendall(data)
        chunks = []
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            chunks.append(chunk)
    reply = b"".join(chunks)
    head, _, body = reply.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1]) if lines[0].startswith("HTTP/1.1 ") else 0
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return status, headers, body


def get(port: int, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
    status, _, body = raw(port, f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode(), timeout)
    return status, body


def _threads() -> int:
    return threading.active_count()


def _rss_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_plain_request_is_served_with_connection_close(server: Served) -> None:
    httpd, _ = server
    status, headers, body = raw(_port(httpd), b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert status == 200 and json.loads(body) == {"status": "ok"}
    assert headers["connection"] == "close" and int(headers["content-length"]) == len(body)
    status, headers, body = raw(_port(httpd), b"HEAD /metrics HTTP/1.0\r\n\r\n")
    assert status == 200 and body == b"" and int(headers["content-length"]) > 0


def test_slow_clients_that_trickle_bytes_time_out_while_others_are_served(server: Served) -> None:
    httpd, _ = server
    port = _port(httpd)
    slow = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(50)]
    try:
        request = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        started = time.monotonic()
        for i in range(4):  # a byte every 0.2 s: each recv succeeds, the head never completes
            for s in slow:
                s.sendall(request[i:i + 1])
            t0 = time.perf_counter()
            assert get(port, "/healthz")[0] == 200
            assert time.perf_counter() - t0 < 0.5
            time.sleep(0.2)
        # The head deadline is for the whole head, not per byte: all of them are answered 408.
        for s in slow:
            s.settimeout(3)
            reply = s.recv(4096)
            assert reply.startswith(b"HTTP/1.1 408 ")
            assert json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["code"] == \
                "request_timeout"
        assert time.monotonic() - started < 3.0
        assert httpd.pending == 0
        assert httpd.abuse.totals["slow_client"] == 50
    finally:
        for s in slow:
            s.close()


@pytest.mark.parametrize("request_bytes, status, code", [
    (b"GET /metrics?" + b"a" * (MAX_HEAD_BYTES + 10) + b" HTTP/1.1\r\n\r\n", 414,
     "uri_too_long"),
    (b"GET /metrics HTTP/1.1\r\nX-Big: " + b"b" * (MAX_HEAD_BYTES + 10) + b"\r\n\r\n", 431,
     "headers_too_large"),
    (b"GET /metrics HTTP/1.1\r\n" + b"".join(b"X-H%d: 1\r\n" % i for i in range(100)) +
     b"\r\n", 431, "too_many_headers"),
    (b"GET /v1/preflight?require=" + b"c" * 5000 + b" HTTP/1.1\r\n\r\n", 414, "uri_too_long"),
    (b"GET /v1/preflight?" + b"&".join(b"p%d=1" % i for i in range(200)) + b" HTTP/1.1\r\n\r\n",
     400, "too_many_parameters"),
    (b"POST /v1/probe HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n", 413, "body_too_large"),
])
def test_oversized_heads_and_queries_get_the_envelope(server: Served, request_bytes: bytes,
                                                      status: int, code: str) -> None:
    httpd, _ = server
    got, _, body = raw(_port(httpd), request_bytes)
    assert got == status and json.loads(body)["error"]["code"] == code
    assert get(_port(httpd), "/healthz")[0] == 200


MALFORMED = [
    b"GARBAGE\r\n\r\n",
    b"GET\r\n\r\n",
    b"GET /metrics\r\n\r\n",                       # HTTP/0.9
    b"GET /metrics HTTP/9.9\r\n\r\n",
    b"get /metrics HTTP/1.1\r\n\r\n",
    b"G\x00T /metrics HTTP/1.1\r\n\r\n",
    b"GET metrics HTTP/1.1\r\n\r\n",
    b"GET http://evil/metrics HTTP/1.1\r\n\r\n",
    b"GET /met rics HTTP/1.1\r\n\r\n",
    b"GET /metrics HTTP/1.1\r\nNo colon here\r\n\r\n",
    b"GET /metrics HTTP/1.1\r\n folded: header\r\n\r\n",
    b"POST /v1/probe HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"POST /v1/probe HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",
    b"POST /v1/probe HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
    # Seeded noise: the same bytes in every process (pytest-xdist's workers must collect the
    # same parameters).
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + random.Random(1).randbytes(32)
    + b"\r\n\r\n",  # TLS
    random.Random(2).randbytes(64) + b"\r\n\r\n",
]
ODD_BUT_WELL_FORMED = [
    (b"BREW /metrics HTTP/1.1\r\n\r\n", 405),
    (b"DELETE /v1/preflight HTTP/1.1\r\n\r\n", 405),
    (b"OPTIONS /healthz HTTP/1.1\r\n\r\n", 405),
    (b"GET /%ff%fe%00 HTTP/1.1\r\n\r\n", 404),
    (b"GET /../../etc/passwd HTTP/1.1\r\n\r\n", 404),
    (b"GET /v1/preflight?%zz=%%%&require=cuda HTTP/1.1\r\n\r\n", 400),
    (b"GET /v1/history?limit=99999999999999999999 HTTP/1.1\r\n\r\n", 400),
    (b"POST /v1/probe?backend=nvml HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc", 202),
]


@pytest.mark.parametrize("request_bytes", MALFORMED)
def test_malformed_requests_get_400_with_the_envelope(server: Served, request_bytes: bytes) -> None:
    httpd, _ = server
    status, headers, body = raw(_port(httpd), request_bytes)
    assert status == 400 and headers["content-type"] == "application/json"
    assert json.loads(body)["error"]["message"]


@pytest.mark.parametrize("request_bytes, expected", ODD_BUT_WELL_FORMED)
def test_odd_methods_and_paths_get_a_4xx_never_a_500(server: Served, request_bytes: bytes,
                                                    expected: int) -> None:
    httpd, _ = server
    status, _, body = raw(_port(httpd), request_bytes)
    assert status == expected
    if status >= 400:
        assert json.loads(body)["error"]["code"]


def test_a_thousand_concurrent_connections_stay_bounded_and_others_are_served(server: Served
                                                                              ) -> None:
    httpd, _ = server
    port = _port(httpd)
    threads_before, rss_before = _threads(), _rss_bytes()
    idle, busy = [], []
    started = time.monotonic()
    try:
        for i in range(1000):
            s = socket.socket()
            s.settimeout(5)
            s.connect(("127.0.0.1", port))
            if i % 2:
                s.sendall(b"GET /healthz HTTP/1.1\r\n\r\n")
                busy.append(s)
            else:
                s.sendall(b"GET /healthz HTTP/1.1\r\n")  # a head that never ends
                idle.append(s)
            if i % 100 == 0:
                # Someone else, in the middle of the flood, is served promptly.
                t0 = time.perf_counter()
                assert get(port, "/metrics")[0] == 200
                assert time.perf_counter() - t0 < 2.0
                assert httpd.pending <= 200
        statuses = []
        for s in busy:
            reply = s.recv(4096)
            statuses.append(int(reply.split()[1]) if reply.startswith(b"HTTP/1.1 ") else 0)
        # Everyone who sent a request got an answer: 200, or 503 busy when the queue was full.
        assert set(statuses) <= {200, 503} and statuses.count(200) >= len(busy) // 2
        assert _threads() <= threads_before + 2 * 8
        assert _rss_bytes() - rss_before < 64 * 2**20
        assert httpd.abuse.totals["connection_cap"] >= 1000 // 2 - 200
        assert time.monotonic() - started < 20
    finally:
        for s in idle + busy:
            s.close()
    wait_for(lambda: httpd.pending == 0, 5)
    assert get(port, "/healthz")[0] == 200


def test_clients_that_disconnect_mid_response_do_not_hurt_others(server: Served) -> None:
    httpd, _ = server
    port = _port(httpd)
    threads_before = _threads()
    for _ in range(100):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
        # RST instead of FIN: the server's write fails, as when a scraper is killed.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
    # A client that asks and then never reads: the write deadline frees the worker.
    stuck = []
    for _ in range(8):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        s.connect(("127.0.0.1", port))
        s.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
        stuck.append(s)
    try:
        for _ in range(20):
            assert get(port, "/healthz")[0] == 200
        wait_for(lambda: _threads() <= threads_before + 2 * 8, 5)
    finally:
        for s in stuck:
            s.close()
    assert get(port, "/metrics")[0] == 200


def test_abuse_is_logged_once_per_kind_then_summarised(caplog: pytest.LogCaptureFixture
                                                       ) -> None:
    now = [0.0]
    abuse = AbuseLog(interval_s=60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="gpudiag.daemon.app"):
        for _ in range(500):
            abuse.note("malformed", "127.0.0.1")
            abuse.flush()
        assert len(caplog.records) == 1 and "malformed" in caplog.records[0].message
        now[0] = 61.0
        abuse.flush()
        abuse.flush()
    assert len(caplog.records) == 2 and "malformed 499" in caplog.records[1].message
    assert abuse.totals["malformed"] == 500


def test_the_real_daemon_under_abuse_logs_once_and_stays_bounded(fakes: FakeDriver,
                                                                 tmp_path: Path) -> None:
    env = host_env(fakes, tmp_path / "host", FAKE_NVML_DEVICE_COUNT=2)
    config = write_config(tmp_path / "d.toml", daemon_toml({"backends.nvml": {"deadline_s": 5}}))
    daemon = Daemon(env, config, tmp_path / "state")
    try:
        daemon.wait_ready()
        port = int(daemon.url.rsplit(":", 1)[1])
        pid = daemon.proc.pid

        def status_of(key: str) -> int:
            with open(f"/proc/{pid}/status") as fh:
                return next(int(ln.split()[1]) for ln in fh if ln.startswith(key + ":"))

        threads0, rss0 = status_of("Threads"), status_of("VmRSS")
        idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(300)]
        try:
            for data in MALFORMED * 10:
                assert raw(port, data)[0] == 400
            for _ in range(50):
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                s.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()
            status, text = daemon.get("/metrics")
            assert status == 200
            assert 'gpudiag_http_rejected_total{reason="malformed"} 160.0' in text
            assert status_of("Threads") <= threads0 + 2 * 16
            assert (status_of("VmRSS") - rss0) * 1024 < 32 * 2**20
        finally:
            for s in idle:
                s.close()
        time.sleep(0.3)
    finally:
        daemon.stop()
    abuse_lines = [json.loads(ln) for ln in daemon.lines if '"abuse' in ln]
    kinds = [ln.get("abuse") for ln in abuse_lines if ln.get("abuse")]
    # 160 malformed requests and 50 broken-off ones: one line per kind, not one per request.
    assert kinds.count("malformed") == 1 and len(abuse_lines) <= len(set(kinds)) + 1
    assert not any('"status": 500' in ln or "Traceback" in ln for ln in daemon.lines)


# -- on-demand probe rate limit -------------------------------------------------------------
def _limited_app(healthy_runs: Runs, burst: int = 3, refill_s: float = 60.0
                 ) -> tuple[DaemonApp, Replay, Scheduler]:
    replay = Replay(dict(healthy_runs))
    sched = Scheduler(quick_config(), runner=replay, env={})
    sched.start()
    wait_for(lambda: sched.snapshot().round_complete, 5)
    return DaemonApp(sched, probe_limit=ProbeRateLimit(burst=burst, refill_s=refill_s)), \
        replay, sched


def test_post_probe_is_rate_limited_per_backend_with_429_and_retry_after(
        healthy_runs: Runs) -> None:
    app, replay, sched = _limited_app(healthy_runs)
    try:
        before = len(replay.calls)
        for _ in range(3):
            assert wsgi(app, "/v1/probe?backend=nvml", method="POST")[0] == 202
            wait_for(lambda: not sched.running(ProbeKey.of("nvml", None)), 5)
        status, headers, body = wsgi(app, "/v1/probe?backend=nvml", method="POST")
        err = json.loads(body)["error"]
        assert status == 429 and err["code"] == "rate_limited" and "nvml" in err["message"]
        assert 1 <= int(headers["Retry-After"]) <= 60
        assert replay.calls[before:].count("nvml") == 3
        # Another backend has its own budget.
        assert wsgi(app, "/v1/probe?backend=cuda", method="POST")[0] == 202
    finally:
        sched.stop()


def test_preflight_max_age_runs_past_the_budget_answer_from_the_snapshot(
        healthy_runs: Runs) -> None:
    app, replay, sched = _limited_app(healthy_runs, burst=2)
    try:
        for _ in range(2):
            time.sleep(0.02)
            status, _, body = wsgi(app, "/v1/preflight?require=cuda&max_age_s=0")
            assert status == 200 and json.loads(body)["fresh"] is True
        time.sleep(0.02)
        runs = len(replay.calls)
        # Past the budget: the snapshot's verdict, marked not fresh, and no new run.
        status, _, body = wsgi(app, "/v1/preflight?require=cuda&max_age_s=0")
        assert status == 200 and json.loads(body)["fresh"] is False
        assert json.loads(body)["age_s"] > 0 and len(replay.calls) == runs
        # Without max_age_s (or with a generous one) the snapshot answers, unlimited.
        for _ in range(20):
            assert wsgi(app, "/v1/preflight?require=cuda")[0] == 200
            assert wsgi(app, "/v1/preflight?require=cuda&max_age_s=3600")[0] == 200
    finally:
        sched.stop()


def test_requests_joining_a_run_in_flight_cost_nothing(healthy_runs: Runs) -> None:
    gate = threading.Event()
    replay = Replay(dict(healthy_runs), gate=gate)
    sched = Scheduler(quick_config(), runner=replay, env={})
    app = DaemonApp(sched, probe_limit=ProbeRateLimit(burst=1, refill_s=60.0))
    try:
        results: list[Any] = []
        for _ in range(10):
            results.append(wsgi(app, "/v1/probe?backend=nvml", method="POST")[0])
        assert results == [202] * 10 and replay.calls == ["nvml"]
    finally:
        gate.set()
        sched.stop()


# -- browsers: CSRF and DNS rebinding -------------------------------------------------------
@pytest.mark.parametrize("request_bytes", [
    b"POST /v1/probe HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: http://evil.example\r\n\r\n",
    b"GET /v1/history HTTP/1.1\r\nHost: evil.example:9477\r\n\r\n",
    b"GET /metrics HTTP/1.1\r\nHost: rebind.attacker.test\r\n\r\n",
])
def test_browser_borne_requests_are_refused_with_403(server: Served, request_bytes: bytes) -> None:
    httpd, replay = server
    before = len(replay.calls)
    status, _, body = raw(_port(httpd), request_bytes)
    assert status == 403 and json.loads(body)["error"]["code"] == "cross_site_request"
    assert replay.calls[before:] == []


@pytest.mark.parametrize("host", [b"127.0.0.1", b"127.0.0.1:9477", b"localhost:9477",
                                  b"[::1]:9477", b"localhost"])
def test_programs_naming_a_loopback_address_are_served(server: Served, host: bytes) -> None:
    httpd, _ = server
    status, _, _ = raw(_port(httpd), b"GET /healthz HTTP/1.1\r\nHost: " + host + b"\r\n\r\n")
    assert status == 200


def test_preflight_cannot_invent_probe_keys_or_run_new_ones_past_the_budget(
        healthy_runs: Runs) -> None:
    app, replay, sched = _limited_app(healthy_runs, burst=1)
    try:
        for query in ("require=iree:zzz", "require=iree:metal-x"):
            status, _, body = wsgi(app, f"/v1/preflight?{query}")
            assert status == 400 and json.loads(body)["error"]["code"] == "bad_requirement"
        # A requirement whose probe never ran starts a run: that is on-demand work too
        # (asked from the daemon's own environment: its fingerprint, which the client sends).
        from gpudiag.core.requirement import parse_requirement
        from gpudiag.engine.client import environment_ids
        from gpudiag.engine.fingerprint import query_value
        from gpudiag.engine.jobpython import this_process

        ids = environment_ids(parse_requirement("iree"), {}, this_process())
        fp = "&fingerprint=" + query_value(ids)
        assert wsgi(app, f"/v1/preflight?require=iree:local-task&wait_s=2{fp}")[0] == 200
        assert replay.calls.count("iree") == 1
        status, _, body = wsgi(app, f"/v1/preflight?require=iree:vulkan&wait_s=2{fp}")
        assert status == 429 and json.loads(body)["error"]["code"] == "rate_limited"
        assert replay.calls.count("iree") == 1
        # The result it has is answered from the snapshot, as often as asked.
        for _ in range(5):
            assert wsgi(app, f"/v1/preflight?require=iree:local-task{fp}")[0] == 200
        # Without a fingerprint no run starts: the asker proves IREE itself.
        assert wsgi(app, "/v1/preflight?require=iree:local-task")[0] == 200
        assert replay.calls.count("iree") == 1
    finally:
        sched.stop()


def test_open_connections_are_capped_below_the_file_descriptor_limit(healthy_runs: Runs
                                                                      ) -> None:
    sched = Scheduler(quick_config(), runner=Replay(dict(healthy_runs)), env={})
    sched.start()
    httpd, thread = serve(DaemonApp(sched), "127.0.0.1", 0, head_timeout_s=5.0,
                          max_connections=50, max_pending=40)
    port = _port(httpd)
    idle = []
    try:
        wait_for(lambda: sched.snapshot().round_complete, 5)
        for _ in range(200):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        wait_for(lambda: httpd.pending > 0, 5)
        assert get(port, "/healthz")[0] == 200  # the oldest idle one gave way
        assert httpd.open_connections <= 50
    finally:
        for s in idle:
            s.close()
        httpd.shutdown()
        thread.join(5)
        sched.stop()
