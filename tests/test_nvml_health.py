"""NVML health without a context: PCIe, NVLink, fabric, held memory, clock events held over a
dwell time, pending retirement and the recovery action, from the fake driver to the verdict
and the metrics.

The rules are pure (gpudiag.core.nvml_health) and tested on typed devices; the probe reads
are tested through the real nvml probe child over the fake libnvidia-ml, and the end-to-end
codes through the real CLI (tests/test_fault_matrix.py covers daemon, metrics and history).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpudiag.core.catalog import BLOCKERS, WARNINGS
from gpudiag.core.environment import probe_environment
from gpudiag.core.findings import Findings
from gpudiag.core.nvml_health import (
    CODES,
    RECOVERY_ACTION_CODES,
    ClockHold,
    NvmlHealthPolicy,
    NvmlHistory,
    advance,
    device_health,
    held_memory_blocks,
)
from gpudiag.core.observations import (
    FabricInfo,
    GpuProcess,
    GpuReadings,
    Memory,
    MigState,
    NvLinks,
    NvmlDevice,
    NvmlObservation,
    PcieLink,
    RemappedRows,
)
from gpudiag.core.probe_run import ProbeRun
from gpudiag.core.recovery import RECOVERY_ACTION_NAMES
from gpudiag.daemon import nvlinks
from gpudiag.daemon.config import ConfigError, from_mapping
from gpudiag.daemon.exporter import SnapshotCollector
from gpudiag.daemon.snapshot import ProbeKey, ProbeResult, Snapshot, WatcherState
from gpudiag.engine.isolation import run_probe
from tests.fakes.build import FakeDriver
from tests.support.daemon import Daemon, daemon_toml, host_env, wait_for, write_config
from tests.support.host import verdict_of

UUID = "GPU-00000000-0000-4000-8000-000000000000"
GIB = 1024 ** 3


def _dev(**kw: Any) -> NvmlDevice:
    base: dict[str, Any] = {"index": 0, "ok": True, "uuid": UUID, "processes": ()}
    base.update(kw)
    return NvmlDevice(**base)


def _busy(**kw: Any) -> NvmlDevice:
    return _dev(readings=GpuReadings(utilization_gpu_ratio=0.9), **kw)


def _codes(d: NvmlDevice, **kw: Any) -> tuple[list[str], list[str]]:
    f = Findings()
    device_health(d, f, **kw)
    return [b.code for b in f.blockers], [w.code for w in f.warnings]


# -- recovery action: one test per value --------------------------------------------------------
EXPECTED_ACTION = {"none": None, "gpu_reset": "gpu_reset_required",
                   "node_reboot": "node_reboot_required", "drain_p2p": "gpu_reset_required",
                   "drain_and_reset": "gpu_reset_required",
                   "recover_imex_domain": "gpu_fabric_not_ready",
                   "bus_reset": "gpu_reset_required", "system_reboot": "node_reboot_required",
                   "action_9": "gpu_reset_required"}


def test_every_recovery_action_value_has_an_expected_code() -> None:
    assert set(RECOVERY_ACTION_NAMES) | {"action_9"} == set(EXPECTED_ACTION)
    assert set(RECOVERY_ACTION_CODES) == set(RECOVERY_ACTION_NAMES) - {"none"}


@pytest.mark.parametrize("action", list(EXPECTED_ACTION))
def test_a_recovery_action_value_maps_to_its_blocker(action: str) -> None:
    blockers, warnings = _codes(_dev(recovery_action=action))
    expected = EXPECTED_ACTION[action]
    assert blockers == ([] if expected is None else [expected]) and warnings == []
    if expected is not None:
        assert expected in BLOCKERS


@pytest.fixture(scope="module")
def action_run(fakes: FakeDriver, tmp_path_factory: pytest.TempPathFactory
               ) -> tuple[int, dict[str, Any]]:
    """One real `gpudiag probe` over 8 fake GPUs, GPU i reporting recovery action i."""
    env = host_env(fakes, tmp_path_factory.mktemp("actions"), gpus=8,
                   FAKE_NVML_RECOVERY_ACTION=",".join(f"{i}:{i}" for i in range(8)))
    return verdict_of(["probe", "--backend", "nvml", "--format", "json"], env)


@pytest.mark.parametrize("value", range(8))
def test_each_recovery_action_value_from_the_driver_reaches_the_verdict(
        value: int, action_run: tuple[int, dict[str, Any]]) -> None:
    rc, rec = action_run
    assert rc == 1
    name = RECOVERY_ACTION_NAMES[value]
    mine = [b for b in rec["blockers"] if b["message"].startswith(f"GPU {value}: ")]
    expected = EXPECTED_ACTION[name]
    assert [b["code"] for b in mine] == ([] if expected is None else [expected])
    if expected is not None:
        assert f"recovery action {name}" in mine[0]["message"]


# -- memory errors ------------------------------------------------------------------------------
def test_a_pending_remap_is_a_reset_due_warning_and_a_failure_blocks() -> None:
    assert _codes(_dev(remapped_rows=RemappedRows(0, 2, True, False))) == (
        [], ["gpu_reset_pending"])
    assert _codes(_dev(remapped_rows=RemappedRows(0, 2, False, True))) == (
        ["gpu_ecc_uncorrectable"], [])
    assert _codes(_dev(retired_pages_pending=True)) == ([], ["gpu_reset_pending"])
    assert _codes(_dev(retired_pages_pending=False)) == ([], [])


# -- PCIe -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("busy", [False, True])
def test_a_narrow_pcie_link_warns_idle_or_busy(busy: bool) -> None:
    link = PcieLink(5, 5, 8, 16)
    d = _busy(pcie=link) if busy else _dev(pcie=link)
    assert _codes(d) == ([], ["gpu_pcie_link_degraded"])


def test_a_link_below_the_configured_width_blocks() -> None:
    policy = NvmlHealthPolicy(pcie_block_below_width=8)
    assert _codes(_dev(pcie=PcieLink(5, 5, 4, 16)), policy=policy) == (
        ["gpu_pcie_link_degraded"], [])
    assert _codes(_dev(pcie=PcieLink(5, 5, 8, 16)), policy=policy) == (
        [], ["gpu_pcie_link_degraded"])


def test_a_lower_pcie_generation_warns_only_while_the_gpu_works() -> None:
    link = PcieLink(1, 5, 16, 16)  # an idle link trains down to gen 1 to save power
    assert _codes(_dev(pcie=link)) == ([], [])
    assert _codes(_busy(pcie=link)) == ([], ["gpu_pcie_link_degraded"])
    assert _codes(_dev(pcie=link, processes=(GpuProcess(42),))) == (
        [], ["gpu_pcie_link_degraded"])
    assert _codes(_busy(pcie=PcieLink(5, 5, 16, 16))) == ([], [])


# -- NVLink ---------------------------------------------------------------------------------------
def test_nvlink_down_against_the_links_seen_active_before() -> None:
    history = NvmlHistory(nvlinks_active={UUID: 4})
    down = _dev(nvlinks=NvLinks((0, 2), (1, 3)))
    f = Findings()
    device_health(down, f, history=history)
    assert [b.code for b in f.blockers] == ["gpu_nvlink_down"]
    assert "link 1, 3" in f.blockers[0].message and "4 active before" in f.blockers[0].message
    # Never seen more: nothing is down (a bridge that was never there is not a fault).
    assert _codes(down) == ([], [])
    assert _codes(_dev(nvlinks=None), history=history) == ([], [])


def test_nvlink_down_against_expected_nvlinks() -> None:
    policy = NvmlHealthPolicy(expected_nvlinks=4)
    blockers, _ = _codes(_dev(nvlinks=NvLinks((0, 1, 2), (3,))), policy=policy)
    assert blockers == ["gpu_nvlink_down"]
    assert _codes(_dev(nvlinks=NvLinks((0, 1, 2, 3), ())), policy=policy) == ([], [])


def test_the_history_remembers_the_most_active_links() -> None:
    def obs(active: tuple[int, ...]) -> NvmlObservation:
        return NvmlObservation(ok=True, devices=(_dev(nvlinks=NvLinks(active, ())),))
    h = advance(NvmlHistory(), obs((0, 1, 2, 3)), 10.0)
    h = advance(h, obs((0,)), 20.0)
    assert h.nvlinks_active == {UUID: 4} and h.now_wall == 20.0


# -- fabric ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("state", "status", "blocks"), [
    (0, 0, False), (1, 0, True), (2, 0, True), (3, 0, False), (3, 5, True)])
def test_fabric_state_blocks_until_registration_completes(state: int, status: int,
                                                          blocks: bool) -> None:
    blockers, _ = _codes(_dev(fabric=FabricInfo(state, status)))
    assert blockers == (["gpu_fabric_not_ready"] if blocks else [])


# -- memory held without a process ----------------------------------------------------------------
def _mem(used_gib: float, total_gib: float = 80) -> GpuReadings:
    total = int(total_gib * GIB)
    used = int(used_gib * GIB)
    return GpuReadings(memory=Memory(total, total - used, used))


def test_memory_held_on_a_gpu_without_processes_warns() -> None:
    assert _codes(_dev(readings=_mem(20))) == ([], ["gpu_memory_held_without_process"])
    assert _codes(_dev(readings=_mem(0.5))) == ([], [])  # the driver's own baseline
    assert _codes(_dev(readings=_mem(20), processes=(GpuProcess(7, 20 * GIB),))) == ([], [])
    assert _codes(_dev(readings=_mem(20), graphics_processes=(GpuProcess(8),))) == ([], [])
    assert _codes(_dev(readings=_mem(20), processes=None)) == ([], [])  # unknown: no claim
    assert _codes(_dev(readings=_mem(20), mig=MigState(True, False, ()))) == ([], [])
    # A working GPU (here: busy, no process listed, as in a container) owns its memory.
    busy = GpuReadings(memory=_mem(20).memory, utilization_gpu_ratio=0.5)
    assert _codes(_dev(readings=busy)) == ([], [])


def test_held_memory_blocks_only_where_the_requirement_is_short() -> None:
    f = Findings()
    device_health(_dev(readings=_mem(20)), f)
    held_memory_blocks(f)
    assert [w.code for w in f.warnings] == ["gpu_memory_held_without_process"]
    f.block("insufficient_free_memory", "short", device=UUID)
    held_memory_blocks(f)
    assert [b.code for b in f.blockers] == ["insufficient_free_memory",
                                            "gpu_memory_held_without_process"]
    assert f.warnings == [] and f.blockers[1].layer == "device"


# -- clock events held over a dwell time ---------------------------------------------------------
def _round(h: NvmlHistory, t: float, reasons: tuple[str, ...], util: float) -> NvmlHistory:
    d = _dev(clocks_event_reasons=reasons, readings=GpuReadings(utilization_gpu_ratio=util))
    return advance(h, NvmlObservation(ok=True, devices=(d,)), t)


def _clock_warnings(h: NvmlHistory, dwell: float = 60) -> list[str]:
    return _codes(_dev(), history=h, policy=NvmlHealthPolicy(clock_dwell_s=dwell))[1]


def test_an_idle_gpu_never_starts_a_clock_event_hold() -> None:
    h = NvmlHistory()
    for t in range(0, 600, 10):
        h = _round(h, float(t), ("hw_power_brake_slowdown", "hw_slowdown"), 0.0)
    assert h.clock_holds == {} and _clock_warnings(h, dwell=0) == []


def test_a_clock_event_warns_only_once_held_past_the_dwell_while_working() -> None:
    h = NvmlHistory()
    for t in (0.0, 10.0, 20.0):
        h = _round(h, t, ("hw_thermal_slowdown",), 0.9)
    assert _clock_warnings(h) == []  # 20 s held, dwell 60 s
    for t in (30.0, 40.0, 50.0, 60.0):
        h = _round(h, t, ("hw_thermal_slowdown",), 0.9)
    f = Findings()
    device_health(_dev(), f, history=h)
    assert [w.code for w in f.warnings] == ["gpu_thermal_throttling"]
    assert f.warnings[0].device == UUID and "held 60 s" in f.warnings[0].message
    assert "100% of samples" in f.warnings[0].message


@pytest.mark.parametrize("reasons", [(), ("sw_power_cap",), ("gpu_idle",)])
def test_a_busy_gpu_at_full_clocks_or_its_power_cap_never_warns(reasons: tuple[str, ...]
                                                                  ) -> None:
    h = NvmlHistory()
    for t in range(0, 600, 10):
        h = _round(h, float(t), reasons, 1.0)
    assert _clock_warnings(h, dwell=0) == [] and h.clock_holds == {}


def test_a_hold_survives_short_breaks_and_ends_when_mostly_clear() -> None:
    h = NvmlHistory()
    brake = ("hw_power_brake_slowdown",)
    for t, reasons in ((0, brake), (10, ()), (20, brake)):
        h = _round(h, float(t), reasons, 0.9)
    hold = h.clock_holds[(UUID, "power")]
    assert hold == ClockHold(0.0, 2, 3, brake)
    h = _round(_round(h, 30.0, (), 0.9), 40.0, (), 0.9)
    assert (UUID, "power") not in h.clock_holds
    h = _round(_round(NvmlHistory(), 0.0, brake, 0.9), 10.0, (), 0.0)
    assert h.clock_holds == {}  # a quiet idle GPU ends the hold


# -- the probe over the fake driver ----------------------------------------------------------------
@pytest.fixture(scope="module")
def nvml_run(fakes: FakeDriver, tmp_path_factory: pytest.TempPathFactory) -> ProbeRun:
    env = host_env(fakes, tmp_path_factory.mktemp("nvmlh"), gpus=3, FAKE_NVML_DEVICE_COUNT=3,
                   FAKE_NVML_PCIE="0:4/5/8/16", FAKE_NVML_NVLINKS="1:4",
                   FAKE_NVML_NVLINK_DOWN="1:1/3", FAKE_NVML_FABRIC="2:2/0",
                   FAKE_NVML_RETIRED_PAGES_PENDING="2:1",
                   FAKE_NVML_GRAPHICS_PROCESSES="2:99:64")
    return run_probe("nvml", env=probe_environment(env), timeout_s=60)


def test_the_probe_reads_link_fabric_and_pending_state_from_the_driver(
        nvml_run: ProbeRun) -> None:
    nvml = nvml_run.nvml
    assert nvml is not None and nvml.ok
    gpu0, gpu1, gpu2 = nvml.devices
    assert gpu0.pcie == PcieLink(4, 5, 8, 16)
    observed = nvml_run.observation
    assert observed is not None
    assert gpu0.nvlinks is None and "nvlinks" in observed["devices"][0]["unsupported"]
    assert gpu1.nvlinks is not None
    assert (gpu1.nvlinks.active, gpu1.nvlinks.inactive) == ((0, 2), (1, 3))
    # Where each active link ends (an NVSwitch: the fake's default; tests/test_nvlink_domain.py).
    assert [e.link for e in gpu1.nvlinks.remotes or ()] == [0, 2]
    assert gpu2.fabric == FabricInfo(2, 0) and gpu0.fabric is None
    assert gpu2.retired_pages_pending is True and gpu0.retired_pages_pending is False
    assert gpu2.graphics_processes == (GpuProcess(99, 64 * 2**20),)


def test_unsupported_signals_degrade_and_never_fail_the_device(
        fakes: FakeDriver, tmp_path: Path) -> None:
    env = host_env(fakes, tmp_path, gpus=1, FAKE_NVML_DEVICE_COUNT=1,
                   FAKE_NVML_UNSUPPORTED="pcie,nvlink,fabric,retired_pages,processes")
    run = run_probe("nvml", env=probe_environment(env), timeout_s=60)
    nvml = run.nvml
    assert nvml is not None and nvml.ok and nvml.devices[0].ok
    d = nvml.devices[0]
    assert (d.pcie, d.nvlinks, d.fabric, d.retired_pages_pending) == (None, None, None, None)
    assert run.observation is not None
    unsupported = run.observation["devices"][0]["unsupported"]
    assert {"pcie", "nvlinks", "fabric", "retired_pages_pending"} <= set(unsupported)
    assert all("NOT_SUPPORTED" in unsupported[k] for k in ("pcie", "fabric"))


def test_a_driver_without_the_functions_degrades_too(fakes: FakeDriver, tmp_path: Path) -> None:
    # An old driver lacks these symbols: pynvml raises FunctionNotFound at the call.
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "sitecustomize.py").write_text(
        "import pynvml\n"
        "def _missing(*a, **k):\n"
        "    raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)\n"
        "for _n in ('nvmlDeviceGetGpuFabricInfoV', 'nvmlDeviceGetGpuFabricInfo',\n"
        "           'nvmlDeviceGetCurrPcieLinkWidth', 'nvmlDeviceGetNvLinkState',\n"
        "           'nvmlDeviceGetGraphicsRunningProcesses_v3'):\n"
        "    setattr(pynvml, _n, _missing)\n")
    env = host_env(fakes, tmp_path / "h", gpus=1, FAKE_NVML_DEVICE_COUNT=1)
    env["PYTHONPATH"] = f"{shadow}:{env.get('PYTHONPATH', '')}"
    run = run_probe("nvml", env=probe_environment(env), timeout_s=60)
    nvml = run.nvml
    assert nvml is not None and nvml.ok and nvml.devices[0].ok
    assert run.observation is not None
    unsupported = run.observation["devices"][0]["unsupported"]
    assert all("FUNCTION_NOT_FOUND" in unsupported[k]
               for k in ("fabric", "pcie", "nvlinks", "graphics_processes")), unsupported


# -- config and metrics ----------------------------------------------------------------------------
def test_nvml_config_keys_are_checked() -> None:
    cfg = from_mapping({"nvml": {"expected_nvlinks": 18, "clock_event_dwell_s": 30,
                                 "pcie_block_below_width": 8}})
    assert cfg.nvml == NvmlHealthPolicy(expected_nvlinks=18, clock_dwell_s=30.0,
                                        pcie_block_below_width=8)
    for bad in ({"expected_nvlinks": 0}, {"expected_nvlinks": "4"},
                {"clock_event_dwell_s": -1}, {"expected_nvlink": 4},
                {"pcie_block_below_width": 0}, {"pcie_block_below_width": 2.5}):
        with pytest.raises(ConfigError,
                           match="nvml.expected_nvlink|nvml.clock_event|nvml.pcie_block"):
            from_mapping({"nvml": bad})


def test_every_nvml_health_code_is_in_the_catalog() -> None:
    assert set(CODES) <= set(BLOCKERS) | set(WARNINGS)


def test_the_exporter_labels_each_signal_with_its_gpu(nvml_run: ProbeRun) -> None:
    key = ProbeKey.of("nvml")
    hold = ClockHold(100.0, 3, 3, ("hw_thermal_slowdown",))
    uuid1 = nvml_run.nvml.devices[1].uuid if nvml_run.nvml else None
    assert uuid1
    snap = Snapshot(seq=1, published_wall=200.0,
                    results={key: ProbeResult(key, nvml_run, 150.0, 151.0)}, stats={},
                    scheduled=(key,), watcher=WatcherState(), full=None, ready=None,
                    nvml_history=NvmlHistory(clock_holds={(uuid1, "thermal"): hold},
                                             now_wall=190.0))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(lambda: snap))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(generate_latest(registry).decode())
               for s in fam.samples}

    def value(name: str, gpu: int, **labels: str) -> float | None:
        uuid = nvml_run.nvml.devices[gpu].uuid if nvml_run.nvml else ""
        want = tuple(sorted({"gpu": str(gpu), "uuid": uuid or "", **labels}.items()))
        return samples.get((name, want))

    assert value("gpudiag_gpu_pcie_link_width", 0, which="current") == 8
    assert value("gpudiag_gpu_pcie_link_generation", 0, which="max") == 5
    assert value("gpudiag_gpu_nvlinks", 1, state="inactive") == 2
    assert value("gpudiag_gpu_fabric_state", 2) == 2
    assert value("gpudiag_gpu_retired_pages_pending", 2) == 1
    assert value("gpudiag_gpu_recovery_action", 0, action="none") == 1
    assert value("gpudiag_gpu_clock_event_held_seconds", 1, group="thermal") == 90
    assert value("gpudiag_gpu_clock_event_held_seconds", 0, group="power") == 0
    assert value("gpudiag_gpu_condition", 0, code="gpu_nvlink_down") == 0


def test_the_condition_metric_follows_the_verdict(nvml_run: ProbeRun) -> None:
    from gpudiag.core.classify import classify
    from gpudiag.core.requirement import parse_requirement
    key = ProbeKey.of("nvml")
    verdict = classify({"nvml": nvml_run}, parse_requirement("cuda", node_health=True),
                       host="h", checked_at="2026-12-01T00:00:00Z")
    snap = Snapshot(seq=1, published_wall=1.0,
                    results={key: ProbeResult(key, nvml_run, 0.0, 1.0)}, stats={},
                    scheduled=(key,), watcher=WatcherState(), full=verdict, ready=verdict)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(lambda: snap))
    on = {(s.labels["gpu"], s.labels["code"])
          for fam in text_string_to_metric_families(generate_latest(registry).decode())
          for s in fam.samples if s.name == "gpudiag_gpu_condition" and s.value == 1}
    assert on == {("0", "gpu_pcie_link_degraded"), ("2", "gpu_fabric_not_ready"),
                  ("2", "gpu_reset_pending")}



# -- the NVLink memory survives a restart ----------------------------------------------------
def test_nvlink_memory_round_trips_and_refuses_what_is_not_its_own(tmp_path: Path) -> None:
    path = tmp_path / nvlinks.FILE_NAME
    assert nvlinks.load(path) == {}
    nvlinks.save(path, {UUID: 18})
    assert nvlinks.load(path) == {UUID: 18} and path.stat().st_mode & 0o777 == 0o600
    for bad in ("not json", "[1, 2]", '{"GPU-x": "18", "GPU-y": true, "GPU-z": 999}'):
        path.write_text(bad)
        assert nvlinks.load(path) == {}
    link = tmp_path / "link.json"
    link.symlink_to(path)
    path.write_text(json.dumps({UUID: 4}))
    assert nvlinks.load(link) == {}  # never followed


def test_a_link_that_went_down_while_the_daemon_was_stopped_is_missed(
        fakes: FakeDriver, tmp_path: Path) -> None:
    config = write_config(tmp_path / "gpudiag.toml", daemon_toml({"xid": {"enabled": False}}))
    state = tmp_path / "state"
    env = host_env(fakes, tmp_path / "host", gpus=2, FAKE_NVML_DEVICE_COUNT=2,
                   FAKE_NVML_NVLINKS="0:4,1:4")
    daemon = Daemon(env, config, state)
    try:
        daemon.wait_ready()
        wait_for(lambda: nvlinks.load(state / nvlinks.FILE_NAME) != {}, 20, interval=0.1)
    finally:
        assert daemon.stop() == 0
    remembered = nvlinks.load(state / nvlinks.FILE_NAME)
    assert sorted(remembered.values()) == [4, 4]
    daemon = Daemon({**env, "FAKE_NVML_NVLINK_DOWN": "1:2"}, config, state)
    try:
        daemon.wait_ready()
        status, rec = daemon.get("/v1/preflight?require=cuda")
    finally:
        assert daemon.stop() == 0
    assert status == 200 and rec["gpu_validation_blocker"] == "gpu_nvlink_down"
    assert "4 active before; down: link 2" in rec["blockers"][0]["message"]
