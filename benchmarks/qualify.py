"""What a qualification costs: the quick and full tiers, wall time and CPU, side by side.

Run: .venv/bin/python benchmarks/qualify.py [--runs 3]

Cases, each a fresh process, interleaved run by run, medians printed:
- ``fakes quick|full``: `gpudiag qualify --gpus 0 --tier T --no-history` on the fake driver
  (one GPU of 8, default size: 64 MiB / 512 MiB copy buffers, copies as fast as memmove);
- ``jax-cpu quick|full``: `gpudiag qualify --platform cpu --cpu-devices 1 --tier T` on one of
  JAX's CPU devices (every measurement and known answer through JAX);
- ``bare jax matmul``: one child that imports JAX, runs the tier's matmul (same n, dtypes and
  repeats) on the CPU and exits: the floor any JAX-based measurement pays. The ratio of
  jax-cpu to it is what the qualification adds (bandwidths, known answers, scoring, CLI);
- ``fakes sdc`` / ``fakes sdc 8 GPUs``: `--tier sdc` on one GPU / every GPU of 8 fakes of
  80 MiB (a 8 MiB memory test; the GEMMs through the test suite's host route,
  GPUDIAG_TEST_SDC_GEMM=host, since the fakes compute no kernels), and ``jax-cpu sdc``: on
  one of JAX's CPU devices (a 16 MiB region, the GEMMs through JAX). For these the table
  also gives the median of each GPU's own ``duration_s`` (the time its 10 s budget counts).
CPU is the children's user + system time (getrusage), so a 2-core box's load shows as wall
time but not as CPU.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpudiag.core.qualify import TIERS  # noqa: E402
from tests.fakes.build import build_fakes  # noqa: E402
from tests.support.host import clean_env, make_host_dirs  # noqa: E402

BARE = """
import time, jax, jax.numpy as jnp, numpy as np
n, repeats, dtypes = {n}, {repeats}, {dtypes!r}
for dtype in dtypes:
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), dtype=dtype)
    f = jax.jit(lambda x, y: x @ y)
    f(a, a).block_until_ready()
    for _ in range(repeats):
        f(a, a).block_until_ready()
"""


PER_GPU: dict[str, list[float]] = {}


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall s, CPU s) of one child run to its end (and each GPU's duration_s, kept)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=False,
                          timeout=600, cwd=ROOT)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(argv)}: exit {proc.returncode}: {proc.stderr[-800:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if "sdc" in argv:
        report = json.loads(proc.stdout)
        PER_GPU.setdefault(" ".join(argv), []).extend(
            q["duration_s"] for q in report["gpus"] if q["duration_s"] is not None)
    return wall, cpu


def cases(fake_env: dict[str, str]) -> dict[str, tuple[list[str], dict[str, str]]]:
    py = [sys.executable, "-m", "gpudiag", "qualify", "--no-history", "--format", "json"]
    cpu_env = clean_env()
    out: dict[str, tuple[list[str], dict[str, str]]] = {}
    for tier in ("quick", "full"):
        spec = TIERS[tier]
        dtypes = [d for d, m in (("bfloat16", "matmul_bf16"), ("float32", "matmul_fp32"))
                  if m in spec.measures]
        out[f"fakes {tier}"] = ([*py, "--gpus", "0", "--tier", tier], fake_env)
        out[f"jax-cpu {tier}"] = ([*py, "--platform", "cpu", "--cpu-devices", "1", "--tier",
                                   tier], cpu_env)
        bare = BARE.format(n=spec.cpu_matmul_n, repeats=spec.matmul_repeats, dtypes=dtypes)
        out[f"bare jax matmul {tier}"] = ([sys.executable, "-c", bare],
                                          {**cpu_env, "JAX_PLATFORMS": "cpu"})
    small = {**fake_env, "FAKE_GPU_MEMORY_TOTAL_MIB": "80", "FAKE_CUDA_CONTEXT_MIB": "1",
             "GPUDIAG_TEST_SDC_GEMM": "host"}
    out["fakes sdc"] = ([*py, "--gpus", "0", "--tier", "sdc"], small)
    out["fakes sdc 8 GPUs"] = ([*py, "--tier", "sdc"], small)
    out["jax-cpu sdc"] = ([*py, "--platform", "cpu", "--cpu-devices", "1", "--tier", "sdc"],
                          cpu_env)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp_text:
        tmp = Path(tmp_text)
        fakes = build_fakes(tmp / "fakes")
        dev, proc = make_host_dirs(tmp / "host", gpus=8)
        fake_env = fakes.env(base={**clean_env(), "GPUDIAG_DEVICE_DIR": str(dev),
                                   "GPUDIAG_DRIVER_PROC_DIR": str(proc),
                                   "GPUDIAG_LOCK_DIR": str(tmp / "locks")})
        table = cases(fake_env)
        got: dict[str, list[tuple[float, float]]] = {name: [] for name in table}
        for _ in range(args.runs):
            for name, (argv, env) in table.items():
                got[name].append(timed(argv, env))
    med = {n: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
           for n, v in got.items()}
    print(f"| case | wall (median of {args.runs}) | CPU |")
    print("|---|---|---|")
    for name, (wall, cpu) in med.items():
        print(f"| {name} | {wall:.2f} s | {cpu:.2f} s |")
    for name, (argv, _env) in table.items():
        per = PER_GPU.get(" ".join(argv))
        if per:
            print(f"| {name}: each GPU's own duration_s (median, max of {len(per)}) | "
                  f"{statistics.median(per):.2f} s, {max(per):.2f} s | |")
    for tier in ("quick", "full"):
        q, b = med[f"jax-cpu {tier}"], med[f"bare jax matmul {tier}"]
        print(f"| **{tier}: jax-cpu / bare matmul** | **{q[0] / b[0]:.2f}x** | "
              f"**{q[1] / b[1]:.2f}x** |")


if __name__ == "__main__":
    main()
