"""The GPU's configuration and firmware inventory (issue 51): read by the nvml probe through the
real pynvml over the fake libnvidia-ml, compared across the node's GPUs (gpu_config_drift)
and before/after a diagnostic (core.gpu_config.changes), exported as an info series."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpudiag.core.classify import classify
from gpudiag.core.environment import probe_environment
from gpudiag.core.gpu_config import FIELDS, Change, changes, drift, inventory
from gpudiag.core.observations import GpuConfig, MigState, NvmlDevice
from gpudiag.core.probe_run import ProbeRun
from gpudiag.core.requirement import parse_requirement
from gpudiag.core.verdict import Verdict
from gpudiag.daemon.exporter import SnapshotCollector
from gpudiag.daemon.snapshot import ProbeKey, ProbeResult, Snapshot, WatcherState
from gpudiag.engine.isolation import run_probe
from tests.fakes.build import FakeDriver
from tests.support.daemon import host_env

H200 = {"driver_version": "570.124.06", "vbios_version": "96.00.9F.00.04",
        "inforom_image_version": "G525.0230.00.01", "gsp_firmware_version": "570.124.06",
        "power_limit_w": "700", "applications_clock_sm_mhz": "1980",
        "applications_clock_memory_mhz": "3201", "persistence_mode": "on", "ecc_mode": "on",
        "ecc_mode_pending": "on", "compute_mode": "default", "mig_mode": "off",
        "mig_mode_pending": "off"}


def _nvml(fakes: FakeDriver, tmp: Path, gpus: int = 4, **knobs: str | int) -> ProbeRun:
    env = host_env(fakes, tmp, gpus=gpus, FAKE_NVML_DEVICE_COUNT=gpus, **knobs)
    return run_probe("nvml", env=probe_environment(env), timeout_s=60)


def _devices(run: ProbeRun) -> tuple[NvmlDevice, ...]:
    assert run.nvml is not None and run.nvml.ok, run.observation
    return run.nvml.devices


def _verdict(run: ProbeRun) -> Verdict:
    return classify({"nvml": run}, parse_requirement("cuda", node_health=True), host="h",
                    checked_at="2026-12-05T00:00:00Z")


def _drift_warnings(run: ProbeRun) -> dict[str, str]:
    return {w.device or "": w.message for w in _verdict(run).warnings
            if w.code == "gpu_config_drift"}


def test_the_probe_reads_every_inventory_field_from_the_driver(
        fakes: FakeDriver, tmp_path: Path) -> None:
    run = _nvml(fakes, tmp_path, FAKE_NVML_VBIOS="1:96.00.9F.00.01",
                FAKE_NVML_INFOROM="1:G525.0230.00.00", FAKE_NVML_GSP_FIRMWARE="1:565.57.01",
                FAKE_NVML_POWER_LIMIT_MW="1:450000", FAKE_NVML_APP_CLOCKS_MHZ="1:1755/2619",
                FAKE_NVML_ECC_MODE="1:1/0", FAKE_NVML_PERSISTENCE="1:0",
                FAKE_NVML_COMPUTE_MODE="1:3")
    assert run.nvml is not None
    gpu0, gpu1 = _devices(run)[:2]
    assert inventory(gpu0, run.nvml.driver_version) == H200
    assert list(H200) == list(FIELDS)
    assert inventory(gpu1, run.nvml.driver_version) == {
        **H200, "vbios_version": "96.00.9F.00.01", "inforom_image_version": "G525.0230.00.00",
        "gsp_firmware_version": "565.57.01", "power_limit_w": "450",
        "applications_clock_sm_mhz": "1755", "applications_clock_memory_mhz": "2619",
        "ecc_mode_pending": "off", "persistence_mode": "off",
        "compute_mode": "exclusive_process"}


def test_firmware_a_gpu_cannot_report_is_none_with_its_reason_and_no_drift(
        fakes: FakeDriver, tmp_path: Path) -> None:
    run = _nvml(fakes, tmp_path, FAKE_NVML_UNSUPPORTED="firmware")
    gpu0 = _devices(run)[0]
    assert gpu0.config == GpuConfig(None, None, None, 700.0, 1980, 3201, True, True)
    assert run.observation is not None
    unsupported = run.observation["devices"][0]["unsupported"]
    assert {"config.vbios", "config.inforom_image", "config.gsp_firmware"} <= set(unsupported)
    assert _drift_warnings(run) == {}


def test_one_gpu_off_its_peers_is_a_drift_warning_naming_each_field(
        fakes: FakeDriver, tmp_path: Path) -> None:
    run = _nvml(fakes, tmp_path, FAKE_NVML_POWER_LIMIT_MW="3:500000",
                FAKE_NVML_VBIOS="3:96.00.9F.00.01")
    gpu3 = _devices(run)[3]
    v = _verdict(run)
    assert v.ready and v.gpu_validation_blocker == "none"
    assert _drift_warnings(run) == {gpu3.uuid: (
        "GPU 3 differs from the node's other NVIDIA H200 GPUs: vbios_version 96.00.9F.00.01 "
        "(the majority: 96.00.9F.00.04, 3 of 4); power_limit_w 500 (the majority: 700, "
        "3 of 4)")}
    assert [w.layer for w in v.warnings if w.code == "gpu_config_drift"] == ["device"]


def test_two_gpus_that_differ_name_no_majority(fakes: FakeDriver, tmp_path: Path) -> None:
    run = _nvml(fakes, tmp_path, gpus=2, FAKE_NVML_APP_CLOCKS_MHZ="1:1755/3201")
    assert _drift_warnings(run) == {}


def test_mig_mode_on_one_gpu_is_a_choice_not_drift(fakes: FakeDriver, tmp_path: Path) -> None:
    run = _nvml(fakes, tmp_path, FAKE_NVML_MIG="1:2")
    assert inventory(_devices(run)[1])["mig_mode"] == "on"
    assert _drift_warnings(run) == {}


def test_a_job_on_some_gpus_hears_of_drift_on_its_own_gpus_only(
        fakes: FakeDriver, tmp_path: Path) -> None:
    run = _nvml(fakes, tmp_path, FAKE_NVML_ECC_MODE="2:0/0")
    gpu2 = _devices(run)[2]
    node = _drift_warnings(run)
    assert gpu2.uuid and list(node) == [gpu2.uuid]
    assert "ecc_mode off (the majority: on, 3 of 4)" in node[gpu2.uuid]
    job = classify({"nvml": run}, parse_requirement("cuda", devices="0,1"), host="h",
                   checked_at="2026-12-05T00:00:00Z")
    assert [w for w in job.warnings if w.code == "gpu_config_drift"] == []


def _device(index: int, name: str, vbios: str) -> NvmlDevice:
    return NvmlDevice(index=index, ok=True, uuid=f"GPU-{index}", name=name,
                      config=GpuConfig(vbios_version=vbios),
                      mig=MigState(enabled=False, pending=False))


def test_gpus_of_another_model_are_not_peers() -> None:
    devs = [_device(0, "NVIDIA H200", "A"), _device(1, "NVIDIA H200", "A"),
            _device(2, "NVIDIA H200", "B"), _device(3, "NVIDIA L40S", "C"),
            _device(4, "NVIDIA L40S", "C")]
    found = drift(devs)
    assert list(found) == ["GPU-2"] and [d.field for d in found["GPU-2"]] == ["vbios_version"]


def test_a_change_counts_only_for_fields_known_before_and_after() -> None:
    before = {"GPU-0": {"power_limit_w": "700", "vbios_version": "A", "ecc_mode": "on"},
              "GPU-1": {"power_limit_w": "700"}}
    after = {"GPU-0": {"power_limit_w": "650", "ecc_mode": "on"},  # VBIOS unreadable now
             "GPU-2": {"power_limit_w": "300"}}                      # a GPU not seen before
    assert changes(before, after) == (Change("GPU-0", "power_limit_w", "700", "650"),)
    assert changes(before, before) == ()


def test_the_exporter_has_one_info_series_per_known_field(
        fakes: FakeDriver, tmp_path: Path) -> None:
    run = _nvml(fakes, tmp_path, gpus=2, FAKE_NVML_VBIOS="1:96.00.9F.00.01")
    key = ProbeKey.of("nvml")
    snap = Snapshot(seq=1, published_wall=1.0, results={key: ProbeResult(key, run, 0.0, 1.0)},
                    stats={}, scheduled=(key,), watcher=WatcherState(), full=None, ready=None)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(lambda: snap))
    series = [(s.labels["gpu"], s.labels["field"], s.labels["value"])
              for fam in text_string_to_metric_families(generate_latest(registry).decode())
              for s in fam.samples if s.name == "gpudiag_gpu_config_info" and s.value == 1]
    assert len(series) == 2 * len(FIELDS)
    assert ("1", "vbios_version", "96.00.9F.00.01") in series
    assert ("0", "driver_version", "570.124.06") in series


@pytest.mark.parametrize("field", FIELDS)
def test_every_inventory_field_is_named_in_the_reference(field: str) -> None:
    text = (Path(__file__).resolve().parent.parent / "docs" / "reference.md").read_text()
    assert field in text
