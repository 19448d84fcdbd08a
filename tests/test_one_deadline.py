"""One deadline per call: a daemon that accepts and never answers costs one wait, once.

The console entry's fast path asks the daemon; when no answer comes it hands what it got (the
failure and the time spent) to the click path, which runs the probes here without asking
again. A mute daemon is a real listening socket whose connections are accepted, counted and
never answered.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpudiag.core import registry
from gpudiag.core.deadlines import daemon_wait_s, fallback_timeouts
from gpudiag.core.limits import CALL_BUDGET_S, DEFAULT_DAEMON_WAIT_S

CLICK_MAIN = "import sys; from gpudiag.cli.commands import main; sys.exit(main())"
# What moves between two probe runs: times, durations, nvidia-smi's clock, the wait's words.
_VOLATILE = (re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?Z"),
             re.compile(r"((?:duration_s|age_s)[\\\"]*[=:] ?)[0-9.e-]+"),
             re.compile(r"\w{3} \w{3} [ 0-9]\d \d\d:\d\d:\d\d \d{4}"),
             re.compile(r"pid [0-9]+"))


class MuteDaemon:
    """A socket that accepts every connection, counts it, and never says a word."""

    def __init__(self, family: int, address: str | tuple[str, int]) -> None:
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.bind(address)
        self.sock.listen(16)
        self.held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.held.append(conn)

    @property
    def connections(self) -> int:
        return len(self.held)

    def reset(self) -> None:
        for conn in self.held:
            conn.close()
        self.held.clear()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.reset()
        self.sock.close()


@pytest.fixture
def mute_unix(tmp_path: Path) -> Iterator[tuple[MuteDaemon, str]]:
    path = tmp_path / "mute.sock"
    mute = MuteDaemon(socket.AF_UNIX, str(path))
    try:
        yield mute, f"unix:{path}"
    finally:
        mute.close()


@pytest.fixture
def mute_tcp() -> Iterator[tuple[MuteDaemon, str]]:
    mute = MuteDaemon(socket.AF_INET, ("127.0.0.1", 0))
    try:
        yield mute, f"http://127.0.0.1:{mute.sock.getsockname()[1]}"
    finally:
        mute.close()


def _run(argv: list[str], env: dict[str, str], *, via_click: bool
         ) -> tuple[subprocess.CompletedProcess[str], float]:
    head = [sys.executable, "-c", CLICK_MAIN] if via_click else [sys.executable, "-m", "gpudiag"]
    t0 = time.monotonic()
    proc = subprocess.run([*head, *argv], env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    return proc, time.monotonic() - t0


def _steady(text: str) -> str:
    for pattern in _VOLATILE:
        text = pattern.sub(lambda m: m.group(1) if m.groups() else "", text)
    return text


@pytest.mark.parametrize("which", ["mute_unix", "mute_tcp"])
def test_a_mute_daemon_costs_one_connection_and_one_wait_on_both_paths(
        gpu_env: object, which: str, request: pytest.FixtureRequest) -> None:
    mute, url = request.getfixturevalue(which)
    env = {**gpu_env(), "GPUDIAG_DAEMON_USER": str(os.getuid())}  # type: ignore[operator]
    timeout_s = 4.0
    argv = ["preflight", "--format", "kv", "--timeout", f"{timeout_s:g}", "--daemon-url", url]
    inline, inline_s = _run([*argv[:5], "--no-daemon"], env, via_click=True)
    outputs = []
    for via_click in (False, True):  # the fast entry, then the click commands alone
        mute.reset()
        proc, took_s = _run(argv, env, via_click=via_click)
        assert mute.connections == 1, (via_click, mute.connections)
        # One wait of --timeout, then the probes as a --no-daemon call runs them; two waits
        # (the old double ask) would add another timeout_s.
        assert took_s < timeout_s + inline_s + timeout_s * 0.75, (via_click, took_s, inline_s)
        assert "source=inline" in proc.stdout
        assert "did not answer" in proc.stderr and "ran the probes here" in proc.stderr
        outputs.append((proc.returncode, _steady(proc.stdout), _steady(proc.stderr)))
    assert outputs[0] == outputs[1]
    assert outputs[0][0] == inline.returncode


def test_a_default_call_waits_once_and_its_fallback_fits_a_prolog_s_60_s() -> None:
    assert daemon_wait_s(None) == DEFAULT_DAEMON_WAIT_S
    assert daemon_wait_s(3.0) == 3.0
    cut = fallback_timeouts(registry.timeouts_s(), None, DEFAULT_DAEMON_WAIT_S)
    assert cut is not None
    # The longest probe after the longest default wait still ends inside the call's budget.
    assert DEFAULT_DAEMON_WAIT_S + max(cut.values()) <= CALL_BUDGET_S < 60
    assert fallback_timeouts(registry.timeouts_s(), 5.0, 5.0) is None  # --timeout is the user's
    assert fallback_timeouts(registry.timeouts_s(), None, 0.0) is None  # nothing waited


@pytest.mark.slow
def test_a_mute_daemon_on_a_default_call_keeps_the_whole_call_under_60_s(
        gpu_env: object, mute_unix: tuple[MuteDaemon, str]) -> None:
    mute, url = mute_unix
    env = {**gpu_env(), "GPUDIAG_DAEMON_USER": str(os.getuid())}  # type: ignore[operator]
    proc, took_s = _run(["preflight", "--require", "jax", "--gpus", "1", "--format", "kv",
                         "--daemon-url", url], env, via_click=False)
    assert mute.connections == 1
    assert DEFAULT_DAEMON_WAIT_S <= took_s < 60, took_s
    assert "source=inline" in proc.stdout


class ScriptedDaemon:
    """A real HTTP server on 127.0.0.1 that answers every request one scripted way, late or
    at once, and counts the connections: a slow, a refusing or a lying daemon."""

    def __init__(self, status: int, body: bytes, delay_s: float = 0.0) -> None:
        self.status, self.body, self.delay_s = status, body, delay_s
        self.requests = 0
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                owner.requests += 1
                time.sleep(owner.delay_s)
                try:
                    self.send_response(owner.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(owner.body)))
                    self.end_headers()
                    self.wfile.write(owner.body)
                except OSError:  # the client gave up first: what a slow daemon meets
                    pass

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _lying_record(env: dict[str, str]) -> bytes:
    """A real verdict record, rewritten to say not ready with no blocker (it cannot hold)."""
    proc, _ = _run(["preflight", "--format", "json", "--no-daemon"], env, via_click=True)
    record = json.loads(proc.stdout)
    record.update(ready=False, gpu_validation_blocker="none", blockers=[], source="daemon")
    return json.dumps(record).encode()


_FAILING = {
    # (status, body or None for the lie, delay, what stderr says)
    "slow": (200, b"{}", 6.0, "did not answer"),
    "refusing": (503, b'{"error": {"code": "unavailable", "message": "not yet"}}', 0.0,
                 "ran the probes here"),
    "lying": (200, None, 0.0, "does not hold"),
}


@pytest.mark.parametrize("how", sorted(_FAILING))
def test_a_slow_refusing_or_lying_daemon_costs_one_ask_and_the_same_answer_on_both_paths(
        gpu_env: object, how: str) -> None:
    env = {**gpu_env(), "GPUDIAG_DAEMON_USER": str(os.getuid())}  # type: ignore[operator]
    status, body, delay_s, said = _FAILING[how]
    daemon = ScriptedDaemon(status, body if body is not None else _lying_record(env), delay_s)
    timeout_s = 3.0
    argv = ["preflight", "--format", "kv", "--timeout", f"{timeout_s:g}"]
    try:
        inline, inline_s = _run([*argv, "--no-daemon"], env, via_click=True)
        outputs, times = [], []
        for via_click in (False, True):  # the fast entry, then the click commands alone
            daemon.requests = 0
            proc, took_s = _run([*argv, "--daemon-url", daemon.url], env, via_click=via_click)
            assert daemon.requests == 1, (how, via_click, daemon.requests)
            assert "source=inline" in proc.stdout, proc.stdout
            assert said in proc.stderr, proc.stderr
            # At most one wait (the slow daemon's --timeout), then the probes here.
            waited = timeout_s if delay_s > timeout_s else 0.0
            assert took_s < waited + inline_s + 2.5, (how, via_click, took_s, inline_s)
            outputs.append((proc.returncode, _steady(proc.stdout), _steady(proc.stderr)))
            times.append(took_s)
        assert outputs[0] == outputs[1]
        assert outputs[0][0] == inline.returncode
        assert abs(times[0] - times[1]) < 2.5, times  # equal failure timing on both paths
    finally:
        daemon.close()
