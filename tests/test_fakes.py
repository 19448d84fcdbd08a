"""The fake driver boundary, exercised through its real consumers.

Every check runs in a child process started with ``FakeDriver.env``: the real
nvidia-ml-py bindings, ctypes on ``libcuda.so.1``, real IREE and the fake
nvidia-smi see the fakes exactly as gpudiag's probes will.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.build import FakeDriver, build_fakes, write_state_file
from tests.fakes.jobs import FakeJobs, read_context_log

H200_MIB = 143771
GPU0_UUID = "GPU-f00d0000-0000-4000-8000-000000000000"
GPU1_UUID = "GPU-f00d0001-0000-4000-8000-000000000001"

# Variables of the developer's shell that would change what the fakes report.
_SCRUB = ("CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH", "LD_PRELOAD")


def _clean_base() -> dict[str, str]:
    return {
        k: v for k, v in os.environ.items() if k not in _SCRUB and not k.startswith("FAKE_")
    }


@pytest.fixture(scope="session")
def fake_driver(tmp_path_factory: pytest.TempPathFactory) -> FakeDriver:
    return build_fakes(tmp_path_factory.mktemp("fake-driver"))


def _env(driver: FakeDriver, **knobs: str | int | None) -> dict[str, str]:
    return driver.env(base=_clean_base(), **knobs)


def run_child(
    driver: FakeDriver, code: str, **knobs: str | int | None
) -> subprocess.CompletedProcess[str]:
    """Runs Python `code` in a child that sees the fakes."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=_env(driver, **knobs),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def child_json(driver: FakeDriver, code: str, **knobs: str | int | None) -> Any:
    """Runs `code` (which prints one JSON document last) and returns it."""
    proc = run_child(driver, code, **knobs)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def smi(driver: FakeDriver, *args: str, env: Mapping[str, str] | None = None,
        **knobs: str | int | None) -> subprocess.CompletedProcess[str]:
    """Runs the fake nvidia-smi found on the child's PATH."""
    return subprocess.run(
        ["nvidia-smi", *args],
        env=dict(env) if env is not None else _env(driver, **knobs),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def assert_hangs(cmd: list[str], env: Mapping[str, str], seconds: float = 0.5,
                 ready_line: bool = False) -> None:
    """The command is still running `seconds` after it started (or, with
    `ready_line`, after it printed its first line); it is then killed."""
    proc = subprocess.Popen(
        cmd, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )
    try:
        if ready_line:
            assert proc.stdout is not None
            assert proc.stdout.readline() == "calling\n"
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=seconds)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# --------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------


def test_build_layout_and_speed(tmp_path: Path) -> None:
    start = time.perf_counter()
    driver = build_fakes(tmp_path / "fresh")
    elapsed = time.perf_counter() - start
    # About 0.3 s on an idle 2-core machine; the bound leaves room for a busy one.
    # A liveness bound (under 1 s quiet): every xdist worker builds them once per session.
    assert elapsed < 30.0, f"building the fakes took {elapsed:.2f}s"
    assert (driver.lib_dir / "libnvidia-ml.so.1").is_file()
    assert (driver.lib_dir / "libcuda.so.1").is_file()
    assert os.readlink(driver.lib_dir / "libcuda.so") == "libcuda.so.1"
    smi_path = driver.bin_dir / "nvidia-smi"
    assert os.access(smi_path, os.X_OK)
    assert smi_path.read_text().splitlines()[0] == f"#!{sys.executable}"
    env = driver.env(base={"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/opt/x"}, FAKE_A=1, GONE=None)
    assert env["LD_LIBRARY_PATH"] == f"{driver.lib_dir}:/opt/x"
    assert env["PATH"] == f"{driver.bin_dir}:/usr/bin"
    assert env["FAKE_A"] == "1" and "GONE" not in env


def test_sources_compile_warning_free(tmp_path: Path) -> None:
    # -Og runs gcc's flow-based warnings (uninitialised use, format truncation)
    # at about half the cost of -O2.
    # -Werror turns any warning into a build failure (RuntimeError with gcc's stderr).
    built = build_fakes(tmp_path / "strict", extra_cflags=("-Og", "-Werror"))
    assert (built.lib_dir / "libnvidia-ml.so.1").is_file()
    assert (built.lib_dir / "libcuda.so.1").is_file()


def test_build_failure_raises_with_gcc_stderr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("tests.fakes.build.CFLAGS", ("-DFOO", "-std=c11", "-shared", "-fPIC",
                                                      "-include", "/nonexistent/header.h"))
    with pytest.raises(RuntimeError, match="nonexistent/header.h"):
        build_fakes(tmp_path / "broken")


# --------------------------------------------------------------------------
# Fake NVML through the real pynvml
# --------------------------------------------------------------------------

NVML_DUMP = """
import ctypes, json, pynvml as N

# Calls before nvmlInit answer NVML_ERROR_UNINITIALIZED (1).
lib = ctypes.CDLL("libnvidia-ml.so.1")
c = ctypes.c_uint()
before = lib.nvmlDeviceGetCount_v2(ctypes.byref(c))

def q(fn, *a):
    try:
        v = fn(*a)
    except N.NVMLError as e:
        return {"error": e.value}
    return v

N.nvmlInit()
out = {"before_init": before, "count": N.nvmlDeviceGetCount(),
       "driver": N.nvmlSystemGetDriverVersion(), "nvml": N.nvmlSystemGetNVMLVersion(),
       "cuda": N.nvmlSystemGetCudaDriverVersion(), "cuda2": N.nvmlSystemGetCudaDriverVersion_v2(),
       "devices": []}
for i in range(out["count"]):
    h = N.nvmlDeviceGetHandleByIndex(i)
    pci = N.nvmlDeviceGetPciInfo(h)
    m1 = N.nvmlDeviceGetMemoryInfo(h)
    m2 = N.nvmlDeviceGetMemoryInfo(h, version=N.nvmlMemory_v2)
    util = q(N.nvmlDeviceGetUtilizationRates, h)
    fv = N.nvmlDeviceGetFieldValues(h, [N.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, 1])
    pages = q(N.nvmlDeviceGetRetiredPages, h, N.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
    procs = q(N.nvmlDeviceGetComputeRunningProcesses, h)
    out["devices"].append({
        "index": N.nvmlDeviceGetIndex(h), "minor": N.nvmlDeviceGetMinorNumber(h),
        "name": N.nvmlDeviceGetName(h), "uuid": N.nvmlDeviceGetUUID(h),
        "by_uuid": N.nvmlDeviceGetIndex(N.nvmlDeviceGetHandleByUUID(N.nvmlDeviceGetUUID(h))),
        "bus_id": pci.busId.decode() if isinstance(pci.busId, bytes) else pci.busId,
        "bus": pci.bus, "domain": pci.domain,
        "mem": [m1.total, m1.used, m1.free], "mem2": [m2.total, m2.reserved, m2.used, m2.free],
        "util": [util.gpu, util.memory] if not isinstance(util, dict) else util,
        "temp": N.nvmlDeviceGetTemperature(h, N.NVML_TEMPERATURE_GPU),
        "power": N.nvmlDeviceGetPowerUsage(h), "limit": N.nvmlDeviceGetEnforcedPowerLimit(h),
        "ecc_mode": N.nvmlDeviceGetEccMode(h),
        "ecc": [N.nvmlDeviceGetTotalEccErrors(h, e, k) for e in (0, 1) for k in (0, 1)],
        "remapped": list(N.nvmlDeviceGetRemappedRows(h)),
        "pages": pages,
        "clocks": N.nvmlDeviceGetCurrentClocksEventReasons(h),
        "throttle": N.nvmlDeviceGetCurrentClocksThrottleReasons(h),
        "persistence": N.nvmlDeviceGetPersistenceMode(h),
        "compute_mode": N.nvmlDeviceGetComputeMode(h),
        "mig_mode": N.nvmlDeviceGetMigMode(h), "max_mig": N.nvmlDeviceGetMaxMigDeviceCount(h),
        "recovery": [fv[0].nvmlReturn, fv[0].valueType, fv[0].value.uiVal],
        "other_field": fv[1].nvmlReturn,
        "procs": procs if isinstance(procs, dict) else [
            [p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId] for p in procs],
    })
N.nvmlShutdown()
print(json.dumps(out))
"""


