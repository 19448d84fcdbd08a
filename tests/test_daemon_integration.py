"""`gpudiag serve` as a real process on the fake driver: Prometheus, hangs, XIDs, client, kill."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpudiag.engine.processes import cmdline
from tests.fakes.build import FakeDriver, write_state_file
from tests.support.daemon import (
    Daemon,
    daemon_toml,
    host_env,
    wait_for,
    write_config,
)
from tests.support.host import free_port, processes_with_env, run_gpudiag, verdict_of


@pytest.fixture
def rig(fakes: FakeDriver, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A fake host (2 GPUs) whose state file the test rewrites while the daemon runs."""
    state = tmp_path / "gpu-state"
    write_state_file(state, {"FAKE_NVML_DEVICE_COUNT": 2})
    env = host_env(fakes, tmp_path / "host", gpus=2, FAKE_GPU_STATE_FILE=str(state))
    daemons: list[Daemon] = []

    def start(nvml_deadline: float = 10) -> Daemon:
        cfg = write_config(tmp_path / "gpudiag.toml",
                           daemon_toml({"backends.nvml": {"deadline_s": nvml_deadline}}))
        d = Daemon(env, cfg, tmp_path / "state")
        daemons.append(d)
        return d

    yield {"state": state, "env": env, "start": start, "tmp": tmp_path}
    for d in daemons:
        d.stop()
    # Nothing the daemon started (probe children, the watcher) outlives it.
    try:
        wait_for(lambda: not processes_with_env(str(state)), 5)
    except AssertionError:
        raise AssertionError(f"orphans: {processes_with_env(str(state))}") from None


