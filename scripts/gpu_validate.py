"""The Python half of scripts/gpu-validate.sh: small tools the shell script calls.

    python scripts/gpu_validate.py hold [--mib N] [--max-s S]
        Hold a CUDA context and N MiB of device memory on ordinal 0 (ctypes on libcuda.so.1)
        until SIGTERM, stdin EOF or --max-s; prints "holding pid=... bytes=..." once it holds.
    python scripts/gpu_validate.py watch-apps OUT --root PID --helper PID --baseline FILE
                                              [--since EPOCH]
        Poll `nvidia-smi --query-compute-apps` until SIGTERM; write OUT (JSON): every PID seen
        besides the baseline's, and whether it belongs to the validation run (descends from
        --root) other than the helper, and started before or after EPOCH.
    python scripts/gpu_validate.py texts OUTDIR [--fakes DIR]
        The safe faults' real texts (NVML, driver, JAX CUDA plugin, IREE CUDA HAL, gpudiag's
        verdict), verbatim, next to what the fake driver prints for the same fault.
    python scripts/gpu_validate.py rules-test METRICS RULES OUT
        A `promtool test rules` file whose input series are the scraped samples and whose
        expectations are the recording rules' values computed here from the same samples.
    python scripts/gpu_validate.py judge-apps FILE | judge-free FILE EPOCH
        One line "pass|fail DETAIL" about a watch-apps report, or about a verdict having
        turned ready on a free GPU proven since EPOCH.
    python scripts/gpu_validate.py spin [--seconds S] | compute [--seconds S] [--n N]
        The job watch's runs on CUDA ordinal 0: one thread spinning on a flag in device
        memory (a hung collective: 100% utilization, low power; ends by itself 10 s after S),
        and a JAX bf16 matmul loop (real work).
    python scripts/gpu_validate.py samples-summary CSV [--skip-s N]
        Utilization, power, power over its limit and SM clock (p1/p50/p99) per GPU, from the
        `nvidia-smi --query-gpu` samples (SAMPLE_FIELDS, csv,noheader,nounits).
    python scripts/gpu_validate.py inventory SMI_Q [NVML_JSON] | inventory-diff BEFORE AFTER
        The GPU's settings and firmware (VBIOS, InfoROM, GSP, power limits, application and
        max clocks, persistence, ECC, compute and MIG mode) as JSON; whether two are equal.
    python scripts/gpu_validate.py get FILE PATH
        A JSON value by dotted path (devices.0.occupancy); prints nothing when absent.

Standard library only (plus what gpudiag itself needs), so that it runs on the device machine
without network; nothing here changes a GPU's settings.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20
BOGUS_UUID = "GPU-00000000-0000-0000-0000-000000000000"
Step = tuple[str, Callable[[], int]]

# ---------------------------------------------------------------------------------------------
# hold: the occupancy helper (someone else's job, as far as gpudiag can tell)
# ---------------------------------------------------------------------------------------------


def _cuda_error(lib: Any, rc: int) -> str:
    name, text = ctypes.c_char_p(), ctypes.c_char_p()
    lib.cuGetErrorName(rc, ctypes.byref(name))
    lib.cuGetErrorString(rc, ctypes.byref(text))
    return f"{rc} {(name.value or b'?').decode()} ({(text.value or b'?').decode()})"


def hold(mib: int, max_s: float) -> int:
    """Hold a context and ``mib`` MiB on CUDA ordinal 0 until told to stop; 1 if it could not."""
    stop = {"now": False}

    def on_signal(signum: int, frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        print(f"failed: {e}", flush=True)
        return 1
    dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
    size = mib * MIB
    steps: tuple[Step, ...]  # (what, the driver call): run in order, the first error ends it
    steps = (("cuInit", lambda: lib.cuInit(0)),
             ("cuDeviceGet", lambda: lib.cuDeviceGet(ctypes.byref(dev), 0)),
             ("cuCtxCreate_v2", lambda: lib.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev)),
             ("cuMemAlloc_v2", lambda: lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(size))),
             # Touch the memory so that it is resident, not only reserved.
             ("cuMemsetD8_v2", lambda: lib.cuMemsetD8_v2(ptr, ctypes.c_ubyte(0),
                                                          ctypes.c_size_t(size))))
    try:
        for name, call in steps:
            rc = call()
            if rc != 0:
                print(f"failed: {name}: {_cuda_error(lib, rc)}", flush=True)
                return 1
        print(f"holding pid={os.getpid()} bytes={size}", flush=True)
        deadline = time.monotonic() + max_s  # never outlive the run, even if nobody stops it
        while not stop["now"] and time.monotonic() < deadline:
            time.sleep(0.1)
        return 0
    finally:
        if ptr.value:
            lib.cuMemFree_v2(ptr)
        if ctx.value:
            lib.cuCtxDestroy_v2(ctx)


# ---------------------------------------------------------------------------------------------
# watch-apps: no context of gpudiag's own while the helper holds the GPU
# ---------------------------------------------------------------------------------------------


def compute_app_pids() -> list[int] | None:
    """PIDs that nvidia-smi lists as compute apps; None when it could not be asked."""
    try:
        proc = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    return [int(t) for t in proc.stdout.split() if t.strip().isdigit()]


def ancestry(pid: int) -> list[int] | None:
    """``pid`` and its ancestors, from /proc; None when it is gone (or in another namespace)."""
    chain: list[int] = []
    while pid > 1 and len(chain) < 64:
        chain.append(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None if len(chain) == 1 else chain
        pid = int(stat.rpartition(")")[2].split()[1])
    return chain


def started_at(pid: int) -> float | None:
    """When ``pid`` started, in Unix seconds (from /proc); None when that cannot be read."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def watch_apps(out: Path, root: int, helper: int, baseline: set[int], interval_s: float,
               since: float) -> int:
    """Poll the compute apps until SIGTERM; write what was seen besides the baseline.

    A process of this run that started before ``since`` (the helper held the GPU from then)
    read NVML while the GPU was free: the window DESIGN accepts, reported but not a violation.
    """
    stop = {"now": False}

    def on_signal(signum: int, frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    seen: dict[int, dict[str, Any]] = {}
    polls = failed = 0
    while not stop["now"]:
        pids = compute_app_pids()
        polls += 1
        if pids is None:
            failed += 1
        for pid in pids or []:
            if pid in baseline or pid in seen:
                continue
            chain = ancestry(pid)
            start = started_at(pid)
            entry: dict[str, Any] = {"first_seen": time.time(), "cmdline": cmdline(pid),
                                     "ancestry": chain, "started_at": start}
            if pid == helper:
                entry["role"] = "helper"
            elif chain is None:
                entry["role"] = "unresolved"  # gone already, or a PID of another namespace
            elif root in chain and start is not None and start < since - 0.05:
                entry["role"] = "ours-before"  # started while the GPU was free
            elif root in chain:
                entry["role"] = "ours"        # the daemon, a probe child, inline preflight
            else:
                entry["role"] = "other"       # someone else's job on a shared card
            seen[pid] = entry
        time.sleep(interval_s)
    report = {"polls": polls, "failed_polls": failed, "helper": helper, "root": root,
              "since": since,
              "baseline": sorted(baseline), "seen": {str(k): v for k, v in seen.items()}}
    out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


def judge_apps(path: Path) -> int:
    """Print "pass|fail DETAIL" for a watch-apps report: no PID of the run's own but the helper."""
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        print(f"fail no watch report ({e})")
        return 0
    seen = report["seen"]
    ours = {p: e["cmdline"] or "?" for p, e in seen.items() if e["role"] in ("ours", "unresolved")}
    helper_seen = any(e["role"] == "helper" for e in seen.values())
    before = {p: e["cmdline"] for p, e in seen.items() if e["role"] == "ours-before"}
    what = (f"{report['polls']} polls ({report['failed_polls']} failed), helper pid "
            f"{report['helper']} {'seen' if helper_seen else 'NEVER seen'}, others' pids "
            f"{sorted(int(p) for p, e in seen.items() if e['role'] == 'other')}"
            + (f", ours started before the helper held the GPU: {before}" if before else ""))
    if ours:
        print(f"fail pids of this run on the GPU besides the helper: {ours}; {what}")
    elif not helper_seen or report["polls"] == report["failed_polls"]:
        print(f"fail cannot prove it: nvidia-smi never listed the helper; {what}")
    else:
        print(f"pass no context of the daemon, its probes or inline preflight; {what}")
    return 0


def judge_free(path: Path, since: float) -> int:
    """Print "pass|fail DETAIL": the verdict is ready on a free GPU proven at or after ``since``."""
    from datetime import datetime

    try:
        record = json.loads(path.read_text())
        device = record["devices"][0]
    except (OSError, ValueError, KeyError, IndexError) as e:
        print(f"fail no verdict with a device ({type(e).__name__}: {e})")
        return 0
    proven = device.get("last_proven_at")
    try:
        proven_s = datetime.fromisoformat(str(proven).replace("Z", "+00:00")).timestamp()
    except ValueError:
        proven_s = float("-inf")
    detail = (f"blocker={record.get('gpu_validation_blocker')} occupancy="
              f"{device.get('occupancy')} last_proven_at={proven} (helper stopped at "
              f"{datetime.fromtimestamp(since).astimezone().isoformat(timespec='seconds')})")
    ok = (record.get("gpu_validation_blocker") == "none" and device.get("occupancy") == "free"
          and proven_s >= since - 1)
    print(("pass " if ok else "fail ") + detail)
    return 0


# ---------------------------------------------------------------------------------------------
# texts: the real driver stack's words for safe faults, next to the fakes'
# ---------------------------------------------------------------------------------------------

# Each program prints its full story, then one "result: ..." line that the comparison uses.
PROGRAMS: dict[str, str] = {
    "nvml": r"""
import pynvml
def err(e):
    return f"{type(e).__name__} value={getattr(e, 'value', '?')} str={e}"
try:
    pynvml.nvmlInit()
except pynvml.NVMLError as e:
    print("result: nvmlInit", err(e)); raise SystemExit(0)
n = pynvml.nvmlDeviceGetCount()
for i in range(n):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    print(i, pynvml.nvmlDeviceGetName(h), pynvml.nvmlDeviceGetUUID(h))
parts = [f"count={n}"]
for label, call in (("ByIndex(99)", lambda: pynvml.nvmlDeviceGetHandleByIndex(99)),
                    ("ByUUID(bogus)", lambda: pynvml.nvmlDeviceGetHandleByUUID(
                        b"GPU-00000000-0000-0000-0000-000000000000"))):
    try:
        call(); parts.append(f"{label}=ok")
    except pynvml.NVMLError as e:
        parts.append(f"{label}={err(e)}")
print("result:", "; ".join(parts))
""",
    "driver": r"""
import ctypes
try:
    lib = ctypes.CDLL("libcuda.so.1")
except OSError as e:
    print(f"result: OSError: {e}"); raise SystemExit(0)
def name(rc):
    n, s = ctypes.c_char_p(), ctypes.c_char_p()
    lib.cuGetErrorName(rc, ctypes.byref(n)); lib.cuGetErrorString(rc, ctypes.byref(s))
    return f"{rc} {(n.value or b'?').decode()} '{(s.value or b'?').decode()}'"
rc = lib.cuInit(0)
print("cuInit:", name(rc))
count = ctypes.c_int(-1)
crc = lib.cuDeviceGetCount(ctypes.byref(count))
print("cuDeviceGetCount:", name(crc), "count", count.value)
for i in range(max(count.value, 0)):
    buf = ctypes.create_string_buffer(256)
    lib.cuDeviceGetName(buf, 256, i)
    print(i, buf.value.decode())
print(f"result: cuInit={name(rc)} count={count.value}")
""",
    "jax": r"""
import os, traceback
print("JAX_PLATFORMS=", os.environ.get("JAX_PLATFORMS"), "CUDA_VISIBLE_DEVICES=",
      repr(os.environ.get("CUDA_VISIBLE_DEVICES")))
try:
    import jax
    print("result: devices", jax.devices())
except BaseException as e:
    traceback.print_exc()
    first = (str(e).strip().splitlines() or [""])[0]
    print(f"result: {type(e).__name__}: {first}")
""",
    "iree": r"""
import traceback
def first(e):
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
parts = []
try:
    import iree.runtime as rt
    drv = rt.get_driver("cuda")
except BaseException as e:
    traceback.print_exc(); print("result: get_driver", first(e)); raise SystemExit(0)
try:
    devs = drv.query_available_devices()
    print("devices:", devs); parts.append(f"devices={len(devs)}")
except BaseException as e:
    traceback.print_exc(); parts.append("query " + first(e))
for label, make in (("default", lambda: drv.create_default_device()),
                    ("bogus-uuid", lambda: drv.create_device_by_uri(
                        "cuda://GPU-00000000-0000-0000-0000-000000000000")),
                    ("index-99", lambda: drv.create_device_by_uri("cuda://99"))):
    try:
        make(); parts.append(f"{label}=ok")
    except BaseException as e:
        print(label, "->", repr(e)); parts.append(f"{label}=" + first(e))
print("result:", "; ".join(parts))
""",
}

#: The safe faults: environment changes only (nothing touches the card's settings).
FAULTS: dict[str, dict[str, str]] = {
    "baseline": {},
    "cvd-empty": {"CUDA_VISIBLE_DEVICES": ""},
    "cvd-bogus-uuid": {"CUDA_VISIBLE_DEVICES": BOGUS_UUID},
    "cvd-index-7": {"CUDA_VISIBLE_DEVICES": "7"},
}


def _run(argv: Sequence[str], env: Mapping[str, str], timeout_s: float) -> tuple[int | str, str]:
    try:
        proc = subprocess.run(list(argv), env=dict(env), capture_output=True, text=True,
                              timeout=timeout_s, check=False, errors="replace",
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) \
            else (e.stdout or "")
        return "timeout", out + f"\n(timed out after {timeout_s} s)\n"
    return proc.returncode, f"--- stdout\n{proc.stdout}--- stderr\n{proc.stderr}"


def _result_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.startswith("result:")]
    return lines[-1][len("result:"):].strip() if lines else "(no result line)"