def test_nvml_defaults(fake_driver: FakeDriver) -> None:
    out = child_json(fake_driver, NVML_DUMP)
    assert out["before_init"] == 1
    assert out["count"] == 8
    assert out["driver"] == "570.124.06"
    assert out["nvml"] == "12.570.124.06"
    assert out["cuda"] == out["cuda2"] == 12080
    total = H200_MIB * 1024 * 1024
    for i, dev in enumerate(out["devices"]):
        assert dev["index"] == dev["minor"] == dev["by_uuid"] == i
        assert dev["name"] == "NVIDIA H200"
        assert dev["uuid"] == f"GPU-f00d{i:04x}-0000-4000-8000-00000000{i:04x}"
        assert dev["bus_id"] == f"00000000:{0x18 + i:02X}:00.0"
        assert (dev["bus"], dev["domain"]) == (0x18 + i, 0)
        assert dev["mem"] == [total, 0, total]
        assert dev["mem2"] == [total, 0, 0, total]
        assert dev["util"] == [0, 0]
        assert (dev["temp"], dev["power"], dev["limit"]) == (35, 75000, 700000)
        assert dev["ecc_mode"] == [1, 1] and dev["ecc"] == [0, 0, 0, 0]
        assert dev["remapped"] == [0, 0, 0, 0]
        assert dev["pages"] == {"error": 3}  # Hopper has no page retirement
        assert dev["clocks"] == dev["throttle"] == 0
        assert (dev["persistence"], dev["compute_mode"]) == (1, 0)
        assert dev["mig_mode"] == [0, 0] and dev["max_mig"] == 7
        assert dev["recovery"] == [0, 1, 0] and dev["other_field"] == 3
        assert dev["procs"] == []


def test_nvml_per_device_knobs(fake_driver: FakeDriver) -> None:
    out = child_json(
        fake_driver, NVML_DUMP,
        FAKE_NVML_DEVICE_COUNT=4,
        FAKE_GPU_NAME="NVIDIA H100 80GB HBM3",
        FAKE_GPU_MEMORY_TOTAL_MIB=81559,
        FAKE_NVML_MEMORY_USED_MIB="1:1000",
        FAKE_NVML_UTILIZATION="2:77",
        FAKE_NVML_TEMPERATURE_C="3:91",
        FAKE_NVML_POWER_MW="1:123456",
        FAKE_NVML_ECC_VOLATILE_CORRECTED="2:5",
        FAKE_NVML_ECC_VOLATILE_UNCORRECTED="2:1",
        FAKE_NVML_ECC_AGGREGATE_CORRECTED="2:50",
        FAKE_NVML_ECC_AGGREGATE_UNCORRECTED="2:10",
        FAKE_NVML_REMAPPED_ROWS="0:0/2/1/0",
        FAKE_NVML_RETIRED_PAGES="1:3",
        FAKE_NVML_CLOCKS_EVENT_REASONS="2:0x48,3:8",
        FAKE_NVML_PERSISTENCE="3:0",
        FAKE_NVML_COMPUTE_MODE="1:3",
        FAKE_NVML_RECOVERY_ACTION="3:2",
        FAKE_NVML_PROCESSES="0:1234:512,0:99:1,2:777:2048",
        FAKE_NVML_DRIVER_VERSION="550.54.15",
        FAKE_CUDA_DRIVER_VERSION=12040,
    )
    mib = 1024 * 1024
    d = out["devices"]
    assert out["count"] == 4 and out["driver"] == "550.54.15"
    assert out["cuda"] == 12040 and out["nvml"] == "12.550.54.15"
    assert d[0]["name"] == "NVIDIA H100 80GB HBM3"
    assert d[0]["mem"] == [81559 * mib, 0, 81559 * mib]
    assert d[1]["mem"] == [81559 * mib, 1000 * mib, 80559 * mib]
    assert d[1]["mem2"] == [81559 * mib, 0, 1000 * mib, 80559 * mib]
    assert d[2]["util"][0] == 77 and d[3]["temp"] == 91
    assert d[1]["power"] == 123456
    assert d[2]["ecc"] == [5, 50, 1, 10]  # corrected vol/agg, uncorrected vol/agg
    assert d[0]["remapped"] == [0, 2, 1, 0]
    assert d[1]["pages"] == [0x0, 0x1000, 0x2000] and d[0]["pages"] == []
    assert (d[2]["clocks"], d[3]["clocks"], d[0]["clocks"]) == (0x48, 8, 0)
    assert d[3]["persistence"] == 0 and d[1]["compute_mode"] == 3
    assert d[3]["recovery"] == [0, 1, 2]
    na = 0xFFFFFFFF
    assert d[0]["procs"] == [[1234, 512 * mib, na, na], [99, mib, na, na]]
    assert d[2]["procs"] == [[777, 2048 * mib, na, na]] and d[1]["procs"] == []


