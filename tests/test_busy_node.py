"""A busy multi-GPU node (issue 12): probes never touch a GPU someone else uses, per-GPU
verdicts, job readiness on N free GPUs apart from node health. Through the real CLI on the
fake driver, with real "other people's jobs" (FakeJobs) and the fake libcuda's context log.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes.build import FakeDriver
from tests.fakes.jobs import FakeJobs, read_context_log
from tests.support.daemon import Daemon, daemon_toml, host_env, write_config
from tests.support.host import EnvFactory, run_gpudiag, verdict_of

UUID = [f"GPU-f00d{i:04x}-0000-4000-8000-00000000{i:04x}" for i in range(4)]
EXCLUSIVE_PROCESS, PROHIBITED = 3, 2


@pytest.fixture
def node(gpu_env: EnvFactory, tmp_path: Path) -> Iterator[tuple[dict[str, str], FakeJobs,
                                                                  Path]]:
    """Two fake GPUs, GPU 0 in EXCLUSIVE_PROCESS mode; jobs come and go through FakeJobs."""
    log = tmp_path / "contexts.jsonl"
    with FakeJobs(tmp_path / "state", compute_modes={0: EXCLUSIVE_PROCESS}) as jobs:
        env = gpu_env(FAKE_NVML_DEVICE_COUNT=2, FAKE_GPU_STATE_FILE=str(jobs.state_file),
                      FAKE_CUDA_CONTEXT_LOG=str(log))
        env["GPUDIAG_LOCK_DIR"] = str(tmp_path / "locks")
        yield env, jobs, log


def _contexts_on(log: Path, uuid: str) -> list[object]:
    return [e for e in read_context_log(log, event="context") if e.uuid == uuid]


def test_preflight_gpus_1_is_ready_on_the_free_gpu_and_never_touches_the_busy_one(
        node: tuple[dict[str, str], FakeJobs, Path]) -> None:
    env, jobs, log = node
    job = jobs.start(0, memory_mib=100_000)
    rc, rec = verdict_of(["preflight", "--require", "cuda", "--gpus", "1", "--no-daemon",
                          "--format", "json"], env)
    assert rc == 0, rec["blockers"]
    assert rec["gpu_validation_blocker"] == "none"
    assert rec["requirement"]["gpus"] == 1
    by_uuid = {d["uuid"]: d for d in rec["devices"]}
    assert by_uuid[UUID[0]]["occupancy"] == "busy" and by_uuid[UUID[0]]["selected"] is False
    assert by_uuid[UUID[1]]["occupancy"] == "free" and by_uuid[UUID[1]]["selected"] is True
    assert by_uuid[UUID[1]]["last_proven_at"] == rec["checked_at"]
    assert by_uuid[UUID[0]]["healthy"] is True
    assert _contexts_on(log, UUID[0]) == [], "a probe made a context on the busy GPU"
    assert _contexts_on(log, UUID[1]), "the free GPU was not proven"
    assert jobs.contexts_while_busy(read_context_log(log)) == []
    assert job.pid > 0


def test_preflight_gpus_2_with_one_busy_gpu_is_devices_busy(
        node: tuple[dict[str, str], FakeJobs, Path]) -> None:
    env, jobs, log = node
    job = jobs.start(0)
    rc, rec = verdict_of(["preflight", "--require", "cuda", "--gpus", "2", "--no-daemon",
                          "--format", "json"], env)
    assert rc == 1
    assert rec["gpu_validation_blocker"] == "devices_busy"
    assert f"GPU 0 ({UUID[0]}, busy)" in rec["blockers"][0]["message"], job
    assert _contexts_on(log, UUID[0]) == []


def test_preflight_without_gpus_needs_every_visible_gpu_free(
        node: tuple[dict[str, str], FakeJobs, Path]) -> None:
    env, jobs, log = node
    job = jobs.start(0)
    rc, rec = verdict_of(["preflight", "--require", "cuda", "--no-daemon", "--format", "json"],
                         env)
    assert rc == 1
    assert rec["gpu_validation_blocker"] == "devices_busy"
    assert str(job.pid) in rec["blockers"][0]["message"]
    assert _contexts_on(log, UUID[0]) == []


def test_health_busy_gpus_are_healthy_in_use(
        node: tuple[dict[str, str], FakeJobs, Path]) -> None:
    env, jobs, log = node
    jobs.start(0, memory_mib=140_000)
    jobs.start(1, memory_mib=140_000)
    rc, rec = verdict_of(["health", "--no-daemon", "--format", "json"], env)
    assert rc == 0, rec["blockers"]
    assert rec["requirement"]["question"] == "node_health"
    assert [d["occupancy"] for d in rec["devices"]] == ["busy", "busy"]
    assert all(d["healthy"] for d in rec["devices"])
    assert read_context_log(log, event="context") == []


def test_health_names_a_lost_gpu_while_another_is_busy(
        node: tuple[dict[str, str], FakeJobs, Path]) -> None:
    env, jobs, _ = node
    jobs.start(0)
    jobs.set_knobs(FAKE_NVML_DEVICE_ERRORS="1:15")
    rc, rec = verdict_of(["health", "--no-daemon", "--format", "json"], env)
    assert rc == 1
    assert rec["gpu_validation_blocker"] == "gpu_lost"


def test_out_of_memory_on_a_full_gpu_without_other_processes_stays_a_fault(
        gpu_env: EnvFactory, tmp_path: Path) -> None:
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=1, FAKE_NVML_MEMORY_USED_MIB="0:143700")
    env["GPUDIAG_LOCK_DIR"] = str(tmp_path / "locks")
    rc, rec = verdict_of(["health", "--no-daemon", "--format", "json"], env)
    assert rc == 1
    assert rec["gpu_validation_blocker"] == "cuda_out_of_memory"


def test_prohibited_mode_without_processes_stays_cuda_devices_unavailable(
        gpu_env: EnvFactory, tmp_path: Path) -> None:
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=1, FAKE_NVML_COMPUTE_MODE=f"0:{PROHIBITED}")
    env["GPUDIAG_LOCK_DIR"] = str(tmp_path / "locks")
    rc, rec = verdict_of(["preflight", "--require", "cuda", "--no-daemon", "--format", "json"],
                         env)
    assert rc == 1
    assert rec["gpu_validation_blocker"] == "cuda_devices_unavailable"


def test_a_gpu_locked_by_a_gpudiag_run_job_is_busy_and_not_probed(
        node: tuple[dict[str, str], FakeJobs, Path]) -> None:
    from gpudiag.engine.locks import release, try_lock

    env, _, log = node
    lock = try_lock(Path(env["GPUDIAG_LOCK_DIR"]), UUID[1])
    assert lock is not None
    try:
        rc, rec = verdict_of(["preflight", "--require", "cuda", "--gpus", "1", "--no-daemon",
                              "--format", "json"], env)
    finally:
        release([lock])
    assert rc == 0, rec["blockers"]
    assert {d["uuid"]: d["occupancy"] for d in rec["devices"]} == {UUID[0]: "free",
                                                                  UUID[1]: "busy"}
    assert _contexts_on(log, UUID[1]) == []


def test_run_gpus_1_runs_on_the_free_gpu_while_another_job_holds_gpu_0(
        node: tuple[dict[str, str], FakeJobs, Path], tmp_path: Path) -> None:
    env, jobs, log = node
    jobs.start(0)
    out = run_gpudiag(["run", "--gpus", "1", "--require", "cuda", "--no-daemon",
                       "--artifacts", str(tmp_path / "art"), "--", "sh", "-c",
                       "echo CVD=$CUDA_VISIBLE_DEVICES"], env)
    assert out.returncode == 0, out.stderr
    assert f"CVD={UUID[1]}" in out.stdout
    assert _contexts_on(log, UUID[0]) == []


def test_daemon_rounds_while_jobs_come_and_go_never_touch_a_busy_gpu(
        fakes: FakeDriver, tmp_path: Path) -> None:
    """Several probe rounds of a real daemon while fake jobs come and go on its GPUs: the
    context log shows no context on a GPU while a job held it, no blocker episode in the
    history is caused by occupancy, and the metrics and both questions say busy, not broken."""
    log = tmp_path / "contexts.jsonl"
    with FakeJobs(tmp_path / "state", compute_modes={0: EXCLUSIVE_PROCESS,
                                                     1: EXCLUSIVE_PROCESS}) as jobs:
        env = host_env(fakes, tmp_path / "host", gpus=2, FAKE_NVML_DEVICE_COUNT=2,
                       FAKE_GPU_STATE_FILE=str(jobs.state_file), FAKE_CUDA_CONTEXT_LOG=str(log))
        env["GPUDIAG_LOCK_DIR"] = str(tmp_path / "locks")
        toml = daemon_toml({"backends.cuda": {"interval_s": 0.3}})
        daemon = Daemon(env, write_config(tmp_path / "gpudiag.toml", toml), tmp_path / "sd")
        try:
            daemon.wait_ready()
            for gpu in (0, 1, 0, 1, 0):
                job = jobs.start(gpu, memory_mib=120_000)
                time.sleep(1.2)  # several cuda rounds (every 0.3 s) while the job runs
                if gpu == 1:
                    status, health = daemon.get("/v1/health")
                    assert status == 200 and health["ready"] is True, health["blockers"]
                    status, job_view = daemon.get("/v1/preflight?gpus=1")
                    assert status == 200 and job_view["ready"] is True
                    chosen = [d["uuid"] for d in job_view["devices"] if d["selected"]]
                    assert chosen == [UUID[0]]
                    _, both = daemon.get("/v1/preflight?gpus=2")
                    assert both["gpu_validation_blocker"] == "devices_busy"
                    _, metrics = daemon.get("/metrics")
                    assert f'gpudiag_gpu_occupancy{{gpu="1",state="busy",uuid="{UUID[1]}"}} 1.0' \
                        in metrics
                    assert 'gpudiag_gpus_ready_free 1.0' in metrics
                    assert "gpudiag_ready 1.0" in metrics
                jobs.stop(job)
                time.sleep(0.6)
            _, history = daemon.get("/v1/history?limit=200")
        finally:
            daemon.stop()
        contexts = read_context_log(log, event="context")
        assert contexts, "the cuda probe never proved a GPU"
        # 0.2 s of grace: a probe that read NVML just before the job appeared cannot know.
        assert jobs.contexts_while_busy(contexts, grace_s=0.2) == []
    episodes = json.dumps(history)
    for code in ("cuda_devices_unavailable", "cuda_out_of_memory", "devices_busy"):
        assert code not in episodes, f"occupancy became a blocker episode: {code}"
