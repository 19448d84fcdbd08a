"""The typed observation parser: probe JSON in, frozen records out, malformed JSON named.

The real probes run on the fake driver libraries; the parser's own edge cases use small
hand-written observations (the JSON edge is the thing under test).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpudiag.core.decode import decode
from gpudiag.core.environment import probe_environment
from gpudiag.core.observations import (
    GpuReadings,
    Malformed,
    NvmlObservation,
    parse_telemetry,
)
from gpudiag.core.probe_run import ProbeRun
from gpudiag.core.registry import parse_observation
from gpudiag.engine.isolation import run_probe
from tests.fakes.build import FakeDriver
from tests.support.daemon import host_env

BACKENDS = ("host", "nvml", "cuda", "jax", "iree")
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=3),
    max_leaves=12)


@pytest.fixture(scope="module")
def nvml_run(fakes: FakeDriver, tmp_path_factory: pytest.TempPathFactory) -> ProbeRun:
    env = host_env(fakes, tmp_path_factory.mktemp("nvml"), gpus=2, FAKE_NVML_DEVICE_COUNT=2,
                   FAKE_NVML_MIG="0:2", FAKE_NVML_PROCESSES="1:77:5",
                   FAKE_NVML_REMAPPED_ROWS="1:0/1/1/0", FAKE_NVML_COMPUTE_MODE="1:3",
                   FAKE_NVML_CLOCKS_EVENT_REASONS="1:0x44", FAKE_NVML_TEMPERATURE_C="1:61")
    return run_probe("nvml", env=probe_environment(env), timeout_s=60)


def test_a_real_nvml_observation_becomes_typed_devices(nvml_run: ProbeRun) -> None:
    nvml = nvml_run.nvml
    assert nvml_run.ok and nvml is not None and nvml.ok
    gpu0, gpu1 = nvml.devices
    assert (gpu0.index, gpu1.index) == (0, 1)
    assert gpu0.uuid and gpu0.uuid.startswith("GPU-") and gpu0.name == "NVIDIA H200"
    assert gpu0.mig is not None and gpu0.mig.enabled and len(gpu0.mig.instances) == 2
    assert all(i.uuid and i.uuid.startswith("MIG-") for i in gpu0.mig.instances)
    assert gpu1.processes is not None and [p.pid for p in gpu1.processes] == [77]
    assert gpu1.processes[0].used_memory_bytes == 5 * 2**20
    assert gpu1.compute_mode == 3 and gpu1.readings.temperature_c == 61
    assert gpu1.remapped_rows is not None and gpu1.remapped_rows.pending
    assert set(gpu1.clocks_event_reasons) == {"sw_power_cap", "hw_thermal_slowdown"}
    assert gpu1.memory is not None and gpu1.memory.total_bytes == 143771 * 2**20


def test_every_real_probe_parses_to_its_own_record(fakes: FakeDriver, tmp_path: Path) -> None:
    env = probe_environment(host_env(fakes, tmp_path, gpus=1, FAKE_NVML_DEVICE_COUNT=1))
    host = run_probe("host", env=env, timeout_s=60)
    cuda = run_probe("cuda", env=env, timeout_s=60)
    assert host.host is not None and host.host.device_nodes.control_present
    assert host.host.device_nodes.gpu_nodes == 1 and host.host.driver_present
    assert cuda.cuda is not None and cuda.cuda.init_ok and cuda.cuda.device_count == 1
    assert cuda.cuda.devices[0].context is not None and cuda.cuda.devices[0].context.ok
    assert host.nvml is None and cuda.host is None  # each run has exactly its own kind


def test_a_malformed_observation_names_the_field() -> None:
    found = parse_observation("nvml", {"ok": True, "devices": [{"index": "zero"}]})
    assert isinstance(found, Malformed)
    assert found.problem == 'devices[0].index: expected an integer, got "zero"'


def test_building_a_run_parses_it_and_malformed_json_is_a_probe_error_run() -> None:
    run = ProbeRun("nvml", {"ok": True, "devices": [{"index": 0, "memory": "lots"}]}, 0.1,
                   exit_code=0)
    assert not run.ok and run.observation is None and run.parsed is None
    assert run.error == ("probe nvml returned a malformed observation: devices[0].memory: "
                         'expected an object, got "lots"')


def test_replacing_the_observation_parses_the_new_one() -> None:
    run = ProbeRun("nvml", {"ok": False, "error": {"code": 9, "name": "DRIVER_NOT_LOADED"}},
                   0.1, exit_code=0)
    assert run.nvml is not None and run.nvml.error is not None and run.nvml.error.code == 9
    again = replace(run, observation={"ok": True, "devices": [{"index": 3, "ok": True}]})
    assert again.nvml is not None and again.nvml.ok and again.nvml.devices[0].index == 3


def test_the_nvml_probe_and_the_watcher_share_one_reading_vocabulary() -> None:
    reading = {"index": 2, "memory": {"total_bytes": 80, "used_bytes": 30, "free_bytes": 50},
               "utilization_gpu_ratio": 0.5, "temperature_c": 61, "power_w": 300.5}
    from_probe = decode(NvmlObservation, {"ok": True, "devices": [{**reading, "ok": True}]})
    from_watcher = parse_telemetry([reading])
    assert from_probe.devices[0].readings == from_watcher[2] == decode(GpuReadings, reading)


def test_newer_telemetry_replaces_only_the_readings_it_has() -> None:
    old = decode(GpuReadings, {"index": 0, "memory": {"total_bytes": 80, "free_bytes": 80},
                             "temperature_c": 40, "power_w": 100.0})
    new = parse_telemetry([{"index": 0, "memory": {"free_bytes": 10}, "temperature_c": 70}])
    merged = old.updated_by(new[0])
    assert merged.memory is not None and merged.memory.total_bytes == 80
    assert (merged.memory.free_bytes, merged.temperature_c, merged.power_w) == (10, 70, 100.0)


@pytest.mark.parametrize("bad", [None, 3, "x", [1], {"index": True}, {"index": "0"}])
def test_malformed_telemetry_entries_are_dropped(bad: Any) -> None:
    assert parse_telemetry([bad, {"index": 1, "temperature_c": 5}]) == {
        1: GpuReadings(index=1, temperature_c=5)}


def test_unset_fields_are_none_not_guesses() -> None:
    nvml = decode(NvmlObservation, {"ok": True, "devices": [{"index": 0}]})
    dev = nvml.devices[0]
    assert (dev.ok, dev.uuid, dev.memory, dev.processes, dev.persistence_mode,
            dev.compute_mode, dev.mig) == (False, None, None, None, None, None, None)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(BACKENDS), st.dictionaries(st.sampled_from(
    ["ok", "error", "devices", "init", "library", "device_nodes", "driver_proc", "drivers",
     "compute", "versions", "environment", "required", "platforms", "nvidia_smi"]),
    JSON, max_size=6))
def test_any_json_object_is_typed_or_malformed_never_an_exception(backend: str,
                                                                   value: dict[str, Any]
                                                                   ) -> None:
    found = parse_observation(backend, json.loads(json.dumps(value)))
    run = ProbeRun(backend, value, 0.1, exit_code=0)
    assert isinstance(found, Malformed) == (run.error is not None)
    if isinstance(found, Malformed):
        assert found.problem and run.error and found.problem in run.error


def test_nothing_above_core_reads_a_raw_observation() -> None:
    import ast

    package = Path(__file__).resolve().parent.parent / "gpudiag"
    readers = []
    for layer in ("engine", "daemon", "runner", "cli"):
        for path in sorted((package / layer).glob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            readers += [f"{layer}/{path.name}:{node.lineno}" for node in ast.walk(tree)
                        if isinstance(node, ast.Attribute) and node.attr == "observation"]
    assert readers == []
