"""The job watch part (daemon/job_watch.py) and its NVML child on the fake driver."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpudiag.core.attribution import Attribution, JobRecord
from gpudiag.core.environment import probe_environment
from gpudiag.core.job_watch import STALLED, STRAGGLER, JobWatchPolicy
from gpudiag.daemon.job_watch import JobWatch, WatchState
from tests.fakes.build import FakeDriver, write_state_file
from tests.support.daemon import host_env, wait_for

FAST = JobWatchPolicy(interval_s=0.1, stall_after_s=0.8, straggler_after_s=0.8)


def uuid_of(env: dict[str, str], index: int) -> str:
    """GPU ``index``'s UUID as the fake driver names it (read through the nvml probe)."""
    out = subprocess.run(
        [sys.executable, "-c", "import pynvml; pynvml.nvmlInit(); print(pynvml."
         f"nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex({index})))"],
        env=env, capture_output=True, text=True, timeout=30, check=True)
    return out.stdout.strip()


@dataclass(frozen=True)
class Run:
    id: str
    gpus: tuple[str, ...]


@dataclass
class Host:
    env: dict[str, str]
    state: Path
    gpus: tuple[str, str]

    def load(self, **knobs: str | int) -> None:
        write_state_file(self.state, {"FAKE_NVML_DEVICE_COUNT": 2, **knobs})


@pytest.fixture
def host(fakes: FakeDriver, tmp_path: Path) -> Host:
    state = tmp_path / "gpu-state"
    env = probe_environment(host_env(fakes, tmp_path / "host", gpus=2,
                                     FAKE_GPU_STATE_FILE=str(state)))
    h = Host(env, state, ("", ""))
    h.load()
    h.gpus = (uuid_of(env, 0), uuid_of(env, 1))
    return h


@pytest.fixture
def runs() -> list[Run]:
    return []


@pytest.fixture
def watch(host: Host, runs: list[Run]) -> Iterator[JobWatch]:
    w = JobWatch(FAST, host.env, lambda: list(runs))
    w.start()
    try:
        yield w
    finally:
        w.stop()