def test_nvml_mig(fake_driver: FakeDriver) -> None:
    out = child_json(fake_driver, """
        import json, pynvml as N
        N.nvmlInit()
        p = N.nvmlDeviceGetHandleByIndex(1)
        migs = [N.nvmlDeviceGetMigDeviceHandleByIndex(p, j) for j in range(3)]
        try:
            N.nvmlDeviceGetMigDeviceHandleByIndex(p, 3)
            beyond = None
        except N.NVMLError as e:
            beyond = e.value
        m = migs[2]
        parent = N.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m)
        print(json.dumps({
            "mode": N.nvmlDeviceGetMigMode(p),
            "other_mode": N.nvmlDeviceGetMigMode(N.nvmlDeviceGetHandleByIndex(0)),
            "beyond": beyond,
            "uuids": [N.nvmlDeviceGetUUID(h) for h in migs],
            "name": N.nvmlDeviceGetName(m),
            "total": N.nvmlDeviceGetMemoryInfo(m).total,
            "is_mig": [N.nvmlDeviceIsMigDeviceHandle(m).value,
                       N.nvmlDeviceIsMigDeviceHandle(p).value],
            "parent": N.nvmlDeviceGetIndex(parent),
            "ids": [N.nvmlDeviceGetGpuInstanceId(m), N.nvmlDeviceGetComputeInstanceId(m)],
            "mig_procs": [[x.pid, x.gpuInstanceId] for x in
                          N.nvmlDeviceGetComputeRunningProcesses(m)],
            "parent_procs": [[x.pid, x.gpuInstanceId] for x in
                             N.nvmlDeviceGetComputeRunningProcesses(p)],
            "by_uuid": N.nvmlDeviceGetUUID(N.nvmlDeviceGetHandleByUUID(
                "MIG-f00d0001-0001-4000-8000-000000000000")),
        }))
        """, FAKE_NVML_MIG="1:3", FAKE_NVML_PROCESSES="1.2:4242:300,1:7:1,1.0:8:2")
    assert out["mode"] == [1, 1] and out["other_mode"] == [0, 0]
    assert out["beyond"] == 6  # NVML_ERROR_NOT_FOUND
    assert out["uuids"] == [f"MIG-f00d0001-{j:04x}-4000-8000-000000000000" for j in range(3)]
    assert out["name"].startswith("NVIDIA H200 MIG ")
    assert out["total"] == (H200_MIB // 3) * 1024 * 1024
    assert out["is_mig"] == [1, 0] and out["parent"] == 1 and out["ids"] == [2, 2]
    assert out["mig_procs"] == [[4242, 2]]
    assert out["parent_procs"] == [[4242, 2], [7, 0xFFFFFFFF], [8, 0]]
    assert out["by_uuid"] == "MIG-f00d0001-0001-4000-8000-000000000000"


# pynvml's str() keeps its own text for some codes (18: "RM has detected an NVML/RM version
# mismatch."); nvmlErrorString is the library's, here NVIDIA's 535 text (test_real_nvidia.py).
@pytest.mark.parametrize(
    ("code", "text", "library_text"),
    [(9, "Driver Not Loaded", "Driver Not Loaded"),
     (18, "RM has detected an NVML/RM version mismatch.", "Driver/library version mismatch"),
     (4, "Insufficient Permissions", "Insufficient Permissions"),
     (999, "Unknown Error", "Unknown Error")],
)
def test_nvml_init_error(fake_driver: FakeDriver, code: int, text: str,
                         library_text: str) -> None:
    out = child_json(fake_driver, """
        import json, pynvml as N
        try:
            N.nvmlInit()
            print(json.dumps(None))
        except N.NVMLError as e:
            print(json.dumps([e.value, str(e), N.nvmlErrorString(e.value)]))
        """, FAKE_NVML_INIT_ERROR=code)
    assert out == [code, text, library_text]


def test_nvml_init_hang(fake_driver: FakeDriver) -> None:
    code = "import pynvml; print('calling', flush=True); pynvml.nvmlInit(); print('returned')"
    assert_hangs([sys.executable, "-c", code], _env(fake_driver, FAKE_NVML_INIT_HANG=1),
                 ready_line=True)


def test_nvml_init_crash(fake_driver: FakeDriver) -> None:
    proc = run_child(fake_driver, "import pynvml; pynvml.nvmlInit()", FAKE_NVML_INIT_CRASH=1)
    assert proc.returncode == -signal.SIGSEGV


def test_nvml_device_errors_and_state_file(fake_driver: FakeDriver, tmp_path: Path) -> None:
    state = tmp_path / "state"
    out = child_json(fake_driver, f"""
        import json, os, pathlib, pynvml as N
        def write_state_file(path, knobs):
            tmp = path.with_name(".tmp")
            tmp.write_text("".join(f"{{k}}={{v}}\\n" for k, v in knobs.items()))
            os.replace(tmp, path)
        def err(fn, *a):
            try:
                fn(*a)
                return 0
            except N.NVMLError as e:
                return e.value
        N.nvmlInit()
        out = {{"lost": err(N.nvmlDeviceGetHandleByIndex, 1),
               "reset": err(N.nvmlDeviceGetHandleByIndex, 2),
               "by_uuid": err(N.nvmlDeviceGetHandleByUUID, "{GPU1_UUID}"),
               "missing_uuid": err(N.nvmlDeviceGetHandleByUUID, "GPU-nope")}}
        h0 = N.nvmlDeviceGetHandleByIndex(0)
        out["temp_env"] = N.nvmlDeviceGetTemperature(h0, 0)
        # The state file overrides the environment, re-read on the next call.
        write_state_file(pathlib.Path({str(state)!r}),
                         {{"FAKE_NVML_DEVICE_ERRORS": "0:14", "FAKE_NVML_TEMPERATURE_C": "0:80"}})
        out["held_handle"] = err(N.nvmlDeviceGetName, h0)
        out["lost_after"] = err(N.nvmlDeviceGetHandleByIndex, 1)
        pathlib.Path({str(state)!r}).write_text("# comment\\n\\nFAKE_NVML_TEMPERATURE_C=0:81\\n")
        out["temp_file"] = N.nvmlDeviceGetTemperature(h0, 0)
        pathlib.Path({str(state)!r}).write_text("FAKE_NVML_TEMPERATURE_C=0:82\\n")
        out["temp_file2"] = N.nvmlDeviceGetTemperature(h0, 0)
        pathlib.Path({str(state)!r}).unlink()
        out["temp_removed"] = N.nvmlDeviceGetTemperature(h0, 0)
        out["errors_removed"] = err(N.nvmlDeviceGetHandleByIndex, 1)
        print(json.dumps(out))
        """,
        FAKE_NVML_DEVICE_ERRORS="1:15,2:16", FAKE_NVML_TEMPERATURE_C="0:40",
        FAKE_GPU_STATE_FILE=str(state))
    assert out == {
        "lost": 15, "reset": 16, "by_uuid": 15, "missing_uuid": 6, "temp_env": 40,
        "held_handle": 14, "lost_after": 0, "temp_file": 81, "temp_file2": 82,
        "temp_removed": 40, "errors_removed": 15,
    }


def test_nvml_unsupported_fields(fake_driver: FakeDriver) -> None:
    families = ("power,temperature,utilization,ecc,remapped_rows,retired_pages,"
                "clocks_event_reasons,persistence,compute_mode,mig,field_values,processes,events")
    out = child_json(fake_driver, """
        import json, pynvml as N
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(0)
        calls = {
            "power": lambda: N.nvmlDeviceGetPowerUsage(h),
            "limit": lambda: N.nvmlDeviceGetEnforcedPowerLimit(h),
            "temperature": lambda: N.nvmlDeviceGetTemperature(h, 0),
            "utilization": lambda: N.nvmlDeviceGetUtilizationRates(h),
            "ecc_mode": lambda: N.nvmlDeviceGetEccMode(h),
            "ecc": lambda: N.nvmlDeviceGetTotalEccErrors(h, 1, 0),
            "remapped_rows": lambda: N.nvmlDeviceGetRemappedRows(h),
            "retired_pages": lambda: N.nvmlDeviceGetRetiredPages(h, 1),
            "clocks": lambda: N.nvmlDeviceGetCurrentClocksEventReasons(h),
            "persistence": lambda: N.nvmlDeviceGetPersistenceMode(h),
            "compute_mode": lambda: N.nvmlDeviceGetComputeMode(h),
            "mig": lambda: N.nvmlDeviceGetMigMode(h),
            "field_values": lambda: N.nvmlDeviceGetFieldValues(h, [230]),
            "processes": lambda: N.nvmlDeviceGetComputeRunningProcesses(h),
            "events": lambda: N.nvmlDeviceRegisterEvents(h, 8, N.nvmlEventSetCreate()),
            "absent": lambda: N.nvmlDeviceGetEncoderUtilization(h),
        }
        out = {}
        for key, fn in calls.items():
            try:
                fn()
                out[key] = 0
            except N.NVMLError as e:
                out[key] = e.value
        out["name"] = N.nvmlDeviceGetName(h)
        print(json.dumps(out))
        """, FAKE_NVML_UNSUPPORTED=families)
    assert out.pop("name") == "NVIDIA H200"
    assert out.pop("absent") == 13  # not in the fake at all: FunctionNotFound
    assert out == dict.fromkeys(out, 3) and len(out) == 15


def test_nvml_xid_events(fake_driver: FakeDriver, tmp_path: Path) -> None:
    """XIDs arrive once each; entries appended to the state file reach a running watcher."""
    state = tmp_path / "state"
    write_state_file(state, {"FAKE_NVML_XIDS": "0:79,1:48"})
    watcher = textwrap.dedent("""
        import json, sys, time, pynvml as N
        N.nvmlInit()
        s = N.nvmlEventSetCreate()
        try:
            N.nvmlDeviceRegisterEvents(N.nvmlDeviceGetHandleByIndex(0), N.nvmlEventTypeAll, s)
            unsupported = None
        except N.NVMLError as e:
            unsupported = e.value
        for i in range(4):
            h = N.nvmlDeviceGetHandleByIndex(i)
            assert N.nvmlDeviceGetSupportedEventTypes(h) & N.nvmlEventTypeXidCriticalError
            N.nvmlDeviceRegisterEvents(h, N.nvmlEventTypeXidCriticalError, s)
        def take(timeout_ms):
            try:
                d = N.nvmlEventSetWait_v2(s, timeout_ms)
            except N.NVMLError as e:
                return e.value
            return [N.nvmlDeviceGetIndex(d.device), d.eventType, d.eventData]
        first = [take(1000), take(1000)]
        t = time.monotonic(); empty = take(200); waited = time.monotonic() - t
        print(json.dumps({"ready": True}), flush=True)
        t = time.monotonic(); live = take(10000); latency = time.monotonic() - t
        print(json.dumps({"unsupported": unsupported, "first": first, "empty": empty,
                          "waited": waited, "live": live, "latency": latency,
                          "again": take(0)}))
        N.nvmlEventSetFree(s)
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", watcher], env=_env(fake_driver, FAKE_GPU_STATE_FILE=str(state)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        assert json.loads(proc.stdout.readline()) == {"ready": True}
        time.sleep(0.2)
        write_state_file(state, {"FAKE_NVML_XIDS": "0:79,1:48,3:31"})
        out = json.loads(proc.stdout.readline())
        assert proc.wait(timeout=10) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        proc.kill()
        proc.wait()
    assert out["unsupported"] == 3  # nvmlEventTypeAll includes types the GPU lacks
    assert out["first"] == [[0, 8, 79], [1, 8, 48]]
    assert out["empty"] == 10 and 0.15 < out["waited"] < 1.0  # NVML_ERROR_TIMEOUT
    assert out["live"] == [3, 8, 31] and out["latency"] < 2.0
    assert out["again"] == 10


# --------------------------------------------------------------------------
# Fake CUDA driver through ctypes
# --------------------------------------------------------------------------

CUDA_PRELUDE = """
import ctypes, json
cu = ctypes.CDLL("libcuda.so.1")
def name_of(code):
    n, s = ctypes.c_char_p(), ctypes.c_char_p()
    r1 = cu.cuGetErrorName(code, ctypes.byref(n))
    r2 = cu.cuGetErrorString(code, ctypes.byref(s))
    return [r1, n.value and n.value.decode(), r2, s.value and s.value.decode()]
def visible():
    count = ctypes.c_int(-1)
    rc = cu.cuInit(0)
    if rc:
        return {"init": rc}
    cu.cuDeviceGetCount(ctypes.byref(count))
    devs = []
    for i in range(count.value):
        d = ctypes.c_int()
        assert cu.cuDeviceGet(ctypes.byref(d), i) == 0
        uuid = (ctypes.c_ubyte * 16)()
        assert cu.cuDeviceGetUuid_v2(uuid, d) == 0
        name = ctypes.create_string_buffer(128)
        assert cu.cuDeviceGetName(name, 128, d) == 0
        mem = ctypes.c_size_t()
        assert cu.cuDeviceTotalMem_v2(ctypes.byref(mem), d) == 0
        devs.append([bytes(uuid).hex(), name.value.decode(), mem.value])
    return {"init": 0, "devices": devs}
"""


def _cuda(body: str) -> str:
    return CUDA_PRELUDE + textwrap.dedent(body)


def test_cuda_healthy(fake_driver: FakeDriver) -> None:
    out = child_json(fake_driver, _cuda("""
        c = ctypes.c_int()
        before = cu.cuDeviceGetCount(ctypes.byref(c))
        ver = ctypes.c_int()
        cu.cuDriverGetVersion(ctypes.byref(ver))
        vis = visible()
        dev = ctypes.c_int()
        cu.cuDeviceGet(ctypes.byref(dev), 1)
        attrs = {}
        for a in (75, 76, 16, 10, 115, 33):
            v = ctypes.c_int()
            assert cu.cuDeviceGetAttribute(ctypes.byref(v), a, dev) == 0
            attrs[a] = v.value
        bus = ctypes.create_string_buffer(32)
        cu.cuDeviceGetPCIBusId(bus, 32, dev)
        ctx = ctypes.c_void_p()
        assert cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev) == 0
        free0, total = ctypes.c_size_t(), ctypes.c_size_t()
        cu.cuMemGetInfo_v2(ctypes.byref(free0), ctypes.byref(total))
        ptr = ctypes.c_uint64()
        assert cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(1 << 20)) == 0
        free1 = ctypes.c_size_t()
        cu.cuMemGetInfo_v2(ctypes.byref(free1), ctypes.byref(total))
        src = (ctypes.c_ubyte * 4096)(*range(256), *([7] * 3840))
        dst = (ctypes.c_ubyte * 4096)()
        cu.cuMemcpyHtoD_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]
        cu.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
        assert cu.cuMemcpyHtoD_v2(ptr.value, src, 4096) == 0
        assert cu.cuMemcpyDtoH_v2(dst, ptr.value, 4096) == 0
        cu.cuMemFree_v2.argtypes = [ctypes.c_uint64]
        assert cu.cuMemFree_v2(ptr.value) == 0
        pctx = ctypes.c_void_p()
        assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(pctx), dev) == 0
        assert cu.cuDevicePrimaryCtxRelease_v2(dev) == 0
        destroyed = cu.cuCtxDestroy_v2(ctx)
        fn = ctypes.c_void_p()
        proc = [cu.cuGetProcAddress(b"cuMemAlloc", ctypes.byref(fn), 11030, 0),
                fn.value == ctypes.cast(cu.cuMemAlloc_v2, ctypes.c_void_p).value,
                cu.cuGetProcAddress(b"cuNoSuchThing", ctypes.byref(fn), 11030, 0), fn.value]
        print(json.dumps({
            "before": before, "version": ver.value, "vis": vis, "attrs": attrs,
            "bus": bus.value.decode(), "total": total.value,
            "alloc_delta": free0.value - free1.value, "roundtrip": bytes(src) == bytes(dst),
            "destroyed": destroyed, "proc": proc,
            "names": {c: name_of(c) for c in (0, 2, 46, 100, 803, 802, 999, 12345)},
        }))
        """))
    assert out["before"] == 3  # CUDA_ERROR_NOT_INITIALIZED
    assert out["version"] == 12080
    devs = out["vis"]["devices"]
    assert len(devs) == 8
    assert devs[0] == ["f00d0000000040008000000000000000", "NVIDIA H200", H200_MIB * 1024 * 1024]
    assert devs[7][0] == "f00d0007000040008000000000000007"
    assert out["attrs"] == {"75": 9, "76": 0, "16": 132, "10": 32, "115": 1, "33": 0x19}
    assert out["bus"] == "0000:19:00.0"
    assert out["total"] == H200_MIB * 1024 * 1024
    assert out["alloc_delta"] == 1 << 20 and out["roundtrip"] and out["destroyed"] == 0
    assert out["proc"] == [0, True, 500, None]
    names = out["names"]
    assert names["0"] == [0, "CUDA_SUCCESS", 0, "no error"]
    assert names["2"] == [0, "CUDA_ERROR_OUT_OF_MEMORY", 0, "out of memory"]
    assert names["46"] == [0, "CUDA_ERROR_DEVICE_UNAVAILABLE", 0,
                           "CUDA-capable device(s) is/are busy or unavailable"]
    assert names["100"] == [0, "CUDA_ERROR_NO_DEVICE", 0, "no CUDA-capable device is detected"]
    assert names["803"] == [0, "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH", 0,
                            "system has unsupported display driver / cuda driver combination"]
    assert names["802"] == [0, "CUDA_ERROR_SYSTEM_NOT_READY", 0, "system not yet initialized"]
    assert names["999"] == [0, "CUDA_ERROR_UNKNOWN", 0, "unknown error"]
    assert names["12345"] == [1, None, 1, None]  # CUDA_ERROR_INVALID_VALUE


def _uuid_hex(i: int) -> str:
    """cuDeviceGetUuid bytes of GPU i, as hex."""
    return f"f00d{i:04x}000040008000{'0' * 8}{i:04x}"


@pytest.mark.parametrize(
    ("knobs", "expected"),
    [
        ({}, list(range(8))),
        ({"CUDA_VISIBLE_DEVICES": "2,0"}, [2, 0]),
        ({"CUDA_VISIBLE_DEVICES": "1,7,9,2"}, [1, 7]),  # stops at the first bad entry
        ({"CUDA_VISIBLE_DEVICES": "3,3,1"}, [3]),
        ({"CUDA_VISIBLE_DEVICES": "GPU-f00d0003"}, [3]),
        ({"CUDA_VISIBLE_DEVICES": "GPU-f00d0005-0000-4000-8000-000000000005,0"}, [5, 0]),
        ({"CUDA_VISIBLE_DEVICES": "GPU-f00d000"}, 100),  # ambiguous prefix
        ({"CUDA_VISIBLE_DEVICES": ""}, 100),
        ({"CUDA_VISIBLE_DEVICES": "-1"}, 100),
        ({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, 100),
        ({"FAKE_CUDA_DEVICE_COUNT": 3}, [0, 1, 2]),
        ({"FAKE_NVML_DEVICE_COUNT": 2}, [0, 1]),
        ({"FAKE_NVML_DEVICE_COUNT": 0}, 100),
    ],
)
def test_cuda_visible_devices(
    fake_driver: FakeDriver, knobs: dict[str, str | int], expected: list[int] | int
) -> None:
    out = child_json(fake_driver, _cuda("print(json.dumps(visible()))"), **knobs)
    if isinstance(expected, int):
        assert out == {"init": expected}
    else:
        assert [d[0] for d in out["devices"]] == [_uuid_hex(i) for i in expected]


def test_cuda_mig_uuid_is_visible(fake_driver: FakeDriver) -> None:
    out = child_json(fake_driver, _cuda("print(json.dumps(visible()))"),
                     FAKE_NVML_MIG="1:2",
                     CUDA_VISIBLE_DEVICES="MIG-f00d0001-0001-4000-8000-000000000000")
    [(uuid, name, mem)] = out["devices"]
    assert uuid == "f00d0001000140008000000000000000"
    assert name.startswith("NVIDIA H200 MIG ")
    assert mem == (H200_MIB // 2) * 1024 * 1024


@pytest.mark.parametrize(
    ("code", "name"),
    [(100, "CUDA_ERROR_NO_DEVICE"), (803, "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH"),
     (999, "CUDA_ERROR_UNKNOWN")],
)
def test_cuda_init_error(fake_driver: FakeDriver, code: int, name: str) -> None:
    out = child_json(fake_driver, _cuda("""
        c = ctypes.c_int()
        print(json.dumps([cu.cuInit(0), cu.cuDeviceGetCount(ctypes.byref(c))]))
        """), FAKE_CUDA_INIT_ERROR=code)
    assert out == [code, 3]


def test_cuda_init_hang_and_crash(fake_driver: FakeDriver) -> None:
    code = ("import ctypes; cu = ctypes.CDLL('libcuda.so.1'); print('calling', flush=True); "
            "cu.cuInit(0); print('returned')")
    assert_hangs([sys.executable, "-c", code], _env(fake_driver, FAKE_CUDA_INIT_HANG=1),
                 ready_line=True)
    proc = run_child(fake_driver, code, FAKE_CUDA_INIT_CRASH=1)
    assert proc.returncode == -signal.SIGSEGV


def test_cuda_context_alloc_and_launch_errors(fake_driver: FakeDriver) -> None:
    out = child_json(fake_driver, _cuda("""
        assert cu.cuInit(0) == 0
        ctx, p = ctypes.c_void_p(), ctypes.c_uint64()
        res = {"ctx": cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, 0),
               "primary": cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0)}
        print(json.dumps(res))
        """), FAKE_CUDA_CTX_ERROR=46)
    assert out == {"ctx": 46, "primary": 46}
    out = child_json(fake_driver, _cuda("""
        assert cu.cuInit(0) == 0
        ctx, p = ctypes.c_void_p(), ctypes.c_uint64()
        assert cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, 0) == 0
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        assert cu.cuModuleLoadData(ctypes.byref(mod), b"// ptx") == 0
        assert cu.cuModuleGetFunction(ctypes.byref(fn), mod, b"k") == 0
        launch = cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, None, None, None)
        print(json.dumps({"alloc": cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(64)),
                          "launch": launch}))
        """), FAKE_CUDA_ALLOC_ERROR=2, FAKE_CUDA_LAUNCH_ERROR=719)
    assert out == {"alloc": 2, "launch": 719}


@pytest.mark.parametrize(("knobs", "vmm"), [({}, 1), ({"FAKE_CUDA_VMM": 0}, 0)])
def test_cuda_surfaces_real_xla_and_cudart_need(fake_driver: FakeDriver,
                                               knobs: dict[str, int], vmm: int) -> None:
    # XLA refuses a device without VMM (attribute 102), dlsyms cuDevicePrimaryCtxGetState and
    # cuDeviceGetPCIBusId; cudart resolves cuGetExportTable through cuGetProcAddress and goes
    # on (with its own error) when a private table is missing; 303 has a name.
    out = child_json(fake_driver, _cuda("""
        assert cu.cuInit(0) == 0
        v, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
        bus = ctypes.create_string_buffer(32)
        fn, table, name = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_char_p()
        res = {"vmm": [cu.cuDeviceGetAttribute(ctypes.byref(v), 102, 0), v.value],
               "state": [cu.cuDevicePrimaryCtxGetState(0, ctypes.byref(flags),
                                                       ctypes.byref(active)), active.value],
               "bus": [cu.cuDeviceGetPCIBusId(bus, 32, 0), bus.value.decode()],
               "proc": cu.cuGetProcAddress(b"cuGetExportTable", ctypes.byref(fn), 12000, 0),
               "found": bool(fn.value),
               "table": cu.cuGetExportTable(ctypes.byref(table), b"0123456789abcdef"),
               "303": [cu.cuGetErrorName(303, ctypes.byref(name)), name.value.decode()]}
        print(json.dumps(res))
        """), **knobs)
    assert out["vmm"] == [0, vmm]
    assert out["state"] == [0, 0]
    assert out["bus"][0] == 0 and out["bus"][1].startswith("0000:")
    assert out["proc"] == 0 and out["found"] is True
    assert out["table"] == 500  # CUDA_ERROR_NOT_FOUND
    assert out["303"] == [0, "CUDA_ERROR_SHARED_OBJECT_INIT_FAILED"]


# --------------------------------------------------------------------------
# Busy GPUs: contexts follow the GPU's state as the fake NVML reports it
# --------------------------------------------------------------------------

GPU3_UUID = "GPU-f00d0003-0000-4000-8000-000000000003"

# contexts(): per visible ordinal, [cuCtxCreate_v2, cuDevicePrimaryCtxRetain] results (each
# undone when it succeeded, so the next call creates afresh).
CONTEXTS = """
import os, pathlib
def contexts():
    rc = cu.cuInit(0)
    if rc:
        return {"init": rc}
    n = ctypes.c_int()
    assert cu.cuDeviceGetCount(ctypes.byref(n)) == 0
    out = []
    for i in range(n.value):
        ctx, prim = ctypes.c_void_p(), ctypes.c_void_p()
        created = cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, i)
        if created == 0:
            assert cu.cuCtxDestroy_v2(ctx) == 0
        retained = cu.cuDevicePrimaryCtxRetain(ctypes.byref(prim), i)
        if retained == 0:
            assert cu.cuDevicePrimaryCtxRelease_v2(i) == 0
        out.append([created, retained])
    return out
