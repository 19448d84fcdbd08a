"""The HTTP API as a WSGI app (no socket), over a real scheduler replaying real probe runs."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeAlias

import pytest

from gpudiag.daemon.app import MAX_BODY_BYTES, MAX_PARAMS, MAX_URL_BYTES, DaemonApp, serve
from gpudiag.daemon.scheduler import Scheduler
from gpudiag.daemon.snapshot import Snapshot
from gpudiag.daemon.store import HistoryStore
from tests.fakes.build import FakeDriver
from tests.support.daemon import Replay, Runs, host_env, quick_config, real_runs, wait_for, wsgi


@pytest.fixture(scope="module")
def healthy_runs(fakes: FakeDriver, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return real_runs(host_env(fakes, tmp_path_factory.mktemp("host"), FAKE_NVML_DEVICE_COUNT=2))


# The started fixture: the app and the replay behind it.
Started: TypeAlias = tuple[DaemonApp, Replay]


@pytest.fixture
def started(healthy_runs: Runs, tmp_path: Path) -> Iterator[Started]:
    replay = Replay(dict(healthy_runs))
    sched = Scheduler(quick_config(), runner=replay, env={})
    store = HistoryStore(tmp_path / "h.sqlite3")

    def record(snap: Snapshot) -> None:
        if snap.full is not None:
            store.record(snap.full)

    sched.on_snapshot(record)
    sched.start()
    app = DaemonApp(sched, store)
    wait_for(lambda: sched.snapshot().round_complete, 5)
    yield app, replay
    sched.stop()
    store.close()


def _json(body: bytes) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(body)
    return data


def test_preflight_answers_from_the_snapshot_with_source_daemon(started: Started) -> None:
    app, replay = started
    calls = len(replay.calls)
    status, headers, body = wsgi(app, "/v1/preflight?require=cuda")
    rec = _json(body)
    assert status == 200 and headers["Content-Type"] == "application/json"
    assert rec["gpu_validation_blocker"] == "none" and rec["ready"] is True
    assert rec["source"] == "daemon" and rec["age_s"] >= 0
    assert [d["index"] for d in rec["devices"]] == [0, 1]
    assert len(replay.calls) == calls  # nothing was re-probed


def test_preflight_uses_the_cli_requirement_syntax(started: Started) -> None:
    app, _ = started
    status, _, body = wsgi(app, "/v1/preflight?require=cuda&devices=0,1&min_devices=2"
                                "&min_free_memory=8GiB")
    rec = _json(body)
    assert status == 200 and rec["ready"] is True
    assert rec["requirement"]["min_free_memory_bytes"] == 8 * 2**30
    status, _, body = wsgi(app, "/v1/preflight?require=cuda&min_devices=3")
    rec = _json(body)
    assert status == 200 and rec["gpu_validation_blocker"] == "insufficient_devices"


def test_preflight_past_max_age_runs_the_probes_first(started: Started) -> None:
    app, replay = started
    before = len(replay.calls)
    time.sleep(0.05)
    status, _, body = wsgi(app, "/v1/preflight?require=cuda&max_age_s=0")
    assert status == 200 and _json(body)["fresh"] is True
    # The cuda probe reads NVML once more right before it (DESIGN "Busy GPUs": occupancy is
    # fresh when a context is made), so nvml runs twice: the requested run and that read.
    assert sorted(replay.calls[before:]) == ["cuda", "host", "nvml", "nvml"]


def test_callers_visibility_is_classified_not_the_daemons(started: Started) -> None:
    app, _ = started
    status, _, body = wsgi(app, "/v1/preflight?require=cuda&visibility=1"
                                "&cuda_visible_devices=7")
    rec = _json(body)
    assert status == 200 and rec["gpu_validation_blocker"] == "visible_devices_invalid"
    status, _, body = wsgi(app, "/v1/preflight?require=cuda&visibility=1"
                                "&cuda_visible_devices=1")
    rec = _json(body)
    assert rec["ready"] is True and [d["index"] for d in rec["devices"]] == [1]


@pytest.mark.parametrize("query, code", [
    ("require=cuda,tpu", "bad_requirement"),
    ("require=", "bad_requirement"),
    ("devices=zero", "bad_requirement"),
    ("min_devices=-1", "bad_parameter"),
    ("min_devices=abc", "bad_parameter"),
    ("min_free_memory=lots", "bad_requirement"),
    ("max_age_s=nan", "bad_parameter"),
    ("max_age_s=-5", "bad_parameter"),
    ("wait_s=99999", "bad_parameter"),
    ("visibility=maybe", "bad_parameter"),
    ("color=blue", "unknown_parameter"),
    ("require=cuda&require=jax", "bad_parameter"),
])
def test_bad_preflight_parameters_get_400_with_the_envelope(started: Started, query: str,
                                                             code: str) -> None:
    app, _ = started
    status, _, body = wsgi(app, f"/v1/preflight?{query}")
    err = _json(body)["error"]
    assert status == 400 and err["code"] == code and err["message"]


def test_request_limits_answer_414_400_and_413(started: Started) -> None:
    app, _ = started
    status, _, body = wsgi(app, "/v1/preflight?require=" + "c" * (MAX_URL_BYTES + 1))
    assert status == 414 and _json(body)["error"]["code"] == "uri_too_long"
    many = "&".join(f"p{i}=1" for i in range(MAX_PARAMS + 1))
    status, _, body = wsgi(app, f"/v1/preflight?{many}")
    assert status == 400 and _json(body)["error"]["code"] == "too_many_parameters"
    status, _, body = wsgi(app, "/v1/probe", method="POST", body_length=MAX_BODY_BYTES + 1)
    assert status == 413 and _json(body)["error"]["code"] == "body_too_large"


def test_unknown_paths_and_methods_get_the_envelope(started: Started) -> None:
    app, _ = started
    status, _, body = wsgi(app, "/v2/nothing")
    assert status == 404 and _json(body)["error"]["code"] == "not_found"
    status, _, body = wsgi(app, "/v1/preflight", method="DELETE")
    assert status == 405 and _json(body)["error"]["code"] == "method_not_allowed"
    status, _, body = wsgi(app, "/v1/probe")  # GET on a POST endpoint
    assert status == 405


def test_post_probe_runs_now_and_answers_202(started: Started) -> None:
    app, replay = started
    before = len(replay.calls)
    status, _, body = wsgi(app, "/v1/probe?backend=nvml", method="POST")
    assert status == 202 and _json(body)["accepted"] == ["nvml"]
    wait_for(lambda: replay.calls[before:] == ["nvml"], 5)
    status, _, body = wsgi(app, "/v1/probe?backend=gpu9", method="POST")
    assert status == 400 and _json(body)["error"]["code"] == "bad_backend"


def test_probes_are_single_flight(healthy_runs: Runs) -> None:
    gate = threading.Event()
    replay = Replay(dict(healthy_runs), gate=gate)
    sched = Scheduler(quick_config(), runner=replay, env={})
    app = DaemonApp(sched)
    try:
        for _ in range(5):
            assert wsgi(app, "/v1/probe?backend=nvml", method="POST")[0] == 202
        time.sleep(0.1)
        assert replay.calls == ["nvml"]
        gate.set()
        wait_for(lambda: sched.snapshot().result("nvml") is not None, 5)
    finally:
        gate.set()
        sched.stop()


def test_no_snapshot_and_probes_still_running_answers_503(healthy_runs: Runs) -> None:
    gate = threading.Event()
    sched = Scheduler(quick_config(), runner=Replay(dict(healthy_runs), gate=gate), env={})
    app = DaemonApp(sched)
    try:
        sched.start()
        status, _, body = wsgi(app, "/v1/preflight?wait_s=0.2")
        err = _json(body)["error"]
        assert status == 503 and err["code"] == "not_ready" and "nvml" in err["message"]
        status, _, body = wsgi(app, "/readyz")
        assert status == 503 and _json(body)["error"]["code"] == "first_round_pending"
        assert wsgi(app, "/healthz")[0] == 200
        gate.set()
        wait_for(lambda: wsgi(app, "/readyz")[0] == 200, 5)
    finally:
        gate.set()
        sched.stop()


def test_healthz_fails_when_the_loop_is_not_running(healthy_runs: Runs) -> None:
    sched = Scheduler(quick_config(), runner=Replay(dict(healthy_runs)), env={})
    status, _, body = wsgi(DaemonApp(sched), "/healthz")
    assert status == 503 and _json(body)["error"]["code"] == "loop_stalled"


def test_history_endpoint_lists_verdict_changes(started: Started) -> None:
    app, _ = started
    wait_for(lambda: _json(wsgi(app, "/v1/history")[2])["verdicts"], 5)
    status, _, body = wsgi(app, "/v1/history?limit=5")
    rec = _json(body)
    assert status == 200 and rec["verdicts"][0]["gpu_validation_blocker"] == "none"
    status, _, body = wsgi(app, "/v1/history?blocked=1")
    assert status == 200 and _json(body)["verdicts"] == []
    status, _, body = wsgi(app, "/v1/history?limit=0")
    assert status == 400


def test_metrics_render_prometheus_text(started: Started) -> None:
    app, _ = started
    status, headers, body = wsgi(app, "/metrics")
    text = body.decode()
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    assert "gpudiag_ready 1.0" in text
    assert 'gpudiag_blocker{code="gpu_lost",layer="device"} 0.0' in text


def test_threaded_server_answers_over_loopback_while_a_preflight_waits(
        healthy_runs: Runs) -> None:
    import urllib.request

    gate = threading.Event()
    sched = Scheduler(quick_config(), runner=Replay(dict(healthy_runs), gate=gate), env={})
    sched.start()
    httpd, _ = serve(DaemonApp(sched), "127.0.0.1", 0)
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        waiting = threading.Thread(
            target=lambda: urllib.request.urlopen(url + "/v1/preflight?wait_s=3", timeout=10),
            daemon=True)
        waiting.start()
        time.sleep(0.1)
        started_at = time.perf_counter()
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            assert r.status == 200
        # Not behind the waiting question (that would be its 3 s or the 5 s timeout).
        assert time.perf_counter() - started_at < 2.5
        gate.set()
        waiting.join(5)
    finally:
        gate.set()
        httpd.shutdown()
        sched.stop()


def test_default_requirement_drives_ready_and_a_bare_preflight(healthy_runs: Runs) -> None:
    runs = dict(healthy_runs)
    sched = Scheduler(quick_config(default_requirement="nvml"), runner=Replay(runs), env={})
    try:
        sched.start()
        app = DaemonApp(sched)
        wait_for(lambda: wsgi(app, "/readyz")[0] == 200, 5)
        status, _, body = wsgi(app, "/v1/preflight")
        assert status == 200 and _json(body)["requirement"]["backends"] == ["nvml"]
        assert "gpudiag_ready 1.0" in wsgi(app, "/metrics")[2].decode()
    finally:
        sched.stop()


def test_a_probe_variant_nobody_schedules_runs_on_demand_once(healthy_runs: Runs) -> None:
    from gpudiag.core.probe_run import ProbeRun

    runs = dict(healthy_runs)
    runs["jax"] = ProbeRun("jax", {"ok": False}, 0.1, exit_code=0)
    replay = Replay(runs)
    sched = Scheduler(quick_config(), runner=replay, env={})
    try:
        sched.start()
        app = DaemonApp(sched)
        wait_for(lambda: sched.snapshot().round_complete, 5)
        assert "jax" not in replay.calls
        # Asked from the daemon's own environment (its fingerprint): proven by the daemon.
        from gpudiag.core.requirement import parse_requirement
        from gpudiag.engine.client import environment_ids
        from gpudiag.engine.fingerprint import query_value
        from gpudiag.engine.jobpython import this_process

        fp = query_value(environment_ids(parse_requirement("jax:cpu"), {}, this_process()))
        assert wsgi(app, f"/v1/preflight?require=jax:cpu&fingerprint={fp}")[0] == 200
        assert wsgi(app, f"/v1/preflight?require=jax:cpu&fingerprint={fp}")[0] == 200
        assert replay.calls.count("jax") == 1  # then served from the snapshot
    finally:
        sched.stop()


def test_every_http_answer_has_the_standard_phrase_and_errors_one_envelope() -> None:
    from http import HTTPStatus

    from gpudiag.daemon.envelope import error_response, status_line, wire_bytes
    from gpudiag.daemon.httpserver import error_response as transport_error

    for status in (200, 400, 404, 405, 413, 414, 429, 431, 500, 503):
        assert status_line(status) == f"{status} {HTTPStatus(status).phrase}"
    assert status_line(599) == "599 "
    line, headers, body = error_response(429, "rate_limited", "slow down", retry_after_s=0.2)
    assert line == "429 Too Many Requests" and ("Retry-After", "1") in headers
    assert json.loads(body) == {"error": {"code": "rate_limited", "message": "slow down"}}
    # The transport's refusals are the same envelope, on a connection that then closes.
    raw = transport_error(503, "busy", "try again")
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
    assert b"Retry-After: 1" in head and head.endswith(b"Connection: close")
    assert json.loads(payload) == {"error": {"code": "busy", "message": "try again"}}
    # An app's own Connection header never reaches the wire twice.
    assert wire_bytes("200 OK", [("Connection", "keep-alive")], b"").count(b"Connection") == 1
