"""The nic backend over sysfs trees written from the kernel's ABI (tests/support/sysfs.py):
which ports count, the four nic_* codes, the daemon's memory (boot, flaps, counters), the
config that names expected ports, and the one-shot commands' --config."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from gpudiag.core.catalog import BLOCKERS, WARNINGS, layer_rank
from gpudiag.core.classify import classify
from gpudiag.core.classify_nic import remembered
from gpudiag.core.nic import (
    NicMemory,
    NicObservation,
    NicPolicyError,
    advance,
    parse_policy,
    parse_rate,
    parse_state,
)
from gpudiag.core.probe_run import ProbeRun
from gpudiag.core.requirement import parse_requirement
from gpudiag.core.verdict import Verdict
from gpudiag.probes import nic_probe
from tests.fakes.build import FakeDriver
from tests.support.daemon import host_env
from tests.support.sysfs import DISABLED, DOWN, HDR, POLLING, SysfsTree


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SysfsTree:
    t = SysfsTree(tmp_path / "sys")
    for key, value in t.env().items():
        monkeypatch.setenv(key, value)
    return t


def _settings(monkeypatch: pytest.MonkeyPatch, **nic: Any) -> None:
    monkeypatch.setenv("GPUDIAG_BACKEND_SETTINGS", json.dumps({"nic": nic}))


def _run() -> ProbeRun:
    run = ProbeRun("nic", nic_probe.probe({}), 0.01)
    assert run.error is None, run.error
    return run


def _verdict(run: ProbeRun, memory: NicMemory | None = None) -> Verdict:
    return classify({"nic": remembered(run, memory)}, parse_requirement("nic"), host="h",
                    checked_at="2026-12-05T00:00:00Z")


def _codes(v: Verdict) -> list[tuple[str, str | None, bool]]:
    return [(f.code, f.device, False) for f in v.blockers] + [
        (f.code, f.device, True) for f in v.warnings]


class _Daemon:
    """The daemon's memory, advanced read by read as its scheduler does."""

    def __init__(self) -> None:
        self.memory: NicMemory | None = None
        self.now = 1000.0

    def read(self, step_s: float = 1.0) -> Verdict:
        self.now += step_s
        run = _run()
        assert isinstance(run.parsed, NicObservation)
        self.memory = advance(self.memory, run.parsed, self.now)
        return _verdict(run, self.memory)


def test_state_and_rate_files_parse_as_the_kernel_abi_writes_them() -> None:
    assert parse_state("4: ACTIVE") == (4, "ACTIVE")
    assert parse_state("5: LinkUp") == (5, "LinkUp")
    assert parse_state("garbage") == (None, "garbage")
    assert parse_rate("400 Gb/sec (4X NDR)") == 400.0
    assert parse_rate("2.5 Gb/sec (1X SDR)") == 2.5
    assert parse_rate("fast") is None


def test_every_nic_code_is_in_the_catalog_in_the_network_layer_after_device() -> None:
    for code in ("nic_link_down", "nic_link_degraded", "nic_link_flapping"):
        assert BLOCKERS[code].layer == "network" and BLOCKERS[code].remediation
    for code in ("nic_link_degraded", "nic_errors_rising"):
        assert WARNINGS[code].layer == "network"
    assert layer_rank("device") < layer_rank("network") < layer_rank("cuda")


def test_an_active_ndr_port_is_ready_and_its_facts_are_in_the_detail(tree: SysfsTree) -> None:
    tree.ib_port("mlx5_0", bus_id="0000:17:00.0", numa_node=1)
    v = _verdict(_run())
    assert v.ready and _codes(v) == []
    status = v.backends["nic"]
    assert status.status == "ok" and status.versions == {"fw_ver": "28.39.1002"}
    port = status.detail["ports"][0]
    assert port == {"port": "mlx5_0/1", "kind": "ib", "up": True, "state": "4: ACTIVE",
                    "phys_state": "5: LinkUp", "rate_gbps": 400.0,
                    "link_layer": "InfiniBand", "rdma": True, "fw_ver": "28.39.1002",
                    "pci_bus_id": "0000:17:00.0", "numa_node": 1, "gpus": {}}


def test_a_required_nic_runs_no_gpu_probe_and_needs_no_gpu() -> None:
    req = parse_requirement("nic")
    assert not req.needs_gpu and req.effective_min_devices == 0


@pytest.mark.parametrize("phys_state, said", [(DISABLED, "Disabled: shut down"),
                                              (POLLING, "Polling: no peer")])