"""


def _contexts(body: str) -> str:
    return _cuda(CONTEXTS + textwrap.dedent(body))


@pytest.mark.parametrize(
    ("knobs", "expected"),
    [
        # EXCLUSIVE_PROCESS held by another process: 46 on that GPU only.
        ({"FAKE_NVML_COMPUTE_MODE": "0:3", "FAKE_NVML_PROCESSES": "0:4242:100"},
         [[46, 46], [0, 0], [0, 0]]),
        # Other processes in DEFAULT mode, or EXCLUSIVE_PROCESS without any: contexts work.
        ({"FAKE_NVML_PROCESSES": "0:4242:100,1:4343:100", "FAKE_NVML_COMPUTE_MODE": "2:3"},
         [[0, 0], [0, 0], [0, 0]]),
        # EXCLUSIVE_THREAD excludes other processes too; PROHIBITED refuses every context.
        ({"FAKE_NVML_COMPUTE_MODE": "0:1,1:2", "FAKE_NVML_PROCESSES": "0:4242:1"},
         [[46, 46], [46, 46], [0, 0]]),
        # A process on another GPU does not make an exclusive GPU busy.
        ({"FAKE_NVML_COMPUTE_MODE": "0:3,1:3", "FAKE_NVML_PROCESSES": "2:4242:1"},
         [[0, 0], [0, 0], [0, 0]]),
        # The old knob still wins, on every GPU.
        ({"FAKE_CUDA_CTX_ERROR": 999}, [[999, 999]] * 3),
    ],
)
def test_cuda_context_follows_compute_mode_and_processes(
    fake_driver: FakeDriver, knobs: dict[str, str | int], expected: list[list[int]]
) -> None:
    out = child_json(fake_driver, _contexts("print(json.dumps(contexts()))"),
                     FAKE_NVML_DEVICE_COUNT=3, **knobs)
    assert out == expected


def test_cuda_exclusive_gpu_held_by_the_caller_itself_takes_its_contexts(
    fake_driver: FakeDriver, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    out = child_json(fake_driver, _contexts(f"""
        pathlib.Path({str(state)!r}).write_text(
            f"FAKE_NVML_PROCESSES=0:{{os.getpid()}}:10,1:{{os.getpid()}}:10,1:4242:10\\n")
        print(json.dumps(contexts()))
        """), FAKE_NVML_DEVICE_COUNT=2, FAKE_NVML_COMPUTE_MODE="0:3,1:3",
        FAKE_GPU_STATE_FILE=str(state))
    assert out == [[0, 0], [46, 46]]


def test_cuda_exclusive_mig_instance_is_busy_only_where_its_process_runs(
    fake_driver: FakeDriver
) -> None:
    migs = ",".join(f"MIG-f00d0001-{j:04x}-4000-8000-000000000000" for j in range(2))
    knobs: dict[str, str | int] = {"FAKE_NVML_MIG": "1:2", "FAKE_NVML_COMPUTE_MODE": "1:3",
                                   "FAKE_NVML_PROCESSES": "1.1:4242:100"}
    out = child_json(fake_driver, _contexts("print(json.dumps(contexts()))"),
                     CUDA_VISIBLE_DEVICES=migs, **knobs)
    assert out == [[0, 0], [46, 46]]
    # The whole GPU is busy when any of its instances is.
    out = child_json(fake_driver, _contexts("print(json.dumps(contexts()))"),
                     CUDA_VISIBLE_DEVICES="1", **knobs)
    assert out == [[46, 46]]


@pytest.mark.parametrize(
    ("used_mib", "context_mib", "expected"),
    [
        (H200_MIB - 600, None, [0, 0]),  # 600 MiB free: a default (500 MiB) context fits
        (H200_MIB - 400, None, [2, 2]),  # 400 MiB free: CUDA_ERROR_OUT_OF_MEMORY
        (H200_MIB, None, [2, 2]),
        (H200_MIB - 400, 300, [0, 0]),
        (H200_MIB - 400, 0, [0, 0]),
    ],
)
def test_cuda_context_out_of_memory_when_nvml_shows_the_gpu_nearly_full(
    fake_driver: FakeDriver, used_mib: int, context_mib: int | None, expected: list[int]
) -> None:
    out = child_json(fake_driver, _contexts("print(json.dumps(contexts()))"),
                     FAKE_NVML_DEVICE_COUNT=2, FAKE_NVML_MEMORY_USED_MIB=f"1:{used_mib}",
                     FAKE_CUDA_CONTEXT_MIB=context_mib)
    assert out == [[0, 0], expected]


def test_cuda_mig_context_needs_free_memory_on_its_own_instance(fake_driver: FakeDriver) -> None:
    instance_mib = H200_MIB // 2
    out = child_json(fake_driver, _contexts("print(json.dumps(contexts()))"),
                     FAKE_NVML_MIG="0:2", FAKE_NVML_MEMORY_USED_MIB=f"0.1:{instance_mib - 100}",
                     CUDA_VISIBLE_DEVICES=",".join(
                         f"MIG-f00d0000-{j:04x}-4000-8000-000000000000" for j in range(2)))
    assert out == [[0, 0], [2, 2]]


def test_cuda_context_follows_a_state_file_changed_while_running(
    fake_driver: FakeDriver, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    write_state_file(state, {})
    out = child_json(fake_driver, _contexts(f"""
        def write(text):
            tmp = pathlib.Path({str(state)!r} + ".tmp")
            tmp.write_text(text)
            os.replace(tmp, {str(state)!r})
        out = {{"free": contexts()}}
        held = ctypes.c_void_p()
        assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(held), 0) == 0
        write("FAKE_NVML_PROCESSES=0:4242:10\\nFAKE_NVML_COMPUTE_MODE=0:3,1:3\\n")
        out["busy"] = contexts()  # GPU 0's primary context is still held: retain shares it
        write("FAKE_NVML_MEMORY_USED_MIB=1:{H200_MIB - 10}\\n")
        out["full"] = contexts()
        write("")
        out["gone"] = contexts()
        print(json.dumps(out))
        """), FAKE_NVML_DEVICE_COUNT=2, FAKE_GPU_STATE_FILE=str(state))
    assert out == {"free": [[0, 0], [0, 0]], "busy": [[46, 0], [0, 0]],
                   "full": [[0, 0], [2, 2]], "gone": [[0, 0], [0, 0]]}


# --------------------------------------------------------------------------
# The context log
# --------------------------------------------------------------------------

LOGGED_WORK = """
assert cu.cuInit(0) == 0
n = ctypes.c_int()
cu.cuDeviceGetCount(ctypes.byref(n))
for i in range(n.value):
    ctx, ptr = ctypes.c_void_p(), ctypes.c_uint64()
    if cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, i) == 0:
        cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(4096))
        cu.cuMemFree_v2.argtypes = [ctypes.c_uint64]
        cu.cuMemFree_v2(ptr.value)
        cu.cuCtxDestroy_v2(ctx)
