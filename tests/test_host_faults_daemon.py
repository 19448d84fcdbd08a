"""Faults of the host with a real `gpudiag serve` on the fake driver: a full disk under the
state directory, a damaged history, a second daemon on the same state directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.build import FakeDriver, write_state_file
from tests.support.daemon import (
    Daemon,
    daemon_toml,
    host_env,
    wait_for,
    write_config,
)
from tests.support.host import processes_with_env, run_gpudiag
from tests.support.host_disk import fill, small_tmpfs

GPUS = {"FAKE_NVML_DEVICE_COUNT": 2}


@pytest.fixture
def host(fakes: FakeDriver, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A fake 2-GPU host whose state file the test rewrites; daemons stopped in teardown."""
    state = tmp_path / "gpu-state"
    write_state_file(state, GPUS)
    env = host_env(fakes, tmp_path / "host", gpus=2, FAKE_GPU_STATE_FILE=str(state))
    cfg = write_config(tmp_path / "gpudiag.toml", daemon_toml())
    daemons: list[Daemon] = []

    def start(state_dir: Path) -> Daemon:
        d = Daemon(env, cfg, state_dir)
        daemons.append(d)
        return d

    yield {"state": state, "env": env, "cfg": cfg, "start": start, "tmp": tmp_path}
    for d in daemons:
        d.stop()
    wait_for(lambda: not processes_with_env(str(state)), 5)


def _metric(daemon: Daemon, name: str) -> float:
    text = daemon.get("/metrics")[1]
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {name!r} in /metrics")


def _logs(daemon: Daemon) -> list[dict[str, Any]]:
    return [json.loads(line) for line in daemon.lines if line.startswith("{")]


def _changes(daemon: Daemon) -> list[dict[str, Any]]:
    return [p for p in _logs(daemon) if p["msg"].startswith("verdict changed")]


def _history(state_dir: Path, env: dict[str, str]) -> dict[str, Any]:
    proc = run_gpudiag(["history", "--state-dir", str(state_dir), "--json", "--limit", "1000"],
                       env)
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(proc.stdout))


def _change_to(host: dict[str, Any], daemon: Daemon, knobs: dict[str, Any]) -> None:
    """Rewrite the fake driver's state and wait until the daemon has said the change."""
    before = len(_changes(daemon))
    write_state_file(host["state"], {**GPUS, **knobs})
    wait_for(lambda: len(_changes(daemon)) > before, 15)


def test_a_full_disk_is_one_line_each_way_and_the_history_keeps_every_change_in_order(
        host: dict[str, Any]) -> None:
    with small_tmpfs(host["tmp"] / "disk", "1m") as disk:
        state_dir = disk / "state"
        daemon = host["start"](state_dir)
        daemon.wait_ready()
        wait_for(lambda: _changes(daemon), 10)
        assert _metric(daemon, "gpudiag_history_writable") == 1
        filler = fill(disk)
        # Verdicts change while nothing can be written: an XID, the driver going away, back.
        _change_to(host, daemon, {"FAKE_NVML_XIDS": "1:13"})
        wait_for(lambda: _metric(daemon, "gpudiag_history_writable") == 0, 10)
        _change_to(host, daemon, {"FAKE_NVML_XIDS": "1:13", "FAKE_NVML_INIT_ERROR": 9})
        _change_to(host, daemon, {"FAKE_NVML_XIDS": "1:13,0:79"})
        errors = wait_for(lambda: (n := _metric(daemon, "gpudiag_history_write_errors_total"))
                          >= 3 and n, 10)
        assert _metric(daemon, "gpudiag_history_pending") >= 3
        time.sleep(2.5)  # the writer retries every second against the full disk
        assert _metric(daemon, "gpudiag_history_write_errors_total") > errors
        filler.unlink()
        wait_for(lambda: _metric(daemon, "gpudiag_history_writable") == 1, 10)
        assert _metric(daemon, "gpudiag_history_pending") == 0
        assert _metric(daemon, "gpudiag_history_dropped_total") == 0
        said = _changes(daemon)
        hist = _history(state_dir, host["env"])
        assert daemon.stop() == 0
    # Every change the daemon said, in the order it said them, with nothing in between.
    stored = [(v["gpu_validation_blocker"], v["blockers"], v["warnings"])
              for v in reversed(hist["verdicts"])]
    # "verdict changed: CODE (what changed)": the code is the word after the colon.
    assert stored == [(p["msg"].split(": ", 1)[1].split(" (", 1)[0], p["blockers"],
                       p["warnings"]) for p in said]
    assert sum(1 for p in said if p.get("history_pending")) >= 3
    assert "driver_not_loaded" in {b for _, bs, _ in stored for b in bs}
    assert stored[-1][0] == "gpu_lost"
    ts = [v["ts"] for v in reversed(hist["verdicts"])]
    assert ts == sorted(ts)
    logs = _logs(daemon)
    down = [p for p in logs if p["msg"].startswith("history not writable")]
    up = [p for p in logs if p["msg"].startswith("history writable again")]
    assert len(down) == 1 and len(up) == 1, [p["msg"] for p in logs]
    assert "database or disk is full" in down[0]["cause"]
    assert not any("exc" in p for p in logs)
    assert not any("Traceback" in line for line in daemon.lines)