def test_an_expected_port_down_is_nic_link_down_saying_why(
        tree: SysfsTree, monkeypatch: pytest.MonkeyPatch, phys_state: str, said: str) -> None:
    tree.ib_port("mlx5_0")
    tree.ib_port("mlx5_1", state=DOWN, phys_state=phys_state)
    _settings(monkeypatch, expect=["mlx5_0/1", "mlx5_1/1"])
    v = _verdict(_run())
    assert v.gpu_validation_blocker == "nic_link_down" and not v.ready
    assert _codes(v) == [("nic_link_down", "mlx5_1/1", False)]
    assert said in v.blockers[0].message and v.blockers[0].layer == "network"


def test_an_expected_port_that_is_not_on_the_node_is_down(
        tree: SysfsTree, monkeypatch: pytest.MonkeyPatch) -> None:
    _settings(monkeypatch, expect=["mlx5_3/1"])
    v = _verdict(_run())
    assert _codes(v) == [("nic_link_down", "mlx5_3/1", False)]
    assert "not on this node" in v.blockers[0].message


def test_a_never_cabled_port_and_a_management_netdev_never_block(tree: SysfsTree) -> None:
    tree.ib_port("mlx5_0")
    tree.ib_port("mlx5_1", state=DOWN, phys_state=POLLING)   # an empty cage since boot
    tree.netdev("eno1", up=False, bus_id="0000:01:00.0")      # plain Ethernet, no RDMA
    tree.netdev("docker0", up=False, bus_id=None)             # virtual
    daemon = _Daemon()
    assert _codes(daemon.read()) == [] and _codes(daemon.read()) == []


def test_a_port_up_since_boot_that_goes_down_blocks_only_with_the_daemons_memory(
        tree: SysfsTree) -> None:
    tree.ib_port("mlx5_0")
    tree.ib_port("mlx5_1")
    daemon = _Daemon()
    assert daemon.read().ready
    tree.ib_port("mlx5_1", state=DOWN, phys_state=POLLING)
    assert _codes(daemon.read()) == [("nic_link_down", "mlx5_1/1", False)]
    # One-shot, without the memory: a port down now was never seen up, so it is not expected.
    assert _verdict(_run()).ready


def test_a_new_boot_forgets_which_ports_were_up(tree: SysfsTree) -> None:
    tree.ib_port("mlx5_0")
    daemon = _Daemon()
    daemon.read()
    tree.ib_port("mlx5_0", state=DOWN, phys_state=POLLING)
    assert not daemon.read().ready
    tree.boot_id.write_text("another-boot\n")
    assert daemon.read().ready and daemon.memory is not None
    assert daemon.memory.seen_up == ()


def test_a_port_below_its_peers_rate_is_a_warning(tree: SysfsTree) -> None:
    tree.ib_port("mlx5_0")
    tree.ib_port("mlx5_1", rate=HDR)
    v = _verdict(_run())
    assert v.ready and _codes(v) == [("nic_link_degraded", "mlx5_1/1", True)]
    assert "200 Gb/s, below its peers' 400 Gb/s" in v.warnings[0].message