print(json.dumps(os.getpid()))
"""


@pytest.mark.parametrize(
    ("visible", "expected_gpus"),
    [
        (None, [0, 1, 2, 3]),
        ("2,0", [2, 0]),
        (f"{GPU3_UUID},{GPU1_UUID}", [3, 1]),
        ("GPU-f00d0002", [2]),
    ],
)
def test_context_log_names_the_physical_gpu_behind_each_ordinal(
    fake_driver: FakeDriver, tmp_path: Path, visible: str | None, expected_gpus: list[int]
) -> None:
    log = tmp_path / "contexts.jsonl"
    before = time.time()
    pid = child_json(fake_driver, _cuda("import os\n" + LOGGED_WORK), FAKE_NVML_DEVICE_COUNT=4,
                     CUDA_VISIBLE_DEVICES=visible, FAKE_CUDA_CONTEXT_LOG=str(log))
    events = read_context_log(log, event=None)
    assert [(e.event, e.ordinal, e.gpu) for e in events] == [
        (kind, ordinal, gpu) for ordinal, gpu in enumerate(expected_gpus)
        for kind in ("context", "alloc")]
    for e in events:
        assert e.pid == pid and e.result == 0 and e.ok and e.mig is None
        assert e.uuid == e.gpu_uuid == f"GPU-f00d{e.gpu:04x}-0000-4000-8000-00000000{e.gpu:04x}"
        assert e.cuda_visible_devices == visible
        assert before <= e.time <= time.time()
    assert [e.call for e in events[:2]] == ["cuCtxCreate_v2", "cuMemAlloc_v2"]
    assert [e.bytes for e in events[:2]] == [None, 4096]
    assert read_context_log(log) == events[::2]  # contexts only, by default


def test_context_log_records_refusals_and_mig_devices(
    fake_driver: FakeDriver, tmp_path: Path
) -> None:
    log = tmp_path / "contexts.jsonl"
    mig = "MIG-f00d0001-0001-4000-8000-000000000000"
    child_json(fake_driver, _contexts("print(json.dumps(contexts()))"),
               FAKE_NVML_MIG="1:2", FAKE_NVML_COMPUTE_MODE="1:3",
               FAKE_NVML_PROCESSES="1.1:4242:1", FAKE_NVML_MEMORY_USED_MIB=f"0:{H200_MIB}",
               CUDA_VISIBLE_DEVICES=f"0,{mig}", FAKE_CUDA_CONTEXT_LOG=str(log))
    events = read_context_log(log)
    assert [(e.call, e.ordinal, e.gpu, e.mig, e.uuid, e.result) for e in events] == [
        ("cuCtxCreate_v2", 0, 0, None, GPU0_UUID, 2),
        ("cuDevicePrimaryCtxRetain", 0, 0, None, GPU0_UUID, 2),
        ("cuCtxCreate_v2", 1, 1, 1, mig, 46),
        ("cuDevicePrimaryCtxRetain", 1, 1, 1, mig, 46),
    ]
    assert {e.gpu_uuid for e in events[2:]} == {GPU1_UUID}


def test_context_log_lines_stay_whole_across_processes_and_odd_variables(
    fake_driver: FakeDriver, tmp_path: Path
) -> None:
    log = tmp_path / "contexts.jsonl"
    # Parsing stops at the first bad entry, so GPU 1 stays visible; the raw value is logged,
    # bytes outside printable ASCII as \\u00XX (so it reads back as latin-1).
    visible = '1,"\\\\ é\t' + "x" * 2000
    code = _cuda("""
        import os
        assert cu.cuInit(0) == 0
        ctx = ctypes.c_void_p()
        for _ in range(50):
            assert cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, 0) == 0
            assert cu.cuCtxDestroy_v2(ctx) == 0
        """)
    env = _env(fake_driver, CUDA_VISIBLE_DEVICES=visible, FAKE_CUDA_CONTEXT_LOG=str(log))
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE)
             for _ in range(4)]
    for p in procs:
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
    lines = log.read_bytes().split(b"\n")
    assert lines[-1] == b"" and len(lines) == 201
    events = read_context_log(log)
    assert len({e.pid for e in events}) == 4 and {e.gpu for e in events} == {1}
    raw = visible.encode()
    assert {e.cuda_visible_devices for e in events} == {raw[:512].decode("latin-1")}


def test_context_log_reader_skips_a_line_still_being_written(tmp_path: Path) -> None:
    log = tmp_path / "contexts.jsonl"
    assert read_context_log(log) == []
    line = {"event": "context", "call": "cuCtxCreate_v2", "pid": 7, "ordinal": 0, "gpu": 2,
            "mig": None, "uuid": "U", "gpu_uuid": "U", "result": 46, "time": 1.5,
            "cuda_visible_devices": None}
    log.write_text(json.dumps(line) + "\n" + json.dumps(line)[:20])
    [event] = read_context_log(log)
    assert (event.gpu, event.result, event.ok, event.bytes) == (2, 46, False, None)


# --------------------------------------------------------------------------
# FakeJobs: other people's jobs coming and going
# --------------------------------------------------------------------------

NVML_OCCUPANCY = """
import json, pynvml as N
N.nvmlInit()
out = []
for i in range(N.nvmlDeviceGetCount()):
    h = N.nvmlDeviceGetHandleByIndex(i)
    out.append({"mode": N.nvmlDeviceGetComputeMode(h),
                "used_mib": N.nvmlDeviceGetMemoryInfo(h).used // 2**20,
                "procs": [[p.pid, p.usedGpuMemory // 2**20]
                          for p in N.nvmlDeviceGetComputeRunningProcesses(h)]})
print(json.dumps(out))
"""


def _parent_pid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[1])


def _ancestors(pid: int) -> list[int]:
    chain = []
    while pid > 1:
        pid = _parent_pid(pid)
        chain.append(pid)
    return chain


def _gone(pid: int) -> bool:
    """No such process, not even a zombie."""
    return not Path(f"/proc/{pid}").exists()


def test_fake_jobs_come_and_go_on_exclusive_gpus(fake_driver: FakeDriver, tmp_path: Path) -> None:
    log = tmp_path / "contexts.jsonl"
    knobs: dict[str, str | int] = {"FAKE_NVML_DEVICE_COUNT": 3}
    with FakeJobs(tmp_path / "state", knobs=knobs, compute_modes={0: 3, 1: 3},
                  memory_used_mib={2: 100}) as jobs:
        env = {"FAKE_GPU_STATE_FILE": str(jobs.state_file), "FAKE_CUDA_CONTEXT_LOG": str(log)}
        idle = child_json(fake_driver, _contexts("print(json.dumps(contexts()))"), **env)
        job = jobs.start(0, memory_mib=70_000)
        # A real process, alive, and not in our process tree.
        assert not _gone(job.pid) and os.getpid() not in _ancestors(job.pid)
        nvml = child_json(fake_driver, NVML_OCCUPANCY, **env)
        busy = child_json(fake_driver, _contexts("print(json.dumps(contexts()))"), **env)
        assert jobs.running == (job,) and jobs.busy(0) and not jobs.busy(1)
        done = jobs.stop(job)
        assert done.stopped_at is not None and done.started_at <= done.stopped_at
        assert _gone(job.pid)
        after = child_json(fake_driver, _contexts("print(json.dumps(contexts()))"), **env)
    assert idle == after == [[0, 0], [0, 0], [0, 0]]
    assert busy == [[46, 46], [0, 0], [0, 0]]
    assert nvml == [{"mode": 3, "used_mib": 70_000, "procs": [[job.pid, 70_000]]},
                    {"mode": 3, "used_mib": 0, "procs": []},
                    {"mode": 0, "used_mib": 100, "procs": []}]
    events = read_context_log(log)
    assert len(events) == 18
    flagged = jobs.contexts_while_busy(events)
    assert [(e.gpu, e.result) for e in flagged] == [(0, 46), (0, 46)]
    assert all(done.started_at <= e.time <= done.stopped_at for e in flagged)
    assert jobs.contexts_while_busy(events, grace_s=3600) == []
    assert jobs.history == (done,)
    state = (tmp_path / "state").read_text()
    assert "FAKE_NVML_PROCESSES=\n" in state and "FAKE_NVML_DEVICE_COUNT=3\n" in state


def test_fake_jobs_fill_memory_mig_instances_and_own_children(
    fake_driver: FakeDriver, tmp_path: Path
) -> None:
    with FakeJobs(tmp_path / "state", knobs={"FAKE_NVML_DEVICE_COUNT": 2}) as jobs:
        env = {"FAKE_GPU_STATE_FILE": str(jobs.state_file)}
        full = jobs.start(1, memory_mib=H200_MIB - 100)
        mine = jobs.start(0, memory_mib=5, detach=False)
        assert _parent_pid(mine.pid) == os.getpid() and os.getpid() not in _ancestors(full.pid)
        out = child_json(fake_driver, _contexts("print(json.dumps(contexts()))"), **env)
        assert out == [[0, 0], [2, 2]]  # DEFAULT mode: only GPU 1's memory is short
        jobs.set_knobs(FAKE_NVML_MIG="0:2")
        on_mig = jobs.start("0.1", memory_mib=10)
        nvml = child_json(fake_driver, NVML_OCCUPANCY, **env)
        assert nvml[0]["used_mib"] == 15 and sorted(nvml[0]["procs"]) == sorted(
            [[mine.pid, 5], [on_mig.pid, 10]])
        jobs.set_compute_mode(0, 3)
        assert jobs.busy(0, 1) and jobs.busy(0) and jobs.busy(0, 0)  # 0's own job is whole-GPU
        jobs.stop(mine)
        assert not jobs.busy(0, 0) and jobs.busy(0, 1)
        migs = ",".join(f"MIG-f00d0000-{j:04x}-4000-8000-000000000000" for j in range(2))
        out = child_json(fake_driver, _contexts("print(json.dumps(contexts()))"),
                         CUDA_VISIBLE_DEVICES=migs, **env)
        assert out == [[0, 0], [46, 46]]
        with pytest.raises(ValueError, match="FAKE_NVML_PROCESSES"):
            jobs.set_knobs(FAKE_NVML_PROCESSES="0:1:1")
        with pytest.raises(ValueError, match="IDX.J"):
            jobs.start("GPU-0")
        pids = [full.pid, on_mig.pid]
    assert jobs.running == () and len(jobs.history) == 3
    assert all(_gone(pid) for pid in [*pids, mine.pid])


def test_fake_jobs_end_when_the_test_process_dies(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
        from tests.fakes.jobs import FakeJobs
        jobs = FakeJobs({str(tmp_path / "state")!r})
        print(jobs.start(0).pid, jobs.start(1).pid, flush=True)
        os.kill(os.getpid(), 9)
        """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(p) for p in pids)


