"""Issue 52: the GPU reset rung: an idle GPU whose fault a reset repairs is reset, verified
and recorded; a busy GPU, or one whose NVLink domain runs work, is never reset.

The policy alone (core.gpu_reset), then a real `gpudiag serve` on the fakes with the fake
nvidia-smi as the configured tool: its FAKE_NVIDIA_SMI_LOG says every call that changed a
GPU, so a test sees exactly when a reset was made and that none was made while a job ran.
No test here (or anywhere) runs a real nvidia-smi: the tool is always the fake's path.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gpudiag.core.gpu_reset import (
    ATTEMPTS,
    BUSY,
    DOMAIN_BUSY,
    LEFT_ALONE_REASONS,
    MIG,
    NO_BUS_ID,
    OUTCOMES,
    GpuResetConfig,
    ResetGpu,
    plan_reset,
    processes_on,
    reset_faults,
)
from gpudiag.core.nvlink_domain import WHOLE_NODE, nvlink_domain
from gpudiag.daemon.config import ConfigError, from_mapping
from gpudiag.daemon.store import default_path
from tests.fakes.build import FakeDriver, write_state_file
from tests.fakes.jobs import FakeJobs, read_context_log
from tests.support.daemon import (
    Daemon,
    daemon_toml,
    metric_samples,
    wait_for,
    write_config,
)
from tests.support.reset_rung import (
    ResetNode,
    reset_node,
    smi_calls,
    smi_resets,
    start_reset_daemon,
)

G0 = "GPU-f00d0000-0000-4000-8000-000000000000"
G1 = "GPU-f00d0001-0000-4000-8000-000000000001"
BUS1 = "00000000:19:00.0"
ON = GpuResetConfig(enabled=True)


def _gpu(uuid: str, occupancy: str = "free", *, nvlink: bool = False, mig: bool = False,
         bus: str | None = "00000000:18:00.0") -> ResetGpu:
    return ResetGpu(uuid, bus, occupancy, nvlink, mig)


# -- the policy --------------------------------------------------------------------------------
def test_only_gpu_reset_required_on_a_gpu_with_nothing_beyond_a_reset_is_a_reset_fault(
) -> None:
    blockers = [("gpu_reset_required", G1), ("gpu_lost", G0), ("gpu_reset_required", None),
                ("gpu_reset_required", "index 3"), ("gpu_reset_required", G1)]
    assert reset_faults(blockers) == [G1]
    # A GPU also off the bus (or asking for a reboot) needs more than a reset.
    assert reset_faults([("gpu_reset_required", G1), ("gpu_lost", G1)]) == []
    assert reset_faults([("gpu_reset_required", G1), ("node_reboot_required", G1)]) == []


def test_an_idle_pcie_gpu_is_reset_alone() -> None:
    gpus = {G0: _gpu(G0, "busy"), G1: _gpu(G1, bus=BUS1)}
    plan = plan_reset(G1, gpus, (), 1000.0, ON)
    assert plan.reset and plan.bus_id == BUS1 and plan.domain == (G1,)


def test_an_nvlink_gpu_whose_topology_was_not_read_is_reset_only_with_the_node_idle() -> None:
    idle = {G0: _gpu(G0, nvlink=True), G1: _gpu(G1, nvlink=True, bus=BUS1)}
    assert nvlink_domain(G1, idle).gpus == (G1, G0)
    assert nvlink_domain(G1, idle).basis == WHOLE_NODE  # tests/test_nvlink_domain.py: the rest
    assert plan_reset(G1, idle, (), 1000.0, ON).domain == (G1, G0)
    for state in ("busy", "unknown"):
        peer_busy = {**idle, G0: _gpu(G0, state, nvlink=True)}
        plan = plan_reset(G1, peer_busy, (), 1000.0, ON)
        assert not plan.reset and plan.reason == DOMAIN_BUSY and G0 in plan.why


@pytest.mark.parametrize(("gpu", "attempts", "reason"), [
    (_gpu(G1, "busy"), (), BUSY),
    (_gpu(G1, "unknown"), (), BUSY),
    (_gpu(G1, mig=True), (), MIG),
    (_gpu(G1), (500.0,), ATTEMPTS),
    (_gpu(G1, bus=None), (), NO_BUS_ID),
])
def test_a_gpu_in_use_in_mig_mode_reset_before_or_unnamed_is_left_alone(
        gpu: ResetGpu, attempts: tuple[float, ...], reason: str) -> None:
    plan = plan_reset(G1, {G1: gpu}, attempts, 1000.0, ON)
    assert not plan.reset and plan.reason == reason and plan.why
    assert reason in LEFT_ALONE_REASONS


def test_the_attempt_cap_counts_within_its_window_only() -> None:
    cfg = GpuResetConfig(enabled=True, max_attempts_per_gpu=2, attempt_window_s=100.0)
    assert plan_reset(G1, {G1: _gpu(G1)}, (920.0, 950.0), 1000.0, cfg).reason == ATTEMPTS
    assert plan_reset(G1, {G1: _gpu(G1)}, (920.0, 950.0), 1030.0, cfg).reset


def test_work_seen_under_the_locks_or_an_unreadable_answer_stops_the_reset() -> None:
    assert processes_on(f"{G0}, 4242\n", [G1]) == []
    assert processes_on(f"{G1}, 4242\n", [G1]) == [f"{G1}, 4242"]
    assert processes_on("garbage\n", [G1]) == ["garbage"]
    assert processes_on("\n", [G1]) == []


def test_the_rung_is_off_by_default_and_its_config_is_checked() -> None:
    assert from_mapping({}).gpu_reset == GpuResetConfig()
    assert not GpuResetConfig().enabled
    cfg = from_mapping({"gpu_reset": {"enabled": True, "nvidia_smi": "/opt/nv/nvidia-smi",
                                      "max_attempts_per_gpu": 2}}).gpu_reset
    assert cfg.enabled and cfg.nvidia_smi == "/opt/nv/nvidia-smi" and cfg.max_attempts_per_gpu == 2
    for bad in ({"nvidia_smi": "nvidia-smi"}, {"enabled": "yes"}, {"max_attempts_per_gpu": 0},
                {"reset_all": True}):
        with pytest.raises(ConfigError, match="gpu_reset"):
            from_mapping({"gpu_reset": bad})


@pytest.mark.parametrize("tool", ["missing", "writable", "fake"])
def test_check_config_refuses_a_reset_tool_the_daemon_would_not_run(
        fakes: FakeDriver, tmp_path: Path, tool: str) -> None:
    """The daemon keeps the rung off with such a tool; --check-config says it and exits 2."""
    path = {"missing": str(tmp_path / "nvidia-smi"), "fake": str(fakes.nvidia_smi)}.get(
        tool, str(tmp_path / "smi"))
    if tool == "writable":
        Path(path).write_bytes(fakes.nvidia_smi.read_bytes())
        Path(path).chmod(0o777)
    config = write_config(tmp_path / "gpudiag.toml", daemon_toml(
        {"gpu_reset": {"enabled": True, "nvidia_smi": path}}))
    done = subprocess.run([sys.executable, "-m", "gpudiag", "serve", "--check-config",
                           "--config", str(config)], capture_output=True, text=True,
                          timeout=60)
    if tool == "fake":
        assert done.returncode == 0, done.stderr
        assert f"# gpu_reset: {path} may be run" in done.stdout
        return
    assert done.returncode == 2, (done.stdout, done.stderr)
    unsafe = {"missing": f"{path}: No such file or directory",
              "writable": f"{path} is writable by its group or by everyone (mode 777)"}[tool]
    assert f"gpudiag serve: [gpu_reset] nvidia_smi: {unsafe}; give the absolute path" \
        in done.stderr, done.stderr
    assert "would keep the GPU reset rung off" in done.stdout
    assert "Traceback" not in done.stderr


# -- the fake tool behaves as the real one does where it matters ------------------------------
def test_the_fake_nvidia_smi_resets_one_idle_gpu_with_persistence_off_and_nothing_else(
        fakes: FakeDriver, tmp_path: Path) -> None:
    state = tmp_path / "state"
    write_state_file(state, {"FAKE_NVML_DEVICE_COUNT": 2, "FAKE_NVML_RECOVERY_ACTION": "1:1",
                             "FAKE_NVML_PROCESSES": "0:4242:100"})
    env = fakes.env(FAKE_GPU_STATE_FILE=str(state))

    def smi(*args: str) -> int:
        return subprocess.run([str(fakes.nvidia_smi), *args], env=env, capture_output=True,
                              timeout=30, check=False).returncode

    assert smi("-r") == 2  # never every GPU at once
    assert smi("-r", "-i", BUS1) == 255  # persistence mode is on
    assert smi("-i", BUS1, "-pm", "0") == 0
    write_state_file(state, {**dict(line.split("=", 1) for line in
                                    state.read_text().splitlines()),
                             "FAKE_NVML_NVLINKS": "0:4,1:4"})
    assert smi("-r", "-i", BUS1) == 255  # its NVLink peer runs a process
    text = state.read_text().replace("FAKE_NVML_NVLINKS=0:4,1:4", "")
    state.write_text(text)
    assert smi("-r", "-i", BUS1) == 0
    assert "FAKE_NVML_RECOVERY_ACTION" not in state.read_text()


# -- a real daemon on the fakes -----------------------------------------------------------------
@pytest.fixture
def node(fakes: FakeDriver, tmp_path: Path) -> ResetNode:
    return reset_node(fakes, tmp_path, gpus=2)


def _start(node: ResetNode, *, enabled: bool = True, **knobs: str | int) -> Daemon:
    return start_reset_daemon(node, knobs, enabled=enabled)


def _health(daemon: Daemon) -> dict[str, Any]:
    status, body = daemon.get("/v1/health")
    assert status == 200, body
    assert isinstance(body, dict)
    return body


def _blocked(daemon: Daemon, code: str = "gpu_reset_required") -> bool:
    return any(b["code"] == code and b["device"] == G1 for b in _health(daemon)["blockers"])


def _counted(daemon: Daemon, name: str, label: str) -> dict[str, float]:
    return {lab[label]: v for lab, v in metric_samples(daemon, name)}


def _history(node: ResetNode, sql: str) -> list[tuple[Any, ...]]:
    db = sqlite3.connect(default_path(node.state))
    try:
        return list(db.execute(sql))
    except sqlite3.OperationalError:
        return []  # the table is made with its first row
    finally:
        db.close()


def test_an_idle_gpu_with_a_reset_xid_is_reset_verified_and_recorded(node: ResetNode
                                                                     ) -> None:
    daemon = _start(node)
    try:
        assert _counted(daemon, "gpudiag_gpu_resets_total", "outcome") == dict.fromkeys(
            OUTCOMES, 0.0)
        write_state_file(node.state_file, {"FAKE_NVML_DEVICE_COUNT": 2,
                                              "FAKE_NVML_XIDS": "1:48"})
        wait_for(lambda: _counted(daemon, "gpudiag_gpu_resets_total", "outcome")[
            "recovered"] == 1, 30, interval=0.2)
        assert not _blocked(daemon)
        assert _health(daemon)["gpu_validation_blocker"] == "none"
        # Persistence handled: off for the reset, on again after it; one GPU named.
        assert [c["argv"] for c in smi_calls(node)] == [
            ["-i", BUS1, "-pm", "0"], ["-r", "-i", BUS1], ["-i", BUS1, "-pm", "1"]]
        assert all(c["exit"] == 0 for c in smi_calls(node))
        evidence = _health(daemon)["evidence"]["gpu_reset"]
        assert evidence["last"]["outcome"] == "recovered" and evidence["pending"] == []
        assert _history(node, "SELECT gpu, outcome FROM resets") == [(G1, "recovered")]
        status, history = daemon.get("/v1/history")
        assert status == 200 and [(r["gpu"], r["outcome"]) for r in history["resets"]] == [
            (G1, "recovered")]
        ((gpu, reason),) = _history(node, "SELECT gpu, reason FROM clears")
        assert gpu == G1 and reason.startswith("reset by gpudiag")
        # The reset names the incident it answers, as the history's incidents row does.
        ((ident,),) = _history(node, "SELECT id FROM incidents")
        assert reason.endswith(f"(incident {ident})")
        assert any("GPU reset of " + G1 + ": recovered" in line for line in daemon.lines)
    finally:
        assert daemon.stop() == 0


def test_a_busy_gpu_is_never_reset_and_is_reset_once_its_job_ends(node: ResetNode
                                                                   ) -> None:
    with FakeJobs(node.state_file, knobs={"FAKE_NVML_DEVICE_COUNT": 2}) as jobs:
        daemon = _start(node)
        try:
            jobs.set_knobs(FAKE_NVML_DEVICE_COUNT=2)  # the start rewrote the file: own it again
            job = jobs.start(1, memory_mib=4096)
            jobs.set_knobs(FAKE_NVML_XIDS="1:48")
            wait_for(lambda: _counted(daemon, "gpudiag_gpu_reset_left_alone_total",
                                      "reason")[BUSY] == 1, 30, interval=0.2)
            time.sleep(1.0)  # cycles go on while it stays busy: still nothing
            assert smi_resets(node) == [] and _blocked(daemon)
            # Nor did anything of the daemon touch it: no CUDA context while the job ran.
            assert jobs.contexts_while_busy(read_context_log(node.contexts)) == []
            job = jobs.stop(job)
            wait_for(lambda: smi_resets(node), 30, interval=0.2)
            ((reset,),) = [smi_resets(node)]
            assert job.stopped_at is not None and reset["time"] > job.stopped_at
            wait_for(lambda: not _blocked(daemon), 30, interval=0.2)
        finally:
            assert daemon.stop() == 0


def test_a_gpu_whose_nvlink_peer_runs_a_job_is_not_reset(node: ResetNode) -> None:
    knobs: dict[str, str | int] = {"FAKE_NVML_DEVICE_COUNT": 2, "FAKE_NVML_NVLINKS": "0:4,1:4"}
    with FakeJobs(node.state_file, knobs=knobs) as jobs:
        daemon = _start(node, FAKE_NVML_NVLINKS="0:4,1:4")
        try:
            jobs.set_knobs(**knobs)
            jobs.start(0, memory_mib=4096)  # the peer, not the faulty GPU
            jobs.set_knobs(FAKE_NVML_XIDS="1:48")
            wait_for(lambda: _counted(daemon, "gpudiag_gpu_reset_left_alone_total",
                                      "reason")[DOMAIN_BUSY] == 1, 30, interval=0.2)
            time.sleep(1.0)
            assert smi_resets(node) == [] and _blocked(daemon)
            assert any("NVLink domain" in line for line in daemon.lines)
        finally:
            assert daemon.stop() == 0


def test_a_reset_that_does_not_repair_is_said_once_and_not_tried_again(node: ResetNode
                                                                        ) -> None:
    # NVML's recovery action asks for a reset, and the reset leaves it there.
    daemon = _start(node, FAKE_NVML_RECOVERY_ACTION="1:1", FAKE_NVIDIA_SMI_RESET_KEEPS_FAULT=1)
    try:
        wait_for(lambda: _counted(daemon, "gpudiag_gpu_resets_total", "outcome")[
            "still_faulty"] == 1, 30, interval=0.2)
        wait_for(lambda: _counted(daemon, "gpudiag_gpu_reset_left_alone_total", "reason")[
            ATTEMPTS] == 1, 10, interval=0.2)
        time.sleep(1.0)
        assert len(smi_resets(node)) == 1 and _blocked(daemon)
        assert _history(node, "SELECT outcome FROM resets") == [("still_faulty",)]
    finally:
        assert daemon.stop() == 0
    # A restart remembers the attempt: no second reset within the window.
    daemon = _start(node, FAKE_NVML_RECOVERY_ACTION="1:1", FAKE_NVIDIA_SMI_RESET_KEEPS_FAULT=1)
    try:
        wait_for(lambda: _counted(daemon, "gpudiag_gpu_reset_left_alone_total", "reason")[
            ATTEMPTS] == 1, 30, interval=0.2)
        assert len(smi_resets(node)) == 1
    finally:
        assert daemon.stop() == 0


def test_a_failing_reset_is_counted_and_persistence_is_restored(node: ResetNode) -> None:
    daemon = _start(node, FAKE_NVML_RECOVERY_ACTION="1:1", FAKE_NVIDIA_SMI_RESET_FAIL=1)
    try:
        wait_for(lambda: _counted(daemon, "gpudiag_gpu_resets_total", "outcome")[
            "failed"] == 1, 30, interval=0.2)
        assert [c["argv"][-2:] for c in smi_calls(node)] == [["-pm", "0"], ["-i", BUS1],
                                                          ["-pm", "1"]]
        assert _blocked(daemon)
        ((detail,),) = _history(node, "SELECT detail FROM resets")
        assert "exited 1" in detail
    finally:
        assert daemon.stop() == 0


def test_with_the_rung_off_nothing_is_reset(node: ResetNode) -> None:
    daemon = _start(node, enabled=False, FAKE_NVML_XIDS="1:48")
    try:
        wait_for(lambda: _blocked(daemon), 30, interval=0.2)
        time.sleep(1.0)
        assert smi_calls(node) == []
        assert metric_samples(daemon, "gpudiag_gpu_resets_total") == []
    finally:
        assert daemon.stop() == 0
