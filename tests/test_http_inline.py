"""Answers at hand are sent from the selector thread; everything that may wait still pools.

A real HttpServer on 127.0.0.1 port 0 serving the daemon's app on a scheduler replaying real
probe runs, with the wall clock held still so that two answers can be compared byte for byte:
the inline answer is the pooled one, a question that needs a probe or a classification goes
to a worker, and a client that does not read an inline answer does not stall anyone.
"""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeAlias

import pytest

from gpudiag.daemon.app import DaemonApp
from gpudiag.daemon.httpserver import HttpServer
from gpudiag.daemon.scheduler import Scheduler
from tests.fakes.build import FakeDriver
from tests.support.daemon import Replay, Runs, host_env, quick_config, real_runs, wait_for, wsgi

WALL = 1_800_000_000.0


class HeldClock:
    """Real monotonic time (the scheduler's loop), a wall clock that moves only when told."""

    def __init__(self) -> None:
        self.wall = WALL

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return self.wall


class Pooled:
    """The daemon's app without ``answer_now``: the transport pools every request."""

    def __init__(self, app: DaemonApp) -> None:
        self.app = app
        self.threads: list[str] = []

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        self.threads.append(threading.current_thread().name)
        return self.app(environ, start_response)


class Watched(Pooled):
    """The daemon's app with ``answer_now``, saying which thread answered which request."""

    def __init__(self, app: DaemonApp) -> None:
        super().__init__(app)
        self.inline: list[str] = []

    def answer_now(self, environ: dict[str, Any], start_response: Any
                   ) -> Iterable[bytes] | None:
        answer = self.app.answer_now(environ, start_response)
        if answer is not None:
            self.inline.append(threading.current_thread().name)
        return answer


@pytest.fixture(scope="module")
def healthy_runs(fakes: FakeDriver, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return real_runs(host_env(fakes, tmp_path_factory.mktemp("host"), gpus=8))


def _serve(app: Any, **options: Any) -> tuple[HttpServer, threading.Thread]:
    httpd = HttpServer(app, "127.0.0.1", 0, **options)
    thread = threading.Thread(target=httpd.serve_forever, name="selector", daemon=True)
    thread.start()
    return httpd, thread


# The sides fixture: the app, its replay and clock, the inline-capable server and its port, the
# pooled one and its port.
Sides: TypeAlias = tuple[DaemonApp, Replay, HeldClock, Watched, int, Pooled, int]


@pytest.fixture
def sides(healthy_runs: Runs) -> Iterator[Sides]:
    """One app (gated replay, held wall clock) behind two servers: inline-capable and pooled."""
    clock = HeldClock()
    replay = Replay(dict(healthy_runs), gate=threading.Event())
    assert replay.gate is not None
    replay.gate.set()
    sched = Scheduler(quick_config(), runner=replay, env={}, clock=clock)
    sched.start()
    wait_for(lambda: sched.snapshot().round_complete, 5)
    clock.wall += 12.5  # the results are 12.5 s old from here on
    app = DaemonApp(sched)
    watched, pooled = Watched(app), Pooled(app)
    inline_httpd, t1 = _serve(watched)
    pooled_httpd, t2 = _serve(pooled)
    yield (app, replay, clock, watched, int(inline_httpd.server_address[1]), pooled,
           int(pooled_httpd.server_address[1]))
    replay.gate.set()
    for httpd, thread in ((inline_httpd, t1), (pooled_httpd, t2)):
        httpd.shutdown()
        thread.join(5)
    sched.stop()


def fetch(port: int, target: str, version: str = "1.1") -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"GET {target} HTTP/{version}\r\nHost: 127.0.0.1\r\n\r\n".encode())
        chunks = []
        while chunk := s.recv(1 << 20):
            chunks.append(chunk)
    # The one part that differs between two answers: how long the app took.
    return re.sub(rb"app;dur=[0-9.]+", b"app;dur=X", b"".join(chunks))


