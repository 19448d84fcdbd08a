"""NVIDIA's real user space (Debian non-free 535: libnvidia-ml, libcuda, nvidia-smi) without a
kernel module: the very common "driver installed but not loaded" host, with real texts.

tests/support/realnvidia.py fetches the packages into ``.cache/nvidia-userspace`` once. Every
command that loads them runs in a private mount namespace whose /dev is a tmpfs copy (as root the
real libraries create /dev/nvidiactl when it is missing): once without NVIDIA nodes, once
with stale ones (nodes with no driver behind them, as in a container after a host upgrade).
gpudiag's probe, preflight, health and daemon must name ``driver_not_loaded`` first and carry
the real texts; the fakes' knobs for the same faults (NVML 9, cuInit 100, nvidia-smi's exit
9) must print exactly what the real libraries print, and the fakes' error tables must agree
with the real ones.

Skipped with the reason where the packages or a private /dev cannot be had;
``GPUDIAG_REAL_NVIDIA=require``, or root under ``CI=true``, makes that a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fakes.build import FakeDriver
from tests.support.daemon import Daemon, daemon_toml, wait_for, write_config
from tests.support.host import clean_env
from tests.support.privatedev import in_private_dev, namespace_problem
from tests.support.realnvidia import (
    NvidiaUserspace,
    UserspaceUnavailable,
    ensure_nvidia_userspace,
)

pytestmark = [pytest.mark.timeout(600)]
STALE = [0, 1]  # no NVIDIA node at all; stale /dev/nvidia0, nvidiactl, nvidia-uvm

# What a child prints: NVML's init error, cuInit's code/name/text, for one library set.
TEXTS = r"""
import ctypes, json, pynvml
out = {}
try:
    pynvml.nvmlInit()
    out["nvml"] = None
except pynvml.NVMLError as e:
    out["nvml"] = [e.value, str(e)]
cu = ctypes.CDLL("libcuda.so.1")
rc = cu.cuInit(0)
name, text = ctypes.c_char_p(), ctypes.c_char_p()
cu.cuGetErrorName(rc, ctypes.byref(name))
cu.cuGetErrorString(rc, ctypes.byref(text))
out["cuinit"] = [rc, name.value.decode(), text.value.decode()]
print(json.dumps(out))
"""

# The error tables: nvmlErrorString 0..27 (28 onward are newer than 535) and every code
# cuGetErrorName knows from 0 to 1000, with its cuGetErrorString.
TABLES = r"""
import ctypes, json
nv = ctypes.CDLL("libnvidia-ml.so.1")
nv.nvmlErrorString.restype = ctypes.c_char_p
cu = ctypes.CDLL("libcuda.so.1")
cuda = {}
for code in range(1001):
    name, text = ctypes.c_char_p(), ctypes.c_char_p()
    if cu.cuGetErrorName(code, ctypes.byref(name)) == 0:
        cu.cuGetErrorString(code, ctypes.byref(text))
        cuda[code] = [name.value.decode(), text.value.decode()]
print(json.dumps({"nvml": {c: nv.nvmlErrorString(c).decode() for c in range(28)},
                  "cuda": cuda}))
"""


def _unavailable(reason: str) -> None:
    if os.environ.get("GPUDIAG_REAL_NVIDIA") == "require" or (
            os.environ.get("CI") == "true" and os.geteuid() == 0):
        pytest.fail(f"the real NVIDIA user-space tier is required here but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def real() -> NvidiaUserspace:
    """The unpacked packages, or a skip (a failure when required) saying why."""
    if os.environ.get("GPUDIAG_REAL_NVIDIA") == "0":
        pytest.skip("the real NVIDIA user-space tier is turned off (GPUDIAG_REAL_NVIDIA=0)")
    problem = namespace_problem()
    if problem is not None:
        _unavailable(f"no private /dev for NVIDIA's libraries: {problem}")
    try:
        return ensure_nvidia_userspace()
    except UserspaceUnavailable as e:
        _unavailable(f"NVIDIA's user-space packages could not be fetched: {e}")
        raise  # not reached: skip and fail raise


@pytest.fixture(scope="module", autouse=True)
def host_dev_untouched() -> Iterator[None]:
    """The machine's own /dev gains no NVIDIA node from this tier."""
    before = sorted(p.name for p in Path("/dev").glob("nvidia*"))
    yield
    assert sorted(p.name for p in Path("/dev").glob("nvidia*")) == before


def _env(lib_dir: Path, bin_dir: Path, **extra: str) -> dict[str, str]:
    env = clean_env()
    env["LD_LIBRARY_PATH"] = str(lib_dir)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', os.defpath)}"
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
    env.update(extra)
    return env


def _real_env(real: NvidiaUserspace) -> dict[str, str]:
    return _env(real.lib_dir, real.bin_dir)


def _run(argv: list[str], env: dict[str, str], stale: int | None
         ) -> subprocess.CompletedProcess[str]:
    """``argv``; inside a private /dev with ``stale`` nodes unless ``stale`` is None (fakes)."""
    cmd = argv if stale is None else in_private_dev(argv, stale)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180,
                          check=False)


def _json(proc: subprocess.CompletedProcess[str]) -> Any:
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError as e:
        raise AssertionError(f"no JSON: rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
                             ) from e


