"""`gpudiag qualify` end to end: the real CLI, real probe children, the fake driver.

The fake libcuda's copies take the time FAKE_CUDA_COPY_GBPS says and FAKE_CUDA_CORRUPT_COPY
flips a byte; its context log records every context, allocation and copy with its time, the
proof of what ran on which GPU and when. GPUs are made small (80 MiB: a 4 MiB copy buffer
within the 10% budget) so that copies at a fraction of a GB/s take milliseconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from gpudiag.engine.locks import release, try_lock
from gpudiag.probes.qualify import ABORT_GRACE_S, Guard, watch
from tests.fakes.jobs import FakeJobs, read_context_log
from tests.support.host import EnvFactory, run_gpudiag

GIB_PER_S = 1e9
HEALTHY_GBPS, SLOW_GBPS = 0.4, 0.1
SMALL_GPU = {"FAKE_GPU_MEMORY_TOTAL_MIB": 80, "FAKE_CUDA_CONTEXT_MIB": 1}


def uuid(i: int) -> str:
    return f"GPU-f00d{i:04x}-0000-4000-8000-00000000{i:04x}"


def _write_table(path: Path, *, names: list[str], bandwidth: float, matmul: float) -> Path:
    """A test reference table: healthy figures of this machine's fakes or CPU devices."""
    peaks = {"memory_bandwidth": bandwidth, "host_to_device_bandwidth": bandwidth,
             "device_to_host_bandwidth": bandwidth, "matmul_bf16": matmul,
             "matmul_fp32": matmul}
    path.write_text(json.dumps({"models": [{
        "model": "test", "names": names, "source": "tests/test_qualify.py",
        "peaks": peaks, "healthy_share": {m: 1.0 for m in peaks}}]}))
    return path


def _qualify(args: list[str], env: Mapping[str, str], timeout: float = 120
             ) -> tuple[int, dict[str, Any], str]:
    proc = run_gpudiag(["qualify", "--format", "json", *args], env, timeout)
    assert proc.stdout, proc.stderr
    return proc.returncode, json.loads(proc.stdout), proc.stderr


def _by_index(report: Mapping[str, Any]) -> dict[int, dict[str, Any]]:
    return {q["index"]: q for q in report["gpus"]}


def test_a_slow_gpu_3_among_8_is_caught_against_table_and_peers(
        gpu_env: EnvFactory, tmp_path: Path) -> None:
    speeds = ",".join(f"{i}:{SLOW_GBPS if i == 3 else HEALTHY_GBPS}" for i in range(8))
    env = gpu_env(FAKE_CUDA_COPY_GBPS=speeds, **SMALL_GPU)
    table = _write_table(tmp_path / "table.json", names=["h200"],
                         bandwidth=HEALTHY_GBPS * GIB_PER_S, matmul=1e12)
    code, report, _ = _qualify(["--reference", str(table), "--state-dir",
                                str(tmp_path / "state")], env)
    gpus = _by_index(report)
    assert sorted(gpus) == list(range(8)) and report["left_alone"] == {}
    assert {i: q["code"] for i, q in gpus.items()} == {
        i: "gpu_underperforming" if i == 3 else "none" for i in range(8)}
    assert code == 0  # a warning by default
    slow = gpus[3]
    assert slow["severity"] == "warning" and "memory_bandwidth" in slow["message"]
    mem = next(s for s in slow["scores"] if s["measure"] == "memory_bandwidth")
    refs = {r["reference"]: r for r in mem["references"]}
    assert refs["peers"]["below"] and refs["peers"]["ratio"] == pytest.approx(0.25, abs=0.08)
    assert refs["table"]["below"] and "tests/test_qualify.py" in refs["table"]["basis"]
    assert mem["value"] == pytest.approx(SLOW_GBPS * GIB_PER_S, rel=0.25)
    # Bounded memory: two 4 MiB buffers, within 10% of an 80 MiB GPU.
    assert all(q["bytes_used"] <= 8 * 2 ** 20 for q in gpus.values())
    history = (tmp_path / "state" / "qualifications.jsonl").read_text().splitlines()
    assert len(history) == 8 and all(json.loads(h)["schema"] == "gpudiag.qualification/1"
                                     for h in history)


