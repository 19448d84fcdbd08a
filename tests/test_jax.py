"""The jax probe and classifier, through the real CLI, on real JAX (CPU build) in real children.

GPU failures come from a fake JAX plugin (tests/fakes/jax_plugin) that fails the way
jax-cuda12-plugin does, so the classifier reads real stderr and real exceptions. Only what the
real stack (tests/test_real_jax.py, jax 0.10.2 over the fake driver) cannot produce here is
faked: a PJRT API version mismatch and the plugin's CUDA component checks (one plugin version
and a matching set of CUDA wheels are installed there), and the older ``failed call to
cuInit:`` text (jaxlib 0.4.x with CUDA built in). JAX's own CPU-fallback warning is now
asserted on the real stack.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gpudiag.core.classify import classify
from gpudiag.core.environment import probe_environment
from gpudiag.core.probe_run import ProbeRun
from gpudiag.core.verdict import BackendRequirement, Requirement
from gpudiag.engine.isolation import run_probe
from tests.support.host import EnvFactory, clean_env, verdict_of

FAKE_PLUGIN_PATH = Path(__file__).resolve().parent / "fakes" / "jax_plugin"


def _codes(record: dict[str, Any]) -> list[str]:
    return [b["code"] for b in record["blockers"]]


def _blocker(record: dict[str, Any], code: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [b for b in record["blockers"] if b["code"] == code]
    assert found, f"{code} not among {_codes(record)}"
    return found[0]


def _with_plugin(env: dict[str, str], mode: str) -> dict[str, str]:
    env = dict(env)
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = f"{FAKE_PLUGIN_PATH}{os.pathsep}{old}" if old else str(FAKE_PLUGIN_PATH)
    env["FAKE_JAX_PLUGIN"] = mode
    return env


def test_jax_cpu_is_ready_on_a_gpu_less_host_and_really_computes(bare_env: dict[str, str]
                                                                   ) -> None:
    code, record = verdict_of(["preflight", "--require", "jax:cpu", "--format", "json"],
                              bare_env)
    assert code == 0, record["blockers"]
    assert record["gpu_validation_blocker"] == "none"
    assert record["preallocation_disabled"] == "yes"
    jax = record["backends"]["jax"]
    assert jax["status"] == "ok"
    assert jax["versions"]["jax"] and jax["versions"]["jaxlib"]
    detail = jax["detail"]
    assert detail["cpu_allowed"] is True and detail["platform_required"] == "cpu"
    assert detail["jax_platforms_effective"] == "cpu"
    assert detail["compute"]["ok"] is True and detail["compute"]["result"] == 64.0
    assert detail["compute"]["device"].startswith("cpu")
    assert detail["init_s"] is not None and detail["compute_s"] is not None
    # Read back inside the child, and the environment evidence is there without a host probe.
    assert detail["xla_env"] == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false",
                                 "XLA_PYTHON_CLIENT_ALLOCATOR": "platform",
                                 "XLA_PYTHON_CLIENT_USE_CUDA_HOST_ALLOCATOR": "false"}
    env_ev = record["evidence"]["environment"]
    assert env_ev["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert "HOME" not in env_ev
    assert "JAX_PLATFORMS" not in env_ev  # the caller set none; the CPU pin is the probe's


def test_jax_on_healthy_fakes_without_cuda_plugin_is_gpu_backend_absent(
        gpu_env: EnvFactory) -> None:
    code, record = verdict_of(["preflight", "--require", "jax", "--format", "json"], gpu_env())
    assert code == 1
    assert record["gpu_validation_blocker"] == "jax_gpu_backend_absent"
    absent = _blocker(record, "jax_gpu_backend_absent")
    assert "platforms present are: cpu" in absent["message"]
    assert "Platforms present are: cpu" in absent["message"]  # JAX's own words, kept
    assert record["backends"]["jax"]["detail"]["platforms"] == ["cpu"]
    # The job would run on the CPU without an error: said too, as a consequence.
    assert "jax_cpu_fallback" in _codes(record)
    # The GPU layers themselves are healthy on the fakes.
    assert record["backends"]["cuda"]["status"] == "ok"
    assert record["backends"]["jax"]["status"] == "blocked"


def test_jax_platforms_cuda_cpu_silent_fallback_is_a_blocker(gpu_env: EnvFactory) -> None:
    # JAX_PLATFORMS=cuda,cpu exits 0 with a CpuDevice and no warning: the silent fallback.
    env = gpu_env(JAX_PLATFORMS="cuda,cpu")
    code, record = verdict_of(["preflight", "--require", "jax", "--format", "json"], env)
    assert code == 1
    fallback = _blocker(record, "jax_cpu_fallback")
    assert "JAX_PLATFORMS='cuda,cpu'" in fallback["message"]
    assert record["backends"]["jax"]["detail"]["default_backend"] == "cpu"


def test_jax_on_bare_host_names_the_driver_as_root_cause(bare_env: dict[str, str]) -> None:
    code, record = verdict_of(["preflight", "--require", "jax", "--format", "json"], bare_env)
    assert code == 1
    assert record["gpu_validation_blocker"] == "driver_library_missing"
    assert "jax_gpu_backend_absent" in _codes(record)
    assert _blocker(record, "jax_gpu_backend_absent")["layer"] == "jax"


def test_leaked_preallocation_is_reported_as_the_child_read_it(bare_env: dict[str, str]
                                                               ) -> None:
    env = dict(bare_env, XLA_PYTHON_CLIENT_PREALLOCATE="true")
    code, record = verdict_of(["preflight", "--require", "jax:cpu", "--format", "json"], env)
    assert code == 1
    assert record["gpu_validation_blocker"] == "jax_preallocation_enabled"
    assert record["preallocation_disabled"] == "no"
    assert "XLA_PYTHON_CLIENT_PREALLOCATE=true" in _blocker(
        record, "jax_preallocation_enabled")["message"]


def test_jax_platforms_cuda_without_device_nodes_is_explained_not_a_probe_error(
        bare_env: dict[str, str]) -> None:
    env = dict(bare_env, JAX_PLATFORMS="cuda")
    code, record = verdict_of(["preflight", "--require", "jax", "--format", "json"], env)
    assert code == 1
    assert "probe_error" not in _codes(record)
    failed = _blocker(record, "jax_backend_init_failed")
    assert "device nodes missing" in failed["message"]
    assert "AssertionError" in failed["message"]
    assert record["backends"]["jax"]["detail"]["init_error"]["type"] == "AssertionError"


@pytest.mark.parametrize(("mode", "code", "text"), [
    ("pjrt_mismatch", "jax_plugin_version_mismatch", "Mismatched PJRT plugin PJRT API version"),
    ("cuda_libs", "jax_cuda_libs_mismatch",
     "Unable to use CUDA because of the following issues with CUDA components"),
    ("cuda_missing", "jax_cuda_libs_mismatch", "Unable to load CUDA. Is it installed?"),
])
def test_fake_plugin_failures_classify_from_real_stderr(gpu_env: EnvFactory, mode: str,
                                                        code: str, text: str) -> None:
    env = _with_plugin(gpu_env(), mode)
    rc, record = verdict_of(["preflight", "--require", "jax", "--format", "json"], env)
    assert rc == 1
    assert code in _codes(record)
    assert text in _blocker(record, code)["message"]
    assert text in record["evidence"]["probe_stderr"]["jax"]
    assert "probe_error" not in _codes(record)


def test_cuinit_failure_keeps_the_inner_cuda_error_from_stderr(gpu_env: EnvFactory) -> None:
    env = _with_plugin(gpu_env(FAKE_CUDA_INIT_ERROR=100), "cuinit")
    rc, record = verdict_of(["preflight", "--require", "jax", "--format", "json"], env)
    assert rc == 1
    assert record["gpu_validation_blocker"] == "cuda_no_device"  # the lower layer is the root
    failed = _blocker(record, "jax_backend_init_failed")
    assert ("Unable to initialize backend 'cuda': FAILED_PRECONDITION: No visible GPU "
            "devices.") in failed["message"]
    assert "CUDA_ERROR_NO_DEVICE" in failed["message"]
    assert "no CUDA-capable device is visible" in failed["message"]


def test_jax_not_importable_is_not_installed(bare_env: dict[str, str], tmp_path: Path) -> None:
    shadow = tmp_path / "shadow" / "jax"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        'raise ModuleNotFoundError("jax requires jaxlib to be installed", name="jaxlib")\n')
    env = dict(bare_env, PYTHONPATH=str(shadow.parent))
    rc, record = verdict_of(["preflight", "--require", "jax:cpu", "--format", "json"], env)
    assert rc == 1
    assert record["gpu_validation_blocker"] == "jax_not_installed"
    assert "jaxlib" in _blocker(record, "jax_not_installed")["message"]
    assert record["backends"]["jax"]["status"] == "not_installed"


# The classifier on observations a GPU host would give: a real CPU observation from a real
# child, with the GPU facts put in (no GPU here to produce them).
@pytest.fixture(scope="module")
def cpu_run() -> ProbeRun:
    env = probe_environment(clean_env())
    run = run_probe("jax", env=env, timeout_s=120, options={"platform": "cpu"})
    assert run.ok, run.error
    return run


def _gpu_verdict(run: ProbeRun, **changes: Any) -> dict[str, Any]:
    gpu_dev = {"id": 0, "platform": "gpu", "kind": "NVIDIA H200"}
    obs = dict(run.observation or {}, platform_required="gpu", cpu_allowed=False,
               default_backend="cuda", platforms=["cpu", "cuda"],
               required_devices=[gpu_dev], devices=[gpu_dev],
               compute={"ok": True, "result": 64.0, "expected": 64.0, "device": "cuda:0"})
    obs.update(changes)
    verdict = classify({"jax": replace(run, observation=obs)},
                       Requirement(backends=(BackendRequirement("jax"),), min_devices=0),
                       host="h", checked_at="2026-11-29T00:00:00Z")
    return verdict.record()


def test_a_gpu_that_computes_is_ready(cpu_run: ProbeRun) -> None:
    record = _gpu_verdict(cpu_run)
    assert record["ready"] is True, record["blockers"]
    assert record["backends"]["jax"]["detail"]["cpu_allowed"] is False


def test_gpu_present_but_cpu_default_is_a_fallback(cpu_run: ProbeRun) -> None:
    record = _gpu_verdict(cpu_run, default_backend="cpu", jax_platforms="cpu,cuda")
    assert record["gpu_validation_blocker"] == "jax_cpu_fallback"
    assert "'cpu,cuda'" in record["blockers"][0]["message"]


def test_a_wrong_gpu_result_is_compute_failed(cpu_run: ProbeRun) -> None:
    record = _gpu_verdict(cpu_run, compute={
        "ok": False, "device": "cuda:0",
        "error": {"type": "WrongResult", "message": "gave 0.0, expected 64.0"}})
    assert record["gpu_validation_blocker"] == "jax_compute_failed"
    assert "gave 0.0" in record["blockers"][0]["message"]


def test_plugin_version_skew_is_a_mismatch(cpu_run: ProbeRun) -> None:
    versions = dict((cpu_run.observation or {})["versions"], **{"jax-cuda12-plugin": "0.4.30"})
    record = _gpu_verdict(cpu_run, versions=versions, default_backend="cpu",
                          platforms=["cpu"], required_devices=[], compute=None)
    assert record["gpu_validation_blocker"] == "jax_plugin_version_mismatch"
    assert "jax-cuda12-plugin 0.4.30" in record["blockers"][0]["message"]


def _wheel_metadata(root: Path, name: str, version: str) -> Path:
    """Just the metadata of an installed wheel (no code, no libraries, no entry points)."""
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return root


@pytest.mark.parametrize(("driver", "too_old"), [(11040, True), (12000, False), (12080, False)])
def test_driver_older_than_the_installed_cuda_runtime_is_driver_too_old(
        gpu_env: EnvFactory, tmp_path: Path, driver: int, too_old: bool) -> None:
    site = _wheel_metadata(tmp_path / "site", "nvidia-cuda-runtime-cu12", "12.9.79")
    jaxlib = verdict_of(["preflight", "--require", "jax:cpu", "--format", "json"], gpu_env()
                        )[1]["backends"]["jax"]["versions"]["jaxlib"]
    _wheel_metadata(site, "jax-cuda12-plugin", jaxlib)  # the plugin is what needs the runtime
    env = gpu_env(FAKE_CUDA_DRIVER_VERSION=driver, PYTHONPATH=str(site))
    rc, record = verdict_of(["preflight", "--require", "jax", "--format", "json"], env)
    assert rc == 1  # the plugin is metadata only: JAX has no GPU platform either way
    detail = record["backends"]["jax"]["detail"]
    assert detail["cuda_driver_version"] == driver
    assert detail["cuda_runtime"] == {"distribution": "nvidia-cuda-runtime-cu12",
                                      "version": "12.9.79", "min_driver_version": 12000}
    if not too_old:
        assert "cuda_driver_too_old" not in _codes(record)
        assert record["gpu_validation_blocker"].startswith("jax_")
        return
    assert record["gpu_validation_blocker"] == "cuda_driver_too_old"
    old = _blocker(record, "cuda_driver_too_old")
    assert old["layer"] == "cuda" and old["backend"] == "jax"
    assert "CUDA 11.4 (cuDriverGetVersion 11040)" in old["message"]
    assert "nvidia-cuda-runtime-cu12 12.9.79" in old["message"]
    assert "cuDriverGetVersion >= 12000" in old["message"]


def test_a_cuda_runtime_without_a_jax_cuda_plugin_is_not_checked(gpu_env: EnvFactory,
                                                                tmp_path: Path) -> None:
    site = _wheel_metadata(tmp_path / "site", "nvidia-cuda-runtime-cu12", "12.9.79")
    env = gpu_env(FAKE_CUDA_DRIVER_VERSION=11040, PYTHONPATH=str(site))
    rc, record = verdict_of(["preflight", "--require", "jax", "--format", "json"], env)
    assert rc == 1
    assert record["gpu_validation_blocker"] == "jax_gpu_backend_absent"
    assert record["backends"]["jax"]["detail"]["cuda_runtime"] is None