def test_a_port_below_min_rate_gbps_is_a_blocker(tree: SysfsTree,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    tree.ib_port("mlx5_0", rate=HDR)
    _settings(monkeypatch, min_rate_gbps=400)
    v = _verdict(_run())
    assert _codes(v) == [("nic_link_degraded", "mlx5_0/1", False)]
    assert "below min_rate_gbps 400" in v.blockers[0].message


def test_a_netdev_is_not_a_slower_peer_of_an_ib_port(tree: SysfsTree) -> None:
    tree.ib_port("mlx5_0")
    tree.netdev("eth2", speed_mbps=200000, rdma=True, bus_id="0000:31:00.0")
    assert _codes(_verdict(_run())) == []


def _flap(tree: SysfsTree, daemon: _Daemon, times: int) -> Verdict:
    v = daemon.read()
    for _ in range(times):
        tree.ib_port("mlx5_0", state=DOWN, phys_state=POLLING)
        daemon.read()
        tree.ib_port("mlx5_0")
        v = daemon.read()
    return v


def test_a_port_that_flaps_past_the_limit_blocks_and_recovers_after_the_window(
        tree: SysfsTree, monkeypatch: pytest.MonkeyPatch) -> None:
    _settings(monkeypatch, flap_transitions=4, flap_window_s=60)
    tree.ib_port("mlx5_0")
    daemon = _Daemon()
    assert _flap(tree, daemon, 1).ready  # two changes: under the limit
    v = _flap(tree, daemon, 1)            # four within the minute
    assert _codes(v) == [("nic_link_flapping", "mlx5_0/1", False)]
    assert "changed link state 4 times in 60 s" in v.blockers[0].message
    assert daemon.read(step_s=61).ready   # steady for the window: it clears


def test_link_downs_the_reads_missed_still_count_as_flaps(
        tree: SysfsTree, monkeypatch: pytest.MonkeyPatch) -> None:
    _settings(monkeypatch, flap_transitions=6)
    tree.ib_port("mlx5_0")
    daemon = _Daemon()
    daemon.read()
    # Three downs and ups between two reads: only link_downed saw them.
    tree.ib_port("mlx5_0", counters={"link_downed": 3})
    v = daemon.read()
    assert ("nic_link_flapping", "mlx5_0/1", False) in _codes(v)


def test_rising_error_counters_warn_and_a_counter_reset_is_a_new_baseline(
        tree: SysfsTree, monkeypatch: pytest.MonkeyPatch) -> None:
    _settings(monkeypatch, errors_hold_s=30)
    tree.ib_port("mlx5_0", counters={"symbol_error": 10, "port_rcv_errors": 5})
    daemon = _Daemon()
    assert _codes(daemon.read()) == []  # the first read is the baseline, whatever it says
    tree.counter("mlx5_0", 1, "symbol_error", 17)
    v = daemon.read()
    assert v.ready and _codes(v) == [("nic_errors_rising", "mlx5_0/1", True)]
    assert "symbol_error +7" in v.warnings[0].message
    tree.counter("mlx5_0", 1, "symbol_error", 0)     # perfquery -R, a driver reload
    tree.counter("mlx5_0", 1, "port_rcv_errors", 0)
    assert _codes(daemon.read(step_s=31)) == []      # a reset is no growth; the hold passed
    tree.counter("mlx5_0", 1, "symbol_error", 2)     # growth from the new baseline
    assert _codes(daemon.read()) == [("nic_errors_rising", "mlx5_0/1", True)]


def test_a_netdev_without_carrier_is_down_and_its_carrier_changes_count_as_flaps(
        tree: SysfsTree, monkeypatch: pytest.MonkeyPatch) -> None:
    _settings(monkeypatch, expect=["eth2"], flap_transitions=4)
    tree.netdev("eth2", carrier_changes=2)
    daemon = _Daemon()
    assert daemon.read().ready
    tree.netdev("eth2", up=False, carrier_changes=7)  # five changes between two reads
    assert _codes(daemon.read()) == [("nic_link_down", "eth2", False),
                                     ("nic_link_flapping", "eth2", False)]


@pytest.mark.parametrize("raw, needle", [
    ({"expect": "mlx5_0/1"}, "expect = 'mlx5_0/1': expected a list of port names"),
    ({"expect": [""]}, "expected a list of port names"),
    ({"min_rate_gbps": 0}, "min_rate_gbps = 0: expected a positive number"),
    ({"flap_transitions": 1}, "flap_transitions = 1"),
    ({"flap_window_s": "1m"}, "flap_window_s = '1m'"),
])
def test_bad_nic_settings_are_refused_naming_the_key(raw: Mapping[str, Any],
                                                     needle: str) -> None:
    with pytest.raises(NicPolicyError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        parse_policy(raw)


def _gpudiag(env: Mapping[str, str], *args: str) -> Any:
    import os
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "gpudiag", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env})


def test_probe_and_preflight_read_expected_ports_from_config(tree: SysfsTree,
                                                             tmp_path: Path) -> None:
    tree.ib_port("mlx5_0")
    tree.ib_port("mlx5_1", state=DOWN, phys_state=DISABLED)
    cfg = tmp_path / "gpudiag.toml"
    cfg.write_text('[backends.nic]\nexpect = ["mlx5_0/1", "mlx5_1/1"]\n')
    probe = _gpudiag({}, "probe", "--backend", "nic", "--config", str(cfg), "--json")
    assert probe.returncode == 1, probe.stderr
    record = json.loads(probe.stdout)
    assert record["gpu_validation_blocker"] == "nic_link_down"
    assert record["backends"]["nic"]["detail"]["expected"] == ["mlx5_0/1", "mlx5_1/1"]
    pre = _gpudiag({}, "preflight", "--require", "nic", "--no-daemon", "--config", str(cfg),
                   "--format", "json")
    assert pre.returncode == 1 and json.loads(pre.stdout)["blockers"][0]["device"] == "mlx5_1/1"
    # Without the config, the port that was never up is nobody's: ready.
    assert _gpudiag({}, "probe", "--backend", "nic").returncode == 0


