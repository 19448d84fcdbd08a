"""Live reload through a real `gpudiag serve`: SIGHUP re-reads the config and applies it without
dropping the listener, the unix socket or the history; an invalid file keeps the running one."""

from __future__ import annotations

import json
import os
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpudiag.daemon.config import from_mapping
from gpudiag.daemon.reload import live_changes, restart_only_changes
from tests.fakes.build import FakeDriver, write_state_file
from tests.support.daemon import Daemon, daemon_toml, host_env, wait_for, write_config


def samples(daemon: Daemon, name: str) -> dict[str, float]:
    """Every sample of metric ``name`` on /metrics, by its label text."""
    status, text = daemon.get("/metrics")
    assert status == 200
    out: dict[str, float] = {}
    for line in str(text).splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels, _, value = line.rpartition(" ")
            out[labels[len(name):]] = float(value)
    return out


def host_runs(daemon: Daemon) -> float:
    return sum(v for k, v in samples(daemon, "gpudiag_probe_runs_total").items()
               if 'backend="host"' in k)


@pytest.fixture
def served(fakes: FakeDriver, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A daemon on an 8-GPU fake host with a unix socket; the test rewrites its config."""
    env = host_env(fakes, tmp_path / "host")
    sock_dir = Path(tempfile.mkdtemp(prefix="gdrl"))  # sun_path is 108 bytes at most
    config = tmp_path / "gpudiag.toml"
    base: dict[str, dict[str, Any]] = {"": {"socket": str(sock_dir / "gpudiag.sock")},
                                       "backends.host": {"interval_s": 30}}
    write_config(config, daemon_toml(base))
    daemon = Daemon(env, config, tmp_path / "state")
    try:
        yield {"daemon": daemon, "config": config, "base": base, "sock": sock_dir / "gpudiag.sock"}
    finally:
        daemon.stop()
        for p in sock_dir.iterdir():
            p.unlink()
        sock_dir.rmdir()


def reload_with(served: dict[str, Any], changes: dict[str, dict[str, Any]]) -> None:
    tables = {k: dict(v) for k, v in served["base"].items()}
    for name, keys in changes.items():
        tables.setdefault(name, {}).update(keys)
    write_config(served["config"], daemon_toml(tables))
    served["daemon"].proc.send_signal(signal.SIGHUP)


def log_records(daemon: Daemon, logger: str) -> list[dict[str, Any]]:
    out = []
    for line in list(daemon.lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("logger") == logger:
            out.append(record)
    return out


def test_reload_applies_interval_backends_and_thresholds_and_keeps_sockets_and_history(
        served: dict[str, Any]) -> None:
    daemon: Daemon = served["daemon"]
    daemon.wait_ready()
    url, pid, sock_inode = daemon.url, daemon.proc.pid, os.stat(served["sock"]).st_ino
    wait_for(lambda: daemon.get("/v1/history")[1]["verdicts"], 10)
    history_before = daemon.get("/v1/history")[1]["verdicts"]
    assert host_runs(daemon) == 1  # host every 30 s: only the first round so far
    assert daemon.get("/v1/health")[1]["gpu_validation_blocker"] == "none"

    # A shorter host interval, cuda switched off as a scheduled backend (the default
    # requirement nvml keeps nvml), and a threshold: 16 GPUs expected on an 8-GPU host.
    reload_with(served, {"": {"expected_gpus": 16, "default_requirement": "nvml"},
                         "backends.host": {"interval_s": 0.2},
                         "backends.cuda": {"enabled": False}})
    wait_for(lambda: log_records(daemon, "gpudiag.daemon.reload"), 10)
    (line,) = log_records(daemon, "gpudiag.daemon.reload")
    assert line["level"] == "info" and line["reload"] == "ok", line
    assert "backends.host.interval_s 30.0 -> 0.2" in line["msg"], line
    wait_for(lambda: host_runs(daemon) >= 5, 10)  # the new interval, not the old 30 s
    health = daemon.get("/v1/health")[1]
    assert "gpu_missing" in {b["code"] for b in health["blockers"]}, health
    wait_for(lambda: 'backend="cuda"' not in str(samples(daemon, "gpudiag_backend_up")), 5)
    assert samples(daemon, "gpudiag_config_reloads_total") == {"": 1.0}
    assert samples(daemon, "gpudiag_config_reload_failures_total") == {"": 0.0}

    # Same process, listener, socket and history.
    assert daemon.proc.poll() is None and daemon.proc.pid == pid and daemon.url == url
    assert os.stat(served["sock"]).st_ino == sock_inode
    history_after = daemon.get("/v1/history", timeout=10)[1]["verdicts"]
    # The reload's own verdict change (gpu_missing) joined the history kept from before.
    assert len(history_after) > len(history_before)
    assert all(v in history_after for v in history_before), (history_before, history_after)
    assert daemon.stop() == 0


def test_an_invalid_config_keeps_the_running_one_logs_one_line_and_counts(
        served: dict[str, Any]) -> None:
    daemon: Daemon = served["daemon"]
    daemon.wait_ready()
    served["config"].write_text(served["config"].read_text()
                                + "[backends.nvml]\ninterval_s = -1\n")  # also a TOML error
    daemon.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: samples(daemon, "gpudiag_config_reload_failures_total") == {"": 1.0}, 10)
    records = log_records(daemon, "gpudiag.daemon.reload")
    assert len(records) == 1 and records[0]["level"] == "error", records
    assert "still running the previous config" in records[0]["msg"]
    assert "not valid TOML" in records[0]["msg"], records[0]["msg"]
    assert samples(daemon, "gpudiag_config_last_reload_successful") == {"": 0.0}
    assert daemon.get("/healthz")[0] == 200 and daemon.proc.poll() is None
    # A bad value (valid TOML) is refused the same way, naming the key.
    reload_with(served, {"backends.nvml": {"interval_s": -1}})
    wait_for(lambda: samples(daemon, "gpudiag_config_reload_failures_total") == {"": 2.0}, 10)
    assert "backends.nvml.interval_s = -1" in log_records(
        daemon, "gpudiag.daemon.reload")[-1]["msg"]
    # Fixed again: applied, and the gauge says so.
    reload_with(served, {})
    wait_for(lambda: samples(daemon, "gpudiag_config_reloads_total") == {"": 1.0}, 10)
    assert samples(daemon, "gpudiag_config_last_reload_successful") == {"": 1.0}
    assert not any("Traceback" in line for line in daemon.lines)
    assert daemon.stop() == 0


def test_restart_only_settings_are_named_not_applied() -> None:
    old = from_mapping({"listen": "127.0.0.1:9477", "backends": {"jax": {"interval_s": 300}}})
    new = from_mapping({"listen": "0.0.0.0:9477", "xid": {"heartbeat_s": 2, "hold_s": 60},
                        "backends": {"jax": {"interval_s": 60}}})
    assert restart_only_changes(old, new) == ["listen_host", "xid.heartbeat_s"]
    assert live_changes(old, new) == ["xid.hold_s 3600.0 -> 60.0",
                                      "backends.jax.interval_s 300.0 -> 60.0"]


def test_the_storm_window_and_xid_promotions_apply_live_and_are_named() -> None:
    old = from_mapping({})
    new = from_mapping({"xid": {"storm_window_s": 60, "promote": {"13": {"count": 0}}}})
    assert restart_only_changes(old, new) == []
    assert live_changes(old, new) == [
        "xid.storm_window_s 300.0 -> 60.0",
        "xid.promote.13 Promotion(count=5, window_s=3600.0) -> "
        "Promotion(count=0, window_s=3600.0)"]


def test_reload_applies_a_shorter_xid_hold(fakes: FakeDriver, tmp_path: Path) -> None:
    """An XID 79 holds gpu_lost for hold_s; a reload to a 1 s hold releases it, live."""
    state = tmp_path / "gpu-state"
    write_state_file(state, {"FAKE_NVML_DEVICE_COUNT": 2})
    env = host_env(fakes, tmp_path / "host", gpus=2, FAKE_GPU_STATE_FILE=str(state))
    config = write_config(tmp_path / "gpudiag.toml", daemon_toml())
    daemon = Daemon(env, config, tmp_path / "state")
    try:
        daemon.wait_ready()
        write_state_file(state, {"FAKE_NVML_DEVICE_COUNT": 2, "FAKE_NVML_XIDS": "0:79"})
        wait_for(lambda: daemon.get("/v1/preflight")[1]["gpu_validation_blocker"]
                 == "gpu_lost", 10)
        write_config(config, daemon_toml({"xid": {"hold_s": 1}}))
        daemon.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: daemon.get("/v1/preflight")[1]["gpu_validation_blocker"]
                 == "none", 10)
        assert "xid.hold_s 3600.0 -> 1.0" in log_records(daemon, "gpudiag.daemon.reload")[0][
            "msg"]
    finally:
        assert daemon.stop() == 0