# --------------------------------------------------------------------------
# Real IREE on the fake CUDA driver
# --------------------------------------------------------------------------

IREE_PROBE = """
import json, numpy as np, iree.runtime as ir
out = {}
try:
    driver = ir.get_driver("cuda")
    out["devices"] = [[d["path"], d["name"]] for d in driver.query_available_devices()]
    device = driver.create_default_device()
    a = np.arange(4096, dtype=np.float32)
    out["roundtrip"] = bool(np.array_equal(ir.asdevicearray(device, a).to_host(), a))
except Exception as e:
    out["error"] = [type(e).__name__, str(e)]
print(json.dumps(out))
"""


def test_iree_healthy(fake_driver: FakeDriver) -> None:
    out = child_json(fake_driver, IREE_PROBE, CUDA_VISIBLE_DEVICES="1,3")
    assert out == {
        "devices": [[GPU1_UUID, "NVIDIA H200"],
                    ["GPU-f00d0003-0000-4000-8000-000000000003", "NVIDIA H200"]],
        "roundtrip": True,
    }


@pytest.mark.parametrize(
    ("knobs", "where", "expected"),
    [
        ({"FAKE_CUDA_INIT_ERROR": 100}, "Error querying devices",
         "CUDA error 'CUDA_ERROR_NO_DEVICE' (100): no CUDA-capable device is detected"),
        ({"FAKE_CUDA_CTX_ERROR": 46}, "Error creating default device",
         "CUDA error 'CUDA_ERROR_DEVICE_UNAVAILABLE' (46): "
         "CUDA-capable device(s) is/are busy or unavailable"),
        ({"FAKE_CUDA_ALLOC_ERROR": 2}, "Failed to allocate buffer",
         "CUDA error 'CUDA_ERROR_OUT_OF_MEMORY' (2): out of memory"),
    ],
)
def test_iree_errors(
    fake_driver: FakeDriver, knobs: dict[str, int], where: str, expected: str
) -> None:
    out = child_json(fake_driver, IREE_PROBE, **knobs)
    kind, text = out["error"]
    assert kind == "RuntimeError"
    assert text.startswith(where) and text.endswith(expected), text


