"""The job watch in a real daemon: a `gpudiag run` whose collective hangs is named, and runs on.

A real `gpudiag serve` on the fakes (two GPUs at 100% utilization and 80 W of 700 W through
the state file) attests a real `gpudiag run` on its socket; with `[jobs] stall_after_s = 1`
the run's metric, /v1/health's runs evidence, its closeout and `gpudiag explain` name
``job_stalled``, and the job still runs to its own end (a warning, never a blocker).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.build import FakeDriver, write_state_file
from tests.support.daemon import (
    Daemon,
    daemon_toml,
    host_env,
    metric_samples,
    wait_for,
    write_config,
)

pytestmark = pytest.mark.slow


@pytest.fixture
def node(fakes: FakeDriver, tmp_path: Path) -> Iterator[tuple[Daemon, dict[str, str], Path]]:
    top = Path(tempfile.mkdtemp(prefix="gpudiag-watch-"))
    top.chmod(0o755)
    (top / "daemon").mkdir(mode=0o755)
    (top / "locks").mkdir(mode=0o1777)
    sock, state_file = top / "daemon" / "gpudiag.sock", tmp_path / "gpu-state"
    write_state_file(state_file, {"FAKE_NVML_DEVICE_COUNT": 2,
                                  "FAKE_NVML_UTILIZATION": "0:100,1:100",
                                  "FAKE_NVML_POWER_MW": "0:80000,1:80000"})
    env = host_env(fakes, tmp_path / "host", gpus=2, FAKE_GPU_STATE_FILE=str(state_file),
                   GPUDIAG_LOCK_DIR=str(top / "locks"))
    cfg = write_config(tmp_path / "gpudiag.toml", daemon_toml(
        {"jobs": {"interval_s": 0.2, "stall_after_s": 1, "straggler_after_s": 1}}))
    d = Daemon(env, cfg, tmp_path / "state", extra_args=("--socket", str(sock)))
    try:
        d.wait_ready()
        yield d, {**env, "GPUDIAG_DAEMON_URL": f"unix:{sock}"}, tmp_path
    finally:
        d.stop()
        shutil.rmtree(top, ignore_errors=True)


def _stalled(d: Daemon) -> dict[str, float]:
    return {lab["run"]: v for lab, v in metric_samples(d, "gpudiag_job_stalled")}


def test_a_hung_two_gpu_run_is_named_job_stalled_and_runs_to_its_end(
        node: tuple[Daemon, dict[str, str], Path]) -> None:
    d, env, tmp = node
    arts, go = tmp / "runs", tmp / "go"
    job = subprocess.Popen(
        [sys.executable, "-m", "gpudiag", "run", "--gpus", "2", "--artifacts", str(arts), "--",
         "sh", "-c", f"while [ ! -e {go} ]; do sleep 0.1; done; exit 0"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stalled = wait_for(lambda: [r for r, v in _stalled(d).items() if v == 1.0], 30)
        status, health = d.get("/v1/health?require=nvml")
        assert status == 200, health
        runs: dict[str, Any] = health["evidence"]["runs"]
        (shown,) = [r for r in runs["open"] if r["run"] == stalled[0]]
        assert shown["job_stalled"] and shown["warnings"][0]["code"] == "job_stalled"
        assert health["gpu_validation_blocker"] == "none"  # a warning on a run, no blocker
        assert job.poll() is None  # nothing stopped the job
        (tmp / "go").touch()
        _, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    assert job.returncode == 0, err
    closeout = json.loads(next(arts.glob("*/closeout.json")).read_text())
    record = closeout["job_record"]
    assert record["attested"] == "socket", record
    (warning,) = record["warnings"]
    assert warning["code"] == "job_stalled" and warning["numbers"]["power_max_w"] == 80.0
    assert warning["numbers"]["utilization_min_ratio"] == 1.0
    # The ended run's series goes (bounded: open runs only).
    wait_for(lambda: stalled[0] not in _stalled(d), 10)
    explained = subprocess.run(
        [sys.executable, "-m", "gpudiag", "explain", "--pid", str(job.pid), "--state-dir",
         str(tmp / "state"), "--format", "json"], env=env, capture_output=True, text=True,
        timeout=60, check=False)
    assert explained.returncode in (0, 1), explained.stderr
    said = json.loads(explained.stdout)
    assert [w["code"] for w in said["job"]["warnings"]] == ["job_stalled"]
    assert any(r["what"] == "job_stalled" for r in said["timeline"]), said["timeline"]
    for fmt, shown in (("kv", "warnings=job_stalled\n"), ("text", "warning: job_stalled: ")):
        out = subprocess.run(
            [sys.executable, "-m", "gpudiag", "explain", "--pid", str(job.pid), "--state-dir",
             str(tmp / "state"), "--format", fmt], env=env, capture_output=True, text=True,
            timeout=60, check=False)
        assert shown in out.stdout, out.stdout
