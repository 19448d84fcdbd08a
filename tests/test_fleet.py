"""`gpudiag fleet`: a real Prometheus scrapes three real `gpudiag serve` daemons on the fakes
(one healthy, one with a lost GPU, one with a busy GPU), and the CLI answers which nodes can
run `--require cuda --gpus 1` and `--gpus 2`, in text and JSON; a stopped daemon's node turns
unknown within the staleness window. Auth, TLS and Prometheus failures use small local
servers."""

from __future__ import annotations

import base64
import http.server
import json
import shutil
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpudiag.core.limits import EXIT_BLOCKED, EXIT_FAILED, EXIT_READY, EXIT_USAGE
from gpudiag.engine.fleet import (
    FleetQuery,
    FleetUsageError,
    PrometheusAccess,
    PrometheusClient,
    PrometheusError,
    ask_fleet,
)
from tests.fakes.build import FakeDriver
from tests.fakes.jobs import FakeJobs
from tests.support.daemon import Daemon
from tests.support.host import clean_env, free_port, run_gpudiag
from tests.support.prometheus import PROMETHEUS, node_env, start_daemon, start_prometheus

EXCLUSIVE_PROCESS = 3
# The CLI's staleness window in these tests; Prometheus scrapes every second.
MAX_AGE_S = 5


@dataclass
class FleetRig:
    prometheus_url: str
    healthy: Daemon
    lost: Daemon
    busy: Daemon

    def fleet(self, *args: str, url: str | None = None) -> subprocess.CompletedProcess[str]:
        return run_gpudiag(["fleet", "--prometheus", url or self.prometheus_url,
                            "--max-age", str(MAX_AGE_S), *args], clean_env(), timeout=60)

    def answer(self, *args: str) -> tuple[int, dict[str, Any]]:
        proc = self.fleet(*args, "--format", "json")
        assert proc.returncode in (EXIT_READY, EXIT_BLOCKED), proc.stdout + proc.stderr
        return proc.returncode, json.loads(proc.stdout)


def nodes_of(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n["instance"]: n for n in record["nodes"]}


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def rig(fakes: FakeDriver, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetRig]:
    if PROMETHEUS is None:
        pytest.skip("prometheus not installed (apt-get install prometheus)")
    root = tmp_path_factory.mktemp("fleet-cli")
    daemons: list[Daemon] = []

    def node(name: str, **knobs: str) -> Daemon:
        env = node_env(fakes, root / f"host-{name}", **knobs)
        # Fake GPUs share UUIDs across nodes: each node's GPU locks are its own.
        env["GPUDIAG_LOCK_DIR"] = str(root / f"locks-{name}")
        daemons.append(start_daemon(root / name, env))
        return daemons[-1]

    with FakeJobs(root / "jobs", compute_modes={0: EXCLUSIVE_PROCESS}) as jobs:
        prometheus = None
        try:
            healthy = node("a")
            # GPU 1: GPU_IS_LOST; GPU 0 on an older VBIOS than the other nodes' (--drift)
            lost = node("b", FAKE_NVML_DEVICE_ERRORS="1:15", FAKE_NVML_VBIOS="0:96.00.9F.00.01")
            busy = node("c", FAKE_GPU_STATE_FILE=str(jobs.state_file))
            jobs.start(0, memory_mib=70_000)  # someone else's job on node c's GPU 0
            prometheus = start_prometheus(root, [d.instance for d in daemons])
            rig = FleetRig(f"http://127.0.0.1:{prometheus.port}",  # type: ignore[attr-defined]
                           healthy, lost, busy)
            wait_for_answer(rig, lambda n: (
                n.get(healthy.instance, {}).get("gpus_ready_free") == 2
                and n.get(lost.instance, {}).get("gpu_validation_blocker") == "gpu_lost"
                and n.get(busy.instance, {}).get("gpus_ready_free") == 1))
            yield rig
        finally:
            if prometheus is not None:
                stop(prometheus)
            for d in daemons:
                d.stop()


