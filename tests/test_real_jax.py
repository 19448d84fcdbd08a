"""The real JAX CUDA stack over the fake driver: every driver fault JAX can meet, real texts.

jax, jaxlib and ``jax-cuda12-plugin[with-cuda]`` (NVIDIA's CUDA 12 user-space wheels) at the
version of the suite's jax are installed once into ``.cache/real-jax``
(tests/support/realjax.py; ``python -m tests.support.realjax`` does it ahead). ``gpudiag
preflight --require jax`` then runs with that venv's python on the fake libcuda/NVML, in a
private mount namespace whose /dev has the NVIDIA nodes (JAX only tries CUDA when they exist),
for each fault under JAX_PLATFORMS unset, ``cuda`` and ``cuda,cpu``. The real plugin and XLA
print what they print on a real host; the verdict must name the right primary code and carry
the real inner cause in every jax message.

Skipped, with the reason, when the wheels cannot be fetched or namespaces cannot be made
(``GPUDIAG_REAL_JAX=require`` makes that a failure; ``GPUDIAG_REAL_JAX=0`` turns the tier off).
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpudiag.core.catalog import BLOCKERS
from tests.fakes.build import FakeDriver
from tests.support.host import clean_env, make_host_dirs
from tests.support.privatedev import in_private_dev, namespace_problem
from tests.support.realjax import RealJax, StackUnavailable, ensure_real_jax

# The install (about 2 minutes, once) counts against the first test's time.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]


def _unavailable(reason: str) -> None:
    if os.environ.get("GPUDIAG_REAL_JAX") == "require":
        pytest.fail(f"GPUDIAG_REAL_JAX=require but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def real_jax() -> RealJax:
    """The cached real stack, or a skip (a failure under GPUDIAG_REAL_JAX=require) saying why."""
    if os.environ.get("GPUDIAG_REAL_JAX") == "0":
        pytest.skip("the real JAX CUDA stack tier is turned off (GPUDIAG_REAL_JAX=0)")
    problem = namespace_problem()
    if problem is not None:
        _unavailable(f"the real JAX CUDA stack tier cannot make device nodes: {problem}")
    try:
        return ensure_real_jax()
    except StackUnavailable as e:
        _unavailable(f"the real JAX CUDA stack could not be installed: {e}")
        raise  # not reached: skip and fail raise


@pytest.fixture(scope="module")
def rig(real_jax: RealJax, fakes: FakeDriver, tmp_path_factory: pytest.TempPathFactory
        ) -> dict[str, str]:
    """One GPU on the fakes, healthy host facts, this checkout's gpudiag in the real venv."""
    dev, proc = make_host_dirs(tmp_path_factory.mktemp("real-jax-host"), gpus=1)
    env = clean_env()
    env.update(GPUDIAG_DEVICE_DIR=str(dev), GPUDIAG_DRIVER_PROC_DIR=str(proc),
               FAKE_NVML_DEVICE_COUNT="1", XLA_PYTHON_CLIENT_PREALLOCATE="false",
               XLA_PYTHON_CLIENT_ALLOCATOR="platform",
               XLA_PYTHON_CLIENT_USE_CUDA_HOST_ALLOCATOR="false")
    return real_jax.env(fakes.env(base=env))