def test_iree_is_refused_only_on_the_busy_exclusive_gpu(
    fake_driver: FakeDriver, tmp_path: Path
) -> None:
    log = tmp_path / "contexts.jsonl"
    knobs: dict[str, str | int] = {
        "FAKE_NVML_COMPUTE_MODE": "0:3,1:3", "FAKE_NVML_PROCESSES": "0:4242:100",
        "FAKE_CUDA_CONTEXT_LOG": str(log)}
    busy = child_json(fake_driver, IREE_PROBE, CUDA_VISIBLE_DEVICES=GPU0_UUID, **knobs)
    kind, text = busy["error"]
    assert text.startswith("Error creating default device") and text.endswith(
        "CUDA error 'CUDA_ERROR_DEVICE_UNAVAILABLE' (46): "
        "CUDA-capable device(s) is/are busy or unavailable"), text
    free = child_json(fake_driver, IREE_PROBE, CUDA_VISIBLE_DEVICES=GPU1_UUID, **knobs)
    assert free["roundtrip"] is True
    events = read_context_log(log)
    assert [(e.gpu, e.uuid, e.result) for e in events] == [
        (0, GPU0_UUID, 46), (1, GPU1_UUID, 0)]
    assert {e.cuda_visible_devices for e in events} == {GPU0_UUID, GPU1_UUID}
    allocs = read_context_log(log, event="alloc")
    assert allocs and {(e.gpu, e.result) for e in allocs} == {(1, 0)}


