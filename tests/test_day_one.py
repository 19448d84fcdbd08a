"""Day one as a new operator meets it (issue 41): each item through the real CLI on the fakes."""

from __future__ import annotations

import pytest

from tests.support.host import EnvFactory, run_gpudiag, verdict_of


def test_preflight_gpus_n_chooses_the_healthiest_free_gpus_and_says_why(
        gpu_env: EnvFactory) -> None:
    # Four GPUs; the first two run on x8 of their x16 PCIe links (a warning, not a blocker).
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=4, FAKE_NVML_PCIE="0:5/5/8/16,1:5/5/8/16")
    rc, record = verdict_of(["preflight", "--gpus", "2", "--no-daemon", "--format", "json"],
                            env)
    assert rc == 0, record["blockers"]
    chosen = [d["index"] for d in record["devices"] if d["selected"]]
    assert chosen == [2, 3]
    for d in record["devices"]:
        why = d["selection"]
        if d["index"] in (2, 3):
            assert why.startswith("chosen: healthy and free, no warning"), why
        else:
            assert why.startswith("not chosen:") and "gpu_pcie_link_degraded" in why, why
    # Each reason once, and only with --gpus.
    rc, record = verdict_of(["preflight", "--no-daemon", "--format", "json"], env)
    assert {d["selection"] for d in record["devices"]} == {None}


@pytest.mark.parametrize("error", [999, 3, 101])
def test_cuda_init_failed_tells_the_operator_what_to_do_next(gpu_env: EnvFactory,
                                                            error: int) -> None:
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=1, FAKE_CUDA_INIT_ERROR=error)
    proc = run_gpudiag(["preflight", "--no-daemon"], env)
    assert proc.returncode == 1
    rc, record = verdict_of(["preflight", "--no-daemon", "--format", "json"], env)
    assert record["gpu_validation_blocker"] == "cuda_init_failed"
    fix = record["blockers"][0]["remediation"]
    assert "nvidia-uvm" in fix and "dmesg" in fix and "nvidia-smi -r" in fix
    assert "nvidia-uvm" in proc.stdout + proc.stderr  # the terminal shows the fix too