def _gpudiag_result(text: str) -> str:
    start, end = text.find("{"), text.rfind("}")
    try:
        record = json.loads(text[start:end + 1])
    except ValueError:
        return "(no verdict record)"
    codes = [b.get("code") for b in record.get("blockers", [])]
    return f"blocker={record.get('gpu_validation_blocker')} blockers={','.join(map(str, codes))}"


def _fake_env(fakes: Path, base: Mapping[str, str], gpus: int, scratch: Path) -> dict[str, str]:
    sys.path.insert(0, str(REPO))
    from tests.fakes.build import FakeDriver  # the same env() the tests use

    driver = FakeDriver(root=fakes, lib_dir=fakes / "lib", bin_dir=fakes / "bin")
    env = driver.env(base=base, FAKE_NVML_DEVICE_COUNT=max(gpus, 1))
    if not Path("/dev/nvidiactl").exists():  # a GPU-less host: healthy look-alike nodes
        from tests.support.host import make_host_dirs
        dev, proc = make_host_dirs(scratch / "host", gpus=max(gpus, 1))
        env["GPUDIAG_DEVICE_DIR"], env["GPUDIAG_DRIVER_PROC_DIR"] = str(dev), str(proc)
    return env


def texts(out: Path, fakes: Path | None, timeout_s: float) -> int:
    """Run every program under every fault, really and on the fakes; write the comparison."""
    out.mkdir(parents=True, exist_ok=True)
    base = {k: v for k, v in os.environ.items()
            if k not in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "JAX_PLATFORMS")}
    base["JAX_PLATFORMS"] = "cuda"  # no silent CPU fallback: the plugin's own words
    base["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # never 75% of a shared card
    real_gpus = len(compute_gpu_uuids())
    sides: dict[str, dict[str, str]] = {"real": base}
    scratch = Path(tempfile.mkdtemp(prefix="gpuval-texts-"))
    if fakes is not None:
        sides["fake"] = _fake_env(fakes, base, real_gpus, scratch)
    gpudiag = [sys.executable, "-m", "gpudiag", "preflight", "--no-daemon", "--require",
               "cuda,jax", "--format", "json"]
    programs, verdicts = [], []
    for fault, changes in FAULTS.items():
        for side, env in sides.items():
            fenv = {**env, **changes}
            for layer, code in PROGRAMS.items():
                programs.append((fault, side, layer, [sys.executable, "-c", code], fenv))
            verdicts.append((fault, side, "gpudiag", gpudiag, fenv))
    results: dict[tuple[str, str, str], str] = {}

    def one(job: tuple[str, str, str, list[str], dict[str, str]]) -> None:
        fault, side, layer, argv, env = job
        rc, text = _run(argv, env, timeout_s)
        (out / f"{fault}.{layer}.{side}.txt").write_text(
            f"# {layer} under {fault} ({side}): exit {rc}\n{text}")
        results[(fault, side, layer)] = (_gpudiag_result(text) if layer == "gpudiag"
                                         else _result_line(text))

    # The bare programs side by side; then gpudiag's verdicts, the baseline's alone: any
    # process of this run on the GPU would be someone else's to it (a busy GPU, not the fault).
    with concurrent.futures.ThreadPoolExecutor(max_workers=6) as pool:
        list(pool.map(one, programs))
        for job in verdicts:
            if job[0] == "baseline":
                one(job)
        list(pool.map(one, [j for j in verdicts if j[0] != "baseline"]))
    shutil.rmtree(scratch, ignore_errors=True)
    lines = ["# Real texts against the fakes' for the same safe fault "
             "(files: FAULT.LAYER.SIDE.txt)",
             f"# fakes: {fakes if fakes is not None else 'not available (not built)'}", ""]
    differ = 0
    for fault in FAULTS:
        for layer in (*PROGRAMS, "gpudiag"):
            real = results.get((fault, "real", layer), "?")
            fake = results.get((fault, "fake", layer))
            same = "n/a" if fake is None else ("same" if fake == real else "DIFFERS")
            differ += same == "DIFFERS"
            lines += [f"{fault} {layer}: {same}", f"  real: {real}"]
            if fake is not None:
                lines.append(f"  fake: {fake}")
    lines.append(f"\n{differ} of {len(FAULTS) * (len(PROGRAMS) + 1)} differ")
    (out / "comparison.txt").write_text("\n".join(lines) + "\n")
    print(f"{differ} differ; comparison in {out / 'comparison.txt'}")
    return 0


def compute_gpu_uuids() -> list[str]:
    """The GPUs nvidia-smi lists (empty on a GPU-less host)."""
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [ln.strip() for ln in proc.stdout.splitlines()
            if proc.returncode == 0 and ln.strip().startswith("GPU-")]


# ---------------------------------------------------------------------------------------------
# rules-test: the recording rules evaluated on the scraped samples
# ---------------------------------------------------------------------------------------------

INSTANCE = {"job": "gpudiag", "instance": "validated-node:9477"}


def _series(name: str, labels: Mapping[str, str]) -> str:
    def esc(v: str) -> str:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    inner = ",".join(f'{k}="{esc(v)}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def _value(v: float) -> str:
    return repr(int(v)) if v.is_integer() and abs(v) < 2**53 else repr(v)


def rules_test(metrics: Path, rules: Path, out: Path) -> int:
    """Write a promtool test of the recording rules on the scraped samples; 1 if none."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = [(s.name, {**s.labels, **INSTANCE}, float(s.value))
               for fam in text_string_to_metric_families(metrics.read_text())
               for s in fam.samples if s.name.startswith("gpudiag_") and math.isfinite(s.value)]
    if not samples:
        print(f"{metrics}: no gpudiag_ samples", file=sys.stderr)
        return 1

    def by(name: str) -> list[tuple[dict[str, str], float]]:
        return [(lab, v) for n, lab, v in samples if n == name]

    expected: list[tuple[str, list[tuple[dict[str, str], float]]]] = []
    blocked: dict[tuple[str, str], float] = {}
    for lab, v in by("gpudiag_blocker"):
        if v == 1:
            key = (lab.get("code", ""), lab.get("layer", ""))
            blocked[key] = blocked.get(key, 0) + 1
    expected.append(("gpudiag:nodes_blocked:count_by_code",
                     [({"code": c, "layer": ly}, n) for (c, ly), n in sorted(blocked.items())]))
    ready = by("gpudiag_ready")
    expected.append(("gpudiag:nodes:count", [({}, float(len(ready)))] if ready else []))
    expected.append(("gpudiag:nodes_ready:sum", [({}, sum(v for _, v in ready))] if ready else []))
    totals = {tuple(sorted(lab.items())): v for lab, v in by("gpudiag_gpu_memory_total_bytes")}
    ratios = []
    for lab, used in by("gpudiag_gpu_memory_used_bytes"):
        total = totals.get(tuple(sorted(lab.items())))
        if total:  # a zero total would be NaN or Inf: nothing to compare exactly
            ratios.append((lab, used / total))
    expected.append(("gpudiag:gpu_memory_used:ratio", ratios))
    free = by("gpudiag_gpus_ready_free")
    expected.append(("gpudiag:gpus_ready_free:sum",
                     [({}, sum(v for _, v in free))] if free else []))
    test = {
        "rule_files": [str(rules.resolve())],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [{"series": _series(n, lab), "values": f"{_value(v)}x5"}
                             for n, lab, v in samples],
            "promql_expr_test": [
                {"expr": record, "eval_time": "2m",
                 "exp_samples": [{"labels": _series(record, lab), "value": v}
                                 for lab, v in exp]}
                for record, exp in expected],
        }],
    }
    # JSON is YAML: promtool reads it as it is, and no YAML library is needed here.
    out.write_text(json.dumps(test, indent=1) + "\n")
    print(f"{out}: {len(samples)} input series, {len(expected)} recording rules")
    return 0


# ---------------------------------------------------------------------------------------------
# spin, compute: the job watch's two runs (a hung collective's signature, and real work)
# ---------------------------------------------------------------------------------------------

# One thread spins on a flag in device memory, as a rank waiting in a hung all-reduce does:
# a kernel always resident (the GPU reads 100% utilization) that does almost nothing (low
# power). %globaltimer bounds it: the kernel ends by itself after max_ns, whatever the host.
SPIN_PTX = b"""
.version 6.0
.target sm_70
.address_size 64

.visible .entry spin(
    .param .u64 flag_param,
    .param .u64 max_ns_param
)
{
    .reg .pred %p<3>;
    .reg .b32 %r<2>;
    .reg .b64 %rd<6>;

    ld.param.u64 %rd1, [flag_param];
    ld.param.u64 %rd2, [max_ns_param];
    cvta.to.global.u64 %rd3, %rd1;
    mov.u64 %rd4, %globaltimer;
    add.u64 %rd5, %rd4, %rd2;
SPIN:
    ld.volatile.global.u32 %r1, [%rd3];
    setp.ne.u32 %p1, %r1, 0;
    @%p1 bra DONE;
    mov.u64 %rd4, %globaltimer;
    setp.lt.u64 %p2, %rd4, %rd5;
    @%p2 bra SPIN;
DONE:
    ret;
}
\x00"""


def spin(seconds: float) -> int:
    """Spin one thread on CUDA ordinal 0 for ``seconds``, then raise the flag; 1 on failure."""
    stop = {"now": False}

    def on_signal(signum: int, frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        print(f"failed: {e}", flush=True)
        return 1
    dev, ctx, mod, fn = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    flag, spinning, copying = ctypes.c_uint64(), ctypes.c_void_p(), ctypes.c_void_p()
    flag_arg, raise_from = ctypes.c_uint64(), ctypes.c_void_p()  # the 1 to copy: pinned
    max_ns = ctypes.c_uint64(int((seconds + 10) * 1e9))
    params = (ctypes.c_void_p * 2)(ctypes.addressof(flag_arg), ctypes.addressof(max_ns))
    non_blocking = 1  # CU_STREAM_NON_BLOCKING: the flag's copy runs beside the kernel
    steps: tuple[Step, ...]  # (what, the driver call): run in order, the first error ends it
    steps = (("cuInit", lambda: lib.cuInit(0)),
             ("cuDeviceGet", lambda: lib.cuDeviceGet(ctypes.byref(dev), 0)),
             ("cuCtxCreate_v2", lambda: lib.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev)),
             ("cuModuleLoadData", lambda: lib.cuModuleLoadData(ctypes.byref(mod), SPIN_PTX)),
             ("cuModuleGetFunction", lambda: lib.cuModuleGetFunction(ctypes.byref(fn), mod,
                                                                     b"spin")),
             ("cuMemAlloc_v2", lambda: lib.cuMemAlloc_v2(ctypes.byref(flag), ctypes.c_size_t(4))),
             ("cuMemsetD32_v2", lambda: lib.cuMemsetD32_v2(flag, ctypes.c_uint(0),
                                                           ctypes.c_size_t(1))),
             ("cuMemHostAlloc", lambda: lib.cuMemHostAlloc(ctypes.byref(raise_from),
                                                           ctypes.c_size_t(4), 0)),
             ("cuCtxSynchronize", lambda: lib.cuCtxSynchronize()),
             ("cuStreamCreate", lambda: lib.cuStreamCreate(ctypes.byref(spinning), non_blocking)),
             ("cuStreamCreate", lambda: lib.cuStreamCreate(ctypes.byref(copying), non_blocking)))
    try:
        for name, call in steps:
            rc = call()
            if rc != 0:
                print(f"failed: {name}: {_cuda_error(lib, rc)}", flush=True)
                return 1
        flag_arg.value = flag.value
        ctypes.cast(raise_from, ctypes.POINTER(ctypes.c_uint32))[0] = 1
        started = time.monotonic()
        rc = lib.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, spinning, params, None)
        if rc != 0:
            print(f"failed: cuLaunchKernel: {_cuda_error(lib, rc)}", flush=True)
            return 1
        print(f"spinning pid={os.getpid()} for {seconds:g} s", flush=True)
        while not stop["now"] and time.monotonic() - started < seconds:
            time.sleep(0.1)
        raised = time.monotonic()
        rc = lib.cuMemcpyHtoDAsync_v2(flag, raise_from, ctypes.c_size_t(4), copying)
        rc = rc or lib.cuStreamSynchronize(spinning)
        ended = time.monotonic()
        how = "the flag" if ended - raised < 5 else "its own deadline"
        print(f"spun {ended - started:.1f} s; the kernel ended {ended - raised:.3f} s after the "
              f"flag was raised (by {how}); rc {rc}", flush=True)
        return 0 if rc == 0 else 1
    finally:
        if flag.value:
            lib.cuMemFree_v2(flag)
        if raise_from.value:
            lib.cuMemFreeHost(raise_from)
        if ctx.value:
            lib.cuCtxDestroy_v2(ctx)


def compute(seconds: float, n: int) -> int:
    """A JAX matmul loop for ``seconds``: full utilization at high power (real work)."""
    import jax  # the job's own framework; imported here only, never by gpudiag's daemon
    import jax.numpy as jnp

    x = jnp.full((n, n), 1.0 / n, dtype=jnp.bfloat16)
    step = jax.jit(lambda a: jnp.tanh(a @ a) + a)
    step(x).block_until_ready()
    started, steps = time.monotonic(), 0
    while time.monotonic() - started < seconds:
        step(x).block_until_ready()  # the same input each time: no value grows without bound
        steps += 1
    took = time.monotonic() - started
    print(f"computed on {jax.devices()[0]}: {steps} steps of a {n}x{n} bf16 matmul in "
          f"{took:.1f} s, {2 * n**3 * steps / took / 1e12:.1f} TFLOP/s", flush=True)
    return 0


# nvidia-smi --query-gpu fields the job watch section samples once a second, in this order.
SAMPLE_FIELDS = ("timestamp", "index", "utilization.gpu", "power.draw", "enforced.power.limit",
                 "clocks.sm", "clocks.max.sm", "clocks.mem", "temperature.gpu", "pstate")


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _number(text: str) -> float | None:
    try:
        return float(text.strip())
    except ValueError:
        return None  # "[N/A]", "[Not Supported]"


def samples_summary(path: Path, skip_s: int) -> int:
    """One line per GPU: utilization, power, power over the limit and SM clock (p1/p50/p99)
    over the samples after the first ``skip_s`` (the run's start). 1 when there are none."""
    per_gpu: dict[str, list[list[float | None]]] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        print(f"no samples ({e})")
        return 1
    for line in lines:
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(SAMPLE_FIELDS) or not cells[1].isdigit():
            continue
        per_gpu.setdefault(cells[1], []).append([_number(c) for c in cells[2:9]])
    said = []
    for gpu, rows in sorted(per_gpu.items()):
        rows = rows[skip_s:] or rows

        def col(i: int, rows: list[list[float | None]] = rows) -> list[float]:
            return [v for r in rows if (v := r[i]) is not None]

        util, power, limit, sm = col(0), col(1), col(2), col(3)
        ratio = [r[1] / r[2] for r in rows if r[1] is not None and r[2]]

        def pct(v: list[float], fmt: str) -> str:
            if not v:
                return "n/a"
            return "/".join(format(_percentile(v, q), fmt) for q in (0.01, 0.5, 0.99))

        said.append(f"GPU {gpu}: {len(rows)} samples; utilization % p1/p50/p99 "
                    f"{pct(util, '.0f')}; power W {pct(power, '.0f')} of limit "
                    f"{pct(limit, '.0f')}; power/limit {pct(ratio, '.2f')}; SM MHz "
                    f"{pct(sm, '.0f')}")
    print("; ".join(said) if said else "no samples")
    return 0 if said else 1


# ---------------------------------------------------------------------------------------------
# inventory: what a diagnostic must leave as it found it
# ---------------------------------------------------------------------------------------------

# Sections of `nvidia-smi -q` kept whole, and keys kept wherever they appear: settings and
# firmware, never readings (clocks now, power now, temperatures, utilization, memory use).
INVENTORY_SECTIONS = ("Inforom Version", "ECC Mode", "MIG Mode", "Applications Clocks",
                      "Default Applications Clocks", "Max Clocks", "Deferred Clocks")
INVENTORY_KEYS = ("Product Name", "GPU UUID", "VBIOS Version", "GSP Firmware Version",
                  "Persistence Mode", "Compute Mode", "Addressing Mode", "Accounting Mode",
                  "Driver Version", "Current Power Limit", "Requested Power Limit",
                  "Default Power Limit", "Enforced Power Limit", "Power Limit",
                  "Min Power Limit", "Max Power Limit")
NVML_KEYS = ("uuid", "name", "pci_bus_id", "memory_total_bytes", "power_limit_w")


def parse_smi_q(text: str) -> dict[str, str]:
    """The inventory fields of `nvidia-smi -q`, as "GPU-BUS/Section/Key" -> value."""
    found: dict[str, str] = {}
    gpu = ""
    stack: list[str] = []  # the section headers above the line, by indent level
    for raw in text.splitlines():
        if not raw.strip() or raw.startswith("="):
            continue
        indent = (len(raw) - len(raw.lstrip(" "))) // 4
        line = raw.strip()
        if indent == 0:
            gpu = line[4:] if line.startswith("GPU ") else ""
            stack = []
            if " : " in line and line.partition(" : ")[0].strip() in INVENTORY_KEYS:
                key, _, value = line.partition(" : ")
                found[key.strip()] = value.strip()  # Driver Version, above every GPU
            continue
        del stack[indent - 1:]
        key, sep, value = line.partition(":")
        if not sep or not value.strip():
            stack.append(line.rstrip(":").strip())
            continue
        key = key.strip()
        if key in INVENTORY_KEYS or any(s in INVENTORY_SECTIONS for s in stack):
            found["/".join([gpu, *stack, key])] = value.strip()
    return found


def inventory(smi_q: Path, nvml: Path | None) -> int:
    """Print the inventory (JSON) from a `nvidia-smi -q` text and a nvml probe record."""
    try:
        found = parse_smi_q(smi_q.read_text(errors="replace"))
    except OSError:
        found = {}
    try:
        rec = json.loads(nvml.read_text()) if nvml else {}
    except (OSError, ValueError):
        rec = {}
    for d in rec.get("devices") or () if isinstance(rec, dict) else ():
        for key in NVML_KEYS:
            if isinstance(d, dict) and d.get(key) is not None:
                found[f"nvml/{d.get('index')}/{key}"] = str(d[key])
        # The probe's own inventory (issue 51's gpu_config_drift reads it): set beside
        # nvidia-smi's, so that a real card shows both read the same.
        config = d.get("config") if isinstance(d, dict) else None
        for key, value in (config.items() if isinstance(config, dict) else ()):
            if value is not None:
                found[f"nvml/{d.get('index')}/config/{key}"] = str(value)
    print(json.dumps(found, indent=1, sort_keys=True))
    return 0


def inventory_diff(before: Path, after: Path) -> int:
    """0 and "unchanged: ..." when both inventories were read and are equal; else 1 and what
    differs (or that nothing was read)."""
    try:
        a, b = json.loads(before.read_text()), json.loads(after.read_text())
    except (OSError, ValueError) as e:
        print(f"no inventory read ({e})")
        return 1
    if not a or not b:
        print(f"no inventory read ({len(a)} fields before, {len(b)} after)")
        return 1
    changed = [f"{k}: {a.get(k, '(absent)')} -> {b.get(k, '(absent)')}"
               for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    if changed:
        print(f"{len(changed)} field(s) changed: " + "; ".join(changed))
        return 1
    shown = [f"{k.rsplit('/', 1)[-1]}={v}" for k, v in sorted(a.items())
             if k.endswith(("VBIOS Version", "Image Version", "GSP Firmware Version",
                            "Current Power Limit", "Enforced Power Limit", "Persistence Mode",
                            "Compute Mode"))]
    print(f"unchanged: {len(a)} fields ({'; '.join(shown[:8]) or 'nvml only'})")
    return 0


# ---------------------------------------------------------------------------------------------


def get(path: Path, dotted: str) -> int:
    """Print a JSON value by dotted path; nothing when the file or the value is absent."""
    try:
        value: Any = json.loads(path.read_text())
        for part in dotted.split("."):
            value = value[int(part)] if isinstance(value, list) else value[part]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return 0
    print(json.dumps(value) if isinstance(value, (dict, list, bool)) or value is None
          else value)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_validate.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("hold")
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--max-s", type=float, default=240.0)
    p = sub.add_parser("watch-apps")
    p.add_argument("out", type=Path)
    p.add_argument("--root", type=int, required=True)
    p.add_argument("--helper", type=int, required=True)
    p.add_argument("--baseline", type=Path, required=True)
    p.add_argument("--interval-s", type=float, default=0.1)
    p.add_argument("--since", type=float, default=0.0, help="when the helper held the GPU")
    p = sub.add_parser("texts")
    p.add_argument("out", type=Path)
    p.add_argument("--fakes", type=Path)
    p.add_argument("--timeout-s", type=float, default=60.0)
    p = sub.add_parser("rules-test")
    p.add_argument("metrics", type=Path)
    p.add_argument("rules", type=Path)
    p.add_argument("out", type=Path)
    p = sub.add_parser("judge-apps")
    p.add_argument("file", type=Path)
    p = sub.add_parser("judge-free")
    p.add_argument("file", type=Path)
    p.add_argument("since", type=float)
    p = sub.add_parser("spin")
    p.add_argument("--seconds", type=float, default=40.0)
    p = sub.add_parser("compute")
    p.add_argument("--seconds", type=float, default=40.0)
    p.add_argument("--n", type=int, default=8192)
    p = sub.add_parser("samples-summary")
    p.add_argument("file", type=Path)
    p.add_argument("--skip-s", type=int, default=0)
    p = sub.add_parser("inventory")
    p.add_argument("smi_q", type=Path)
    p.add_argument("nvml", type=Path, nargs="?")
    p = sub.add_parser("inventory-diff")
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    p = sub.add_parser("get")
    p.add_argument("file", type=Path)
    p.add_argument("path")
    a = parser.parse_args(argv)
    if a.cmd == "hold":
        return hold(a.mib, a.max_s)
    if a.cmd == "watch-apps":
        try:
            base = {int(t) for t in a.baseline.read_text().split() if t.isdigit()}
        except OSError:
            base = set()
        return watch_apps(a.out, a.root, a.helper, base, a.interval_s, a.since or time.time())
    if a.cmd == "texts":
        return texts(a.out, a.fakes, a.timeout_s)
    if a.cmd == "rules-test":
        return rules_test(a.metrics, a.rules, a.out)
    if a.cmd == "judge-apps":
        return judge_apps(a.file)
    if a.cmd == "judge-free":
        return judge_free(a.file, a.since)
    if a.cmd == "spin":
        return spin(a.seconds)
    if a.cmd == "compute":
        return compute(a.seconds, a.n)
    if a.cmd == "samples-summary":
        return samples_summary(a.file, a.skip_s)
    if a.cmd == "inventory":
        return inventory(a.smi_q, a.nvml)
    if a.cmd == "inventory-diff":
        return inventory_diff(a.before, a.after)
    return get(a.file, a.path)


if __name__ == "__main__":
    sys.exit(main())
