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

from tests.support.host import clean_env

BARE_JAX = "import jax; jax.devices()"
BARE_IREE = "import iree.runtime as rt; rt.get_driver('local-task').create_default_device()"


def wall_s(argv: list[str], env: dict[str, str], fresh_cache: bool = False) -> float:
    """Wall time of one fresh process; exit 0 (ready) or 1 (blocked) accepted."""
    run_env = dict(env)
    with tempfile.TemporaryDirectory() as cache:
        if fresh_cache:
            run_env["GPUDIAG_CACHE_DIR"] = cache
        started = time.perf_counter()
        proc = subprocess.run(argv, env=run_env, capture_output=True, check=False)
        elapsed = time.perf_counter() - started
    if proc.returncode not in (0, 1):
        raise SystemExit(f"{argv} failed with {proc.returncode}: {proc.stderr[-2000:]!r}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    env = clean_env()
    py = sys.executable
    gd = [py, "-m", "gpudiag", "probe", "--json", "--backend"]
    # The path before the probe fork server: every probe child spawned (env adds ~1 ms).
    spawned = ["env", "GPUDIAG_PROBE_FORK_SERVER=0", *gd]
    # name -> (argv, fresh cache, the bare baseline it is compared with)
    cases: dict[str, tuple[list[str], bool, str | None]] = {
        "bare jax": ([py, "-c", BARE_JAX], False, None),
        "bare iree": ([py, "-c", BARE_IREE], False, None),
        "gpudiag --version (CLI start, no probe)": ([py, "-m", "gpudiag", "--version"], False,
                                                    None),
        "gpudiag probe --backend jax": ([*gd, "jax"], False, "bare jax"),
        "gpudiag probe --backend jax (spawned)": ([*spawned, "jax"], False, "bare jax"),
        "gpudiag probe --backend jax:cpu": ([*gd, "jax:cpu"], False, "bare jax"),
        "probe child alone: jax cpu": (
            [py, "-m", "gpudiag.probes", "jax", '{"platform": "cpu"}'], False, "bare jax"),
        "gpudiag probe --backend iree": ([*gd, "iree"], False, "bare iree"),
        "gpudiag probe --backend iree (spawned)": ([*spawned, "iree"], False, "bare iree"),
        "gpudiag probe --backend iree:local-task": ([*gd, "iree:local-task"], False,
                                                    "bare iree"),
        "gpudiag probe --backend iree:local-task (uncached)": ([*gd, "iree:local-task"], True,
                                                               "bare iree"),
        "probe child alone: iree local-task": (
            [py, "-m", "gpudiag.probes", "iree", '{"drivers": ["local-task"]}'], False,
            "bare iree"),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    # Interleaved rounds: a busy machine slows every case alike instead of one of them.
    for i in range(args.runs + 1):
        for name, (argv, fresh, _) in cases.items():
            elapsed = wall_s(argv, env, fresh)
            if i:  # round 0 warms the caches
                times[name].append(elapsed)
    med = {name: statistics.median(t) for name, t in times.items()}
    # The minimum is the steadier figure on a shared, busy machine: noise only adds time.
    low = {name: min(t) for name, t in times.items()}
    print(f"runs={args.runs} (fresh processes, interleaved, one warm-up round; "
          "median and min)")
    print(f"bare jax  = `python -c \"{BARE_JAX}\"`")
    print(f"bare iree = `python -c \"{BARE_IREE}\"`")
    for name, (_, _, base) in cases.items():
        ratio = (f"  ratio {med[name] / med[base]:5.2f} (min {low[name] / low[base]:5.2f}) "
                 f"vs {base}, target <= 1.25") if base else ""
        print(f"{name:<52} {med[name] * 1000:6.0f} ms (min {low[name] * 1000:5.0f}){ratio}")


if __name__ == "__main__":
    main()
