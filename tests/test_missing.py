"""gpu_missing: GPUs on the PCI bus (or expected) that NVML does not show, CLI and daemon."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpudiag.core.missing import pci_address
from gpudiag.daemon.config import ConfigError, from_mapping
from gpudiag.probes.host import pci_gpus
from tests.fakes.build import FakeDriver
from tests.fakes.sysfs import make_pci_tree
from tests.fakes.sysfs import pci_address as fake_address
from tests.support.daemon import Daemon, daemon_toml, host_env, write_config
from tests.support.host import run_gpudiag, verdict_of

PROBE = ["probe", "--backend", "host,nvml,cuda", "--json"]


def test_the_host_probe_counts_nvidia_display_and_3d_controllers_only(tmp_path: Path) -> None:
    tree = make_pci_tree(tmp_path / "devices", gpus=2)
    make_pci_tree(tmp_path / "vga", gpus=1, klass="0x030000")
    seen = pci_gpus(str(tree))
    assert seen["available"] and seen["error"] is None
    # Not the Intel bridge, not the GPU's audio function, not the NVSwitch.
    assert [(g["address"], g["driver"]) for g in seen["gpus"]] == [
        ("0000:18:00.0", "nvidia"), ("0000:19:00.0", "nvidia")]
    assert [g["class"] for g in pci_gpus(str(tmp_path / "vga"))["gpus"]] == ["0x030000"]


def test_an_unreadable_or_switched_off_pci_folder_counts_nothing(tmp_path: Path) -> None:
    gone = pci_gpus(str(tmp_path / "absent"))
    assert not gone["available"] and "absent" in gone["error"] and gone["gpus"] == []
    off = pci_gpus("")
    assert not off["available"] and "GPUDIAG_SYSFS_PCI_DIR" in off["error"]


@pytest.mark.parametrize(("bus_id", "address"), [
    ("00000000:18:00.0", "0000:18:00.0"), ("0000:1F:00.0", "0000:1f:00.0"),
    ("0001:c1:1f.7", "0001:c1:1f.7"), ("GPU-x", None), ("18:00.0", None)])
def test_nvml_and_sysfs_pci_addresses_compare_alike(bus_id: str, address: str | None) -> None:
    assert pci_address(bus_id) == address


def _pci_env(fakes: FakeDriver, tmp_path: Path, pci_gpus: int, **knobs: str | int
             ) -> dict[str, str]:
    env = host_env(fakes, tmp_path / "host", gpus=8, **knobs)
    env["GPUDIAG_SYSFS_PCI_DIR"] = str(make_pci_tree(tmp_path / "pci", gpus=pci_gpus))
    return env


def test_cli_names_the_pci_gpu_that_nvml_lost_without_expected_gpus(
        fakes: FakeDriver, tmp_path: Path) -> None:
    code, rec = verdict_of(PROBE, _pci_env(fakes, tmp_path, 8, FAKE_NVML_DEVICE_COUNT=7))
    assert code == 1 and rec["gpu_validation_blocker"] == "gpu_missing"
    msg = rec["blockers"][0]["message"]
    assert fake_address(7) in msg and fake_address(6) not in msg.split("not shown")[-1]
    assert "8 NVIDIA GPU(s) on the PCI bus, NVML shows 7" in msg and "cuInit 7" in msg


def test_cli_is_ready_when_pci_and_nvml_agree(fakes: FakeDriver, tmp_path: Path) -> None:
    code, rec = verdict_of(PROBE, _pci_env(fakes, tmp_path, 8))
    assert code == 0 and rec["ready"], rec["blockers"]


def test_a_gpu_passed_through_to_a_vm_is_not_missing(fakes: FakeDriver, tmp_path: Path) -> None:
    env = _pci_env(fakes, tmp_path, 2, FAKE_NVML_DEVICE_COUNT=2)
    make_pci_tree(Path(env["GPUDIAG_SYSFS_PCI_DIR"]), gpus=2)
    make_pci_tree(tmp_path / "vfio", gpus=0, extra=(2,), driver="vfio-pci")
    (Path(env["GPUDIAG_SYSFS_PCI_DIR"]) / fake_address(2)).symlink_to(
        tmp_path / "vfio" / fake_address(2))
    code, rec = verdict_of(PROBE, env)
    assert code == 0, rec["blockers"]


@pytest.mark.parametrize(("expected", "ready"), [(8, True), (9, False)])
def test_cli_expected_gpus_without_a_pci_count(fakes: FakeDriver, tmp_path: Path,
                                               expected: int, ready: bool) -> None:
    env = host_env(fakes, tmp_path / "host")  # GPUDIAG_SYSFS_PCI_DIR="": no PCI count
    code, rec = verdict_of(["preflight", "--no-daemon", "--format", "json",
                            "--expected-gpus", str(expected)], env)
    assert rec["ready"] is ready and code == (0 if ready else 1)
    if not ready:
        assert rec["gpu_validation_blocker"] == "gpu_missing"
        assert "expected_gpus is 9, but only NVML 8, cuInit 8" in rec["blockers"][0]["message"]


def test_cli_refuses_a_bad_expected_gpus(fakes: FakeDriver, tmp_path: Path) -> None:
    proc = run_gpudiag(["preflight", "--expected-gpus", "0"], host_env(fakes, tmp_path))
    assert proc.returncode == 2 and "--expected-gpus" in proc.stderr


@pytest.mark.parametrize("value", [0, -1, "8", 2.5, True])
def test_the_daemon_config_refuses_a_bad_expected_gpus(value: object) -> None:
    with pytest.raises(ConfigError, match="expected_gpus"):
        from_mapping({"expected_gpus": value})
    assert from_mapping({"expected_gpus": 8}).expected_gpus == 8
    assert from_mapping({}).expected_gpus is None


@pytest.mark.parametrize(("extra", "pci", "knobs", "expect"), [
    ("", 8, {"FAKE_NVML_DEVICE_COUNT": 7}, "not shown by NVML: " + fake_address(7)),
    ("expected_gpus = 9\n", 0, {}, "expected_gpus is 9, but only PCI 0"),
], ids=["pci_against_nvml", "expected_gpus"])
def test_the_daemon_reports_gpu_missing(fakes: FakeDriver, tmp_path: Path, extra: str,
                                        pci: int, knobs: dict[str, str | int], expect: str
                                        ) -> None:
    env = _pci_env(fakes, tmp_path, pci, **knobs)
    cfg = write_config(tmp_path / "gpudiag.toml", extra + daemon_toml())
    daemon = Daemon(env, cfg, tmp_path / "state")
    try:
        daemon.wait_ready()
        status, rec = daemon.get("/v1/preflight?require=cuda&max_age_s=0")
        assert status == 200 and rec["gpu_validation_blocker"] == "gpu_missing", rec
        assert expect in rec["blockers"][0]["message"]
        _, metrics = daemon.get("/metrics")
        assert 'gpudiag_blocker{code="gpu_missing",layer="device"} 1.0' in metrics
    finally:
        assert daemon.stop() == 0