QUESTIONS = [
    "/v1/preflight?require=cuda",
    "/v1/preflight?require=cuda&gpus=2&max_age_s=3600",
    "/v1/preflight?require=nvml&min_devices=8",
    "/v1/preflight?require=cuda&visibility=1&cuda_visible_devices=1,2",
    "/v1/health?require=cuda",
    # Refused from the query alone: answered inline as well, with the same envelope.
    "/v1/preflight?require=cuda&bogus=1",
    "/v1/preflight?require=cuda&max_age_s=-1",
    "/v1/health?gpus=1",
]


def test_an_answer_at_hand_is_sent_inline_with_the_pooled_answers_bytes(sides: Sides) -> None:
    app, replay, clock, watched, port, pooled, pooled_port = sides
    for target in QUESTIONS:
        first = fetch(port, target)  # a verdict's first answer is classified on a worker
        inline_before = len(watched.inline)
        second = fetch(port, target, "1.0")
        assert len(watched.inline) == inline_before + 1, target
        assert first == second == fetch(pooled_port, target), target
        assert second.startswith((b"HTTP/1.1 200 ", b"HTTP/1.1 400 ")), second[:60]
    assert b'"age_s": 12.5' in fetch(port, QUESTIONS[0])
    # Inline answers come from the selector thread; the pooled ones from workers.
    assert set(watched.inline) == {"selector"}
    assert watched.threads and all(t.startswith("http-wait") for t in watched.threads)
    assert all(t.startswith("http-wait") for t in pooled.threads)
    assert len(pooled.threads) == len(QUESTIONS)


def test_questions_that_need_a_probe_or_a_classification_go_to_the_pool(sides: Sides) -> None:
    app, replay, clock, watched, port, pooled, pooled_port = sides
    target = "/v1/preflight?require=cuda"
    fetch(port, target)
    assert watched.threads and not watched.inline  # first: classified and encoded on a worker
    fetch(port, target)
    assert len(watched.inline) == 1 and len(watched.threads) == 1
    for other in ("/metrics", "/readyz", "/v1/history"):
        fetch(port, other)
    assert len(watched.inline) == 1 and len(watched.threads) == 4
    # A result older than max_age_s needs a probe: the question waits on a worker while the
    # probe is held, and meanwhile the answer at hand still comes at once, from the selector.
    assert replay.gate is not None
    replay.gate.clear()
    waiting: list[bytes] = []
    asker = threading.Thread(target=lambda: waiting.append(
        fetch(port, target + "&max_age_s=1&wait_s=5")))
    asker.start()
    wait_for(lambda: len(watched.threads) == 5, 5)  # the waiting question is on a worker
    started = time.monotonic()
    quick = fetch(port, target)
    # At once, not after the held probe (it is held until the test lets it go).
    assert time.monotonic() - started < 5 and quick.startswith(b"HTTP/1.1 200 ")
    assert len(watched.inline) == 2 and not waiting
    replay.gate.set()
    asker.join(10)
    assert waiting and waiting[0].startswith(b"HTTP/1.1 200 ")
    assert watched.threads[-1].startswith("http-wait")


def test_an_answer_at_hand_is_sent_while_every_slow_worker_waits(sides: Sides) -> None:
    app, replay = sides[0], sides[1]
    httpd, thread = _serve(Watched(app), workers=1, max_queued=0)
    port = int(httpd.server_address[1])
    target = "/v1/preflight?require=cuda"
    assert replay.gate is not None  # the sides fixture gates its replay
    try:
        assert fetch(port, target).startswith(b"HTTP/1.1 200 ")  # classified on the worker
        time.sleep(0.2)  # the worker frees its slot just after its answer is queued
        replay.gate.clear()
        runs = len(replay.calls)
        waited: list[bytes] = []
        asker = threading.Thread(target=lambda: waited.append(
            fetch(port, target + "&max_age_s=1&wait_s=5")))
        asker.start()
        wait_for(lambda: len(replay.calls) > runs, 5)  # its probe runs: the one worker waits
        busy = fetch(port, target + "&max_age_s=2")  # needs a worker: there is none
        assert busy.startswith(b"HTTP/1.1 503 ") and b'"busy"' in busy
        assert fetch(port, target).startswith(b"HTTP/1.1 200 ")  # at hand: no worker needed
        replay.gate.set()
        asker.join(10)
        assert waited[0].startswith(b"HTTP/1.1 200 ") and b'"fresh": true' in waited[0]
    finally:
        replay.gate.set()
        httpd.shutdown()
        thread.join(5)


