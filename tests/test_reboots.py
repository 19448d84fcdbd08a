"""Issue 52: reboot-class faults heal after a reboot, with no `gpudiag clear`.

A real `gpudiag serve` on the fakes, stopped and started again; the boot id comes from
GPUDIAG_BOOT_ID_FILE, so a "reboot" is a new id in that file. Same boot: held. A new boot
with the fault still there: held. A new boot and healthy fakes: released by the first fresh
pass, recorded as the daemon's own clear. The drain side (remediation resuming its own
drain) is in tests/test_remediation_slurm.py against a real slurmctld.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from gpudiag.core.findings import XidEvent
from gpudiag.core.xids import XIDS
from gpudiag.daemon.bootid import ENV, boot_id
from gpudiag.daemon.reboots import BootFacts, note_boot, reboot_candidates
from gpudiag.daemon.store import HistoryStore, default_path
from tests.fakes.build import FakeDriver, write_state_file
from tests.support.daemon import (
    Daemon,
    daemon_toml,
    host_env,
    metric_samples,
    wait_for,
    write_config,
)

UUID1 = "GPU-f00d0001-0000-4000-8000-000000000001"
BOOT_A, BOOT_B, BOOT_C = ("aaaaaaaa-0000-4000-8000-00000000000a",
                          "bbbbbbbb-0000-4000-8000-00000000000b",
                          "cccccccc-0000-4000-8000-00000000000c")


# -- the boot id and the history's boots -------------------------------------------------------
def test_the_boot_id_is_the_kernels_unless_a_test_names_a_file(tmp_path: Path) -> None:
    assert boot_id({}) == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    f = tmp_path / "boot_id"
    f.write_text(BOOT_A + "\n")
    assert boot_id({ENV: str(f)}) == BOOT_A
    f.write_text("not a boot id\n")
    assert boot_id({ENV: str(f)}) is None
    assert boot_id({ENV: str(tmp_path / "missing")}) is None


def test_each_held_xid_knows_its_boot_and_only_an_earlier_boot_heals(tmp_path: Path) -> None:
    store = HistoryStore(default_path(tmp_path))
    assert note_boot(store, BOOT_A, 100.0) == BootFacts(BOOT_A, True)
    assert note_boot(store, BOOT_A, 150.0) == BootFacts(BOOT_A, False)  # a restart, same boot
    lost, ecc, app = (XidEvent(79, 1, UUID1, 200.0), XidEvent(48, 1, UUID1, 201.0),
                      XidEvent(13, 1, UUID1, 202.0))
    unknown_gpu = XidEvent(79, 1, None, 203.0)
    held = [lost, ecc, app, unknown_gpu]
    assert reboot_candidates(store, held, BOOT_A) == []
    assert note_boot(store, BOOT_B, 300.0) == BootFacts(BOOT_B, True)
    # Only what a reboot repairs, of a GPU known by its UUID, from the earlier boot.
    assert reboot_candidates(store, held, BOOT_B) == [lost]
    assert reboot_candidates(store, [XidEvent(79, 1, UUID1, 50.0)], BOOT_B) == []  # unknown
    assert reboot_candidates(store, held, None) == []
    store.close()


def test_the_catalog_says_which_xids_a_reboot_heals() -> None:
    healed = sorted(x for x, e in XIDS.items() if e.reboot_heals)
    assert healed == [79, 110, 151, 159, 168]
    assert not XIDS[54].reboot_heals  # aux power cables: a reboot does not connect them


# -- a real daemon, restarted across "reboots" --------------------------------------------------
@pytest.fixture
def node(fakes: FakeDriver, tmp_path: Path) -> dict[str, Any]:
    state_file = tmp_path / "gpu-state"
    write_state_file(state_file, {"FAKE_NVML_DEVICE_COUNT": 2})
    boot = tmp_path / "boot_id"
    env = host_env(fakes, tmp_path / "host", gpus=2, FAKE_GPU_STATE_FILE=str(state_file),
                   GPUDIAG_BOOT_ID_FILE=str(boot))
    return {"env": env, "state_file": state_file, "state": tmp_path / "state",
            "tmp": tmp_path, "boot": boot}


SMALL_GPU: dict[str, str | int] = {  # qualification on the fakes: small, no data-sheet row
    "FAKE_GPU_MEMORY_TOTAL_MIB": 80, "FAKE_CUDA_CONTEXT_MIB": 1, "FAKE_GPU_NAME": "Fake GPU"}


def _start(node: dict[str, Any], boot: str, qualify: bool = False,
           **fakes: str | int) -> Daemon:
    node["boot"].write_text(boot + "\n")
    write_state_file(node["state_file"], {"FAKE_NVML_DEVICE_COUNT": 2, **SMALL_GPU, **fakes})
    # With qualification on, nothing is due on its schedule (idle_s): only what is asked for.
    qualification = ({"enabled": True, "idle_s": 3600, "tick_s": 0.1} if qualify
                     else {"enabled": False})
    toml = daemon_toml({"xid": {"hold_s": 3600}, "qualification": qualification})
    return Daemon.ready(node["env"], write_config(node["tmp"] / "gpudiag.toml", toml),
                        node["state"])


def _health(daemon: Daemon) -> dict[str, Any]:
    status, body = daemon.get("/v1/health")
    assert status == 200, body
    assert isinstance(body, dict)
    return body


def _xid_79_held(body: dict[str, Any]) -> bool:
    return any(b["code"] == "gpu_lost" and "XID 79" in b["message"] and b["device"] == UUID1
               for b in body["blockers"])


def _after_a_fresh_pass(daemon: Daemon) -> dict[str, Any]:
    """/v1/health once the first round after the start (host, nvml, cuda) is in."""
    started = time.time()
    wait_for(lambda: _health(daemon).get("fresh", True) and time.time() - started > 1.5, 10)
    return _health(daemon)


def _clears(node: dict[str, Any]) -> list[tuple[str | None, str]]:
    db = sqlite3.connect(default_path(node["state"]))
    try:
        return [(r[0], str(r[1])) for r in db.execute("SELECT gpu, reason FROM clears")]
    except sqlite3.OperationalError:
        return []  # no clear yet: the table is made with the first
    finally:
        db.close()


def test_a_reboot_class_hold_is_kept_in_its_boot_and_healed_by_a_reboot_and_a_clean_pass(
        node: dict[str, Any]) -> None:
    daemon = _start(node, BOOT_A)
    try:
        write_state_file(node["state_file"], {"FAKE_NVML_DEVICE_COUNT": 2, **SMALL_GPU,
                                              "FAKE_NVML_XIDS": "1:79"})
        wait_for(lambda: _xid_79_held(_health(daemon)), 15)
        wait_for(lambda: any("XID 79" in line for line in daemon.lines), 5)
        time.sleep(0.3)  # kept in the history on its writer thread
    finally:
        assert daemon.stop() == 0
    # A restart of the daemon alone, in the same boot: still held.
    daemon = _start(node, BOOT_A)
    try:
        assert _xid_79_held(_after_a_fresh_pass(daemon))
    finally:
        assert daemon.stop() == 0
    # A reboot, but GPU 1 still fails (NVML's recovery action: reset it): held, said why.
    daemon = _start(node, BOOT_B, FAKE_NVML_RECOVERY_ACTION="1:1")
    try:
        body = _after_a_fresh_pass(daemon)
        assert _xid_79_held(body), body["blockers"]
        wait_for(lambda: any("still finds a fault" in line for line in daemon.lines), 10)
        assert _clears(node) == []
    finally:
        assert daemon.stop() == 0
    # Another reboot, and the GPU is healthy: released by the first fresh pass, no clear.
    daemon = _start(node, BOOT_C)
    try:
        wait_for(lambda: _health(daemon)["gpu_validation_blocker"] == "none", 15)
        assert _health(daemon)["ready"] is True
        ((gpu, reason),) = _clears(node)
        assert gpu == UUID1 and reason.startswith(f"rebooted (boot {BOOT_C})")
        assert any("released without a person" in line for line in daemon.lines)
    finally:
        assert daemon.stop() == 0
    # Released for good: the next start (same boot) holds nothing again.
    daemon = _start(node, BOOT_C)
    try:
        assert _after_a_fresh_pass(daemon)["gpu_validation_blocker"] == "none"
    finally:
        assert daemon.stop() == 0


def test_with_qualification_on_the_quick_tier_runs_before_the_reboot_releases_a_hold(
        node: dict[str, Any]) -> None:
    daemon = _start(node, BOOT_A)
    try:
        write_state_file(node["state_file"], {"FAKE_NVML_DEVICE_COUNT": 2, **SMALL_GPU,
                                              "FAKE_NVML_XIDS": "1:79"})
        wait_for(lambda: _xid_79_held(_health(daemon)), 15)
        wait_for(lambda: any("XID 79" in line for line in daemon.lines), 5)
        time.sleep(0.3)
    finally:
        assert daemon.stop() == 0
    daemon = _start(node, BOOT_B, qualify=True)
    try:
        wait_for(lambda: _health(daemon)["gpu_validation_blocker"] == "none", 90, interval=0.2)
        runs = sum(v for _, v in metric_samples(daemon, "gpudiag_qualification_runs_total"))
        assert runs >= 1
        ((gpu, reason),) = _clears(node)
        assert gpu == UUID1 and reason.startswith(f"rebooted (boot {BOOT_B})")
        released = next(i for i, line in enumerate(daemon.lines)
                        if "released without a person" in line)
        qualified = next(i for i, line in enumerate(daemon.lines) if "qualif" in line.lower())
        assert qualified < released
    finally:
        assert daemon.stop() == 0
