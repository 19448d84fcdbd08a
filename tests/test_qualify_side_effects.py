"""A qualification must leave its GPU as it found it (issue 51): the inventory is read before
and after each GPU's run, and a change is ``diagnostic_side_effect``. The fake libcuda's
FAKE_CUDA_WORK_SETS plays a diagnostic that changes its GPU: its first device-to-device copy
on that GPU writes a setting into the state file, which the fake libnvidia-ml then reports,
read through the real pynvml by the nvml child after the run."""

from __future__ import annotations

import json
from pathlib import Path

from gpudiag.core.qualify_score import GpuResult, parse_result, result_record
from gpudiag.core.qualify_verdict import qualification_findings
from gpudiag.engine.qualify import QualifyOptions, qualify
from tests.fakes.build import write_state_file
from tests.support.host import EnvFactory, run_gpudiag

SMALL_GPU = {"FAKE_GPU_MEMORY_TOTAL_MIB": "80", "FAKE_CUDA_CONTEXT_MIB": "1",
             "FAKE_CUDA_COPY_GBPS": ",".join(f"{i}:0.4" for i in range(4))}


def uuid(i: int) -> str:
    return f"GPU-f00d{i:04x}-0000-4000-8000-00000000{i:04x}"


def test_a_run_that_changes_its_gpu_is_a_side_effect_of_that_gpu_only(
        gpu_env: EnvFactory, tmp_path: Path) -> None:
    state = tmp_path / "gpu-state"
    write_state_file(state, {"FAKE_CUDA_WORK_SETS": "2:FAKE_NVML_APP_CLOCKS_MHZ=2:1755/3201"})
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=4, FAKE_GPU_STATE_FILE=str(state), **SMALL_GPU)
    proc = run_gpudiag(["qualify", "--format", "json", "--no-history"], env, 120)
    report = json.loads(proc.stdout)
    assert proc.returncode == 0, proc.stderr  # a warning: the GPU computes right
    effects = {q["index"]: q.get("side_effects") for q in report["gpus"]}
    assert effects == {0: None, 1: None, 2: ["applications_clock_sm_mhz 1980 -> 1755"],
                       3: None}
    text = run_gpudiag(["qualify", "--gpus", "2", "--no-history"], env, 120)
    # The clocks stay changed: the next run finds them so before and after, and says nothing.
    assert "diagnostic_side_effect" not in text.stdout


def test_the_side_effect_is_a_warning_in_the_verdicts_until_the_next_outcome(
        gpu_env: EnvFactory, tmp_path: Path) -> None:
    state = tmp_path / "gpu-state"
    write_state_file(state, {"FAKE_CUDA_WORK_SETS": "1:FAKE_NVML_ECC_MODE=1:1/0"})
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=2, FAKE_GPU_STATE_FILE=str(state), **SMALL_GPU)
    report = qualify(QualifyOptions(gpus=("1",)), env=env)
    (q,) = report.qualifications
    assert q.result.side_effects == ("ecc_mode_pending on -> off",)
    # The fakes copy far below an H200's data sheet: gpu_underperforming beside it.
    found = qualification_findings([q], block=False)
    assert found.blockers == ()
    (w,) = [w for w in found.warnings if w.code == "diagnostic_side_effect"]
    assert (w.code, w.device, w.layer) == ("diagnostic_side_effect", uuid(1), "device")
    assert "GPU 1: the qualification (quick tier) left its configuration changed: " \
        "ecc_mode_pending on -> off" == w.message
    # Kept in the history line and read back (the daemon's latest outcome per GPU).
    assert parse_result(json.loads(json.dumps(result_record(q.result)))) == q.result


def test_a_history_line_without_side_effects_reads_as_none() -> None:
    r = GpuResult("GPU-x", None, 0, "quick", "cuda")
    assert "side_effects" not in result_record(r)
    assert parse_result({**result_record(r), "side_effects": "not a list"}).side_effects == ()