# --------------------------------------------------------------------------
# Fake nvidia-smi (real pynvml on the fake NVML)
# --------------------------------------------------------------------------


def test_smi_table_and_list(fake_driver: FakeDriver) -> None:
    table = smi(fake_driver, FAKE_NVML_DEVICE_COUNT=2, FAKE_NVML_MEMORY_USED_MIB="1:2048",
                FAKE_NVML_UTILIZATION="1:55", FAKE_NVML_PROCESSES="1:4242:2048")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert "Driver Version: 570.124.06" in lines[2] and "CUDA Version: 12.8" in lines[2]
    rows = [ln for ln in lines if "NVIDIA H200" in ln]
    assert len(rows) == 2 and "00000000:19:00.0" in rows[1]
    assert any("2048MiB / 143771MiB" in ln and "55%" in ln for ln in lines)
    assert any("4242" in ln and "2048MiB" in ln for ln in lines)
    assert all(len(ln) == 91 for ln in lines[1:] if ln.startswith(("|", "+")))

    listing = smi(fake_driver, "-L", FAKE_NVML_DEVICE_COUNT=2, FAKE_NVML_MIG="1:2")
    assert listing.returncode == 0
    lines = listing.stdout.splitlines()
    assert lines[0] == f"GPU 0: NVIDIA H200 (UUID: {GPU0_UUID})"
    assert lines[1] == f"GPU 1: NVIDIA H200 (UUID: {GPU1_UUID})"
    assert lines[2].endswith("Device  0: (UUID: MIG-f00d0001-0000-4000-8000-000000000000)")
    assert len(lines) == 4


def test_smi_csv_queries(fake_driver: FakeDriver) -> None:
    fields = "index,uuid,name,pci.bus_id,memory.total,memory.used,memory.free"
    gpu = smi(fake_driver, f"--query-gpu={fields}", "--format=csv,noheader,nounits",
              FAKE_NVML_DEVICE_COUNT=3, FAKE_NVML_MEMORY_USED_MIB="2:100")
    assert gpu.returncode == 0, gpu.stderr
    assert gpu.stdout.splitlines() == [
        f"0, {GPU0_UUID}, NVIDIA H200, 00000000:18:00.0, 143771, 0, 143771",
        f"1, {GPU1_UUID}, NVIDIA H200, 00000000:19:00.0, 143771, 0, 143771",
        "2, GPU-f00d0002-0000-4000-8000-000000000002, NVIDIA H200, 00000000:1A:00.0, "
        "143771, 100, 143671",
    ]
    subset = smi(fake_driver, "--query-gpu=memory.used,index", "--format=csv",
                 FAKE_NVML_DEVICE_COUNT=1)
    assert subset.stdout.splitlines() == ["memory.used [MiB], index", "0 MiB, 0"]

    apps = smi(fake_driver, "--query-compute-apps=pid,gpu_uuid,used_memory",
               "--format=csv,noheader,nounits", FAKE_NVML_PROCESSES="0:1234:512,1:77:3")
    assert apps.returncode == 0
    assert apps.stdout.splitlines() == [f"1234, {GPU0_UUID}, 512", f"77, {GPU1_UUID}, 3"]
    none = smi(fake_driver, "--query-compute-apps=pid,gpu_uuid,used_memory",
               "--format=csv,noheader,nounits")
    assert (none.returncode, none.stdout) == (0, "")

    bad = smi(fake_driver, "--query-gpu=bogus", "--format=csv")
    assert bad.returncode == 2 and 'Field "bogus" is not a valid field' in bad.stdout


def test_smi_xml(fake_driver: FakeDriver) -> None:
    proc = smi(fake_driver, "-q", "-x", FAKE_NVML_DEVICE_COUNT=2,
               FAKE_NVML_REMAPPED_ROWS="1:0/2/1/0")
    assert proc.returncode == 0, proc.stderr
    root = ET.fromstring(proc.stdout.split("\n", 2)[2])
    assert root.tag == "nvidia_smi_log"
    assert root.findtext("driver_version") == "570.124.06"
    assert root.findtext("cuda_version") == "12.8"
    assert root.findtext("attached_gpus") == "2"
    gpus = root.findall("gpu")
    assert [g.get("id") for g in gpus] == ["00000000:18:00.0", "00000000:19:00.0"]
    assert gpus[1].findtext("product_name") == "NVIDIA H200"
    assert gpus[1].findtext("uuid") == GPU1_UUID
    assert gpus[1].findtext("fb_memory_usage/total") == "143771 MiB"
    assert gpus[1].findtext("fb_memory_usage/free") == "143771 MiB"
    assert gpus[1].findtext("remapped_rows/remapped_row_unc") == "2"
    assert gpus[1].findtext("remapped_rows/remapped_row_pending") == "Yes"


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (9, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
            "Make sure that the latest NVIDIA driver is installed and running.\n\n"),
        (18, "Failed to initialize NVML: Driver/library version mismatch\n"
             "NVML library version: 570.124\n"),
        (4, "Failed to initialize NVML: Insufficient Permissions\n"),
    ],
)
def test_smi_init_failures(fake_driver: FakeDriver, code: int, expected: str) -> None:
    proc = smi(fake_driver, FAKE_NVML_INIT_ERROR=code)
    assert (proc.returncode, proc.stdout) == (code, expected)


def test_smi_lost_gpu_hang_exit_and_bare_env(fake_driver: FakeDriver, tmp_path: Path) -> None:
    lost = smi(fake_driver, "-L", FAKE_NVML_DEVICE_COUNT=2, FAKE_NVML_DEVICE_ERRORS="1:15")
    assert lost.returncode == 15
    assert lost.stdout.splitlines()[1] == (
        "Unable to determine the device handle for GPU0000:19:00.0: "
        "GPU is lost.  Reboot the system to recover this GPU")

    forced = smi(fake_driver, "-L", FAKE_NVIDIA_SMI_EXIT=3)
    assert forced.returncode == 3 and GPU0_UUID in forced.stdout

    assert_hangs([str(fake_driver.nvidia_smi)], _env(fake_driver, FAKE_NVIDIA_SMI_HANG=1),
                 seconds=1.0)

    # Like the real tool, it finds "its" NVML without LD_LIBRARY_PATH, and it
    # honours the state file.
    state = tmp_path / "state"
    write_state_file(state, {"FAKE_NVML_DEVICE_COUNT": 1, "FAKE_GPU_NAME": "NVIDIA B200"})
    bare = smi(fake_driver, "-L", env={"PATH": f"{fake_driver.bin_dir}:/usr/bin:/bin",
                                       "FAKE_NVML_DEVICE_COUNT": "4",
                                       "FAKE_GPU_STATE_FILE": str(state)})
    assert bare.returncode == 0, bare.stdout + bare.stderr
    assert bare.stdout == f"GPU 0: NVIDIA B200 (UUID: {GPU0_UUID})\n"


def test_nvml_xids_are_delivered_by_content_when_the_state_file_is_rewritten(
        fake_driver: FakeDriver, tmp_path: Path) -> None:
    """A rewritten list delivers what it holds beyond what was delivered (issue 41)."""
    state = tmp_path / "state"
    write_state_file(state, {"FAKE_NVML_XIDS": "0:79"})
    watcher = textwrap.dedent("""
        import json, sys, pynvml as N
        N.nvmlInit()
        s = N.nvmlEventSetCreate()
        for i in range(4):
            N.nvmlDeviceRegisterEvents(N.nvmlDeviceGetHandleByIndex(i),
                                       N.nvmlEventTypeXidCriticalError, s)
        for _ in sys.stdin:  # one line: take everything pending now
            got = []
            while True:
                try:
                    d = N.nvmlEventSetWait_v2(s, 300)
                except N.NVMLError:
                    break
                got.append([N.nvmlDeviceGetIndex(d.device), d.eventData])
            print(json.dumps(got), flush=True)
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", watcher], env=_env(fake_driver, FAKE_GPU_STATE_FILE=str(state)),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None

    def take(xids: str | None) -> list[list[int]]:
        if xids is not None:
            write_state_file(state, {"FAKE_NVML_XIDS": xids})
        proc.stdin.write("\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        taken: list[list[int]] = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        return taken

    try:
        assert take(None) == [[0, 79]]
        assert take("2:13") == [[2, 13]]           # replaced, not appended: still delivered
        assert take("2:13") == []                  # the same content: nothing new
        assert take("0:79,2:13,0:79") == [[0, 79]]  # listed once more: delivered once more
        assert take("") == []
    finally:
        proc.kill()
        proc.wait()
