"""What nvidia-smi and nvitop users expect of `gpudiag probe` (issue 30): who uses a busy GPU
(process name, user, GPU memory), a lost GPU's PCI bus id, full UUIDs on request, and UUIDs
that differ only at the end told apart at 80 columns."""

from __future__ import annotations

import getpass
import io
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpudiag.cli.render import render_text
from gpudiag.core.missing import sysfs_bus_ids
from gpudiag.core.requirement import parse_requirement
from gpudiag.core.verdict import DeviceInfo, DeviceProcess, Verdict
from tests.fakes.build import FakeDriver, write_state_file
from tests.support.daemon import Daemon, daemon_toml, host_env, wait_for, write_config
from tests.support.host import EnvFactory, run_gpudiag
from tests.support.tty import run_on_tty

PROBE = ["probe", "--backend", "host,nvml,cuda"]


@pytest.fixture
def job() -> Iterator[int]:
    """Another user's job: a real process with a name of its own."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def _section(text: str, title: str) -> list[str]:
    """The rows of a table of the text output, below its rule line."""
    body = text.split(f"\n{title}", 1)[1].split("─\n", 1)[1]
    rows = []
    for line in body.splitlines():
        if not line.startswith(" "):
            break
        rows.append(line)
    return rows


@pytest.mark.parametrize("columns", [80, 120])
def test_a_busy_gpu_shows_each_process_with_its_user_memory_and_command(
        gpu_env: EnvFactory, job: int, columns: int) -> None:
    env = gpu_env(FAKE_NVML_PROCESSES=f"2:{job}:20000,5:{job}:512",
                  FAKE_NVML_MEMORY_USED_MIB="2:20000,5:512")
    rc, text = run_on_tty([sys.executable, "-m", "gpudiag", *PROBE], env, columns=columns)
    assert rc == 0, text
    out = text[text.index("host "):]
    assert [line for line in out.splitlines() if len(line.rstrip()) > columns] == []
    processes = [r.split() for r in _section(out, "Processes")]
    me = getpass.getuser()
    assert [r[:5] for r in processes] == [["2", str(job), me, "19.5", "GiB"],
                                          ["5", str(job), me, "512.0", "MiB"]], out
    assert all(r[5].startswith("python") for r in processes), out  # its command name
    devices = {r.split()[0]: r for r in _section(out, "Devices")}
    assert re.search(rf"busy pid {job}\s", devices["2"]), devices["2"]


def test_the_record_carries_the_processes_and_reads_back(gpu_env: EnvFactory, job: int) -> None:
    env = gpu_env(FAKE_NVML_PROCESSES=f"2:{job}:20000", FAKE_NVML_MEMORY_USED_MIB="2:20000")
    proc = run_gpudiag([*PROBE, "--format", "json"], env)
    record = json.loads(proc.stdout)
    procs = record["devices"][2]["processes"]
    assert procs == [{"pid": job, "used_memory_bytes": 20000 * 2**20,
                      "name": procs[0]["name"], "user": getpass.getuser()}]
    assert procs[0]["name"].startswith("python")
    assert DeviceInfo.from_record(record["devices"][2]).processes == (
        DeviceProcess(job, 20000 * 2**20, procs[0]["name"], getpass.getuser()),)
    assert record["devices"][0]["processes"] == []


def test_a_process_named_like_markup_is_shown_as_named() -> None:
    dev = DeviceInfo(0, "GPU-f00d0000-0000-4000-8000-000000000000", "H200", None, None, None,
                     occupancy="busy", healthy=True, pids=(7,),
                     processes=(DeviceProcess(7, 2**20, "[red]x[/]", "[b]"),))
    assert re.search(r"^\s+0\s+7\s+\[b\]\s+1\.0 MiB\s+\[red\]x\[/\]$", _render(dev), re.M)


def test_a_process_hidden_by_proc_shows_its_pid_and_memory_and_says_why() -> None:
    dev = DeviceInfo(0, "GPU-f00d0000-0000-4000-8000-000000000000", "H200", None, None, None,
                     occupancy="busy", healthy=True, pids=(4242,),
                     processes=(DeviceProcess(4242, 2**30),))
    text = _render(dev)
    assert re.search(r"^\s+0\s+4242\s+-\s+1\.0 GiB\s+-$", text, re.M), text
    assert "ProtectProc" in " ".join(text.split())


def test_a_lost_gpu_keeps_the_pci_bus_id_sysfs_knows(gpu_env: EnvFactory,
                                                     tmp_path: Path) -> None:
    from tests.fakes.sysfs import make_pci_tree

    env = gpu_env(FAKE_NVML_DEVICE_ERRORS="1:15")
    env["GPUDIAG_SYSFS_PCI_DIR"] = str(make_pci_tree(tmp_path / "pci", 8))
    env["COLUMNS"] = "80"
    proc = run_gpudiag(PROBE, env)
    assert proc.returncode == 1
    rows = {r.split()[0]: r for r in _section(proc.stdout, "Devices")}
    assert rows["1"].split()[1:4] == ["lost", "-", "19:00.0"], proc.stdout
    record = json.loads(run_gpudiag([*PROBE, "--format", "json"], env).stdout)
    assert record["devices"][1]["pci_bus_id"] == "00000000:19:00.0"
    assert record["devices"][1]["uuid"] is None  # NVML cannot say: nothing is made up


def test_the_daemon_names_a_lost_gpu_by_its_last_uuid_and_bus_id(fakes: FakeDriver,
                                                                tmp_path: Path) -> None:
    uuid1 = "GPU-f00d0001-0000-4000-8000-000000000001"
    state_file = tmp_path / "gpu-state"
    write_state_file(state_file, {"FAKE_NVML_DEVICE_COUNT": 2})
    # No sysfs PCI tree here: the bus id of the lost GPU can only come from memory.
    env = host_env(fakes, tmp_path / "host", gpus=2, FAKE_GPU_STATE_FILE=str(state_file))
    state = tmp_path / "state"
    daemon = Daemon(env, write_config(tmp_path / "gpudiag.toml", daemon_toml({})), state)
    try:
        daemon.wait_ready()  # GPU 1 read fine: the daemon has seen its UUID
        write_state_file(state_file, {"FAKE_NVML_DEVICE_COUNT": 2,
                                      "FAKE_NVML_DEVICE_ERRORS": "1:15"})

        def lost() -> dict[str, Any] | None:
            status, rec = daemon.get("/v1/health")
            return rec if status == 200 and any(
                b["code"] == "gpu_lost" for b in rec["blockers"]) else None

        health = wait_for(lost, 15, interval=0.1)
        gpu0, gpu1 = health["devices"]
        assert (gpu1["uuid"], gpu1["uuid_source"], gpu1["pci_bus_id"]) == (
            uuid1, "last_seen", "00000000:19:00.0"), gpu1
        assert gpu1["healthy"] is False and gpu0["uuid_source"] == "nvml"
        assert [b["device"] for b in health["blockers"]] == [uuid1]
        status, pre = daemon.get("/v1/preflight?require=cuda")
        assert status == 200 and [(b["code"], b["device"]) for b in pre["blockers"]] == [
            ("gpu_lost", uuid1)]
        assert pre["devices"][1]["uuid_source"] == "last_seen"
        # `probe` always probes here; `health` is the text a daemon answers.
        text = run_gpudiag(["health", "--daemon-url", daemon.url],
                           {**env, "COLUMNS": "80"})
        assert text.returncode == 1, text.stdout + text.stderr
        rows = {r.split()[0]: r.split() for r in _section(text.stdout, "Devices")}
        assert rows["1"][1] == "lost" and uuid1.startswith(rows["1"][2].rstrip("…"))
        assert rows["1"][3] == "19:00.0" and "source daemon" in text.stdout, text.stdout
        said = " ".join(text.stdout.split())
        assert "uuid of GPU 1: as last seen (NVML cannot read it now)" in said
        proc = run_gpudiag(["clear", "--gpu", uuid1, "--reason", "reseated GPU 1",
                            "--state-dir", str(state)], env)
        assert proc.returncode == 0 and f"clear of {uuid1} requested" in proc.stdout, proc.stderr
    finally:
        assert daemon.stop() == 0


def test_no_pci_bus_id_is_guessed_when_the_bus_and_nvml_disagree() -> None:
    host = {"pci": {"available": True, "gpus": [{"address": f"0000:{b:02x}:00.0"}
                                                for b in (0x18, 0x19, 0x1a)]}}
    lost = {"index": 1, "pci_bus_id": None}
    nvml = {"ok": True, "device_count": 3, "devices": [
        {"index": 0, "pci_bus_id": "00000000:18:00.0"}, lost,
        {"index": 2, "pci_bus_id": "00000000:1A:00.0"}]}
    assert sysfs_bus_ids(host, nvml) == {1: "00000000:19:00.0"}
    assert sysfs_bus_ids(host, {**nvml, "device_count": 2}) == {}  # a GPU NVML lacks
    swapped = {**nvml, "devices": [{"index": 0, "pci_bus_id": "00000000:1A:00.0"}, lost,
                                   {"index": 2, "pci_bus_id": "00000000:18:00.0"}]}
    assert sysfs_bus_ids(host, swapped) == {}  # not in bus order


def test_wide_prints_full_uuids(gpu_env: EnvFactory) -> None:
    env = gpu_env()
    env["COLUMNS"] = "80"
    proc = run_gpudiag([*PROBE, "--wide"], env)
    rows = _section(proc.stdout, "Devices")
    assert [r.split()[2] for r in rows] == [
        f"GPU-f00d{i:04x}-0000-4000-8000-{i:012x}" for i in range(8)], proc.stdout
    short = _section(run_gpudiag(PROBE, env).stdout, "Devices")
    assert [r.split()[2] for r in short] == [f"GPU-f00d{i:04x}" for i in range(8)]


@pytest.mark.parametrize("command", [["preflight", "--require", "cuda", "--no-daemon"],
                                     ["health", "--require", "cuda", "--no-daemon"]])
def test_wide_prints_full_uuids_in_preflight_and_health_without_watch(
        gpu_env: EnvFactory, command: list[str]) -> None:
    env = gpu_env()
    env["COLUMNS"] = "80"
    wide = _section(run_gpudiag([*command, "--wide"], env).stdout, "Devices")
    assert [r.split()[2] for r in wide] == [
        f"GPU-f00d{i:04x}-0000-4000-8000-{i:012x}" for i in range(8)], wide
    short = _section(run_gpudiag(command, env).stdout, "Devices")
    assert [r.split()[2] for r in short] == [f"GPU-f00d{i:04x}" for i in range(8)], short


def _render(*devices: DeviceInfo, columns: int = 80) -> str:
    verdict = Verdict(requirement=parse_requirement("nvml", node_health=True), blockers=(),
                      warnings=(), devices=devices, backends={}, evidence={},
                      preallocation_disabled=True, host="h", checked_at="t")
    out = io.StringIO()
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(columns)
    try:
        render_text(verdict, out, color=False)
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old
    return out.getvalue()


def test_uuids_that_differ_only_at_the_end_stay_apart_at_80_columns() -> None:
    uuids = [f"GPU-5f3a2b1c-1111-4000-8000-00000000000{i}" for i in range(8)]
    devices = [DeviceInfo(i, u, "NVIDIA H200", f"00000000:{0x18 + i:02X}:00.0", 2**37, 2**37,
                          occupancy="free", healthy=True, memory_used_bytes=0,
                          utilization_ratio=0.0, temperature_c=35.0)
               for i, u in enumerate(uuids)]
    text = _render(*devices)
    assert [line for line in text.splitlines() if len(line) > 80] == []
    rows = _section(text, "Devices: 8 x NVIDIA H200, 128.0 GiB each")
    assert [r.split()[1:3] for r in rows] == [["ready", f"GPU-5f3a2b1c…000{i}"]
                                              for i in range(8)], text