def test_a_damaged_history_is_moved_aside_and_the_daemon_serves_as_fast_as_usual(
        host: dict[str, Any]) -> None:
    state_dir = host["tmp"] / "state"
    state_dir.mkdir()
    t0 = time.monotonic()
    host["start"](host["tmp"] / "clean").wait_ready()
    normal_s = time.monotonic() - t0
    junk = os.urandom(64 * 1024)
    (state_dir / "history.sqlite3").write_bytes(junk)
    t0 = time.monotonic()
    daemon = host["start"](state_dir)
    daemon.wait_ready()
    damaged_s = time.monotonic() - t0
    assert damaged_s < max(3 * normal_s, normal_s + 5), (normal_s, damaged_s)
    moved = [p for p in state_dir.iterdir() if p.name.startswith("history.sqlite3.damaged-")]
    assert len(moved) == 1 and moved[0].read_bytes() == junk
    line = next(p for p in _logs(daemon) if "moved it aside" in p["msg"])
    assert line["damaged"] == str(moved[0]) and line["level"] == "error"
    assert _metric(daemon, "gpudiag_history_damaged_files") == 1
    wait_for(lambda: _changes(daemon) and _changes(daemon)[0].get("history_id"), 10)
    proc = run_gpudiag(["history", "--state-dir", str(state_dir)], host["env"])
    assert proc.returncode == 0 and f"moved aside to {moved[0]}" in proc.stderr
    assert _history(state_dir, host["env"])["damaged"] == [str(moved[0])]
    assert not any("Traceback" in line for line in daemon.lines)


def test_a_second_daemon_on_the_same_state_dir_exits_2_naming_the_first(
        host: dict[str, Any]) -> None:
    state_dir = host["tmp"] / "state"
    first = host["start"](state_dir)
    first.wait_ready()
    t0 = time.monotonic()
    second = subprocess.run(
        [sys.executable, "-m", "gpudiag", "serve", "--listen", "127.0.0.1:0", "--config",
         str(host["cfg"]), "--state-dir", str(state_dir)], env=host["env"],
        capture_output=True, text=True, timeout=60, check=False)
    assert second.returncode == 2, second.stderr
    assert time.monotonic() - t0 < 10  # at once: no probes, no waiting for the port
    assert f"PID {first.proc.pid}" in second.stderr and str(state_dir) in second.stderr
    assert "Traceback" not in second.stderr
    assert first.get("/healthz")[0] == 200  # the first one never noticed
    # A daemon killed outright leaves its lock file behind: it never blocks the next one.
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(10)
    assert (state_dir / "daemon.lock").exists()
    host["start"](state_dir).wait_ready()


def _serve_fails(host: dict[str, Any], state_dir: Path) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "gpudiag", "serve", "--listen", "127.0.0.1:0", "--config",
         str(host["cfg"]), "--state-dir", str(state_dir)], env=host["env"],
        capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and f"cannot use --state-dir {state_dir}" in proc.stderr
    assert "Traceback" not in proc.stderr
    return proc.stderr


def test_a_state_dir_that_is_a_file_stays_a_startup_error(host: dict[str, Any]) -> None:
    path = host["tmp"] / "not-a-dir"
    path.write_text("x")
    _serve_fails(host, path / "sub")


def test_a_state_dir_that_cannot_be_written_stays_a_startup_error(
        host: dict[str, Any]) -> None:
    with small_tmpfs(host["tmp"] / "ro", "64k", "ro") as ro:
        assert "Read-only file system" in _serve_fails(host, ro)


def test_a_daemon_started_on_a_full_disk_serves_and_opens_its_history_once_there_is_room(
        host: dict[str, Any]) -> None:
    with small_tmpfs(host["tmp"] / "disk", "1m") as disk:
        state_dir = disk / "state"
        first = host["start"](state_dir)
        wait_for(lambda: _changes(first) and _changes(first)[0].get("history_id"), 10)
        assert first.stop() == 0
        filler = fill(disk)  # a restart (say, by systemd) finds the disk full
        daemon = host["start"](state_dir)
        daemon.wait_ready()
        assert _metric(daemon, "gpudiag_history_writable") == 0
        # Unavailable, and why: not "this daemon keeps no history" (issue 24).
        status, body = daemon.get("/v1/history")
        assert status == 503 and body["error"]["code"] == "history_unavailable", body
        assert body["error"]["message"].startswith("the history could not be opened: "), body
        assert "no --state-dir" not in body["error"]["message"]
        assert daemon.get("/v1/preflight")[0] == 200  # verdicts go on regardless
        _change_to(host, daemon, {"FAKE_NVML_XIDS": "0:79"})
        filler.unlink()
        wait_for(lambda: _metric(daemon, "gpudiag_history_writable") == 1, 10)
        status, body = daemon.get("/v1/history")
        assert status == 200
        assert body["verdicts"][0]["gpu_validation_blocker"] == "gpu_lost"
        logs = _logs(daemon)
        assert [p["msg"].split(":")[0] for p in logs if p["msg"].startswith("history ")] == [
            "history not writable", "history writable again"]
        assert not any("Traceback" in line for line in daemon.lines)
        assert daemon.stop() == 0