def test_a_wrong_byte_is_a_compute_mismatch_and_a_busy_gpu_is_never_touched(
        gpu_env: EnvFactory, tmp_path: Path) -> None:
    log = tmp_path / "contexts.jsonl"
    with FakeJobs(tmp_path / "state-file") as jobs:
        jobs.start(1)
        env = gpu_env(FAKE_GPU_STATE_FILE=str(jobs.state_file), FAKE_CUDA_CONTEXT_LOG=str(log),
                      FAKE_CUDA_CORRUPT_COPY="5:99", **SMALL_GPU)
        code, report, _ = _qualify(["--gpus", f"1,{uuid(5)}", "--no-history"], env)
    assert code == 1, report
    (only,) = report["gpus"]
    assert only["uuid"] == uuid(5) and only["code"] == "gpu_compute_mismatch"
    assert "byte 99 read back" in only["message"]
    assert report["left_alone"] == {uuid(1): "busy"}
    assert not [e for e in read_context_log(log, event=None) if e.gpu == 1]


def test_a_job_appearing_mid_run_aborts_it_within_1_s(
        gpu_env: EnvFactory, tmp_path: Path) -> None:
    log = tmp_path / "contexts.jsonl"
    with FakeJobs(tmp_path / "state-file", knobs={"FAKE_CUDA_COPY_GBPS": "2:0.02"}) as jobs:
        env = gpu_env(FAKE_GPU_STATE_FILE=str(jobs.state_file), FAKE_CUDA_CONTEXT_LOG=str(log),
                      **SMALL_GPU)
        proc = subprocess.Popen([sys.executable, "-m", "gpudiag", "qualify", "--gpus", "2",
                                 "--format", "json", "--no-history"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not read_context_log(log, event="copy") and time.monotonic() < deadline:
            time.sleep(0.05)
        job = jobs.start(2)
        out, err = proc.communicate(timeout=60)
        ended = time.time()
    assert proc.returncode == 0, err
    (only,) = json.loads(out)["gpus"]
    assert only["code"] == "qualification_aborted" and str(job.pid) in only["message"]
    copies = [e for e in read_context_log(log, event="copy") if e.gpu == 2]
    assert copies, "the run had begun before the job appeared"
    # Nothing ran on the GPU 1 s after the job appeared; the child was gone soon after.
    assert max(e.time for e in copies) <= job.started_at + 1.0
    assert ended - job.started_at < 10
    lock = try_lock(Path(env["GPUDIAG_LOCK_DIR"]), uuid(2))
    assert lock is not None, "the GPU's lock was released"
    release([lock])


# JAX starts, compiles and measures on 8 CPU devices, then once more: about 10 s on an idle
# machine, 20 s on a loaded one.
@pytest.mark.slow
def test_the_pipeline_runs_for_real_on_jax_cpu_devices(tmp_path: Path) -> None:
    from tests.support.host import clean_env

    table = _write_table(tmp_path / "cpu.json", names=["cpu"], bandwidth=1e6, matmul=1e6)
    state = tmp_path / "state"
    args = ["--platform", "cpu", "--reference", str(table), "--state-dir", str(state)]
    code, report, err = _qualify(args, clean_env())
    assert code == 0, err
    gpus = _by_index(report)
    assert sorted(gpus) == list(range(8))
    for q in gpus.values():
        assert q["platform"] == "cpu" and q["aborted"] is None, q
        assert {k["check"]: k["ok"] for k in q["known_answers"]} == {
            "memory_pattern": True, "matmul_bf16": True}
        values = {s["measure"]: s["value"] for s in q["scores"]}
        assert set(values) == {"memory_bandwidth", "host_to_device_bandwidth",
                               "device_to_host_bandwidth", "matmul_bf16"}
        assert all(v is not None and v > 0 for v in values.values())
        assert q["reference_model"] == "test"
    # Device 0's record, written twice more as if from earlier runs: the next run finds
    # three in the history, and its own median becomes a reference.
    lines = (state / "qualifications.jsonl").read_text().splitlines()
    first = next(ln for ln in lines if json.loads(ln)["uuid"] == "CPU-0")
    with (state / "qualifications.jsonl").open("a") as f:
        f.write(f"{first}\n{first}\n")
    code, again, err = _qualify([*args, "--cpu-devices", "1", "--gpus", "0"], clean_env())
    assert code == 0, err
    hist = {r["reference"]: r for r in again["gpus"][0]["scores"][0]["references"]}["history"]
    assert hist["value"] is not None and "last 3 result(s)" in hist["basis"]
    assert len((state / "qualifications.jsonl").read_text().splitlines()) == 11


# JAX and IREE both start, and IREE compiles a 512 x 512 matmul (cached afterwards): about
# 10 s on an idle machine, 20 s on a loaded one.
@pytest.mark.slow
def test_full_tier_measures_fp32_with_a_known_answer_on_cpu(tmp_path: Path) -> None:
    from tests.support.host import clean_env

    code, report, err = _qualify(["--platform", "cpu", "--cpu-devices", "1", "--tier", "full",
                                  "--no-history"], clean_env())
    assert code == 0, err
    (only,) = report["gpus"]
    checks = {k["check"]: k for k in only["known_answers"]}
    assert checks["matmul_fp32"]["ok"] and "tolerance" in checks["matmul_fp32"]["detail"]
    # The same product through IREE's local-task, checked against float64 too.
    assert checks["matmul_fp32_iree"]["ok"] and "IREE local-task" in checks[
        "matmul_fp32_iree"]["detail"]
    values = {s["measure"]: s["value"] for s in only["scores"]}
    assert all(values[m] > 0 for m in ("matmul_fp32", "matmul_bf16", "matmul_fp32_iree"))


@pytest.mark.parametrize(("args", "message"), [
    (["--gpus", "banana"], "is not a GPU name: an index, a full UUID"),
    (["--gpus", ","], "names no GPU"),
    (["--platform", "cpu", "--cpu-devices", "2", "--gpus", "5"], "devices 0 to 1"),
])
def test_bad_flags_are_usage_errors_that_name_the_fix(args: list[str], message: str) -> None:
    from tests.support.host import clean_env

    proc = run_gpudiag(["qualify", *args, "--no-history"], clean_env())
    assert proc.returncode == 2 and message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_bad_reference_table_is_a_usage_error(tmp_path: Path) -> None:
    from tests.support.host import clean_env

    bad = tmp_path / "t.json"
    bad.write_text('{"models": [{"names": ["x"], "peaks": {"warp": 1}, "source": "s"}]}')
    proc = run_gpudiag(["qualify", "--reference", str(bad)], clean_env())
    assert proc.returncode == 2 and "unknown measure 'warp'" in proc.stderr


def test_the_watcher_stops_the_run_when_a_process_appears() -> None:
    readings = iter([[], [], [4242]])
    guard = Guard(deadline=time.monotonic() + 60)
    appeared = threading.Event()

    def read(_: str) -> list[int]:
        pids = next(readings, [4242])
        if pids:
            appeared.set()
        return pids

    started = time.monotonic()
    thread = watch(guard, "GPU-x", read)
    assert guard.stopped.wait(5) and appeared.is_set()
    assert time.monotonic() - started < 5 and "4242" in (guard.reason or "")  # not at 60 s
    guard.done.set()  # the measurements stopped: the watcher must not end the process
    thread.join(ABORT_GRACE_S * 2)
    assert not thread.is_alive()


def test_the_python_api_qualifies_and_keeps_history(gpu_env: EnvFactory, tmp_path: Path) -> None:
    import gpudiag
    from gpudiag.core.qualify import parse_reference_table

    table = parse_reference_table(json.loads(_write_table(
        tmp_path / "t.json", names=["h200"], bandwidth=HEALTHY_GBPS * GIB_PER_S,
        matmul=1e12).read_text()))
    env = gpu_env(FAKE_CUDA_COPY_GBPS=f"0:{HEALTHY_GBPS}", **SMALL_GPU)
    options = gpudiag.QualifyOptions(gpus=("0",), table=table, state_dir=tmp_path / "state")
    report = gpudiag.qualify(options, env=env)
    (only,) = report.qualifications
    assert (only.code, only.result.uuid, report.failed) == ("none", uuid(0), False)
    assert only.reference_model == "test" and report.history_error is None
    assert only.result.value("memory_bandwidth") == pytest.approx(HEALTHY_GBPS * GIB_PER_S,
                                                                   rel=0.25)
    assert (tmp_path / "state" / "qualifications.jsonl").read_text().count("\n") == 1


def test_without_nvml_nothing_is_known_idle_and_gpudiag_says_so(bare_env: dict[str, str]
                                                                 ) -> None:
    proc = run_gpudiag(["qualify", "--no-history"], bare_env)
    assert proc.returncode == 3 and "NVML could not be read" in proc.stderr
    assert "gpudiag probe --backend nvml" in proc.stderr and "Traceback" not in proc.stderr
