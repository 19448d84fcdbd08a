"""The iree probe and classifier: real IREE runtime and compiler, real children, fake libcuda."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpudiag.core.classify_iree import parse_status
from tests.support.host import EnvFactory, run_gpudiag, verdict_of


def _codes(record: dict[str, Any]) -> list[str]:
    return [b["code"] for b in record["blockers"]]


def _blocker(record: dict[str, Any], code: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [b for b in record["blockers"] if b["code"] == code]
    assert found, f"{code} not among {_codes(record)}"
    return found[0]


def test_local_task_compiles_and_runs_for_real(bare_env: dict[str, str], tmp_path: Path
                                               ) -> None:
    env = dict(bare_env, GPUDIAG_CACHE_DIR=str(tmp_path / "cache"))
    code, record = verdict_of(["preflight", "--require", "iree:local-task", "--format",
                               "json"], env)
    assert code == 0, record["blockers"]
    iree = record["backends"]["iree"]
    assert iree["status"] == "ok"
    assert iree["versions"]["iree-base-runtime"]
    local = iree["detail"]["driver_detail"]["local-task"]
    assert local["compile"]["cached"] is False  # a fresh cache folder: really compiled
    assert local["run"]["ok"] is True and local["run"]["result"] == [3.0, 6.0, 9.0, 12.0]
    assert iree["detail"]["init_s"]["local-task"] is not None
    assert record["evidence"]["environment"]["XLA_PYTHON_CLIENT_ALLOCATOR"] == "platform"


def test_a_corrupt_cached_module_is_recompiled_before_blaming_the_device(
        bare_env: dict[str, str], tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    env = dict(bare_env, GPUDIAG_CACHE_DIR=str(cache))
    args = ["preflight", "--require", "iree:local-task", "--format", "json"]
    assert verdict_of(args, env)[0] == 0
    code, record = verdict_of(args, env)
    assert code == 0
    assert record["backends"]["iree"]["detail"]["driver_detail"]["local-task"]["compile"]["cached"]
    for vmfb in (cache / "iree-vmfb").glob("*.vmfb"):
        vmfb.write_bytes(b"not a flatbuffer")
    code, record = verdict_of(args, env)
    assert code == 0, record["blockers"]
    local = record["backends"]["iree"]["detail"]["driver_detail"]["local-task"]
    assert local["compile"]["cached"] is False and local["run"]["ok"] is True


def test_iree_cuda_without_libcuda_is_driver_unavailable(bare_env: dict[str, str]) -> None:
    code, record = verdict_of(["preflight", "--require", "iree", "--format", "json"], bare_env)
    assert code == 1
    assert record["gpu_validation_blocker"] == "driver_library_missing"
    msg = _blocker(record, "iree_driver_unavailable")["message"]
    assert "UNAVAILABLE" in msg and "cuda_dynamic_symbols.c:" in msg
    assert "local-task control works" in msg


def test_iree_cuinit_failure_is_no_device_with_the_cuda_error(gpu_env: EnvFactory) -> None:
    env = gpu_env(FAKE_CUDA_INIT_ERROR=100)
    code, record = verdict_of(["preflight", "--require", "iree", "--format", "json"], env)
    assert code == 1
    assert record["gpu_validation_blocker"] == "cuda_no_device"
    msg = _blocker(record, "iree_no_device")["message"]
    assert "CUDA_ERROR_NO_DEVICE" in msg and "FAILED_PRECONDITION" in msg
    assert "no CUDA-capable device is visible" in msg


def test_iree_context_failure_is_device_create_failed(gpu_env: EnvFactory) -> None:
    env = gpu_env(FAKE_CUDA_CTX_ERROR=46)
    code, record = verdict_of(["preflight", "--require", "iree", "--format", "json"], env)
    assert code == 1
    assert record["gpu_validation_blocker"] == "cuda_devices_unavailable"
    msg = _blocker(record, "iree_device_create_failed")["message"]
    assert "CUDA_ERROR_DEVICE_UNAVAILABLE" in msg and "busy or unavailable" in msg


def test_iree_checks_the_kernel_result_which_the_fake_gpu_cannot_compute(
        gpu_env: EnvFactory) -> None:
    # The fake libcuda accepts launches but runs nothing: a probe that did not check the
    # result would call this GPU healthy.
    code, record = verdict_of(["preflight", "--require", "iree", "--format", "json"],
                              gpu_env())
    assert code == 1
    assert record["gpu_validation_blocker"] == "iree_execute_failed"
    assert "expected [3.0, 6.0, 9.0, 12.0]" in _blocker(record, "iree_execute_failed")[
        "message"]
    cuda = record["backends"]["iree"]["detail"]["driver_detail"]["cuda"]
    assert cuda["compile"]["cached"] is False  # a failing cached module was recompiled
    assert record["backends"]["cuda"]["status"] == "ok"


def test_iree_and_jax_combine_and_probe_shows_both(bare_env: dict[str, str]) -> None:
    code, record = verdict_of(["probe", "--backend", "jax:cpu,iree:local-task", "--json"],
                              bare_env)
    assert code == 0, record["blockers"]
    assert record["requirement"]["backends"] == ["jax:cpu", "iree:local-task"]
    for name in ("jax", "iree"):
        backend = record["backends"][name]
        assert backend["status"] == "ok" and backend["versions"]
        assert backend["detail"]["init_s"] and backend["detail"]["compute_s"]
    text = run_gpudiag(["probe", "--backend", "jax:cpu,iree:local-task"], bare_env)
    assert text.returncode == 0
    assert "default_backend=cpu" in text.stdout and "local-task:0 default" in text.stdout


@pytest.mark.parametrize(("text", "status", "cuda_error"), [
    ("Error creating driver: c/runtime/src/iree/hal/drivers/cuda/cuda_dynamic_symbols.c:66: "
     "UNAVAILABLE; CUDA driver library 'libcuda.so'/'nvcuda.dll' not available; please "
     "ensure installed and in dynamic library search path", "UNAVAILABLE", None),
    ("Error querying devices: c/runtime/src/iree/hal/drivers/cuda/cuda_driver.c:136: "
     "FAILED_PRECONDITION; CUDA error 'CUDA_ERROR_NO_DEVICE' (100): no CUDA-capable device "
     "is detected", "FAILED_PRECONDITION", "CUDA_ERROR_NO_DEVICE"),
    ("c/runtime/src/iree/hal/drivers/vulkan/dynamic_symbols.cc:123: NOT_FOUND; Vulkan "
     "loader library not found", "NOT_FOUND", None),
])
def test_iree_status_text_is_parsed_not_the_exception_type(text: str, status: str,
                                                           cuda_error: str | None) -> None:
    st = parse_status(text)
    assert st.status == status
    assert st.file is not None and st.line is not None and st.line > 0
    assert st.cuda_error == cuda_error
