"""The probe engine end to end: the real CLI, real probe children, the fake driver rig."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from gpudiag.core.catalog import BLOCKERS
from tests.fakes.build import FakeDriver
from tests.support.faults import FAULTS
from tests.support.host import (
    EnvFactory,
    make_host_dirs,
    processes_with_env,
    run_gpudiag,
    verdict_of,
)

ENGINE_LAYERS = ("probe", "visibility", "driver", "device", "cuda", "requirement")


# Only the daemon raises these (its XID watcher; its NVML rounds and [nvml] config; its
# qualification of idle GPUs): the fault matrix's daemon route, tests/test_xids.py and
# tests/test_qualify_verdict.py produce them end to end.
WATCHER_ONLY = frozenset({"node_reboot_required", "gpu_nvlink_down", "gpu_pcie_link_degraded",
                          "gpu_compute_mismatch", "gpu_underperforming",
                          "gpu_memory_test_failed"})
ENGINE_CODES = sorted(c for c, e in BLOCKERS.items()
                      if e.layer in ENGINE_LAYERS and c not in WATCHER_ONLY)


def test_every_engine_code_has_a_fault_case() -> None:
    assert sorted(FAULTS) == ENGINE_CODES


@pytest.mark.parametrize("code", ENGINE_CODES)
def test_each_fault_gives_its_code_end_to_end(code: str, gpu_env: EnvFactory,
                                              fakes: FakeDriver, tmp_path: Path) -> None:
    fault = FAULTS[code]
    if fault.prefix and shutil.which(fault.prefix[0]) is None:
        pytest.skip(f"{fault.prefix[0]} is not installed, so no user namespace can be made")
    env = fault.env(tmp_path, fakes, gpu_env) if fault.env else gpu_env(**fault.knobs)
    args = ["preflight", "--require", "cuda", "--format", "json", *fault.args]
    proc = subprocess.run([*fault.prefix, sys.executable, "-m", "gpudiag", *args], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 1, proc.stderr
    import json

    record = json.loads(proc.stdout)
    assert record["gpu_validation_blocker"] == code, record["blockers"]
    primary = record["blockers"][0]
    assert primary["code"] == code
    assert primary["layer"] == BLOCKERS[code].layer
    assert primary["message"] and primary["remediation"] == BLOCKERS[code].remediation
    assert record["ready"] is False


def test_healthy_fakes_are_ready_with_eight_devices(gpu_env: EnvFactory) -> None:
    rc, record = verdict_of(["preflight", "--require", "cuda", "--format", "json"], gpu_env())
    assert rc == 0, record["blockers"]
    assert record["gpu_validation_blocker"] == "none"
    assert record["ready"] is True
    assert len(record["devices"]) == 8
    assert record["devices"][3]["uuid"] == "GPU-f00d0003-0000-4000-8000-000000000003"
    assert record["devices"][0]["memory_total_bytes"] == 143771 * 2**20
    assert record["backends"]["cuda"]["status"] == "ok"
    assert record["backends"]["nvml"]["versions"]["driver"] == "570.124.06"
    assert record["evidence"]["nvidia_smi"]["exit_code"] == 0
    assert "NVIDIA H200" in record["evidence"]["nvidia_smi"]["stdout"]
    assert record["evidence"]["driver"]["kernel_module_version"] == "570.124.06"
    assert record["preallocation_disabled"] == "yes"
    assert record["warnings"] == []


def test_bare_host_names_the_missing_library_and_nvidia_smi(bare_env: dict[str, str]) -> None:
    rc, record = verdict_of(["probe", "--backend", "host,nvml,cuda", "--json"], bare_env)
    assert rc == 1
    assert record["gpu_validation_blocker"] == "driver_library_missing"
    message = record["blockers"][0]["message"]
    assert "libnvidia-ml.so.1" in message and "nvidia-smi is missing" in message
    assert record["evidence"]["nvidia_smi"]["missing"] is True
    assert "cuda_library_missing" in [b["code"] for b in record["blockers"]]


def test_probe_text_output_ends_with_the_blocker_line(bare_env: dict[str, str]) -> None:
    proc = run_gpudiag(["probe", "--backend", "host,nvml,cuda"], bare_env)
    assert proc.returncode == 1
    assert proc.stdout.rstrip().splitlines()[-1] == "gpu_validation_blocker=driver_library_missing"
    assert "Install the NVIDIA driver" in proc.stdout  # the remediation is shown


@pytest.mark.parametrize("value", ["", "-1", "NoDevFiles"])
def test_hidden_gpus_are_visible_devices_empty(value: str, gpu_env: EnvFactory) -> None:
    rc, record = verdict_of(["preflight", "--format", "json"],
                            gpu_env(CUDA_VISIBLE_DEVICES=value))
    assert rc == 1 and record["gpu_validation_blocker"] == "visible_devices_empty"


def test_a_uuid_prefix_selects_that_device_alone(gpu_env: EnvFactory) -> None:
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=2, CUDA_VISIBLE_DEVICES="GPU-f00d0001")
    rc, record = verdict_of(["preflight", "--format", "json"], env)
    assert rc == 0, record["blockers"]
    assert [d["uuid"] for d in record["devices"]] == ["GPU-f00d0001-0000-4000-8000-000000000001"]


def test_a_lost_gpu_outside_the_selected_devices_does_not_block(gpu_env: EnvFactory) -> None:
    env = gpu_env(FAKE_NVML_DEVICE_ERRORS="5:15")
    rc, record = verdict_of(["preflight", "--devices", "0,1", "--format", "json"], env)
    assert rc == 0, record["blockers"]
    rc, record = verdict_of(["preflight", "--format", "json"], env)
    assert rc == 1 and record["gpu_validation_blocker"] == "gpu_lost"
    assert record["blockers"][0]["device"] == "index 5"


def test_other_devices_are_still_reported_when_one_is_lost(gpu_env: EnvFactory) -> None:
    rc, record = verdict_of(["probe", "--backend", "nvml", "--json"],
                            gpu_env(FAKE_NVML_DEVICE_ERRORS="1:15"))
    assert rc == 1
    assert len(record["devices"]) == 8
    assert record["devices"][0]["uuid"].startswith("GPU-f00d0000")
    assert record["devices"][1]["uuid"] is None


def test_a_hung_probe_is_killed_with_its_process_group(gpu_env: EnvFactory,
                                                       tmp_path: Path) -> None:
    marker = f"GPUDIAG_TEST_MARK={uuid.uuid4().hex}"
    env = gpu_env(FAKE_NVML_INIT_HANG=1, GPUDIAG_TEST_MARK=marker.split("=")[1])
    started = time.monotonic()
    rc, record = verdict_of(["preflight", "--timeout", "1.5", "--format", "json"], env)
    assert time.monotonic() - started < 20
    assert rc == 1
    assert record["gpu_validation_blocker"] == "probe_timeout"
    assert record["blockers"][0]["backend"] == "nvml"
    # The fake's hung init left nothing behind: no process still has the fake library mapped.
    time.sleep(0.2)
    survivors = processes_with_env(marker)
    assert survivors == [], f"processes {survivors} survived"


def test_kv_format_has_the_contract_keys(gpu_env: EnvFactory) -> None:
    proc = run_gpudiag(["preflight", "--format", "kv"], gpu_env(FAKE_NVML_DEVICE_COUNT=2))
    assert proc.returncode == 0
    lines = proc.stdout.splitlines()
    assert "gpu_validation_blocker=none" in lines
    assert "preallocation_disabled=yes" in lines
    assert "devices.count=2" in lines
    assert all("=" in line for line in lines)


def test_no_secret_reaches_any_output(gpu_env: EnvFactory, tmp_path: Path) -> None:
    env = gpu_env(FAKE_NVML_INIT_ERROR=9)
    env["MY_API_TOKEN"] = "s3cr3t-value-123"
    env["CUDA_CACHE_PATH"] = str(tmp_path)  # allow-listed, to prove the list works
    record_file = tmp_path / "verdict.json"
    outputs = [run_gpudiag(["preflight", "--format", fmt, "--record", str(record_file)], env)
               for fmt in ("json", "kv", "text")]
    outputs.append(run_gpudiag(["probe", "--backend", "host,nvml,cuda", "--json"], env))
    for proc in outputs:
        assert "s3cr3t-value-123" not in proc.stdout + proc.stderr
        assert "MY_API_TOKEN" not in proc.stdout
    assert "s3cr3t-value-123" not in record_file.read_text()
    assert str(tmp_path) in outputs[0].stdout


def test_record_is_written_atomically_next_to_the_output(gpu_env: EnvFactory,
                                                        tmp_path: Path) -> None:
    import json

    target = tmp_path / "rec.json"
    proc = run_gpudiag(["preflight", "--format", "kv", "--record", str(target)], gpu_env())
    assert proc.returncode == 0
    assert json.loads(target.read_text())["gpu_validation_blocker"] == "none"
    assert [p.name for p in tmp_path.iterdir()] == ["rec.json"] or all(
        not p.name.endswith(".tmp") for p in tmp_path.iterdir())


@pytest.mark.parametrize(("args", "needle"), [
    (["preflight", "--min-free-memory", "eight"], "'eight'"),
    (["preflight", "--devices", "0,,1"], "'0,,1'"),
    (["preflight", "--timeout", "soon"], "'soon'"),
    (["preflight", "--require", "tensorflow"], "'tensorflow'"),
    (["probe", "--backend", "gpu"], "gpu"),
    (["preflight", "--format", "yaml"], "yaml"),
])
def test_bad_flags_exit_2_naming_the_value(args: list[str], needle: str,
                                           bare_env: dict[str, str]) -> None:
    proc = run_gpudiag(args, bare_env)
    assert proc.returncode == 2
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unwritable_record_path_exits_2_before_probing(gpu_env: EnvFactory) -> None:
    # Issue 16: a --record path that cannot be written is a usage error found before probing.
    proc = run_gpudiag(["preflight", "--record", "/proc/no/such/dir/x.json"], gpu_env())
    assert proc.returncode == 2
    assert proc.stdout == ""  # no probe ran, so no verdict
    assert "could not write --record" in proc.stderr and "Traceback" not in proc.stderr


def test_correctable_ecc_is_a_warning_and_one_clock_event_reading_is_none(
        gpu_env: EnvFactory) -> None:
    # A thermal clock event warns only once held past the daemon's dwell time while the GPU
    # works (tests/test_nvml_health.py): one inline reading of a working GPU cannot say so.
    env = gpu_env(FAKE_NVML_CLOCKS_EVENT_REASONS="0:0x40", FAKE_NVML_UTILIZATION="0:90",
                  FAKE_NVML_ECC_VOLATILE_CORRECTED="1:5", FAKE_NVML_PERSISTENCE="2:0")
    rc, record = verdict_of(["preflight", "--format", "json"], env)
    assert rc == 0
    codes = {w["code"] for w in record["warnings"]}
    assert {"gpu_ecc_correctable", "gpu_persistence_off"} <= codes
    assert "gpu_thermal_throttling" not in codes


def test_nvml_and_cuda_disagreeing_on_the_count_is_a_warning(gpu_env: EnvFactory) -> None:
    rc, record = verdict_of(["preflight", "--format", "json"],
                            gpu_env(FAKE_NVML_DEVICE_COUNT=4, FAKE_CUDA_DEVICE_COUNT=3))
    assert "device_count_mismatch" in {w["code"] for w in record["warnings"]}


def test_missing_nodes_with_working_inits_are_only_a_warning(gpu_env: EnvFactory,
                                                             tmp_path: Path) -> None:
    dev, proc = make_host_dirs(tmp_path / "wsl", nodes=False)
    rc, record = verdict_of(["preflight", "--format", "json"],
                            gpu_env(GPUDIAG_DEVICE_DIR=str(dev), GPUDIAG_DRIVER_PROC_DIR=str(proc)))
    assert rc == 0
    assert "device_nodes_missing" in {w["code"] for w in record["warnings"]}


def test_chatter_on_a_probe_childs_stdout_does_not_spoil_the_observation(
        gpu_env: EnvFactory, tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    # Only the probe children chatter, the way a driver library writing to fd 1 would.
    (site / "sitecustomize.py").write_text(
        "import os\n"
        "if b'gpudiag.probes' in open('/proc/self/cmdline', 'rb').read():\n"
        "    os.write(1, b'chatter from a library at start-up\\n')\n")
    env = gpu_env()
    env["PYTHONPATH"] = str(site)
    rc, record = verdict_of(["preflight", "--format", "json"], env)
    assert rc == 0, record["blockers"]
    assert record["gpu_validation_blocker"] == "none"


def test_a_hung_probe_dies_with_a_sigkilled_parent(gpu_env: EnvFactory) -> None:
    marker = uuid.uuid4().hex
    env = gpu_env(FAKE_NVML_INIT_HANG=1, GPUDIAG_TEST_MARK=marker)
    parent = subprocess.Popen(
        [sys.executable, "-c",
         "import os; from gpudiag.engine.isolation import run_probe; "
         "run_probe('nvml', env=os.environ, timeout_s=300)"], env=env)

    def probe_pids() -> list[int]:
        return [pid for pid in processes_with_env(marker, cmdline_has="gpudiag.probes")
                if pid != parent.pid]

    deadline = time.monotonic() + 30
    while not probe_pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert probe_pids(), "the probe child never started"
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while probe_pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert probe_pids() == [], "the hung probe outlived its SIGKILLed parent"


def test_without_a_daemon_the_route_runs_inline_and_says_why(gpu_env: EnvFactory) -> None:
    from gpudiag.core.requirement import parse_requirement
    from gpudiag.engine.route import daemon_else_inline

    env = gpu_env()  # GPUDIAG_DAEMON_URL points at port 1: nothing listens there
    routed = daemon_else_inline(parse_requirement("nvml"), env=env, timeout_s=30)
    assert routed.verdict.source == "inline" and routed.verdict.ready
    assert routed.runs is not None and set(routed.runs) == {"host", "nvml"}
    assert routed.daemon_reason is not None and "127.0.0.1:1" in routed.daemon_reason
    asked_none = daemon_else_inline(parse_requirement("nvml"), env=env, use_daemon=False)
    assert asked_none.daemon_reason is None and asked_none.runs is not None
