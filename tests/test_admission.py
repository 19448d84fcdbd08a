"""Admission through the Python API on the fake driver: leaves, visibility, locks, re-observation.

Observations run in real probe children against the fake libnvidia-ml; locks are real flocks
in a temporary folder; holders are real processes that the tests SIGKILL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import gpudiag
from gpudiag.core.decode import decode
from gpudiag.core.environment import PREALLOCATION_OFF, is_full_uuid
from gpudiag.core.observations import NvmlObservation
from gpudiag.core.occupancy import BUSY, FREE, UNKNOWN, leaves_from_nvml
from gpudiag.core.requirement import parse_requirement
from gpudiag.engine.locks import default_lock_dir
from gpudiag.runner.admission import (
    Admission,
    AdmissionError,
    Admitter,
    Observation,
    narrow,
)
from tests.fakes.build import write_state_file
from tests.support.host import EnvFactory


def gpu_uuid(i: int) -> str:
    return f"GPU-f00d{i:04x}-0000-4000-8000-00000000{i:04x}"


def mig_uuid(i: int, j: int) -> str:
    return f"MIG-f00d{i:04x}-{j:04x}-4000-8000-000000000000"


@pytest.fixture
def locks(tmp_path: Path) -> Path:
    return tmp_path / "locks"


def refusal(excinfo: pytest.ExceptionInfo[AdmissionError]) -> dict[str, Any]:
    record: dict[str, Any] = excinfo.value.verdict.record()
    return record


def test_healthy_host_admits_one_full_uuid_and_the_exact_child_environment(
        gpu_env: EnvFactory, locks: Path) -> None:
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=4)
    with gpudiag.admit(gpus=1, env=env, lock_dir=locks, timeout=0) as adm:
        assert isinstance(adm, Admission)
        assert adm.uuids == (gpu_uuid(0),)
        assert adm.verdict.ready and adm.verdict.gpu_validation_blocker == "none"
        assert adm.leaves[0].occupancy == FREE and adm.leaves[0].name == "NVIDIA H200"
        assert adm.locked is not None and adm.first is not None
        assert [lk.uuid for lk in adm.locks] == [gpu_uuid(0)]
        assert Path(adm.locks[0].path) == locks / f"{gpu_uuid(0)}.lock"
        child = gpudiag.child_environment(adm, {"HOME": "/home/x", "JAX_PLATFORMS": "cuda,cpu",
                                                "XLA_PYTHON_CLIENT_PREALLOCATE": "true"})
        assert child["CUDA_VISIBLE_DEVICES"] == child["NVIDIA_VISIBLE_DEVICES"] == gpu_uuid(0)
        for key, value in PREALLOCATION_OFF.items():
            assert child[key] == value  # a leaked "true" in the base env is overridden
        assert child["HOME"] == "/home/x"
        assert child["JAX_PLATFORMS"] == "cuda,cpu"  # no JAX in the requirement: untouched
        record = adm.record()
        assert record["selected"] == [gpu_uuid(0)]
        assert record["first_observation"]["leaves"][0]["occupancy"] == FREE
        assert len(record["fingerprint"]) == 64


@pytest.mark.parametrize(("require", "expected"), [("cuda,jax", "cuda"), ("cuda,jax:gpu", "cuda"),
                                                   ("cuda,jax:cpu", "cpu"), ("cuda", None)])
def test_jax_platforms_follow_the_requirement(gpu_env: EnvFactory, locks: Path, require: str,
                                              expected: str | None) -> None:
    # The fake host has no real JAX CUDA backend, so a `jax` preflight is blocked here
    # (jax_gpu_backend_absent, tested in test_run.py); a ready cuda verdict stands in for it,
    # and the proof under the lock (which would refuse it: tests/test_truthful.py) is off.
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=2)
    verdict = gpudiag.preflight("cuda", env=env)
    assert verdict.ready
    adm = Admitter(env=env, lock_dir=locks, gpus=1, lock_timeout_s=0, prover=None).admit(
        replace(verdict, requirement=parse_requirement(require)))
    try:
        child = gpudiag.child_environment(adm, {})
        assert child.get("JAX_PLATFORMS") == expected
        assert child["CUDA_VISIBLE_DEVICES"] == gpu_uuid(0)
    finally:
        adm.release()


def test_a_gpu_busy_with_another_process_is_never_chosen(gpu_env: EnvFactory,
                                                          locks: Path) -> None:
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=4, FAKE_NVML_PROCESSES="0:4242:100,2:4343:100")
    with gpudiag.admit(gpus=2, env=env, lock_dir=locks, timeout=0) as adm:
        assert set(adm.uuids) == {gpu_uuid(1), gpu_uuid(3)}
        occ = {lf.uuid: lf.occupancy for lf in adm.candidates}
        assert occ[gpu_uuid(0)] == BUSY and occ[gpu_uuid(2)] == BUSY
    with pytest.raises(AdmissionError) as excinfo:
        with gpudiag.admit(gpus=3, env=env, lock_dir=locks, timeout=0):
            pytest.fail("admitted onto a busy GPU")
    record = refusal(excinfo)
    assert record["gpu_validation_blocker"] == "devices_busy"
    busy = record["blockers"][-1]
    assert busy["layer"] == "admission" and "4242" in busy["message"]
    leaves = record["evidence"]["admission"]["candidates"]
    assert {lf["uuid"]: lf["pids"] for lf in leaves}[gpu_uuid(0)] == [4242]


def test_unreadable_occupancy_is_unknown_and_never_free(gpu_env: EnvFactory,
                                                         locks: Path) -> None:
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=2, FAKE_NVML_UNSUPPORTED="processes")
    with pytest.raises(AdmissionError) as excinfo:
        with gpudiag.admit(gpus=1, env=env, lock_dir=locks, timeout=0):
            pytest.fail("admitted a GPU whose processes could not be listed")
    record = refusal(excinfo)
    assert record["gpu_validation_blocker"] == "device_state_unknown"
    assert "compute processes could not be listed" in record["blockers"][-1]["message"]
    assert all(lf["occupancy"] == UNKNOWN
               for lf in record["evidence"]["admission"]["candidates"])


def test_mig_instances_are_the_leaves_and_their_parent_is_not(gpu_env: EnvFactory,
                                                               locks: Path) -> None:
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=2, FAKE_NVML_MIG="0:3")
    with gpudiag.admit(gpus=4, env=env, lock_dir=locks, timeout=0) as adm:
        assert set(adm.uuids) == {mig_uuid(0, 0), mig_uuid(0, 1), mig_uuid(0, 2), gpu_uuid(1)}
        assert gpu_uuid(0) not in {lf.uuid for lf in adm.candidates}
        migs = [lf for lf in adm.leaves if lf.kind == "mig"]
        assert all(lf.parent_uuid == gpu_uuid(0) for lf in migs)
        assert all(lf.memory_total_bytes and lf.memory_total_bytes < 60 * 2**30 for lf in migs)
        assert gpudiag.child_environment(adm, {})["CUDA_VISIBLE_DEVICES"] == ",".join(adm.uuids)
    with pytest.raises(AdmissionError) as excinfo:
        with gpudiag.admit(gpus=5, env=env, lock_dir=locks, timeout=0):
            pytest.fail("the MIG parent was counted as a leaf")
    assert refusal(excinfo)["gpu_validation_blocker"] == "insufficient_devices"


def test_a_busy_mig_instance_is_skipped(gpu_env: EnvFactory, locks: Path) -> None:
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=1, FAKE_NVML_MIG="0:2", FAKE_NVML_PROCESSES="0.0:77:5")
    with gpudiag.admit(gpus=1, env=env, lock_dir=locks, timeout=0) as adm:
        assert adm.uuids == (mig_uuid(0, 1),)


def test_visibility_narrows_and_never_widens(gpu_env: EnvFactory, locks: Path) -> None:
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=4, CUDA_VISIBLE_DEVICES=gpu_uuid(2))
    with gpudiag.admit(gpus=1, env=env, lock_dir=locks, timeout=0) as adm:
        assert adm.uuids == (gpu_uuid(2),)
    with pytest.raises(AdmissionError) as excinfo:
        with gpudiag.admit(gpus=2, env=env, lock_dir=locks, timeout=0):
            pytest.fail("widened past CUDA_VISIBLE_DEVICES")
    assert refusal(excinfo)["gpu_validation_blocker"] == "insufficient_devices"
    both = gpu_env(FAKE_NVML_DEVICE_COUNT=4, CUDA_VISIBLE_DEVICES=f"{gpu_uuid(1)},{gpu_uuid(3)}",
                   NVIDIA_VISIBLE_DEVICES=f"{gpu_uuid(3)},{gpu_uuid(1)}")
    with gpudiag.admit(gpus=2, env=both, lock_dir=locks, timeout=0) as adm:
        assert set(adm.uuids) == {gpu_uuid(1), gpu_uuid(3)}
    # CUDA's list within NVIDIA's narrows further, as inside a container.
    within = gpu_env(FAKE_NVML_DEVICE_COUNT=4, CUDA_VISIBLE_DEVICES=gpu_uuid(3),
                     NVIDIA_VISIBLE_DEVICES=f"{gpu_uuid(1)},{gpu_uuid(3)}")
    with gpudiag.admit(gpus=1, env=within, lock_dir=locks, timeout=0) as adm:
        assert adm.uuids == (gpu_uuid(3),)


def test_visibility_variables_that_disagree_are_a_conflict(gpu_env: EnvFactory,
                                                            locks: Path) -> None:
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=4, CUDA_VISIBLE_DEVICES=gpu_uuid(1),
                  NVIDIA_VISIBLE_DEVICES=gpu_uuid(2))
    with pytest.raises(AdmissionError) as excinfo:
        with gpudiag.admit(gpus=1, env=env, lock_dir=locks, timeout=0):
            pytest.fail("admitted although the visibility variables disagree")
    record = refusal(excinfo)
    assert record["gpu_validation_blocker"] == "visible_devices_conflict"
    message = record["blockers"][-1]["message"]
    assert gpu_uuid(1) in message and gpu_uuid(2) in message
    assert record["evidence"]["admission"]["narrowing"]["CUDA_VISIBLE_DEVICES"] == gpu_uuid(1)


def test_a_uuid_prefix_is_never_an_identity(gpu_env: EnvFactory, locks: Path) -> None:
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=4, CUDA_VISIBLE_DEVICES="GPU-f00d0002")
    with pytest.raises(AdmissionError) as excinfo:
        with gpudiag.admit(gpus=1, env=env, lock_dir=locks, timeout=0):
            pytest.fail("a UUID prefix was taken as an identity")
    record = refusal(excinfo)
    assert record["gpu_validation_blocker"] == "visible_devices_invalid"
    assert "GPU-f00d0002" in record["blockers"][-1]["message"]


def test_min_free_memory_is_per_leaf(gpu_env: EnvFactory, locks: Path) -> None:
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=2, FAKE_NVML_MEMORY_USED_MIB="0:140000")
    with gpudiag.admit(gpus=1, env=env, lock_dir=locks, timeout=0,
                       min_free_memory="8GiB") as adm:
        assert adm.uuids == (gpu_uuid(1),)
        assert adm.requirement.min_free_memory_bytes == 8 * 2**30
    with pytest.raises(AdmissionError) as excinfo:
        with gpudiag.admit(gpus=2, env=env, lock_dir=locks, timeout=0, min_free_memory="8GiB"):
            pytest.fail("admitted a GPU without the free memory asked for")
    record = refusal(excinfo)
    assert record["gpu_validation_blocker"] == "insufficient_free_memory"
    assert gpu_uuid(0) in record["blockers"][-1]["message"]


@pytest.mark.parametrize(("knob", "value", "says"), [
    ("FAKE_NVML_PROCESSES", "0:999:10,1:999:10", "occupancy free -> busy"),
    ("FAKE_NVML_MEMORY_USED_MIB", "0:1000,1:1000", "memory free"),
    ("FAKE_NVML_DEVICE_COUNT", "1", "topology"),
])
def test_a_change_before_the_locked_observation_aborts(gpu_env: EnvFactory, locks: Path,
                                                        tmp_path: Path, knob: str, value: str,
                                                        says: str) -> None:
    state = tmp_path / "state"
    write_state_file(state, {})
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=2, FAKE_GPU_STATE_FILE=str(state))
    seen: list[Observation] = []

    def inject(first: Observation) -> None:
        seen.append(first)
        write_state_file(state, {knob: value})

    with pytest.raises(AdmissionError) as excinfo:
        with gpudiag.admit(gpus=1, env=env, lock_dir=locks, timeout=0,
                           after_first_observation=inject):
            pytest.fail("launched after the GPU changed under the lock")
    record = refusal(excinfo)
    assert seen and record["gpu_validation_blocker"] == "admission_changed"
    assert says in record["blockers"][-1]["message"]
    ev = record["evidence"]["admission"]
    assert ev["first_observation"]["leaves"] != ev["locked_observation"]["leaves"]
    # The abort released the lock: once the change is undone the same GPU is admitted.
    write_state_file(state, {})
    with gpudiag.admit(gpus=1, env=env, lock_dir=locks, timeout=0) as adm:
        assert adm.uuids == (gpu_uuid(0),)


HOLDER = """
import sys, time, gpudiag
with gpudiag.admit(gpus=1, lock_dir=sys.argv[1], timeout=0) as adm:
    print(adm.uuids[0], flush=True)
    time.sleep(float(sys.argv[2]))