def _child(env: dict[str, str], gpus: list[str]) -> dict[str, Any]:
    """The first sample line of the child watching ``gpus``."""
    proc = subprocess.Popen([sys.executable, "-m", "gpudiag.probes.job_watch",
                             '{"interval_s": 0.05}'], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(json.dumps({"gpus": gpus}) + "\n")
        proc.stdin.flush()
        for _ in range(3):  # the second sample has a link rate (two counter readings)
            line: dict[str, Any] = json.loads(proc.stdout.readline())
        proc.stdin.close()
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return line


def test_the_child_reads_utilization_power_limit_clock_and_link_of_each_gpu(
        host: Host) -> None:
    host.load(FAKE_NVML_UTILIZATION="0:100,1:40", FAKE_NVML_POWER_MW="0:80000,1:600000",
              FAKE_NVML_CLOCKS_EVENT_REASONS="1:64", FAKE_NVML_LINK_KBPS="0:500")
    line = _child(host.env, list(host.gpus))
    assert line["type"] == "sample"
    a, b = line["gpus"]
    assert (a["uuid"], a["utilization_ratio"], a["power_w"], a["power_limit_w"]) == (
        host.gpus[0], 1.0, 80.0, 700.0)
    assert a["sm_clock_mhz"] == 1980 and a["link_kbps"] == pytest.approx(500, rel=0.2)
    assert b["throttle_reasons"] == ["hw_thermal_slowdown"] and b["link_kbps"] is None
    assert a["pcie_degraded"] is False and b["power_w"] == 600.0


def test_a_driver_without_clock_or_throughput_calls_leaves_them_none(host: Host) -> None:
    host.load(FAKE_NVML_UNSUPPORTED="clocks,clocks_event_reasons,field_values,pcie,"
              "remapped_rows", FAKE_NVML_UTILIZATION="0:100")
    a = _child(host.env, [host.gpus[0]])["gpus"][0]
    assert a["utilization_ratio"] == 1.0 and a["power_w"] == 75.0
    assert [a[k] for k in ("sm_clock_mhz", "throttle_reasons", "link_kbps", "pcie_degraded",
                           "ecc_pending")] == [None] * 5


def _stalled(state: WatchState) -> dict[str, bool]:
    return {run: stalled for run, _, stalled, _ in state.runs}


def test_a_two_gpu_run_at_full_utilization_and_80_w_of_700_w_is_stalled(
        host: Host, runs: list[Run], watch: JobWatch) -> None:
    host.load(FAKE_NVML_UTILIZATION="0:100,1:100", FAKE_NVML_POWER_MW="0:80000,1:80000")
    runs.append(Run("r1", host.gpus))
    wait_for(lambda: _stalled(watch.state()).get("r1"), 15)
    codes = [w.code for w in watch.warnings("r1")]
    assert codes == [STALLED]
    version, evidence = watch.evidence()
    shown = evidence["open"][0]
    assert shown["job_stalled"] and shown["warnings"][0]["numbers"]["power_max_w"] == 80.0
    assert evidence["watch"]["sampling"] and evidence["watch"]["error"] is None
    # The run ends: its series go, its warnings stay for its record, the child stops.
    runs.clear()
    wait_for(lambda: not watch.state().runs and not watch.state().running, 10)
    assert [w.code for w in watch.warnings("r1")] == [STALLED]
    assert watch.end_notes("r1")["warnings"][0]["code"] == STALLED
    assert watch.evidence()[0] > version


def test_the_same_run_at_600_w_is_nothing(host: Host, runs: list[Run],
                                          watch: JobWatch) -> None:
    host.load(FAKE_NVML_UTILIZATION="0:100,1:100", FAKE_NVML_POWER_MW="0:600000,1:600000")
    runs.append(Run("r1", host.gpus))
    wait_for(lambda: watch.evidence()[1]["open"] and
             watch.evidence()[1]["open"][0]["samples"] >= 15, 15)
    assert watch.warnings("r1") == () and _stalled(watch.state()) == {"r1": False}


def test_one_gpu_at_half_its_peers_power_under_the_same_load_is_a_straggler(
        host: Host, runs: list[Run], watch: JobWatch) -> None:
    host.load(FAKE_NVML_UTILIZATION="0:100,1:100", FAKE_NVML_POWER_MW="0:600000,1:300000")
    runs.append(Run("r1", host.gpus))
    wait_for(lambda: watch.warnings("r1"), 15)
    (w,) = watch.warnings("r1")
    assert (w.code, w.gpu) == (STRAGGLER, host.gpus[1])
    assert dict(w.numbers)["signal"] == "power" and dict(w.numbers)["cause"] == "unknown"
    assert ("r1", host.gpus, False, (host.gpus[1],)) in watch.state().runs


def test_a_run_that_ends_before_the_window_has_nothing(host: Host, runs: list[Run],
                                                       fakes: FakeDriver) -> None:
    host.load(FAKE_NVML_UTILIZATION="0:100,1:100", FAKE_NVML_POWER_MW="0:80000,1:80000")
    slow = JobWatch(JobWatchPolicy(interval_s=0.1, stall_after_s=30), host.env, lambda: runs)
    runs.append(Run("r1", host.gpus))
    slow.start()
    try:
        wait_for(lambda: slow.evidence()[1]["open"] and
                 slow.evidence()[1]["open"][0]["samples"] >= 5, 15)
        runs.clear()
        wait_for(lambda: not slow.state().runs, 10)
        assert slow.warnings("r1") == ()
    finally:
        slow.stop()


def test_a_driver_without_clock_or_throughput_calls_still_names_the_stall(
        host: Host, runs: list[Run], watch: JobWatch) -> None:
    host.load(FAKE_NVML_UTILIZATION="0:100,1:100", FAKE_NVML_POWER_MW="0:80000,1:80000",
              FAKE_NVML_UNSUPPORTED="clocks,clocks_event_reasons,field_values")
    runs.append(Run("r1", host.gpus))
    wait_for(lambda: watch.warnings("r1"), 15)
    assert [w.code for w in watch.warnings("r1")] == [STALLED]


def test_the_record_kept_for_a_run_carries_its_warnings(host: Host, runs: list[Run],
                                                        watch: JobWatch) -> None:
    host.load(FAKE_NVML_UTILIZATION="0:100,1:100", FAKE_NVML_POWER_MW="0:80000,1:80000")
    runs.append(Run("r1", host.gpus))
    wait_for(lambda: watch.warnings("r1"), 15)
    kept: list[JobRecord] = []

    def keep(job: JobRecord, uid: int, how: str | None, run_id: str | None) -> bool:
        kept.append(job)
        return True

    job = JobRecord(1, 2, ("x",), None, "h", 0.0, 1.0, 0, host.gpus,
                    Attribution("none", "job_succeeded"), None)
    assert watch.keeping(keep)(job, 0, "socket", "r1")
    assert watch.keeping(keep)(job, 0, "root", None)
    assert [w.code for w in kept[0].warnings] == [STALLED] and kept[1].warnings == ()


def test_without_nvml_the_watch_says_why_and_keeps_no_child(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": str(tmp_path)}
    runs = [Run("r1", ("GPU-aaaaaaaa-0000-0000-0000-000000000000",))]
    w = JobWatch(FAST, env, lambda: runs)
    w.start()
    try:
        wait_for(lambda: w.evidence()[1]["watch"]["error"], 15)
        assert "NVML" in w.evidence()[1]["watch"]["error"]
    finally:
        w.stop()
    assert w.warnings("r1") == ()


def test_mig_leaves_alone_are_not_watched() -> None:
    runs = [Run("r1", ("MIG-aaaaaaaa-0000-0000-0000-000000000000",))]
    w = JobWatch(FAST, {}, lambda: runs)
    w.start()
    try:
        wait_for(lambda: w.evidence()[0] == 0 and not w.state().running, 2)
        assert w.state().runs == ()
    finally:
        w.stop()


def test_off_starts_nothing() -> None:
    w = JobWatch(JobWatchPolicy(enabled=False), {}, lambda: [Run("r1", ("GPU-x",))])
    w.start()
    w.stop()
    assert w.state() == WatchState(False) and not w.evidence()[1]["watch"]["enabled"]


def test_a_child_that_dies_is_said_and_started_again(tmp_path: Path) -> None:
    starts = tmp_path / "starts"
    script = f"open({str(starts)!r}, 'a').write('x'); raise SystemExit(3)"
    runs = [Run("r1", ("GPU-aaaaaaaa-0000-0000-0000-000000000000",))]
    w = JobWatch(FAST, {}, lambda: runs, argv=[sys.executable, "-c", script])
    w.start()
    try:
        wait_for(lambda: starts.exists() and len(starts.read_text()) >= 2, 15)
        error = w.evidence()[1]["watch"]["error"]
        assert "exited" in error or "closed its output" in error, error
        assert w.warnings("r1") == ()
    finally:
        w.stop()
    assert not w.state().running
