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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20
BOGUS_UUID = "GPU-00000000-0000-0000-0000-000000000000"

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
    chain = []
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
    return get(a.file, a.path)


if __name__ == "__main__":
    sys.exit(main())