def _metric(text: str, line_start: str) -> float:
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {line_start!r} in /metrics")


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # gone meanwhile
        return b""


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus is not installed")
def test_prometheus_scrapes_ready_blockers_and_gpus_then_sees_a_new_blocker(rig: dict[str, Any]
                                                                            ) -> None:
    daemon = rig["start"]()
    daemon.wait_ready()
    tmp: Path = rig["tmp"]
    target = daemon.url.removeprefix("http://")
    (tmp / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\n"
        f"scrape_configs:\n  - job_name: gpudiag\n    static_configs:\n"
        f"      - targets: ['{target}']\n")
    port = free_port()
    prom = subprocess.Popen(
        ["prometheus", f"--config.file={tmp / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}",
         "--log.level=warn"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        start_new_session=True)
    api = f"http://127.0.0.1:{port}/api/v1/query?query="

    def query(expr: str) -> list[dict[str, Any]]:
        try:
            with urllib.request.urlopen(api + urllib.parse.quote(expr), timeout=5) as r:
                return list(json.load(r)["data"]["result"])
        except OSError:
            return []

    try:
        ready = wait_for(lambda: query("gpudiag_ready"), 25, 0.25)
        assert ready[0]["value"][1] == "1"
        blockers = query("gpudiag_blocker")
        assert len(blockers) >= 40 and {b["value"][1] for b in blockers} == {"0"}
        gpus = query("gpudiag_gpu_info")
        assert sorted(g["metric"]["gpu"] for g in gpus) == ["0", "1"]
        assert len(query("gpudiag_gpu_memory_total_bytes")) == 2
        # GPU 1 falls off the bus while the daemon runs.
        write_state_file(rig["state"], {"FAKE_NVML_DEVICE_COUNT": 2,
                                        "FAKE_NVML_DEVICE_ERRORS": "1:15"})
        lost = wait_for(lambda: [r for r in query('gpudiag_blocker{code="gpu_lost"} == 1')], 15,
                        0.25)
        assert lost[0]["metric"]["layer"] == "device"
        assert wait_for(lambda: query("gpudiag_ready == 0"), 10, 0.25)
    finally:
        os.killpg(prom.pid, signal.SIGTERM)
        prom.wait(10)


def test_a_hung_probe_never_slows_metrics_or_preflight(rig: dict[str, Any]) -> None:
    daemon = rig["start"](nvml_deadline=1.5)
    daemon.wait_ready()
    assert daemon.get("/v1/preflight")[1]["gpu_validation_blocker"] == "none"
    write_state_file(rig["state"], {"FAKE_NVML_DEVICE_COUNT": 2, "FAKE_NVML_INIT_HANG": 1})
    hung_at = time.monotonic()
    client_ms: list[float] = []
    server_ms: list[float] = []
    verdict: dict[str, Any] = {}
    while time.monotonic() - hung_at < 8:
        for path in ("/metrics", "/v1/preflight"):
            t = time.perf_counter()
            status, body = daemon.get(path)
            client_ms.append((time.perf_counter() - t) * 1000)
            server_ms.append(daemon.server_ms)
            assert status == 200
            if path == "/v1/preflight":
                verdict = body
        if verdict["gpu_validation_blocker"] == "probe_timeout":
            break
        time.sleep(0.02)
    became = time.monotonic() - hung_at
    assert verdict["gpu_validation_blocker"] == "probe_timeout", verdict["blockers"]
    assert verdict["blockers"][0]["backend"] == "nvml"
    assert "missed its 1.5 s deadline" in verdict["blockers"][0]["message"]
    # Killed at its deadline: the hung child ran 1.5 s (plus the kill), no longer.
    # Liveness bounds only (issue 50): killed, not left hanging; the figures (a 1.5 s run, a
    # verdict within interval + deadline) are docs/benchmarks.md's, not this test's.
    assert 1.5 <= verdict["backends"]["nvml"]["duration_s"] < 8
    assert became < 8
    # No answer waits for the hung probe: under the 1.5 s a blocked thread would take. The
    # latency figures (usually 15-25 ms here) are benchmarks/daemon.py's and
    # benchmarks/preflight_p99.py's; a loaded machine may delay any answer by hundreds of ms.
    client_ms.sort()
    p99 = client_ms[int(len(client_ms) * 0.99)]
    seen = f"p99 {p99:.1f} ms, max {client_ms[-1]:.1f} ms over {len(client_ms)} answers"
    assert max(server_ms) < 500, f"daemon took {max(server_ms):.1f} ms while a probe hung"
    assert p99 < 500 and client_ms[-1] < 1400, seen
    status, text = daemon.get("/metrics")
    assert _metric(text, 'gpudiag_probe_runs_total{backend="nvml",outcome="timeout"}') >= 1
    assert _metric(text, 'gpudiag_blocker{code="probe_timeout",layer="probe"}') == 1
    assert daemon.stop() == 0


def test_xid_79_is_gpu_lost_and_xid_13_only_a_warning(rig: dict[str, Any]) -> None:
    daemon = rig["start"]()
    daemon.wait_ready()
    wait_for(lambda: _metric(daemon.get("/metrics")[1], "gpudiag_xid_watcher_up") == 1, 10)
    before = time.time()
    write_state_file(rig["state"], {"FAKE_NVML_DEVICE_COUNT": 2, "FAKE_NVML_XIDS": "1:13"})
    rec = wait_for(lambda: (r := daemon.get("/v1/preflight")[1])["warnings"] and r, 10)
    assert rec["ready"] is True and rec["gpu_validation_blocker"] == "none"
    assert [w["code"] for w in rec["warnings"]] == ["gpu_xid_application"]
    write_state_file(rig["state"], {"FAKE_NVML_DEVICE_COUNT": 2,
                                    "FAKE_NVML_XIDS": "1:13,0:79,1:13"})
    rec = wait_for(lambda: (r := daemon.get("/v1/preflight")[1])["blockers"] and r, 10)
    after = time.time()
    assert rec["gpu_validation_blocker"] == "gpu_lost"
    assert rec["blockers"][0]["device"] == "GPU-f00d0000-0000-4000-8000-000000000000"
    assert "XID 79" in rec["blockers"][0]["message"]
    text = wait_for(lambda: (t := daemon.get("/metrics")[1]).count("gpudiag_gpu_xid_errors_total{")
                    == 2 and 'xid="13"} 2.0' in t and t, 10)
    u0, u1 = "GPU-f00d0000-0000-4000-8000-000000000000", "GPU-f00d0001-0000-4000-8000-000000000001"
    assert _metric(text, f'gpudiag_gpu_xid_errors_total{{gpu="0",uuid="{u0}",xid="79"}}') == 1
    assert _metric(text, f'gpudiag_gpu_xid_errors_total{{gpu="1",uuid="{u1}",xid="13"}}') == 2
    for gpu, uuid, xid in (("0", u0, "79"), ("1", u1, "13")):
        ts = _metric(text, f'gpudiag_gpu_xid_last_timestamp_seconds{{gpu="{gpu}",uuid="{uuid}",'
                           f'xid="{xid}"}}')
        assert before <= ts <= after
    assert _metric(text, 'gpudiag_blocker{code="gpu_lost",layer="device"}') == 1
    assert _metric(text, 'gpudiag_warning{code="gpu_xid_application",layer="device"}') == 1
    if shutil.which("promtool"):  # the daemon's real output, XID series included
        lint = subprocess.run(["promtool", "check", "metrics"], input=text, text=True,
                              capture_output=True, timeout=30, check=False)
        assert lint.returncode == 0 and not (lint.stdout + lint.stderr).strip(), lint.stdout
    # The history recorded the change with its evidence, readable while the daemon runs.
    proc = run_gpudiag(["history", "--state-dir", str(rig["tmp"] / "state"), "--json"],
                       rig["env"])
    hist = json.loads(proc.stdout)
    assert hist["verdicts"][0]["gpu_validation_blocker"] == "gpu_lost"
    assert any(e["code"] == "gpu_lost" and e["ended"] is None for e in hist["episodes"])


def test_a_dying_watcher_is_restarted_and_its_gap_becomes_a_warning(rig: dict[str, Any]) -> None:
    daemon = rig["start"]()
    daemon.wait_ready()
    # NVML init now fails for every new child: the watcher keeps dying on restart.
    write_state_file(rig["state"], {"FAKE_NVML_DEVICE_COUNT": 2, "FAKE_NVML_INIT_ERROR": 999})
    watchers = [p for p in processes_with_env(str(rig["state"]))
                if b"xid_watch" in _cmdline(p)]
    assert len(watchers) == 1
    os.kill(watchers[0], signal.SIGKILL)
    text = wait_for(lambda: (t := daemon.get("/metrics")[1]) and _metric(
        t, "gpudiag_xid_watcher_restarts_total") >= 2 and t, 10)
    assert _metric(text, "gpudiag_xid_watcher_up") == 0
    assert _metric(text, "gpudiag_xid_watcher_gap_seconds_total") > 0
    write_state_file(rig["state"], {"FAKE_NVML_DEVICE_COUNT": 2})
    wait_for(lambda: _metric(daemon.get("/metrics")[1], "gpudiag_xid_watcher_up") == 1, 10)
    assert any("XID watcher down" in line for line in daemon.lines)


def test_gap_past_the_limit_is_the_xid_watcher_gap_warning(rig: dict[str, Any]) -> None:
    daemon = rig["start"]()
    daemon.wait_ready()
    write_state_file(rig["state"], {"FAKE_NVML_DEVICE_COUNT": 2, "FAKE_NVML_INIT_ERROR": 999})
    for p in processes_with_env(str(rig["state"])):
        if b"xid_watch" in _cmdline(p):
            os.kill(p, signal.SIGKILL)
    # gap_warning_s is 5 in DAEMON_CONFIG; nvml now blocks too, the warning rides along.
    rec = wait_for(lambda: (r := daemon.get("/v1/preflight")[1]) and any(
        w["code"] == "xid_watcher_gap" for w in r["warnings"]) and r, 12, 0.2)
    assert "down for" in next(w for w in rec["warnings"]
                              if w["code"] == "xid_watcher_gap")["message"]


def test_preflight_cli_asks_the_daemon_then_falls_back_inline(rig: dict[str, Any]) -> None:
    daemon = rig["start"]()
    daemon.wait_ready()
    env = dict(rig["env"])
    code, rec = verdict_of(["preflight", "--format", "json", "--daemon-url", daemon.url], env)
    assert code == 0 and rec["source"] == "daemon" and rec["age_s"] >= 0
    env["GPUDIAG_DAEMON_URL"] = daemon.url
    env["CUDA_VISIBLE_DEVICES"] = "5"
    code, rec = verdict_of(["preflight", "--format", "json"], env)
    assert code == 1 and rec["source"] == "daemon"
    assert rec["gpu_validation_blocker"] == "visible_devices_invalid"
    del env["CUDA_VISIBLE_DEVICES"]
    code, rec = verdict_of(["preflight", "--format", "json", "--no-daemon"], env)
    assert code == 0 and rec["source"] == "inline"
    free = f"http://127.0.0.1:{free_port()}"
    t = time.monotonic()
    code, rec = verdict_of(["preflight", "--format", "json", "--daemon-url", free], env)
    assert code == 0 and rec["source"] == "inline" and time.monotonic() - t < 20
    proc = run_gpudiag(["preflight", "--daemon-url", "ftp://x"], env)
    assert proc.returncode == 2 and "--daemon-url" in proc.stderr and "Traceback" not in (
        proc.stderr)


def test_daemon_never_loads_driver_or_framework_libraries(rig: dict[str, Any]) -> None:
    daemon = rig["start"]()
    daemon.wait_ready()
    maps = Path(f"/proc/{daemon.proc.pid}/maps").read_text()
    for lib in ("libnvidia-ml", "libcuda", "jaxlib", "iree"):
        assert lib not in maps, f"the daemon process mapped {lib}"
    probe = subprocess.run(
        [sys.executable, "-c", "import sys, gpudiag.cli.commands, gpudiag.daemon.app, "
         "gpudiag.daemon.scheduler, "
         "gpudiag.daemon.watcher, gpudiag.daemon.exporter; print(sorted(m for m in sys.modules if "
         "m.split('.')[0] in ('pynvml', 'jax', 'jaxlib', 'iree', 'ctypes')))"],
        capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == "[]"


def test_logs_are_json_and_there_is_no_line_per_scrape(rig: dict[str, Any]) -> None:
    daemon = rig["start"]()
    daemon.wait_ready()
    time.sleep(0.3)
    count = len(daemon.lines)
    for _ in range(30):
        daemon.get("/metrics")
        daemon.get("/v1/preflight")
    assert len(daemon.lines) - count < 5
    assert daemon.stop() == 0
    parsed = [json.loads(line) for line in daemon.lines]
    assert all({"ts", "level", "logger", "msg"} <= set(p) for p in parsed)
    assert any(p["msg"].startswith("verdict changed") for p in parsed)


def test_sd_notify_ready_and_watchdog_keepalives(rig: dict[str, Any], tmp_path: Path) -> None:
    sock_path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(sock_path)
    sock.settimeout(10)
    rig["env"]["NOTIFY_SOCKET"] = sock_path
    rig["env"]["WATCHDOG_USEC"] = "2000000"
    daemon = rig["start"]()
    got: list[str] = []
    while not ("READY=1" in "".join(got) and sum("WATCHDOG=1" in g for g in got) >= 3):
        got.append(sock.recv(4096).decode())
    daemon.stop()
    assert any(g.startswith("READY=1") for g in got)
    sock.close()


def test_sigkill_of_the_daemon_keeps_acknowledged_history(rig: dict[str, Any]) -> None:
    states: list[dict[str, str | int]] = [
        {"FAKE_NVML_DEVICE_COUNT": 2, "FAKE_NVML_DEVICE_ERRORS": "1:15"},
        {"FAKE_NVML_DEVICE_COUNT": 2}]
    acked: set[int] = set()
    for i in range(3):
        daemon = rig["start"]()
        write_state_file(rig["state"], states[i % 2])
        lines = daemon.lines
        wait_for(lambda: any('"history_id"' in line for line in lines), 10)  # noqa: B023
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.proc.wait(5)
        daemon._reader.join(5)
        acked |= {json.loads(line)["history_id"] for line in daemon.lines
                  if '"history_id"' in line}
    db = sqlite3.connect(rig["tmp"] / "state" / "history.sqlite3")
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert len(acked) >= 3 and acked <= {r[0] for r in db.execute("SELECT id FROM verdicts")}
    # The watcher child notices its reader is gone (broken pipe) and exits by itself; the
    # rig's teardown checks that nothing is left.


def test_sigterm_while_a_probe_hangs_exits_at_once_and_leaves_nothing(rig: dict[str, Any]) -> None:
    daemon = rig["start"](nvml_deadline=60)
    daemon.wait_ready()
    write_state_file(rig["state"], {"FAKE_NVML_DEVICE_COUNT": 2, "FAKE_NVML_INIT_HANG": 1})
    # Wait until an nvml child is hung in nvmlInit (the state file is read at init).
    # psutil reads argv as ps does: NUL-separated, or a forked child's setproctitle-style
    # line split at spaces (gpudiag/probes/forkserver.py).
    wait_for(lambda: any(" gpudiag.probes nvml" in " ".join(cmdline(p))
                         for p in processes_with_env(str(rig["state"]))), 10)
    time.sleep(1.0)
    t = time.monotonic()
    assert daemon.stop() == 0
    assert time.monotonic() - t < 5, "the daemon waited for the hung probe's deadline"
    assert any("killed" in line and "probe child" in line for line in daemon.lines)