def test_answer_now_declines_exactly_what_would_wait(sides: Sides) -> None:
    app = sides[0]

    def ask(call: Any, path: str, query: str) -> list[bytes] | None:
        environ = {"REQUEST_METHOD": "GET", "PATH_INFO": path, "QUERY_STRING": query}
        answer = call(environ, lambda status, headers: None)
        return None if answer is None else list(answer)

    assert ask(app.answer_now, "/v1/preflight", "require=cuda") is None  # not classified yet
    assert ask(app, "/v1/preflight", "require=cuda") is not None
    assert ask(app.answer_now, "/v1/preflight", "require=cuda") is not None
    assert ask(app.answer_now, "/v1/preflight", "require=cuda&max_age_s=1") is None  # stale
    assert ask(app.answer_now, "/v1/preflight", "require=cuda&max_age_s=60") is not None
    for path in ("/metrics", "/healthz", "/readyz", "/v1/history", "/v1/probe"):
        assert ask(app.answer_now, path, "") is None


def test_a_question_is_parsed_again_under_a_reloaded_config(sides: Sides) -> None:
    app = sides[0]
    asked = [json.loads(wsgi(app, q)[2])["requirement"]["backends"]
             for q in ("/v1/preflight", "/v1/health?wait_s=1")]
    app.scheduler.reconfigure(dataclasses.replace(app.scheduler.config,
                                                  default_requirement="nvml"))
    wait_for(lambda: app.scheduler.snapshot().round_complete, 5)
    again = [json.loads(wsgi(app, q)[2])["requirement"]["backends"]
             for q in ("/v1/preflight", "/v1/health?wait_s=1")]
    assert asked == [["cuda"], ["cuda"]] and again == [["nvml"], ["nvml"]]


BIG = bytes(range(256)) * (16 * 1024)  # 4 MiB: far over a loopback socket's buffer


class BigAnswers:
    """A WSGI app whose /v1/preflight answer is always at hand, and 4 MiB on ?big."""

    def __init__(self) -> None:
        self.pooled = 0

    def __call__(self, environ: dict[str, Any], start_response: Any) -> list[bytes]:
        self.pooled += 1
        raise AssertionError("an answer at hand was sent to the pool")

    def answer_now(self, environ: dict[str, Any], start_response: Any) -> list[bytes]:
        body = BIG if environ["QUERY_STRING"] == "big" else b"small"
        start_response("200 OK", [("Content-Length", str(len(body)))])
        return [body]


def test_a_client_that_does_not_read_an_inline_answer_stalls_nobody() -> None:
    app = BigAnswers()
    httpd, thread = _serve(app, workers=1, write_timeout_s=1.0)
    port = int(httpd.server_address[1])
    try:
        assert fetch(port, "/v1/preflight?big").partition(b"\r\n\r\n")[2] == BIG
        stuck = socket.socket()
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stuck.connect(("127.0.0.1", port))
        stuck.sendall(b"GET /v1/preflight?big HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        try:
            time.sleep(0.2)  # its answer is partly sent; the rest waits for the selector
            for _ in range(20):
                started = time.monotonic()
                assert fetch(port, "/v1/preflight").endswith(b"\r\n\r\nsmall")
                assert time.monotonic() - started < 0.5
            wait_for(lambda: httpd.abuse.totals["client_gone"] == 1, 5)  # the write deadline
        finally:
            stuck.close()
        assert fetch(port, "/v1/preflight").endswith(b"small") and app.pooled == 0
        wait_for(lambda: httpd.open_connections == 0, 5)
    finally:
        httpd.shutdown()
        thread.join(5)