"""


def _holder(env: dict[str, str], locks: Path, hold_s: float) -> tuple[subprocess.Popen[str],
                                                                     str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(locks), str(hold_s)],
                            env=env,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert is_full_uuid(line), f"holder printed {line!r}, exit {proc.poll()}"
    return proc, line


def test_a_gpu_whose_holder_was_sigkilled_is_admitted_again(gpu_env: EnvFactory,
                                                             locks: Path) -> None:
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=2, CUDA_VISIBLE_DEVICES=gpu_uuid(1))
    proc, held = _holder(env, locks, 60)
    try:
        assert held == gpu_uuid(1)
        with pytest.raises(AdmissionError) as excinfo:
            with gpudiag.admit(gpus=1, env=env, lock_dir=locks, timeout=0):
                pytest.fail("admitted a GPU another process holds")
        record = refusal(excinfo)
        assert record["gpu_validation_blocker"] == "lock_timeout"
        holders = record["evidence"]["admission"]["held_by_others"]
        assert holders[0]["uuid"] == gpu_uuid(1) and holders[0]["holder"]["pid"] == proc.pid
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    with gpudiag.admit(gpus=1, env=env, lock_dir=locks, timeout=0) as adm:
        assert adm.uuids == (gpu_uuid(1),)


def test_a_waiting_admission_gets_the_gpu_when_its_holder_ends(gpu_env: EnvFactory,
                                                               locks: Path) -> None:
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=1)
    proc, held = _holder(env, locks, 3.0)
    try:
        t0 = time.monotonic()
        with gpudiag.admit(gpus=1, env=env, lock_dir=locks, timeout=20) as adm:
            waited = time.monotonic() - t0
            assert adm.uuids == (held,)
            # The holder was alive when admit() began; the GPU came only once it ended.
            assert proc.poll() is not None, "admitted while the holder still ran"
        assert waited < 15
    finally:
        proc.kill()
        proc.wait()


def test_nothing_to_admit_for_zero_gpus(bare_env: dict[str, str], locks: Path) -> None:
    with gpudiag.admit(gpus=0, require="jax:cpu", env=bare_env, lock_dir=locks) as adm:
        child = gpudiag.child_environment(adm, {})
        assert adm.uuids == () and adm.locks == ()
        assert child["CUDA_VISIBLE_DEVICES"] == "" and child["NVIDIA_VISIBLE_DEVICES"] == ""
        assert child["JAX_PLATFORMS"] == "cpu"
    assert not locks.exists()


def test_a_blocked_preflight_is_refused_with_its_own_blocker(gpu_env: EnvFactory,
                                                              locks: Path) -> None:
    env = gpu_env(FAKE_NVML_INIT_ERROR=9)
    with pytest.raises(AdmissionError) as excinfo:
        with gpudiag.admit(gpus=1, env=env, lock_dir=locks):
            pytest.fail("admitted on a blocked host")
    assert refusal(excinfo)["gpu_validation_blocker"] == "driver_not_loaded"


def test_lock_dir_comes_from_the_environment(tmp_path: Path) -> None:
    assert default_lock_dir({"GPUDIAG_LOCK_DIR": str(tmp_path)}) == tmp_path


def test_leaves_from_an_unreadable_device_are_unknown() -> None:
    nvml = {"ok": True, "devices": [
        {"index": 0, "ok": False, "error": {"code": 15, "name": "GPU_IS_LOST"}},
        {"index": 1, "ok": True, "uuid": "GPU-f00d", "memory": {"free_bytes": 1},
         "processes": []},
        {"index": 2, "ok": True, "uuid": gpu_uuid(2), "memory": None, "processes": []},
    ]}
    leaves = leaves_from_nvml(decode(NvmlObservation, nvml))
    assert [lf.occupancy for lf in leaves] == [UNKNOWN, UNKNOWN, UNKNOWN]
    assert "full UUID" in str(leaves[1].reason) and "memory" in str(leaves[2].reason)


def test_index_entries_narrow_by_nvml_index() -> None:
    nvml = {"ok": True, "devices": [
        {"index": i, "ok": True, "uuid": gpu_uuid(i), "memory": {"free_bytes": 1},
         "processes": []} for i in range(3)]}
    got = narrow(leaves_from_nvml(decode(NvmlObservation, nvml)), {"CUDA_VISIBLE_DEVICES": "2,0"})
    assert got.allowed == frozenset({gpu_uuid(0), gpu_uuid(2)}) and not got.blockers
    bad = narrow(leaves_from_nvml(decode(NvmlObservation, nvml)), {"CUDA_VISIBLE_DEVICES": "7"})
    assert [b.code for b in bad.blockers] == ["visible_devices_invalid"]


def test_lock_files_are_never_named_by_prefix_or_index(tmp_path: Path) -> None:
    from gpudiag.engine.locks import try_lock

    for bad in ("GPU-f00d", "0", "../x"):
        with pytest.raises(ValueError):
            try_lock(tmp_path, bad)
    assert os.listdir(tmp_path) == []


def test_the_complete_runner_example_in_docs_runs(gpu_env: EnvFactory, tmp_path: Path) -> None:
    doc = (Path(__file__).resolve().parent.parent / "docs" / "runner.md").read_text()
    example = doc.split("## A complete runner", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    # Its own __main__ runs one default trial; this test drives run_trial itself.
    example = example.split('if __name__ == "__main__":', 1)[0]
    script = tmp_path / "runner_example.py"
    script.write_text(example + textwrap.dedent("""
        import sys
        code = run_trial([sys.executable, "-c",
                          "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"],
                         Path(sys.argv[1]))
        sys.exit(code)
    """))
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=2, GPUDIAG_LOCK_DIR=str(tmp_path / "locks"),
                  GPUDIAG_DAEMON_URL="http://127.0.0.1:9")  # nothing listens: inline
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "rec")], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == gpu_uuid(0)
    record = json.loads((tmp_path / "rec" / "record.json").read_text())
    assert record["outcome"] == "ran" and record["exit_code"] == 0
    assert record["admission"]["selected"] == [gpu_uuid(0)]
    assert record["verdict"]["gpu_validation_blocker"] == "none"
    assert record["verdict"]["source"] == "inline"
    # Its default trial as written shows the admitted GPU (nvidia-smi -L would list all).
    whole = doc.split("## A complete runner", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    (tmp_path / "whole.py").write_text(whole)
    proc = subprocess.run([sys.executable, str(tmp_path / "whole.py")], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    assert f"trial sees CUDA_VISIBLE_DEVICES={gpu_uuid(0)}" in proc.stdout


def test_releasing_twice_never_closes_a_reused_descriptor(tmp_path: Path) -> None:
    from gpudiag.engine.locks import release, try_lock

    lk = try_lock(tmp_path, gpu_uuid(0))
    assert lk is not None
    release([lk])
    with open(tmp_path / "other", "w") as fh:
        if fh.fileno() != lk.fd:
            os.dup2(fh.fileno(), lk.fd)  # the number now belongs to an unrelated file
        release([lk])
        assert os.fstat(lk.fd).st_ino == os.fstat(fh.fileno()).st_ino  # still open
        if fh.fileno() != lk.fd:
            os.close(lk.fd)


def test_a_waiting_admission_notices_a_busy_gpu_becoming_free(gpu_env: EnvFactory,
                                                              locks: Path,
                                                              tmp_path: Path) -> None:
    import threading

    from gpudiag.core.requirement import parse_requirement
    from gpudiag.runner.admission import Admitter, observe, preflight_for_admission

    state = tmp_path / "state"
    write_state_file(state, {"FAKE_NVML_PROCESSES": "0:4242:100"})
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=2, FAKE_GPU_STATE_FILE=str(state))
    proc, held = _holder(dict(env, CUDA_VISIBLE_DEVICES=gpu_uuid(1)), locks, 60)
    timers: list[threading.Timer] = []

    def observer(e: Any) -> Observation:
        obs = observe(e)
        if not timers:  # the GPU's other process ends a second after the first look
            timers.append(threading.Timer(1.0, write_state_file, args=(state, {})))
            timers[0].start()
        return obs

    try:
        assert held == gpu_uuid(1)
        verdict, _ = preflight_for_admission(parse_requirement("cuda"), 1, env)
        adm = Admitter(env=env, lock_dir=locks, gpus=1, lock_timeout_s=20,
                       observer=observer).admit(verdict)
        try:
            assert adm.uuids == (gpu_uuid(0),)  # the busy one, once its process was gone
            assert adm.attempts >= 2 and adm.first is not None
            assert adm.first.leaf(gpu_uuid(0)).occupancy == FREE  # type: ignore[union-attr]
        finally:
            adm.release()
    finally:
        for t in timers:
            t.cancel()
        proc.kill()
        proc.wait()
