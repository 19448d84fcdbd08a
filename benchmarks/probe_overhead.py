"""Overhead of `gpudiag probe --backend nvml,cuda` over a bare NVML child, against the fakes.

Prints, in one run, the median wall time of each and their ratio (target <= 1.5):
    .venv/bin/python benchmarks/probe_overhead.py [--runs 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.conftest import clean_env, make_host_dirs
from tests.fakes.build import build_fakes

BARE = ("import pynvml; pynvml.nvmlInit(); pynvml.nvmlDeviceGetCount(); "
        "pynvml.nvmlShutdown()")


def median_wall_s(argv: list[str], env: dict[str, str], runs: int) -> float:
    """Median wall time of a fresh process, after one warm-up run."""
    times = []
    for i in range(runs + 1):
        started = time.perf_counter()
        proc = subprocess.run(argv, env=env, capture_output=True, check=False)
        elapsed = time.perf_counter() - started
        if proc.returncode not in (0,):
            raise SystemExit(f"{argv} failed with {proc.returncode}: {proc.stderr[-2000:]!r}")
        if i:
            times.append(elapsed)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--devices", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fakes = build_fakes(Path(tmp) / "fakes")
        dev, proc = make_host_dirs(Path(tmp) / "host", gpus=args.devices)
        env = fakes.env(base={**clean_env(), "GPUDIAG_DEVICE_DIR": str(dev),
                              "GPUDIAG_DRIVER_PROC_DIR": str(proc)},
                        FAKE_NVML_DEVICE_COUNT=args.devices)
        gpudiag = [sys.executable, "-m", "gpudiag", "probe", "--backend", "nvml,cuda", "--json"]
        bare = [sys.executable, "-c", BARE]
        t_gpudiag = median_wall_s(gpudiag, env, args.runs)
        # The same command with every probe spawned (no fork server): the path before it.
        t_spawned = median_wall_s(gpudiag, {**env, "GPUDIAG_PROBE_FORK_SERVER": "0"},
                                  args.runs)
        t_bare = median_wall_s(bare, env, args.runs)
        # Where the difference goes: the CLI's own start, and one probe child alone.
        t_cli = median_wall_s([sys.executable, "-m", "gpudiag", "--version"], env, args.runs)
        t_child = median_wall_s([sys.executable, "-m", "gpudiag.probes", "nvml"], env,
                                args.runs)
    print(f"devices={args.devices} runs={args.runs} cpus={os.cpu_count()} "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"gpudiag probe --backend nvml,cuda  median {t_gpudiag * 1000:8.1f} ms")
    print(f"  the same, every probe spawned    median {t_spawned * 1000:8.1f} ms "
          f"(GPUDIAG_PROBE_FORK_SERVER=0; ratio {t_spawned / t_bare:.2f})")
    print(f"bare pynvml init + device count    median {t_bare * 1000:8.1f} ms")
    print(f"gpudiag --version (CLI start)      median {t_cli * 1000:8.1f} ms")
    print(f"nvml probe child alone             median {t_child * 1000:8.1f} ms "
          f"(ratio {t_child / t_bare:.2f})")
    print(f"ratio {t_gpudiag / t_bare:.2f} (target <= 1.5)")


if __name__ == "__main__":
    main()
