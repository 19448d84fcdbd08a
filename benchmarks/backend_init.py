"""Cost of `gpudiag probe --backend jax|iree` over bare JAX / IREE initialization, side by side.

Prints, in one run, the median wall time of fresh processes and the ratios (target <= 1.25):
    .venv/bin/python benchmarks/backend_init.py [--runs 7]

On a GPU-less host `--backend jax` (a GPU requirement) also runs the host, nvml and cuda
children and finds no GPU to compute on; `jax:cpu` and `iree:local-task` do the full work
(init plus a checked tiny computation). "uncached" gives IREE a fresh module cache each run,
so the compile is paid every time.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.conftest import clean_env

BARE_JAX = "import jax; jax.devices()"
BARE_IREE = "import iree.runtime as rt; rt.get_driver('local-task').create_default_device()"


def median_wall_s(argv: list[str], env: dict[str, str], runs: int,
                  fresh_cache: bool = False) -> float:
    """Median wall time of a fresh process, after one warm-up run; exit 0 or 1 accepted."""
    times = []
    for i in range(runs + 1):
        run_env = dict(env)
        with tempfile.TemporaryDirectory() as cache:
            if fresh_cache:
                run_env["GPUDIAG_CACHE_DIR"] = cache
            started = time.perf_counter()
            proc = subprocess.run(argv, env=run_env, capture_output=True, check=False)  # noqa: S603
            elapsed = time.perf_counter() - started
        if proc.returncode not in (0, 1):
            raise SystemExit(f"{argv} failed with {proc.returncode}: {proc.stderr[-2000:]!r}")
        if i:
            times.append(elapsed)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    env = clean_env()
    py = sys.executable
    gd = [py, "-m", "gpudiag", "probe", "--json", "--backend"]
    rows: list[tuple[str, float, float]] = []
    bare_jax = median_wall_s([py, "-c", BARE_JAX], env, args.runs)
    for spec in ("jax", "jax:cpu"):
        rows.append((f"gpudiag probe --backend {spec}", bare_jax,
                     median_wall_s([*gd, spec], env, args.runs)))
    bare_iree = median_wall_s([py, "-c", BARE_IREE], env, args.runs)
    for spec, fresh in (("iree", False), ("iree:local-task", False),
                        ("iree:local-task", True)):
        label = f"gpudiag probe --backend {spec}" + (" (uncached)" if fresh else "")
        rows.append((label, bare_iree, median_wall_s([*gd, spec], env, args.runs, fresh)))
    print(f"runs={args.runs} (median of fresh processes, one warm-up each)")
    print(f"bare `python -c \"{BARE_JAX}\"`: {bare_jax * 1000:.0f} ms")
    print(f"bare `python -c \"{BARE_IREE}\"`: {bare_iree * 1000:.0f} ms")
    for label, bare, ours in rows:
        print(f"{label:<48} {ours * 1000:6.0f} ms  ratio {ours / bare:5.2f} "
              f"(target <= 1.25)")


if __name__ == "__main__":
    main()
