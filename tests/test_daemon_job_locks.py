"""One lock view: the daemon's published occupancy shows a GPU a `gpudiag run` job holds as
BUSY after every NVML reading, not only right after its own active round."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from gpudiag.core.probe_run import ProbeRun
from gpudiag.core.readiness import BUSY, FREE, UNKNOWN, GpuOccupancy
from gpudiag.daemon.scheduler import Scheduler
from gpudiag.daemon.snapshot import ProbeKey
from gpudiag.engine.locks import JOB_LOCKED, release, try_lock
from gpudiag.engine.occupancy_view import relook
from tests.fakes.build import FakeDriver
from tests.support.daemon import (
    Daemon,
    Replay,
    daemon_toml,
    host_env,
    qualification_outcomes,
    quick_config,
    wait_for,
    write_config,
)

UUID0 = "GPU-f00d0000-0000-4000-8000-000000000000"
UUID1 = "GPU-f00d0001-0000-4000-8000-000000000001"
UUID2 = "GPU-f00d0002-0000-4000-8000-000000000002"


def _free(*uuids: str) -> dict[str, GpuOccupancy]:
    return {u: GpuOccupancy(u, FREE) for u in uuids}


def _marked(lock_dir: Path, occupancy: dict[str, GpuOccupancy]) -> dict[str, GpuOccupancy]:
    return dict(relook(occupancy, occupancy, lock_dir=lock_dir).gpus)


def test_a_jobs_lock_is_busy_a_sibling_probes_lock_is_not_and_nothing_stays_held(
        tmp_path: Path) -> None:
    locks = tmp_path / "locks"
    job = try_lock(locks, UUID0, purpose="job")
    probe = try_lock(locks, UUID1, purpose="probe")
    assert job is not None and probe is not None
    try:
        seen = _marked(locks, _free(UUID0, UUID1, UUID2))
    finally:
        release([job, probe])
    assert seen[UUID0] == GpuOccupancy(UUID0, BUSY, why=JOB_LOCKED)
    assert seen[UUID1].state == FREE and seen[UUID2].state == FREE
    # The check let go of every lock it took: a job can take the free GPU at once.
    taken = try_lock(locks, UUID2, purpose="job")
    assert taken is not None
    release([taken])


def test_a_busy_or_unknown_gpu_is_left_as_nvml_said(tmp_path: Path) -> None:
    occupancy = {UUID0: GpuOccupancy(UUID0, BUSY, pids=(4242,)),
                 UUID1: GpuOccupancy(UUID1, UNKNOWN)}
    assert _marked(tmp_path / "locks", occupancy) == occupancy
    assert not (tmp_path / "locks").exists()  # nothing was even tried


def _nvml_run(*uuids: str) -> ProbeRun:
    devices = [{"index": i, "ok": True, "uuid": u, "processes": [],
                "memory": {"free_bytes": 10, "total_bytes": 20}} for i, u in enumerate(uuids)]
    return ProbeRun("nvml", {"ok": True, "devices": devices}, 0.1, exit_code=0)


def test_a_lock_file_that_cannot_be_opened_makes_its_gpu_unknown_said_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    locks = tmp_path / "locks"
    locks.mkdir()
    os.mkfifo(locks / f"{UUID0}.lock")  # planted in the shared folder
    sched = Scheduler(quick_config(), runner=Replay({"nvml": _nvml_run(UUID0, UUID1)}),
                      env={}, lock_dir=locks)
    with caplog.at_level(logging.WARNING, "gpudiag.daemon.scheduler"):
        for _ in range(2):  # every reading: unknown again
            assert sched.trigger([ProbeKey("nvml")])[ProbeKey("nvml")].done.wait(10)
            scope = sched.relook_locks().scope
            assert scope is not None
            seen = scope.occupancy
            assert seen[UUID0].state == UNKNOWN and "cannot be checked" in seen[UUID0].why
            assert seen[UUID1].state == FREE
    said = [r.getMessage() for r in caplog.records if "unknown, not free" in r.getMessage()]
    assert len(said) == 1 and UUID0 in said[0], said


def _samples(daemon: Daemon) -> dict[str, float]:
    out = {}
    for line in str(daemon.get("/metrics")[1]).splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _ready_free(daemon: Daemon) -> float:
    return _samples(daemon)["gpudiag_gpus_ready_free"]


def _nvml_readings(daemon: Daemon) -> float:
    """How many nvml probe runs the daemon has finished."""
    return sum(v for k, v in _samples(daemon).items()
               if k.startswith('gpudiag_probe_runs_total{backend="nvml"'))


def test_a_gpudiag_run_holding_every_gpu_is_busy_to_the_daemon_within_one_nvml_interval(
        fakes: FakeDriver, tmp_path: Path) -> None:
    env = host_env(fakes, tmp_path / "host", gpus=2, FAKE_NVML_DEVICE_COUNT=2,
                   GPUDIAG_LOCK_DIR=str(tmp_path / "locks"))
    # No cuda round during the test: what the daemon says comes from its NVML readings
    # (every 0.5 s) alone.
    toml = daemon_toml({"backends.cuda": {"interval_s": 600}})
    daemon = Daemon(env, write_config(tmp_path / "gpudiag.toml", toml), tmp_path / "state")
    job: subprocess.Popen[str] | None = None
    try:
        daemon.wait_ready()
        assert daemon.get("/v1/preflight?gpus=1")[1]["ready"] is True
        wait_for(lambda: _ready_free(daemon) == 2, 5)
        started = tmp_path / "started"
        job = subprocess.Popen(
            [sys.executable, "-m", "gpudiag", "run", "--gpus", "2", "--no-daemon",
             "--artifacts", str(tmp_path / "runs"), "--", "sh", "-c",
             f"touch {started}; sleep 6"],
            env={**env, "GPUDIAG_DAEMON_URL": "http://127.0.0.1:9"},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(started.exists, 30)  # the locks are held from before the child started
        t0, readings = time.monotonic(), _nvml_readings(daemon)

        def busy() -> dict[str, Any] | None:
            rec = daemon.get("/v1/preflight?gpus=1")[1]
            return rec if rec["gpu_validation_blocker"] == "devices_busy" else None

        def settled() -> bool:
            # Busy, or the daemon has finished two readings since (one may have been under
            # way when the locks were taken): then it must say busy.
            return busy() is not None or _nvml_readings(daemon) >= readings + 2

        wait_for(settled, 10)
        took = time.monotonic() - t0
        print(f"busy {took:.2f} s after the job's child started (nvml interval 0.5 s)")
        rec = busy()
        assert rec is not None, "the next NVML reading did not see the job's locks"
        assert rec["ready"] is False
        assert {d["occupancy"] for d in rec["devices"]} == {"busy"}
        # And it stays busy through the following NVML readings (the bug: the next reading
        # forgot the lock), with no GPU counted free for the default requirement.
        readings = _nvml_readings(daemon)
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            assert busy() is not None
            assert _ready_free(daemon) == 0
            time.sleep(0.1)
        assert _nvml_readings(daemon) >= readings + 2, "too few NVML readings to tell"
        _, err = job.communicate(timeout=30)
        assert job.returncode == 0, err
        # The job ended: its GPUs are free again at the next reading.
        wait_for(lambda: daemon.get("/v1/preflight?gpus=1")[1]["ready"] is True, 3)
        wait_for(lambda: _ready_free(daemon) == 2, 3)
    finally:
        if job is not None and job.poll() is None:
            job.kill()
            job.wait(10)
        assert daemon.stop() == 0


def test_a_gpu_a_qualification_let_go_of_is_free_to_jobs_before_the_next_nvml_reading(
        fakes: FakeDriver, tmp_path: Path) -> None:
    """A finished qualification makes the daemon look at the locks again at once: a job
    asking right after is not told ``devices_busy`` for an NVML interval (15 s by default;
    600 s here, so no reading can come between)."""
    locks = tmp_path / "locks"
    env = host_env(fakes, tmp_path / "host", gpus=2, FAKE_NVML_DEVICE_COUNT=2,
                   GPUDIAG_LOCK_DIR=str(locks))
    toml = daemon_toml({"backends.nvml": {"interval_s": 600},
                        "backends.cuda": {"interval_s": 600},
                        "qualification": {"enabled": False, "tick_s": 0.1}})
    daemon = Daemon(env, write_config(tmp_path / "gpudiag.toml", toml), tmp_path / "state")
    try:
        daemon.wait_ready()
        assert daemon.get("/v1/preflight?require=cuda&gpus=2")[1]["ready"] is True
        # A qualification holds GPU 0 (its lock and mark, shared) while the daemon reads.
        held = try_lock(locks, UUID0, purpose="qualify", shared=True)
        assert held is not None
        try:
            rec = daemon.get("/v1/preflight?require=cuda&gpus=2&max_age_s=0")[1]
        finally:
            release([held])
        assert rec["gpu_validation_blocker"] == "devices_busy", rec["blockers"]
        # The daemon's own qualification of GPU 1 ends: its outcome makes it look again.
        req = urllib.request.Request(daemon.url + "/v1/qualify?gpus=1", method="POST",
                                     data=b"")
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 202
        wait_for(lambda: "1" in qualification_outcomes(daemon), 60, interval=0.1)  # GPU 1

        def answer() -> dict[str, Any]:
            got = daemon.get("/v1/preflight?require=cuda&gpus=2&max_age_s=600")[1]
            assert isinstance(got, dict)
            return got

        # The outcome is in /metrics a moment before the look (the same publish).
        wait_for(lambda: answer()["ready"], 5, interval=0.05)
        rec = answer()
        assert {d["occupancy"] for d in rec["devices"]} == {"free"}, rec["devices"]
    finally:
        assert daemon.stop() == 0


def test_an_inline_probe_proving_a_gpu_beside_the_daemon_is_no_user_of_it(
        fakes: FakeDriver, tmp_path: Path) -> None:
    """Siblings are not users after every NVML reading too, not only in the busy-GPU round:
    a probe child of this uid under a holder of the GPU's probe mark (an inline preflight
    proving GPU 0) leaves it free; once the mark is let go, the same process is a user."""
    locks = tmp_path / "locks"
    mark = try_lock(locks, UUID0, purpose="probe", shared=True)  # the preflight's lock and mark
    assert mark is not None
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "-m",
                              "gpudiag.probes", "cuda"])  # its probe child, listed on GPU 0
    env = host_env(fakes, tmp_path / "host", gpus=2, FAKE_NVML_DEVICE_COUNT=2,
                   GPUDIAG_LOCK_DIR=str(locks), FAKE_NVML_PROCESSES=f"0:{child.pid}:300")
    toml = daemon_toml({"backends.cuda": {"interval_s": 600}})
    daemon = Daemon(env, write_config(tmp_path / "gpudiag.toml", toml), tmp_path / "state")

    def gpu0() -> str:
        rec = daemon.get("/v1/preflight?gpus=2")[1]
        return str(next(d["occupancy"] for d in rec["devices"] if d["uuid"] == UUID0))

    try:
        daemon.wait_ready()
        readings = _nvml_readings(daemon)
        wait_for(lambda: _nvml_readings(daemon) >= readings + 2, 10)
        rec = daemon.get("/v1/preflight?gpus=2")[1]
        assert rec["ready"] is True, rec["blockers"]
        assert gpu0() == "free"
        release([mark])  # no probe mark now: the process on GPU 0 is someone's use of it
        wait_for(lambda: gpu0() == "busy", 10)
        assert daemon.get("/v1/preflight?gpus=2")[1]["gpu_validation_blocker"] == "devices_busy"
    finally:
        release([mark])
        child.kill()
        child.wait(10)
        assert daemon.stop() == 0