def _preflight(real_jax: RealJax, env: dict[str, str]) -> tuple[int, dict[str, Any]]:
    argv = [str(real_jax.python), "-m", "gpudiag", "preflight", "--require", "jax",
            "--format", "json"]
    proc = subprocess.run(in_private_dev(argv, gpus=1), env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    try:
        return proc.returncode, json.loads(proc.stdout)
    except json.JSONDecodeError as e:
        raise AssertionError(f"no JSON from gpudiag preflight: rc={proc.returncode}\n"
                             f"stdout={proc.stdout}\nstderr={proc.stderr}") from e


@dataclass(frozen=True)
class Fault:
    """A driver fault, the primary code it must give, and the real text JAX must carry."""

    name: str
    knobs: dict[str, str]
    primary: str
    inner: str  # in every jax-layer message and in the JAX child's stderr


CUINIT = "operation cuInit(0) failed: "
FALLBACK_WARNING = ("An NVIDIA GPU may be present on this machine, but a CUDA-enabled jaxlib is "
                    "not installed. Falling back to cpu.")
FAULTS = [
    Fault("cuinit_no_device", {"FAKE_CUDA_INIT_ERROR": "100"}, "cuda_no_device",
          CUINIT + "CUDA_ERROR_NO_DEVICE"),
    Fault("cuinit_driver_mismatch", {"FAKE_CUDA_INIT_ERROR": "803"}, "cuda_driver_mismatch",
          CUINIT + "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH"),
    Fault("cuinit_unknown", {"FAKE_CUDA_INIT_ERROR": "999"}, "cuda_init_failed",
          CUINIT + "CUDA_ERROR_UNKNOWN"),
    Fault("cuinit_not_initialized", {"FAKE_CUDA_INIT_ERROR": "3"}, "cuda_init_failed",
          CUINIT + "CUDA_ERROR_NOT_INITIALIZED"),
    Fault("cuinit_system_not_ready", {"FAKE_CUDA_INIT_ERROR": "802"}, "cuda_system_not_ready",
          CUINIT + "CUDA_ERROR_SYSTEM_NOT_READY"),
    # The real driver API has no name for 35 (the runtime's cudaErrorInsufficientDriver); JAX
    # then blames the CUDA libraries, the cuda probe names the driver.
    Fault("cuinit_35", {"FAKE_CUDA_INIT_ERROR": "35"}, "cuda_driver_too_old",
          CUINIT + "Unknown CUDA error 35; cuGetErrorName failed."),
    Fault("driver_too_old", {"FAKE_CUDA_DRIVER_VERSION": "11040"}, "cuda_driver_too_old",
          "CUDA Runtime error: : cudaErrorInsufficientDriver: CUDA driver version is "
          "insufficient for CUDA runtime version"),
    Fault("no_vmm", {"FAKE_CUDA_VMM": "0"}, "jax_backend_init_failed",
          "Failed to create stream executor for device CUDA:0: Device 0 does not support CUDA "
          "Virtual Memory Management (VMM). VMM is required for device memory allocation in "
          "XLA."),
    Fault("context_busy", {"FAKE_CUDA_CTX_ERROR": "46"}, "cuda_devices_unavailable",
          "Failed to create stream executor for device CUDA:0: CUDA error: : "
          "CUDA_ERROR_DEVICE_UNAVAILABLE: CUDA-capable device(s) is/are busy or unavailable"),
    Fault("context_out_of_memory", {"FAKE_CUDA_CTX_ERROR": "2"}, "cuda_out_of_memory",
          "Failed to create stream executor for device CUDA:0: : CUDA_ERROR_OUT_OF_MEMORY: "
          "out of memory"),
    Fault("context_unknown", {"FAKE_CUDA_CTX_ERROR": "999"}, "cuda_context_failed",
          "Failed to create stream executor for device CUDA:0: CUDA error: : CUDA_ERROR_UNKNOWN: "
          "unknown error"),
]
PLATFORMS = [None, "cuda", "cuda,cpu"]


def _jax_messages(record: dict[str, Any]) -> list[str]:
    return [b["message"] for b in record["blockers"]
            if BLOCKERS[b["code"]].layer == "jax" and b["code"] != "jax_preallocation_enabled"]


@pytest.mark.parametrize("platforms", PLATFORMS, ids=["unset", "cuda", "cuda_cpu"])
@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_real_jax_driver_fault_gives_its_code_and_the_real_inner_cause(
        real_jax: RealJax, rig: dict[str, str], fault: Fault, platforms: str | None) -> None:
    env = {**rig, **fault.knobs}
    if platforms is not None:
        env["JAX_PLATFORMS"] = platforms
    rc, record = _preflight(real_jax, env)
    assert rc == 1
    codes = [b["code"] for b in record["blockers"]]
    assert record["gpu_validation_blocker"] == fault.primary, record["blockers"]
    assert "probe_error" not in codes
    assert fault.inner in record["evidence"]["probe_stderr"]["jax"]  # the real text
    messages = _jax_messages(record)
    assert messages, codes
    assert all(fault.inner in m for m in messages), messages
    if fault.name.startswith("cuinit") and platforms is None:
        # The plugin failed, JAX fell back to the CPU and exited 0: the silent fallback, in
        # JAX's own (misleading) words.
        fallback = next(b for b in record["blockers"] if b["code"] == "jax_cpu_fallback")
        assert FALLBACK_WARNING in fallback["message"]
        assert FALLBACK_WARNING in record["evidence"]["probe_stderr"]["jax"]
        assert record["backends"]["jax"]["detail"]["default_backend"] == "cpu"
    elif fault.name.startswith("cuinit"):
        assert "Backend 'cuda' is not in the list of known backends" in messages[0]


def test_real_jax_on_a_too_old_driver_names_both_versions(real_jax: RealJax,
                                                          rig: dict[str, str]) -> None:
    rc, record = _preflight(real_jax, {**rig, "FAKE_CUDA_DRIVER_VERSION": "11040",
                                       "JAX_PLATFORMS": "cuda"})
    assert rc == 1
    old = next(b for b in record["blockers"] if b["code"] == "cuda_driver_too_old")
    assert old["layer"] == "cuda"
    assert "CUDA 11.4 (cuDriverGetVersion 11040)" in old["message"]
    assert "nvidia-cuda-runtime-cu12 12." in old["message"]
    assert "cuDriverGetVersion >= 12000" in old["message"]
    detail = record["backends"]["jax"]["detail"]
    assert detail["cuda_driver_version"] == 11040
    assert detail["cuda_runtime"]["min_driver_version"] == 12000
    assert record["evidence"]["driver"]["cuda_driver_version"] == 11040


@pytest.mark.parametrize("platforms", PLATFORMS, ids=["unset", "cuda", "cuda_cpu"])
def test_real_jax_on_a_healthy_fake_gets_past_context_creation(
        real_jax: RealJax, rig: dict[str, str], platforms: str | None) -> None:
    # The fake has no kernels and none of the driver's private tables cudart asks for, so a
    # healthy fake still fails after XLA enumerated the device and retained its context.
    env = dict(rig) if platforms is None else {**rig, "JAX_PLATFORMS": platforms}
    rc, record = _preflight(real_jax, env)
    assert rc == 1
    assert record["gpu_validation_blocker"] in ("jax_backend_init_failed", "jax_compute_failed")
    assert record["backends"]["cuda"]["status"] == "ok"  # no fault below JAX
    assert record["backends"]["jax"]["versions"]["jax-cuda12-plugin"] == real_jax.version
    if record["gpu_validation_blocker"] == "jax_backend_init_failed":
        said = "Failed to create stream executor for device CUDA:0: CUDA Runtime error"
        assert all(said in m for m in _jax_messages(record)), record["blockers"]


def test_real_jax_stack_is_cached_outside_git(real_jax: RealJax) -> None:
    assert real_jax.python.is_file()
    root = Path(__file__).resolve().parent.parent
    if real_jax.venv.is_relative_to(root):
        proc = subprocess.run(["git", "check-ignore", "-q", str(real_jax.venv)], cwd=root,
                              capture_output=True, check=False)
        assert proc.returncode == 0, f"{real_jax.venv} is not ignored by git"
    assert ensure_real_jax(real_jax.version).install_s is None  # the second call is cached


def test_the_real_jax_stack_as_a_runtime_is_classified_right_through_the_daemon(
        real_jax: RealJax, rig: dict[str, str], tmp_path: Path) -> None:
    """The real plugin's venv configured as a runtime (issue 37): the daemon proves JAX under
    that interpreter (in a private /dev with one NVIDIA node), and a job of that venv asking
    the daemon gets that proof, classified as the same job's inline verdict is."""
    from tests.support.daemon import Daemon, daemon_toml, metric_samples, wait_for, write_config

    env = {**rig, "FAKE_CUDA_INIT_ERROR": "100"}
    rc_here, here = _preflight(real_jax, env)
    config = write_config(tmp_path / "d.toml", daemon_toml({
        "backends.jax": {"enabled": True, "interval_s": 600}})
        + f'[runtimes.real]\npython = "{real_jax.python}"\nuser = "root"\nrequire = "jax"\n')
    daemon = Daemon(env, config, tmp_path / "state",
                    prefix=tuple(in_private_dev([], gpus=1)))
    try:
        wait_for(lambda: [v for labels, v in metric_samples(daemon, "gpudiag_runtime_blocker")
                          if labels["runtime"] == "real" and v == 1], 600, 1.0)
        argv = [str(real_jax.python), "-m", "gpudiag", "preflight", "--require", "jax",
                "--daemon-url", daemon.url, "--format", "json"]
        proc = subprocess.run(in_private_dev(argv, gpus=1), env=env, capture_output=True,
                              text=True, timeout=300, check=False)
        record = json.loads(proc.stdout)
        assert record["evidence"]["proof"]["jax"]["runtime"] == "real", record["evidence"]
        assert record["source"] == "daemon"
        assert (proc.returncode, record["gpu_validation_blocker"]) == (
            rc_here, here["gpu_validation_blocker"]) == (1, "cuda_no_device")
        jax_codes = {b["code"] for b in record["blockers"] if b["backend"] == "jax"}
        assert jax_codes == {b["code"] for b in here["blockers"] if b["backend"] == "jax"}
        assert CUINIT + "CUDA_ERROR_NO_DEVICE" in record["evidence"]["probe_stderr"]["jax"]
    finally:
        daemon.stop()
