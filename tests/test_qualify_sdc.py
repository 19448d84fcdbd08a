"""`gpudiag qualify --tier sdc` end to end: the real CLI, real probe children, the fake driver.

The fake libcuda's memory really holds bytes; FAKE_CUDA_MEMORY_FAULT gives one GPU a bad
cell (a bit flipped, stuck at 0 or at 1) that every device-to-host copy covering it shows.
The fakes compute no kernels, so the GEMM checks run the same seeded programs on the host
(GPUDIAG_TEST_SDC_GEMM=host) and GPUDIAG_TEST_SDC_FAULT flips one output bit on a chosen GPU,
the test hook in the GEMM path. GPUs are small (80 MiB: a 7.9 MiB memory test within the
10% cap) so that every run takes a fraction of a second per GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from gpudiag.core.sdc import SDC
from tests.fakes.jobs import FakeJobs, read_context_log
from tests.support.host import EnvFactory, run_gpudiag

SMALL: dict[str, str | int] = {"FAKE_GPU_MEMORY_TOTAL_MIB": 80, "FAKE_CUDA_CONTEXT_MIB": 1,
                               "GPUDIAG_TEST_SDC_GEMM": "host"}
MEMORY = ("memory_address", "memory_walking_ones", "memory_random")


def uuid(i: int) -> str:
    return f"GPU-f00d{i:04x}-0000-4000-8000-00000000{i:04x}"


def _sdc(args: list[str], env: Mapping[str, str], timeout: float = 180
         ) -> tuple[int, dict[str, Any], str]:
    proc = run_gpudiag(["qualify", "--tier", "sdc", "--format", "json", *args], env, timeout)
    assert proc.stdout, proc.stderr
    return proc.returncode, json.loads(proc.stdout), proc.stderr


def _by_index(report: Mapping[str, Any]) -> dict[int, dict[str, Any]]:
    return {q["index"]: q for q in report["gpus"]}


def _checks(q: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["check"]: c for c in q["checks"]}


def test_three_gpus_one_busy_the_busy_one_untouched_a_record_per_idle_gpu_within_budget(
        gpu_env: EnvFactory, tmp_path: Path) -> None:
    log = tmp_path / "contexts.jsonl"
    with FakeJobs(tmp_path / "state-file") as jobs:
        jobs.start(1)
        env = gpu_env(FAKE_NVML_DEVICE_COUNT=3, FAKE_GPU_STATE_FILE=str(jobs.state_file),
                      FAKE_CUDA_CONTEXT_LOG=str(log), **SMALL)
        started = time.monotonic()
        code, report, err = _sdc(["--state-dir", str(tmp_path / "state")], env)
        took = time.monotonic() - started
    assert code == 0, err
    gpus = _by_index(report)
    assert sorted(gpus) == [0, 2] and report["left_alone"] == {uuid(1): "busy"}
    assert not [e for e in read_context_log(log, event=None) if e.gpu == 1]
    for q in gpus.values():
        assert q["tier"] == "sdc" and q["code"] == "none" and q["aborted"] is None, q
        assert q["duration_s"] <= SDC.budget_s and q["budget_s"] == SDC.budget_s
        checks = _checks(q)
        assert set(checks) == {"gemm_repeat", "golden", *MEMORY}
        assert all(checks[m]["status"] == "pass" for m in (*MEMORY, "gemm_repeat"))
        # Two GPUs agreeing are fewer than three: the golden is unknown, never a pass.
        assert checks["golden"]["status"] == "unknown" and "3 agree" in checks["golden"][
            "detail"]
        cov = q["coverage"]
        assert cov["unknown"] == ["golden"] and cov["checks"]["memory_random"] == "pass"
        assert cov["bytes_tested"] == 3 * checks["memory_address"]["bytes_tested"] > 2 ** 20
        # Under the memory cap: 10% of an 80 MiB GPU.
        assert q["bytes_used"] <= 8 * 2 ** 20
        for c in checks.values():
            cond = c["conditions"]
            assert cond["sm_clock_mhz"] == 1980 and cond["temperature_c"] == 35, cond
            assert cond["power_limit_w"] == 700.0 and cond["throttle_mask"] == 0
        assert q["versions"]["driver"] == "570.124.06" and "numpy" in q["versions"]
    assert "not covered (unknown, not a pass): golden" in gpus[0]["message"]
    assert took < 2 * SDC.budget_s + 20  # two GPUs, one after the other, and start-up


def test_every_injected_memory_fault_is_a_memory_test_failure_with_its_evidence(
        gpu_env: EnvFactory, tmp_path: Path) -> None:
    # One bad cell per GPU: a flip, stuck at 0, stuck at 1, at the first and last bytes,
    # within and across chunk boundaries; GPU 7 is clean.
    faults = {0: (0, 0, "flip"), 1: (8 * 1024 ** 2 // 10 * 9, 7, "flip"),
              2: (12345, 3, "stuck0"), 3: (4 * 1024 ** 2 + 1, 5, "stuck1"),
              4: (4 * 1024 ** 2 - 1, 7, "stuck0"), 5: (777, 0, "stuck1"),
              6: (8285183, 6, "flip")}
    knob = ",".join(f"{i}:{o}:{b}:{m}" for i, (o, b, m) in faults.items())
    env = gpu_env(FAKE_CUDA_MEMORY_FAULT=knob, **SMALL)
    code, report, err = _sdc(["--no-history"], env)
    assert code == 1, err
    gpus = _by_index(report)
    for i, (offset, bit, _mode) in faults.items():
        q = gpus[i]
        assert q["code"] == "gpu_memory_test_failed" and q["severity"] == "blocker", (i, q)
        failed = [c for c in q["checks"] if c["status"] == "fail"]
        assert failed and all(c["check"] in MEMORY for c in failed), failed
        where = failed[0]["where"]
        tested = int(where.split(" of the ")[1].split()[0])  # the region: the cell is mod it
        word = offset % tested // 8
        assert f"byte offset {8 * word} (word {word})" in where, (i, where)
        assert f"bit(s) {(offset % 8) * 8 + bit} of the word" in where, (i, where)
        assert failed[0]["expected"] != failed[0]["got"]
        assert failed[0]["conditions"]["sm_clock_mhz"] == 1980
        assert "memory test failed" in q["message"]
    assert gpus[7]["code"] == "none"


def test_every_injected_gemm_bit_flip_is_a_compute_mismatch_with_its_element(
        gpu_env: EnvFactory, tmp_path: Path) -> None:
    n = SDC.cpu_gemm_n
    flips = {0: (1, 0, 0), 1: (SDC.gemm_repeats, n * n - 1, 31), 2: (3, 5 * n + 7, 22),
             3: (2, 17, 0)}
    hook = ",".join(f"{i}:gemm_repeat:{it}:{e}:{b}" for i, (it, e, b) in flips.items())
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=5, GPUDIAG_TEST_SDC_FAULT=hook, **SMALL)
    code, report, err = _sdc(["--no-history"], env)
    assert code == 1, err
    gpus = _by_index(report)
    for i, (iteration, element, _bit) in flips.items():
        rep = _checks(gpus[i])["gemm_repeat"]
        assert gpus[i]["code"] == "gpu_compute_mismatch" and rep["status"] == "fail"
        assert rep["injected"] is True
        assert rep["where"] == f"element ({element // n}, {element % n}) of {n}x{n}, product " \
                               f"{iteration}"
        assert rep["expected"] != rep["got"]
    assert gpus[4]["code"] == "none" and _checks(gpus[4])["gemm_repeat"]["status"] == "pass"


def test_the_gpu_whose_golden_differs_from_its_7_peers_is_the_one_blocked_then_a_library_change_records_a_new_golden(  # noqa: E501
        gpu_env: EnvFactory, tmp_path: Path) -> None:
    state = tmp_path / "state"
    env = gpu_env(GPUDIAG_TEST_SDC_FAULT=f"5:golden:0:{SDC.cpu_golden_n + 3}:12", **SMALL)
    code, report, err = _sdc(["--state-dir", str(state)], env)
    assert code == 1, err
    gpus = _by_index(report)
    assert {i: q["code"] for i, q in gpus.items()} == {
        i: "gpu_compute_mismatch" if i == 5 else "none" for i in range(8)}
    golden5 = _checks(gpus[5])["golden"]
    assert golden5["status"] == "fail" and "differs from the node's majority" in golden5[
        "detail"]
    assert all(_checks(gpus[i])["golden"]["status"] == "pass" for i in range(8) if i != 5)
    store = json.loads((state / "goldens.json").read_text())["goldens"]
    ((key, golden),) = store.items()
    assert "driver 570.124.06" in key and "gemm-f32-n128" in key
    assert golden["gpus"] == sorted(uuid(i) for i in range(8) if i != 5)
    assert golden["hash"] == _checks(gpus[0])["golden"]["output_hash"]
    # One GPU alone is judged against the stored golden: still the broken one.
    code, alone, _ = _sdc(["--state-dir", str(state), "--gpus", "5"], env)
    assert code == 1 and alone["gpus"][0]["code"] == "gpu_compute_mismatch"
    # A driver (library) upgrade on every GPU, all agreeing: a new golden, nothing blocked.
    upgraded = gpu_env(FAKE_NVML_DRIVER_VERSION="575.51.03", **SMALL)
    code, after, err = _sdc(["--state-dir", str(state)], upgraded)
    assert code == 0, err
    assert all(q["code"] == "none" and _checks(q)["golden"]["status"] == "pass"
               for q in after["gpus"]), [q["message"] for q in after["gpus"]]
    store = json.loads((state / "goldens.json").read_text())["goldens"]
    assert len(store) == 2 and any("driver 575.51.03" in k for k in store)


def test_memory_taken_makes_the_memory_checks_unknown_never_a_pass(
        gpu_env: EnvFactory) -> None:
    # GPU 0 nearly full (79 of 80 MiB used by someone who left no process): 10% of the free
    # memory is below the memory test's minimum size.
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=1, FAKE_NVML_MEMORY_USED_MIB="0:79", **SMALL)
    code, report, err = _sdc(["--no-history"], env)
    assert code == 0, err
    (q,) = report["gpus"]
    checks = _checks(q)
    assert all(checks[m]["status"] == "unknown" and checks[m]["bytes_tested"] == 0
               for m in MEMORY), checks
    assert "minimum size" in checks["memory_address"]["detail"]
    assert set(q["coverage"]["unknown"]) == {*MEMORY, "golden"}
    assert q["coverage"]["bytes_tested"] == 0


def test_without_a_gemm_route_the_gemm_checks_are_unknown(gpu_env: EnvFactory) -> None:
    knobs = {k: v for k, v in SMALL.items() if k != "GPUDIAG_TEST_SDC_GEMM"}
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=1, **knobs)
    code, report, err = _sdc(["--no-history"], env)
    assert code == 0, err
    checks = _checks(report["gpus"][0])
    assert checks["gemm_repeat"]["status"] == checks["golden"]["status"] == "unknown"
    assert all(checks[m]["status"] == "pass" for m in MEMORY)


def test_a_job_appearing_mid_sdc_run_aborts_it_within_1_s(
        gpu_env: EnvFactory, tmp_path: Path) -> None:
    log = tmp_path / "contexts.jsonl"
    with FakeJobs(tmp_path / "state-file", knobs={"FAKE_CUDA_COPY_GBPS": "2:0.01"}) as jobs:
        env = gpu_env(FAKE_GPU_STATE_FILE=str(jobs.state_file), FAKE_CUDA_CONTEXT_LOG=str(log),
                      **SMALL)
        proc = subprocess.Popen([sys.executable, "-m", "gpudiag", "qualify", "--tier", "sdc",
                                 "--gpus", "2", "--format", "json", "--no-history"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not read_context_log(log, event="copy") and time.monotonic() < deadline:
            time.sleep(0.05)
        job = jobs.start(2)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    (only,) = json.loads(out)["gpus"]
    assert only["code"] == "qualification_aborted" and str(job.pid) in only["message"]
    assert only["coverage"]["checks"] == {}
    copies = [e for e in read_context_log(log, event="copy") if e.gpu == 2]
    assert copies and max(e.time for e in copies) <= job.started_at + 1.0


# The budget case spends most of the 10 s budget on purpose (copies at 1 MB/s).
@pytest.mark.slow
def test_the_budget_is_kept_and_what_it_cut_short_is_unknown(gpu_env: EnvFactory) -> None:
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=1, FAKE_CUDA_COPY_GBPS="0:0.001", **SMALL)
    code, report, err = _sdc(["--no-history"], env)
    assert code == 0, err
    (q,) = report["gpus"]
    assert q["duration_s"] <= SDC.budget_s, q["duration_s"]
    checks = _checks(q)
    assert checks["memory_random"]["status"] == "unknown"
    assert "budget" in checks["memory_random"]["detail"]
    assert checks["gemm_repeat"]["status"] == "pass"


def _clean_runs(gpu_env: EnvFactory, runs: int) -> dict[str, Any]:
    # A 24 MiB GPU (a 2.4 MiB memory test) and one BLAS thread: the same screen, cheaper.
    env = gpu_env(**{**SMALL, "FAKE_GPU_MEMORY_TOTAL_MIB": 24, "OPENBLAS_NUM_THREADS": 1})
    proc = subprocess.run([sys.executable, "-m", "tests.support.sdc_runs", str(runs)], env=env,
                          capture_output=True, text=True, timeout=900, check=False,
                          cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 0, proc.stderr
    out: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    return out


def _no_false_blocker(summary: Mapping[str, Any], runs: int) -> None:
    assert summary["codes"] == {"none": runs}, summary
    assert len(summary["hashes"]) == 1  # the same program gives the same bits every run
    for check in ("gemm_repeat", *MEMORY):
        assert summary["statuses"][check] == {"pass": runs}, summary
    assert summary["statuses"]["golden"] == {"pass": runs}  # against the first run's golden


def test_clean_runs_give_no_false_blocker(gpu_env: EnvFactory) -> None:
    _no_false_blocker(_clean_runs(gpu_env, 10), 10)


# 1000 runs of the whole child-side screen on the fake driver: 75 ms each on the loaded
# 2-core dev VM, about 80 s in all.
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_1000_clean_runs_give_no_false_blocker(gpu_env: EnvFactory) -> None:
    summary = _clean_runs(gpu_env, 1000)
    _no_false_blocker(summary, 1000)


def test_the_daemon_schedules_the_sdc_tier_and_a_bad_cell_blocks_its_gpu(
        fakes: Any, tmp_path: Path) -> None:
    from tests.support.daemon import (
        Daemon,
        daemon_toml,
        host_env,
        qualification_outcomes,
        wait_for,
        write_config,
    )

    env = host_env(fakes, tmp_path / "host", gpus=3, FAKE_NVML_DEVICE_COUNT=3,
                   FAKE_CUDA_MEMORY_FAULT="2:4096:3:stuck1", FAKE_GPU_NAME="Fake GPU",
                   **SMALL)
    config = write_config(tmp_path / "d.toml", daemon_toml({"qualification": {
        "tier": "sdc", "idle_s": 0.2, "tick_s": 0.1, "max_age_s": 3600}}))
    daemon = Daemon(env, config, tmp_path / "state")
    try:
        outcomes = wait_for(lambda: (o := qualification_outcomes(daemon)) and len(o) == 3 and o,
                            120, interval=0.5)
        assert outcomes == {"0": "none", "1": "none", "2": "gpu_memory_test_failed"}
        health = wait_for(lambda: (h := daemon.get("/v1/health?max_age_s=600")[1]) and any(
            b["code"] == "gpu_memory_test_failed" for b in h["blockers"]) and h, 30)
        (bad,) = [b for b in health["blockers"] if b["code"] == "gpu_memory_test_failed"]
        assert bad["device"] == uuid(2) and bad["layer"] == "device"
        assert "sdc tier" in bad["message"] and "byte offset 4096" in bad["message"]
        from tests.support.daemon import metric_samples

        checks = {(lab["gpu"], lab["check"]): lab["status"] for lab, v in
                  metric_samples(daemon, "gpudiag_gpu_qualification_check") if v == 1}
        assert checks[("2", "memory_walking_ones")] == "fail"
        assert checks[("0", "memory_random")] == "pass"
        tested = {lab["gpu"]: v for lab, v in
                  metric_samples(daemon, "gpudiag_gpu_qualification_tested_bytes")}
        assert tested["0"] > 2 ** 20
    finally:
        assert daemon.stop() == 0
    lines = [json.loads(x) for x in
             (tmp_path / "state" / "qualifications.jsonl").read_text().splitlines()]
    assert {r["tier"] for r in lines} == {"sdc"} and all("coverage" in r for r in lines)


# JAX starts once and compiles the two products per device: about 10-20 s on the dev VM.
@pytest.mark.slow
def test_the_sdc_tier_runs_for_real_on_jax_cpu_devices(tmp_path: Path) -> None:
    from tests.support.host import clean_env

    state = tmp_path / "state"
    code, report, err = _sdc(["--platform", "cpu", "--cpu-devices", "3", "--state-dir",
                              str(state)], clean_env())
    assert code == 0, err
    gpus = _by_index(report)
    assert sorted(gpus) == [0, 1, 2]
    for q in gpus.values():
        checks = _checks(q)
        assert q["code"] == "none" and {c["status"] for c in checks.values()} == {"pass"}, q
        assert checks["gemm_repeat"]["route"] == "jax" and "jax" in q["versions"]
        assert checks["memory_random"]["bytes_tested"] == 16 * 2 ** 20
        assert checks["golden"]["conditions"]["reason"].startswith("no GPU")
        assert q["duration_s"] <= SDC.budget_s
    ((key, golden),) = json.loads((state / "goldens.json").read_text())["goldens"].items()
    assert "gemm-bf16-f32acc-n128" in key and len(golden["gpus"]) == 3


def test_every_quick_tier_measurement_records_clocks_power_limit_temperature_and_throttle(
        gpu_env: EnvFactory) -> None:
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=1, FAKE_NVML_CLOCKS_MHZ="0:1410/2619",
                  FAKE_NVML_CLOCKS_EVENT_REASONS="0:0x4", FAKE_NVML_POWER_LIMIT_MW="0:450000",
                  FAKE_NVML_TEMPERATURE_C="0:71", **SMALL)
    proc = run_gpudiag(["qualify", "--format", "json", "--no-history"], env)
    assert proc.returncode == 0, proc.stderr
    (q,) = json.loads(proc.stdout)["gpus"]
    assert q["measurements"] and q["coverage"]["checks"]["memory_pattern"] == "pass"
    for m in q["measurements"]:
        assert m["conditions"] == {"sm_clock_mhz": 1410, "memory_clock_mhz": 2619,
                                   "temperature_c": 71, "power_limit_w": 450.0,
                                   "throttle_mask": 4, "throttle_reasons": ["sw_power_cap"],
                                   "reason": None}, m


def test_an_sdc_pass_keeps_a_quick_finding_and_the_gpu_is_not_due_again_at_once(
        tmp_path: Path) -> None:
    from gpudiag.core.qualify_score import GpuResult, KnownAnswer, score
    from gpudiag.core.readiness import FREE, GpuOccupancy
    from gpudiag.core.sdc import CheckResult
    from gpudiag.daemon.config import QualificationConfig
    from gpudiag.daemon.qualify_schedule import Qualifier
    from gpudiag.engine.qualify import QualifyReport
    from gpudiag.engine.qualify_history import QualificationHistory
    from tests.support.daemon import wait_for

    gpu = uuid(0)
    wrong = score(GpuResult(gpu, "Fake GPU", 0, "quick", "cuda", known_answers=(
        KnownAnswer("memory_pattern", False, "byte 7"),), started_at=100.0))
    QualificationHistory.in_state_dir(tmp_path).append([wrong.record()])
    passed = score(GpuResult(gpu, "Fake GPU", 0, "sdc", "cuda", checks=(
        CheckResult("memory_address", "pass", "ok"),), started_at=1000.0))
    runs: list[Any] = []

    def runner(options: Any) -> Any:
        runs.append(options)
        return QualifyReport("sdc", "cuda", "t", (passed,))

    cfg = QualificationConfig(tier="sdc", idle_s=0.0, max_age_s=100.0, tick_s=0.02)
    q = Qualifier(cfg, tmp_path, lambda: {gpu: GpuOccupancy(gpu, FREE)}, runner=runner,
                  clock=lambda: 1010.0)
    q.load()
    assert q.state().latest[gpu].code == "gpu_compute_mismatch"
    q.start()  # due at once: its last qualification (at 100) is older than max_age_s
    try:
        wait_for(lambda: runs and not q.state().running, 10)
        time.sleep(0.5)  # 25 ticks: a GPU due again at every tick would run again
    finally:
        q.stop()
    assert len(runs) == 1 and runs[0].tier == "sdc"
    # The quick tier's wrong answer stands (only a quick pass overturns it) ...
    assert q.state().latest[gpu].code == "gpu_compute_mismatch"
    # ... and the GPU, qualified at 1000, is not due again before max_age_s.
    assert q.due(1050.0) == [] and q.due(1101.0) == [gpu]


def test_the_text_says_once_per_gpu_what_was_covered_and_never_every_check_passed(
        gpu_env: EnvFactory) -> None:
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=1, **SMALL)
    proc = run_gpudiag(["qualify", "--tier", "sdc", "--no-history"], env, 180)
    assert proc.returncode == 0, proc.stderr
    # One GPU: no golden majority, so golden is unknown, said once, never beside a pass-all.
    assert "every check passed" not in proc.stdout
    assert proc.stdout.count("not covered") == 1, proc.stdout
    assert "covered: gemm_repeat, memory_address" in proc.stdout


def test_a_qualification_that_measured_nothing_does_not_exit_0(gpu_env: EnvFactory) -> None:
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=1, FAKE_CUDA_INIT_ERROR=999, **SMALL)
    code, report, err = _sdc(["--no-history"], env)
    assert code == 3, err
    assert "measured nothing: GPU 0: a CUDA call failed: cuInit" in err
    assert report["measured_nothing"] and report["gpus"][0]["yielded"] is False


def test_a_driver_library_without_a_copy_call_is_named_not_an_internal_error(
        gpu_env: EnvFactory) -> None:
    import ctypes

    from gpudiag.probes.qualify import _abort

    env = gpu_env(FAKE_NVML_DEVICE_COUNT=1)
    lib = ctypes.CDLL(str(Path(env["LD_LIBRARY_PATH"].split(":")[0]) / "libcuda.so.1"))
    try:
        lib.cuMemcpyNoSuchCall_v9  # noqa: B018 (ctypes looks the symbol up on access)
    except AttributeError as e:
        out: dict[str, Any] = {}
        _abort(out, e)
    assert "has no cuMemcpyNoSuchCall_v9" in out["aborted"]
    assert "NVIDIA driver's own libcuda.so.1" in out["aborted"] and not out.get("yielded")
    with pytest.raises(AttributeError):
        _abort({}, AttributeError("'NoneType' object has no attribute 'x'"))  # our own bug