def test_a_bad_config_is_a_usage_error_naming_the_key(tree: SysfsTree, tmp_path: Path) -> None:
    cfg = tmp_path / "gpudiag.toml"
    cfg.write_text('[backends.nic]\nexpect = "mlx5_0/1"\n')
    out = _gpudiag({}, "probe", "--backend", "nic", "--config", str(cfg))
    assert out.returncode == 2 and "backends.nic.expect" in out.stderr
    assert "Traceback" not in out.stderr


# -- which GPU uses which NIC --------------------------------------------------------------------
HOST0, HOST1 = "pci0000:00", "pci0000:80"
SWITCH = (HOST0, "0000:00:01.0", "0000:01:00.0")  # a root port, then a PCIe switch


def test_each_port_names_how_near_each_gpu_is_on_the_pci_bus(tree: SysfsTree) -> None:
    tree.gpu("0000:03:00.0", under=(*SWITCH, "0000:02:00.0"))       # behind the NIC's switch
    tree.gpu("0000:05:00.0", under=(HOST0, "0000:00:02.0"))          # another root port
    tree.gpu("0000:41:00.0", under=("pci0000:40",))                  # another bridge, node 0
    tree.gpu("0000:81:00.0", numa_node=1, under=(HOST1,))            # the other socket
    tree.ib_port("mlx5_0", bus_id="0000:04:00.0", under=(*SWITCH, "0000:02:04.0"))
    port = _run().parsed.ports[0]  # type: ignore[union-attr]
    assert dict(port.gpus) == {"0000:03:00.0": "PIX", "0000:05:00.0": "PHB",
                               "0000:41:00.0": "NODE", "0000:81:00.0": "SYS"}
    detail = _verdict(_run()).backends["nic"].detail["ports"]
    assert detail[0]["gpus"]["0000:03:00.0"] == "PIX"


def test_a_port_without_a_pci_function_names_no_gpu(tree: SysfsTree) -> None:
    tree.gpu("0000:03:00.0")
    tree.netdev("veth0", bus_id=None)
    assert dict(_run().parsed.ports[0].gpus) == {}  # type: ignore[union-attr]


def test_probe_wide_shows_the_ports_and_the_gpus_behind_their_switch(
        tree: SysfsTree, tmp_path: Path) -> None:
    tree.gpu("0000:03:00.0", under=(*SWITCH, "0000:02:00.0"))
    tree.ib_port("mlx5_0", bus_id="0000:04:00.0", under=(*SWITCH, "0000:02:04.0"))
    tree.ib_port("mlx5_1", state=DOWN, phys_state=POLLING, bus_id="0000:84:00.0",
                 under=(HOST1,))
    out = _gpudiag({}, "probe", "--backend", "nic", "--wide")
    assert out.returncode == 0, out.stderr
    lines = {line.split()[0]: line.split() for line in out.stdout.splitlines()
             if line.startswith("mlx5_")}
    assert lines["mlx5_0/1"][:5] == ["mlx5_0/1", "up", "400", "Gb/s", "yes"]
    assert lines["mlx5_0/1"][-1] == "03:00.0"
    assert lines["mlx5_1/1"][1] == "down" and lines["mlx5_1/1"][-1] == "-"
    assert "Ports" not in _gpudiag({}, "probe", "--backend", "nic").stdout


# -- remediation: NIC codes drain only with [remediation] drain_on_nic -----------------------
def test_nic_codes_drain_only_when_the_operator_says_so() -> None:
    from gpudiag.core.catalog import NIC_DRAINS, drains

    assert NIC_DRAINS == {"nic_link_down", "nic_link_flapping"}
    for code in ("nic_link_down", "nic_link_flapping", "nic_link_degraded", "nic_errors_rising"):
        assert not drains(code), code
        assert drains(code, drain_on_nic=True) == (code in NIC_DRAINS), code
    assert not drains("cuda_init_failed", drain_on_nic=True)


def test_drain_on_nic_is_off_by_default_and_checked() -> None:
    from gpudiag.daemon.config import ConfigError, from_mapping

    assert from_mapping({}).remediation.drain_on_nic is False
    assert from_mapping({"remediation": {"drain_on_nic": True}}).remediation.drain_on_nic
    with pytest.raises(ConfigError, match="drain_on_nic"):
        from_mapping({"remediation": {"drain_on_nic": "yes"}})