def wait_for_answer(rig: FleetRig, done: Callable[[dict[str, dict[str, Any]]], bool],
                    *args: str, timeout_s: float = 90.0) -> dict[str, Any]:
    """Poll `gpudiag fleet --format json` until ``done(nodes)`` (scrapes take a moment)."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        proc = rig.fleet("--require", "cuda", "--gpus", "2", *args, "--format", "json")
        last = proc.stdout + proc.stderr
        if proc.returncode in (EXIT_READY, EXIT_BLOCKED):
            record: dict[str, Any] = json.loads(proc.stdout)
            if done(nodes_of(record)):
                return record
            last = record
        time.sleep(1.0)
    raise AssertionError(f"the fleet never answered as expected: {last}")


def test_one_gpu_jobs_can_run_on_every_node_with_a_free_healthy_gpu(rig: FleetRig) -> None:
    code, record = rig.answer("--require", "cuda", "--gpus", "1")
    assert code == EXIT_READY
    assert record["query"]["require"] == "cuda" and record["query"]["gpus"] == 1
    nodes = nodes_of(record)
    assert set(nodes) == {rig.healthy.instance, rig.lost.instance, rig.busy.instance}
    for instance, free in ((rig.healthy.instance, 2), (rig.lost.instance, 1),
                           (rig.busy.instance, 1)):
        node = nodes[instance]
        assert (node["ready"], node["gpus_ready_free"], node["gpu_validation_blocker"]) == (
            True, free, "none"), node
        # The evidence is the daemon's own recent cuda proof.
        assert node["age_s"] is not None and 0 <= node["age_s"] < 60, node
    assert set(record["nodes"][0]) >= {"instance", "ready", "gpus_ready_free",
                                       "gpu_validation_blocker", "age_s"}


def test_two_gpu_jobs_run_only_on_the_healthy_idle_node(rig: FleetRig) -> None:
    code, record = rig.answer("--require", "cuda", "--gpus", "2")
    assert code == EXIT_READY
    nodes = nodes_of(record)
    assert [n["instance"] for n in record["nodes"] if n["ready"]] == [rig.healthy.instance]
    lost, busy = nodes[rig.lost.instance], nodes[rig.busy.instance]
    assert (lost["ready"], lost["state"], lost["gpus_ready_free"],
            lost["gpu_validation_blocker"]) == (False, "blocked", 1, "gpu_lost")
    # A busy GPU is healthy in use: the node is not broken, the job just does not fit now.
    assert (busy["ready"], busy["gpus_ready_free"], busy["gpu_validation_blocker"]) == (
        False, 1, "devices_busy")


def test_text_output_names_each_node_its_state_and_blocker(rig: FleetRig) -> None:
    proc = rig.fleet("--require", "cuda", "--gpus", "2")
    assert proc.returncode == EXIT_READY, proc.stderr
    lines = {line.split()[0]: line.split() for line in proc.stdout.splitlines()[2:-1]}
    assert lines[rig.healthy.instance][1:4] == ["ready", "2", "none"]
    assert lines[rig.lost.instance][1:4] == ["blocked", "1", "gpu_lost"]
    assert lines[rig.busy.instance][1:4] == ["blocked", "1", "devices_busy"]
    assert proc.stdout.splitlines()[-1] == "1 of 3 node(s) can run it now"
    proc = rig.fleet("--require", "cuda", "--gpus", "1")
    assert proc.returncode == EXIT_READY, proc.stderr
    lines = {line.split()[0]: line.split() for line in proc.stdout.splitlines()[2:-1]}
    assert {i: row[1:4] for i, row in lines.items()} == {
        rig.healthy.instance: ["ready", "2", "none"], rig.lost.instance: ["ready", "1", "none"],
        rig.busy.instance: ["ready", "1", "none"]}
    assert proc.stdout.splitlines()[-1] == "3 of 3 node(s) can run it now"


def test_no_node_fits_exits_1(rig: FleetRig) -> None:
    code, record = rig.answer("--require", "cuda", "--gpus", "3")
    assert code == EXIT_BLOCKED
    assert not any(n["ready"] for n in record["nodes"])
    assert nodes_of(record)[rig.healthy.instance]["gpu_validation_blocker"] == \
        "insufficient_devices"


def test_a_backend_the_daemons_do_not_prove_is_never_ready(rig: FleetRig) -> None:
    code, record = rig.answer("--require", "jax", "--gpus", "1")
    assert code == EXIT_BLOCKED
    assert {n["state"] for n in record["nodes"]} == {"blocked"}
    assert all("jax not proven" in n["reason"] for n in record["nodes"])


def test_the_recording_rules_agree_with_the_cli(rig: FleetRig) -> None:
    client = PrometheusClient(PrometheusAccess(rig.prometheus_url))
    expr = 'gpudiag:gpus_ready_free:by_backend{backend="cuda"}'
    deadline = time.monotonic() + 30
    got: dict[str, float] = {}
    while time.monotonic() < deadline:
        got = {labels["instance"]: value for labels, value in client.query(expr)}
        if got == {rig.healthy.instance: 2, rig.lost.instance: 1, rig.busy.instance: 1}:
            break
        time.sleep(1)
    assert got == {rig.healthy.instance: 2, rig.lost.instance: 1, rig.busy.instance: 1}


def test_qualified_counts_only_gpus_that_passed_qualification_lately(rig: FleetRig) -> None:
    # The rig's daemons qualify each idle GPU once, soon after they start (test_grafana's
    # FLEET_CONFIG): node a's two GPUs pass, so a two-GPU job that wants them qualified fits.
    record = wait_for_answer(rig, lambda n: bool(n.get(rig.healthy.instance, {}).get("ready")),
                             "--qualified", "3600")
    assert record["query"]["qualified_within_s"] == 3600
    time.sleep(1.5)
    code, record = rig.answer("--require", "cuda", "--gpus", "1", "--qualified", "1")
    assert code == EXIT_BLOCKED, record
    node = nodes_of(record)[rig.healthy.instance]
    assert node["state"] == "blocked" and "passed qualification within 1 s" in node["reason"]


def test_drift_names_the_node_whose_gpu_inventory_differs_from_the_others(
        rig: FleetRig) -> None:
    proc = rig.fleet("--drift", "--format", "json")
    assert proc.returncode == EXIT_BLOCKED, proc.stdout + proc.stderr
    record = json.loads(proc.stdout)
    assert record["query"] == {"job": "gpudiag", "drift_by": "partition"}
    nodes = nodes_of(record)
    assert nodes[rig.lost.instance]["fields"] == [
        {"field": "vbios_version", "value": "96.00.9F.00.01", "majority": "96.00.9F.00.04",
         "agree": 2, "of": 3}]
    assert nodes[rig.healthy.instance]["drifted"] is False
    assert {n["model"] for n in nodes.values()} == {"NVIDIA H200"}
    text = rig.fleet("--drift")
    assert text.returncode == EXIT_BLOCKED
    assert (f"{rig.lost.instance} (partition=-, NVIDIA H200): vbios_version 96.00.9F.00.01, "
            "the majority 96.00.9F.00.04 (2 of 3 nodes)") in text.stdout
    bad = rig.fleet("--drift", "--drift-by", "not a label")
    assert bad.returncode == EXIT_USAGE and "--drift-by" in bad.stderr


def test_usage_errors_exit_2(rig: FleetRig) -> None:
    for args in (("--require", "cudnn"), ("--gpus", "0"), ("--max-age", "0")):
        proc = rig.fleet(*args)
        assert proc.returncode == EXIT_USAGE, (args, proc.stderr)
        assert "Traceback" not in proc.stderr and "Error" in proc.stderr
    proc = rig.fleet(url="prometheus:9090")
    assert proc.returncode == EXIT_USAGE and "not an http(s) URL" in proc.stderr


def test_prometheus_that_cannot_be_asked_exits_3_with_a_clear_message(rig: FleetRig) -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    proc = rig.fleet(url=closed)
    assert proc.returncode == EXIT_FAILED
    assert f"cannot reach Prometheus at {closed}" in proc.stderr
    assert "Traceback" not in proc.stderr
    # A daemon is not Prometheus: its 404 is named, not parsed.
    proc = rig.fleet(url=rig.healthy.url)
    assert proc.returncode == EXIT_FAILED and "HTTP 404" in proc.stderr, proc.stderr
    # A bad PromQL job name would be refused by Prometheus: the CLI refuses it first.
    proc = rig.fleet("--job", 'x"y')
    assert proc.returncode == EXIT_USAGE


# This one stops the healthy daemon: it must run last in this module.
def test_a_stopped_daemon_turns_its_node_unknown_within_the_staleness_window(
        rig: FleetRig) -> None:
    rig.healthy.stop()
    stopped = time.monotonic()
    record = wait_for_answer(
        rig, lambda n: n.get(rig.healthy.instance, {}).get("state") == "unknown",
        timeout_s=MAX_AGE_S + 10)
    assert time.monotonic() - stopped <= MAX_AGE_S + 10
    node = nodes_of(record)[rig.healthy.instance]
    assert (node["ready"], node["gpus_ready_free"], node["gpu_validation_blocker"]) == (
        False, None, None)
    # Nobody else fits two GPUs: exit 1, and the unknown node is listed last.
    proc = rig.fleet("--require", "cuda", "--gpus", "2", "--format", "json")
    assert proc.returncode == EXIT_BLOCKED
    assert json.loads(proc.stdout)["nodes"][-1]["instance"] == rig.healthy.instance


# --- auth, TLS and odd answers, against a small local stand-in for the query API ------------

EMPTY = {"status": "success", "data": {"resultType": "vector", "result": []}}


class Recorder(http.server.BaseHTTPRequestHandler):
    seen: list[dict[str, str]] = []
    answer: tuple[int, bytes] = (200, json.dumps(EMPTY).encode())

    def do_GET(self) -> None:
        type(self).seen.append(dict(self.headers))
        status, body = type(self).answer
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def standin() -> Iterator[tuple[str, type[Recorder]]]:
    handler = type("H", (Recorder,), {"seen": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


def test_basic_auth_and_bearer_token_are_sent(standin: tuple[str, type[Recorder]],
                                              tmp_path: Path) -> None:
    url, handler = standin
    (tmp_path / "pw").write_text("s3cret\n")
    proc = run_gpudiag(["fleet", "--prometheus", url, "--user", "ops",
                        "--password-file", str(tmp_path / "pw")], clean_env())
    assert proc.returncode == EXIT_BLOCKED, proc.stderr  # no nodes: none can run it
    assert "no nodes" in proc.stdout
    expected = "Basic " + base64.b64encode(b"ops:s3cret").decode()
    assert {h["Authorization"] for h in handler.seen} == {expected}
    handler.seen.clear()
    (tmp_path / "token").write_text("tok-123\n")
    proc = run_gpudiag(["fleet", "--prometheus", url, "--bearer-token-file",
                        str(tmp_path / "token")], clean_env())
    assert proc.returncode == EXIT_BLOCKED, proc.stderr
    assert {h["Authorization"] for h in handler.seen} == {"Bearer tok-123"}
    proc = run_gpudiag(["fleet", "--prometheus", url, "--bearer-token-file",
                        str(tmp_path / "absent")], clean_env())
    assert proc.returncode == EXIT_USAGE and "bearer token file" in proc.stderr


def test_refused_credentials_and_non_prometheus_answers_exit_3(
        standin: tuple[str, type[Recorder]]) -> None:
    url, handler = standin
    handler.answer = (401, b"Unauthorized")
    proc = run_gpudiag(["fleet", "--prometheus", url], clean_env())
    assert proc.returncode == EXIT_FAILED and "HTTP 401" in proc.stderr
    assert "--bearer-token-file" in proc.stderr and "Traceback" not in proc.stderr
    handler.answer = (200, b"<html>a login page</html>")
    proc = run_gpudiag(["fleet", "--prometheus", url], clean_env())
    assert proc.returncode == EXIT_FAILED and "did not answer like Prometheus" in proc.stderr
    handler.answer = (200, json.dumps({"status": "error", "error": "parse error"}).encode())
    with pytest.raises(PrometheusError, match="parse error"):
        PrometheusClient(PrometheusAccess(url)).query("up")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")
def test_tls_is_verified_by_default(tmp_path: Path) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    handler = type("H", (Recorder,), {"seen": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"https://127.0.0.1:{server.server_address[1]}"
    try:
        proc = run_gpudiag(["fleet", "--prometheus", url, "--timeout", "5"], clean_env())
        assert proc.returncode == EXIT_FAILED and "CERTIFICATE_VERIFY_FAILED" in proc.stderr
        for extra in (["--ca-file", str(cert)], ["--insecure-skip-tls-verify"]):
            proc = run_gpudiag(["fleet", "--prometheus", url, *extra], clean_env())
            assert proc.returncode == EXIT_BLOCKED, proc.stderr
        proc = run_gpudiag(["fleet", "--prometheus", url, "--ca-file", str(tmp_path / "no")],
                           clean_env())
        assert proc.returncode == EXIT_USAGE and "--ca-file" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
    finally:
        server.shutdown()
        server.server_close()


def test_query_rejects_what_cannot_be_asked() -> None:
    with pytest.raises(FleetUsageError, match="at least 1"):
        FleetQuery(gpus=0)
    with pytest.raises(FleetUsageError, match="not both"):
        PrometheusAccess("http://p:9090", username="u", bearer_token="t")
    answer = ask_fleet(FleetQuery(), _NoNodes(), url="http://p:9090")
    assert answer.record() == {
        "query": {"require": "cuda", "gpus": 1, "job": "gpudiag", "max_age_s": 120.0,
                  "prometheus": "http://p:9090", "evaluated_at": 1000.0},
        "nodes": []}


class _NoNodes(PrometheusClient):
    def __init__(self) -> None:
        pass

    def query(self, expr: str, at: float | None = None
              ) -> list[tuple[Mapping[str, str], float]]:
        return [({}, 1000.0)] if expr == "vector(time())" else []
