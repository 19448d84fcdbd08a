"""The Collector over a snapshot: the names of docs/reference.md, every code present,
promtool-clean."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import TypeAlias

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpudiag.core import registry
from gpudiag.core.catalog import BLOCKERS, WARNINGS
from gpudiag.core.findings import XidEvent
from gpudiag.daemon.exporter import SnapshotCollector
from gpudiag.daemon.snapshot import Snapshot, WatcherState, XidCount
from tests.fakes.build import FakeDriver
from tests.support.daemon import Runs, host_env, real_runs, snapshot_of

UUID0 = "GPU-f00d0000-0000-4000-8000-000000000000"


@pytest.fixture(scope="module")
def runs_8(fakes: FakeDriver, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return real_runs(host_env(fakes, tmp_path_factory.mktemp("h8"), FAKE_NVML_DEVICE_COUNT=8,
                              FAKE_NVML_UNSUPPORTED="power"))


@pytest.fixture(scope="module")
def runs_lost(fakes: FakeDriver, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return real_runs(host_env(fakes, tmp_path_factory.mktemp("hl"), FAKE_NVML_DEVICE_COUNT=2,
                              FAKE_NVML_DEVICE_ERRORS="1:15"))


# Scraped samples by metric name: (labels, value) each.
Samples: TypeAlias = dict[str, list[tuple[dict[str, str], float]]]


def scrape(snap: Snapshot, now: float = 1_800_000_000.0) -> tuple[str, Samples]:
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(lambda: snap, wall=lambda: now))
    text = generate_latest(registry).decode()
    samples: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return text, samples


def one(samples: Samples, metric: str, **labels: str) -> float:
    found = [v for lab, v in samples.get(metric, []) if all(lab.get(k) == x
                                                           for k, x in labels.items())]
    assert len(found) == 1, f"{metric}{labels}: {found}"
    return found[0]


XID_STATE = WatcherState(
    enabled=True, running=True, restarts=2, gap_seconds_closed=3.5,
    xid_counts=(XidCount(0, UUID0, 79, 1, 1_799_999_990.0),
                XidCount(1, "GPU-x", 13, 3, 1_799_999_995.0)),
    recent=(XidEvent(79, 0, UUID0, 1_799_999_990.0),))


@pytest.mark.parametrize("code", list(BLOCKERS))
def test_every_blocker_code_is_present_as_0_or_1(runs_lost: Runs, code: str) -> None:
    _, samples = scrape(snapshot_of(runs_lost))
    value = one(samples, "gpudiag_blocker", code=code, layer=BLOCKERS[code].layer)
    assert value == (1.0 if code == "gpu_lost" else 0.0)


def test_every_warning_code_is_present(runs_8: Runs) -> None:
    _, samples = scrape(snapshot_of(runs_8))
    assert {lab["code"] for lab, _ in samples["gpudiag_warning"]} == set(WARNINGS)


def test_ready_and_backend_up_follow_the_verdicts(runs_8: Runs, runs_lost: Runs) -> None:
    _, healthy = scrape(snapshot_of(runs_8))
    assert one(healthy, "gpudiag_ready") == 1.0
    assert {lab["backend"]: v for lab, v in healthy["gpudiag_backend_up"]} == {
        "host": 1.0, "nvml": 1.0, "cuda": 1.0}
    _, lost = scrape(snapshot_of(runs_lost))
    assert one(lost, "gpudiag_ready") == 0.0
    assert one(lost, "gpudiag_backend_up", backend="nvml") == 0.0


def test_per_gpu_series_for_8_gpus_and_missing_readings_are_absent(runs_8: Runs) -> None:
    _, samples = scrape(snapshot_of(runs_8))
    gpus = {lab["gpu"] for lab, _ in samples["gpudiag_gpu_info"]}
    assert gpus == {str(i) for i in range(8)}
    assert one(samples, "gpudiag_gpu_info", gpu="0", uuid=UUID0, name="NVIDIA H200") == 1
    assert one(samples, "gpudiag_gpu_memory_total_bytes", gpu="0", uuid=UUID0) > 0
    assert one(samples, "gpudiag_gpu_memory_used_bytes", gpu="0", uuid=UUID0) == 0
    assert one(samples, "gpudiag_gpu_temperature_celsius", gpu="3") == 35
    assert one(samples, "gpudiag_gpu_utilization_ratio", gpu="7") == 0
    # FAKE_NVML_UNSUPPORTED=power: no series at all, never NaN.
    assert "gpudiag_gpu_power_watts" not in samples
    assert len(samples["gpudiag_gpu_ecc_errors_total"]) == 16
    assert one(samples, "gpudiag_probe_runs_total", backend="nvml", outcome="ok") == 1
    assert one(samples, "gpudiag_probe_runs_total", backend="nvml", outcome="timeout") == 0
    assert one(samples, "gpudiag_probe_duration_seconds", backend="cuda") > 0
    assert one(samples, "gpudiag_probe_last_success_timestamp_seconds", backend="host") > 0
    build = samples["gpudiag_build_info"][0][0]
    assert build["driver_version"] == "570.124.06" and build["cuda_driver_version"] == "12080"


def test_xid_series_and_watcher_health(runs_8: Runs) -> None:
    _, samples = scrape(snapshot_of(runs_8, XID_STATE))
    assert one(samples, "gpudiag_gpu_xid_errors_total", gpu="0", xid="79") == 1
    assert one(samples, "gpudiag_gpu_xid_errors_total", gpu="1", xid="13") == 3
    assert one(samples, "gpudiag_gpu_xid_last_timestamp_seconds", xid="79") == 1_799_999_990.0
    assert one(samples, "gpudiag_xid_watcher_up") == 1
    assert one(samples, "gpudiag_xid_watcher_restarts_total") == 2
    assert one(samples, "gpudiag_xid_watcher_gap_seconds_total") == 3.5
    assert one(samples, "gpudiag_blocker", code="gpu_lost") == 1  # XID 79 within hold


def test_watcher_telemetry_overlays_newer_readings(runs_8: Runs) -> None:
    snap = snapshot_of(runs_8)
    from dataclasses import replace

    from gpudiag.core.observations import parse_telemetry

    # The watcher's telemetry line, in the nvml probe's vocabulary.
    readings = parse_telemetry([{"index": 0, "temperature_c": 71,
                                 "memory": {"used_bytes": 1024}}])
    live = replace(snap.watcher, telemetry=readings, telemetry_wall=snap.published_wall + 1)
    _, samples = scrape(replace(snap, watcher=live))
    assert one(samples, "gpudiag_gpu_temperature_celsius", gpu="0") == 71
    assert one(samples, "gpudiag_gpu_memory_used_bytes", gpu="0") == 1024
    assert one(samples, "gpudiag_gpu_temperature_celsius", gpu="1") == 35


def test_collect_reads_a_fresh_snapshot_every_scrape(runs_8: Runs, runs_lost: Runs) -> None:
    current: list[Snapshot] = [snapshot_of(runs_8)]
    get: Callable[[], Snapshot] = lambda: current[0]  # noqa: E731
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(get))
    assert b"gpudiag_ready 1.0" in generate_latest(registry)
    current[0] = snapshot_of(runs_lost)
    text = generate_latest(registry).decode()
    assert "gpudiag_ready 0.0" in text and 'gpu="7"' not in text


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_check_metrics_is_clean(runs_8: Runs, tmp_path: Path) -> None:
    text, _ = scrape(snapshot_of(runs_8, XID_STATE))
    proc = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                          text=True, timeout=30, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "" and proc.stderr.strip() == "", (
        proc.stdout + proc.stderr)


def test_backend_ready_is_present_for_every_requirement_backend(runs_8: Runs,
                                                                 runs_lost: Runs) -> None:
    """cuda is proven on a healthy node; jax, iree and nic, not probed here, read 0 (never
    ready)."""
    _, healthy = scrape(snapshot_of(runs_8))
    assert {lab["backend"]: v for lab, v in healthy["gpudiag_backend_ready"]} == {
        "cuda": 1.0, "jax": 0.0, "iree": 0.0, "nic": 0.0}
    assert {lab["backend"] for lab, _ in healthy["gpudiag_backend_ready"]} == set(
        registry.published())
    proven = healthy["gpudiag_backend_last_proven_timestamp_seconds"]
    assert [lab["backend"] for lab, _ in proven] == ["cuda"]
    per_gpu = [v for lab, v in healthy["gpudiag_gpu_last_proven_timestamp_seconds"]
               if lab["backend"] == "cuda"]
    assert proven[0][1] == max(per_gpu)


def test_backend_ready_is_0_under_a_host_wide_blocker(fakes: FakeDriver,
                                                      tmp_path: Path) -> None:
    runs = real_runs(host_env(fakes, tmp_path, FAKE_NVML_DEVICE_COUNT=2,
                              FAKE_NVML_INIT_ERROR="9"))
    _, samples = scrape(snapshot_of(runs))
    assert {lab["backend"]: v for lab, v in samples["gpudiag_backend_ready"]} == {
        "cuda": 0.0, "jax": 0.0, "iree": 0.0, "nic": 0.0}
    # CUDA itself came up, but a node whose NVML is down is not ready for a cuda job.
    assert one(samples, "gpudiag_backend_up", backend="cuda") == 1.0
def test_a_lost_gpu_keeps_its_last_known_identity_labels(fakes: FakeDriver,
                                                         tmp_path: Path) -> None:
    healthy = real_runs(host_env(fakes, tmp_path / "h", FAKE_NVML_DEVICE_COUNT=2))
    lost = real_runs(host_env(fakes, tmp_path / "l", FAKE_NVML_DEVICE_COUNT=2,
                              FAKE_NVML_DEVICE_ERRORS="1:15"))
    current = [snapshot_of(healthy)]
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(lambda: current[0]))  # one daemon, scraped twice

    def scraped() -> Samples:
        samples: Samples = {}
        for fam in text_string_to_metric_families(generate_latest(registry).decode()):
            for sample in fam.samples:
                samples.setdefault(sample.name, []).append((sample.labels, sample.value))
        return samples

    before = scraped()
    current[0] = snapshot_of(lost)
    after = scraped()
    uuid1 = "GPU-f00d0001-0000-4000-8000-000000000001"
    info = [[lab for lab, _ in s["gpudiag_gpu_info"] if lab["gpu"] == "1"]
            for s in (before, after)]
    assert info[0] == info[1] and len(info[1]) == 1  # the same series, not a new one
    assert info[1][0]["uuid"] == uuid1 and info[1][0]["name"] == "NVIDIA H200"
    assert info[1][0]["pci_bus_id"].endswith("19:00.0")
    assert one(after, "gpudiag_gpu_healthy", gpu="1", uuid=uuid1) == 0