def test_the_actor_sees_a_port_down_as_a_fault_only_with_drain_on_nic(
        tree: SysfsTree, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpudiag.core.remediation import Fault
    from gpudiag.daemon.remediation import snapshot_faults
    from gpudiag.daemon.snapshot import ProbeKey, ProbeResult, Snapshot, WatcherState

    tree.ib_port("mlx5_0", state=DOWN, phys_state=POLLING)
    _settings(monkeypatch, expect=["mlx5_0/1"])
    run = _run()
    verdict = _verdict(run)
    assert verdict.gpu_validation_blocker == "nic_link_down"
    key = ProbeKey.of("nic")
    snap = Snapshot(seq=1, published_wall=1000.0, results={key: ProbeResult(key, run, 990.0,
                                                                            991.0)},
                    stats={}, scheduled=(key,), watcher=WatcherState(), full=verdict,
                    ready=verdict)
    assert snapshot_faults(snap) == ((), None)
    faults, _ = snapshot_faults(snap, drain_on_nic=True)
    assert faults == (Fault("nic_link_down", None, 990.0),)


# -- firmware drift ----------------------------------------------------------------------------
def test_an_hca_on_other_firmware_than_its_peers_is_config_drift(tree: SysfsTree) -> None:
    for i in range(3):
        tree.ib_port(f"mlx5_{i}", fw_ver="28.38.1000" if i == 2 else "28.39.1002")
    v = _verdict(_run())
    assert v.ready and _codes(v) == [("nic_config_drift", "mlx5_2", True)]
    assert "fw_ver 28.38.1000" in v.warnings[0].message and "28.39.1002 (2 of 3)" in \
        v.warnings[0].message


def test_two_hcas_that_differ_name_no_majority(tree: SysfsTree) -> None:
    tree.ib_port("mlx5_0", fw_ver="28.38.1000")
    tree.ib_port("mlx5_1", fw_ver="28.39.1002")
    assert _codes(_verdict(_run())) == []


def test_only_rdma_and_expected_ports_are_shown_so_pod_veths_add_nothing(
        tree: SysfsTree, monkeypatch: pytest.MonkeyPatch) -> None:
    tree.ib_port("mlx5_0")
    for i in range(3):
        tree.netdev(f"veth{i}", bus_id=None)
    tree.netdev("eth9", bus_id="0000:01:00.0")
    _settings(monkeypatch, expect=["mlx5_0/1", "eth9"])
    shown = _verdict(_run()).backends["nic"].detail["ports"]
    assert [p["port"] for p in shown] == ["mlx5_0/1", "eth9"]


# -- --gpus N prefers GPUs whose NICs are up ------------------------------------------------------
SWITCH_A = (HOST0, "0000:00:01.0", "0000:01:00.0")
SWITCH_B = (HOST0, "0000:00:02.0", "0000:02:00.0")


def test_a_job_on_n_gpus_gets_those_whose_nearest_nic_is_up(
        tree: SysfsTree, fakes: FakeDriver, tmp_path: Path) -> None:
    # The fake NVML's GPUs 0 and 1 sit at 18:00.0 and 19:00.0, each behind its own PCIe
    # switch with an HCA; GPU 0's HCA trains at HDR beside an NDR peer (a warning).
    tree.gpu("0000:18:00.0", under=(*SWITCH_A, "0000:03:00.0"))
    tree.gpu("0000:19:00.0", under=(*SWITCH_B, "0000:04:00.0"))
    tree.ib_port("mlx5_0", rate=HDR, bus_id="0000:05:00.0", under=(*SWITCH_A, "0000:03:01.0"))
    tree.ib_port("mlx5_1", bus_id="0000:06:00.0", under=(*SWITCH_B, "0000:04:01.0"))
    cfg = tmp_path / "gpudiag.toml"
    cfg.write_text('[backends.nic]\nexpect = ["mlx5_0/1", "mlx5_1/1"]\n')
    env = host_env(fakes, tmp_path / "host", gpus=2, FAKE_NVML_DEVICE_COUNT=2,
                   FAKE_CUDA_DEVICE_COUNT=2)
    out = _gpudiag({**env, **tree.env()}, "preflight", "--require", "cuda,nic", "--gpus", "1",
                   "--no-daemon", "--config", str(cfg), "--format", "json")
    assert out.returncode == 0, out.stdout + out.stderr
    record = json.loads(out.stdout)
    assert [(w["code"], w["device"]) for w in record["warnings"]] == [
        ("nic_link_degraded", "mlx5_0/1")]
    selected = {d["index"]: d for d in record["devices"]}
    assert [i for i, d in selected.items() if d.get("selected")] == [1]
    assert "its NIC mlx5_0/1 down or degraded" in selected[0]["selection"]
    assert selected[1]["selection"].startswith("chosen: healthy and free, no warning")