# -- the fakes print what NVIDIA's libraries print ----------------------------------------------
@pytest.mark.parametrize("stale", STALE)
def test_the_fake_driver_not_loaded_texts_are_the_real_ones(
        real: NvidiaUserspace, fakes: FakeDriver, stale: int) -> None:
    got = _json(_run([sys.executable, "-c", TEXTS], _real_env(real), stale))
    assert got == {"nvml": [9, "Driver Not Loaded"],
                   "cuinit": [100, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"]}
    fake_env = _env(fakes.lib_dir, fakes.bin_dir, FAKE_NVML_INIT_ERROR="9",
                    FAKE_CUDA_INIT_ERROR="100")
    assert _json(_run([sys.executable, "-c", TEXTS], fake_env, None)) == got


@pytest.mark.parametrize("stale", STALE)
def test_the_fake_nvidia_smi_fails_like_the_real_one(
        real: NvidiaUserspace, fakes: FakeDriver, stale: int) -> None:
    smi = _run([str(real.bin_dir / "nvidia-smi")], _real_env(real), stale)
    assert smi.returncode == 9 and smi.stderr == ""
    assert smi.stdout.startswith("NVIDIA-SMI has failed because it couldn't communicate "
                                 "with the NVIDIA driver.")
    fake = _run([str(fakes.nvidia_smi)], _env(fakes.lib_dir, fakes.bin_dir,
                                              FAKE_NVML_INIT_ERROR="9"), None)
    assert (fake.returncode, fake.stdout, fake.stderr) == (
        smi.returncode, smi.stdout, smi.stderr)


def test_the_fake_error_tables_are_the_real_ones(real: NvidiaUserspace,
                                                 fakes: FakeDriver) -> None:
    got = _json(_run([sys.executable, "-c", TABLES], _real_env(real), 0))
    fake = _json(_run([sys.executable, "-c", TABLES], _env(fakes.lib_dir, fakes.bin_dir),
                      None))
    assert fake["nvml"] == got["nvml"]
    assert fake["cuda"] == got["cuda"]


# -- gpudiag over the real libraries: driver_not_loaded first, with the real texts -------------
@pytest.mark.parametrize("stale", STALE)
def test_probe_names_driver_not_loaded_with_the_real_evidence(real: NvidiaUserspace,
                                                              stale: int) -> None:
    proc = _run([sys.executable, "-m", "gpudiag", "probe", "--backend", "host,nvml,cuda",
                 "--format", "json"], _real_env(real), stale)
    rec = _json(proc)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert rec["gpu_validation_blocker"] == "driver_not_loaded"
    codes = [b["code"] for b in rec["blockers"]]
    assert "cuda_no_device" in codes
    nvml = next(b for b in rec["blockers"] if b["code"] == "driver_not_loaded")
    assert "NVML_ERROR_DRIVER_NOT_LOADED (9): Driver Not Loaded" in nvml["message"]
    cuda = next(b for b in rec["blockers"] if b["code"] == "cuda_no_device")
    assert "no CUDA-capable device is detected" in cuda["message"]
    smi = rec["evidence"]["nvidia_smi"]
    assert smi["exit_code"] == 9 and "couldn't communicate" in smi["stdout"]


@pytest.mark.parametrize("command", ["preflight", "health"])
def test_preflight_and_health_block_on_the_real_libraries(real: NvidiaUserspace,
                                                          command: str) -> None:
    proc = _run([sys.executable, "-m", "gpudiag", command, "--require", "cuda,iree",
                 "--no-daemon", "--format", "json"], _real_env(real), 1)
    rec = _json(proc)
    assert proc.returncode == 1, proc.stderr
    assert rec["gpu_validation_blocker"] == "driver_not_loaded" and rec["ready"] is False
    # IREE's CUDA HAL loaded the real libcuda.so and met cuInit's real 100.
    iree = [b for b in rec["blockers"] if b["layer"] == "iree"]
    assert iree and "CUDA_ERROR_NO_DEVICE" in iree[0]["message"]


def test_the_daemon_serves_driver_not_loaded_for_rounds(real: NvidiaUserspace,
                                                        tmp_path: Path) -> None:
    config = write_config(tmp_path / "gpudiag.toml", daemon_toml({
        "backends.nvml": {"interval_s": 0.5, "deadline_s": 20},
        "backends.cuda": {"interval_s": 1, "deadline_s": 20},
        "xid": {"enabled": False}}))
    prefix = tuple(in_private_dev([], gpus=1))
    daemon = Daemon(_real_env(real), config, tmp_path / "state", prefix=prefix)
    try:
        daemon.wait_ready(timeout=60)
        status, rec = daemon.get("/v1/preflight?require=cuda")
        assert status == 200 and rec["gpu_validation_blocker"] == "driver_not_loaded"

        def rounds() -> bool:
            with urllib.request.urlopen(daemon.url + "/metrics", timeout=30) as r:
                text = r.read().decode()
            runs = {(s.labels["backend"], s.labels["outcome"]): s.value
                    for f in text_string_to_metric_families(text) for s in f.samples
                    if s.name == "gpudiag_probe_runs_total"}
            return runs.get(("nvml", "ok"), 0) >= 3

        wait_for(rounds, 60, interval=0.5)
        with urllib.request.urlopen(daemon.url + "/metrics", timeout=30) as r:
            samples = {(s.name, s.labels.get("code")): s.value
                       for f in text_string_to_metric_families(r.read().decode())
                       for s in f.samples}
        assert samples[("gpudiag_blocker", "driver_not_loaded")] == 1
        assert samples[("gpudiag_blocker", "cuda_no_device")] == 1
        assert samples[("gpudiag_ready", None)] == 0
    finally:
        code = daemon.stop()
    assert code == 0, "\n".join(daemon.lines[-30:])
