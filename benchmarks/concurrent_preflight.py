"""Eight inline preflights started together against one alone, side by side in one run.

Run: .venv/bin/python benchmarks/concurrent_preflight.py [--base OTHER_CHECKOUT/.venv/bin/python]
     [--rounds 5] [--require cuda]

Issue 23: inline runs started together (Slurm Prologs, pytest-xdist workers) used to find each
other's probe locks, skip the GPUs and answer devices_busy or a false "ready". Probes now
take shared locks, so siblings prove the GPUs side by side. This prints, on a fake 8-GPU host,
the median wall time of one `gpudiag preflight --require R --no-daemon` alone and of the
slowest of 8 started at the same moment, the ratio of the two, and how many of the 8 gave
an answer other than the lone one; with ``--base`` (the interpreter of a checkout from before
the change) the same for that checkout, interleaved round by round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fakes.build import build_fakes  # noqa: E402
from tests.support.host import clean_env, make_host_dirs  # noqa: E402

Answer = tuple[int, str]


def _argv(python: str, require: str) -> list[str]:
    return [python, "-m", "gpudiag", "preflight", "--require", require, "--no-daemon",
            "--format", "json"]


def _answer(proc: subprocess.Popen[str]) -> Answer:
    out, err = proc.communicate(timeout=300)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"gpudiag preflight exit {proc.returncode}: {err[-500:]}")
    return proc.returncode, str(json.loads(out)["gpu_validation_blocker"])


def together(python: str, env: dict[str, str], require: str, n: int
             ) -> tuple[float, list[Answer]]:
    """Wall time until the last of ``n`` preflights started at once answered, and answers."""
    # Run from the interpreter's own checkout: `-m` puts the working folder first on sys.path.
    cwd = Path(python).parents[2]
    start = time.perf_counter()
    procs = [subprocess.Popen(_argv(python, require), env=env, cwd=cwd, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(n)]
    answers = [_answer(p) for p in procs]
    return time.perf_counter() - start, answers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", help="python of a checkout from before issue 23")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--require", default="cuda")
    args = ap.parse_args()
    sides = {"this": sys.executable, **({"base": args.base} if args.base else {})}
    with tempfile.TemporaryDirectory() as tmp_text:
        tmp = Path(tmp_text)
        fakes = build_fakes(tmp / "fakes")
        dev, proc = make_host_dirs(tmp / "host", gpus=8)
        env = fakes.env(base={**clean_env(), "GPUDIAG_DEVICE_DIR": str(dev),
                              "GPUDIAG_DRIVER_PROC_DIR": str(proc),
                              "GPUDIAG_LOCK_DIR": str(tmp / "locks"),
                              "FAKE_NVML_DEVICE_COUNT": "8"})
        lone: dict[str, list[float]] = {s: [] for s in sides}
        eight: dict[str, list[float]] = {s: [] for s in sides}
        differ: dict[str, int] = dict.fromkeys(sides, 0)
        for python in sides.values():
            together(python, env, args.require, 1)  # warm the page cache
        for _ in range(args.rounds):
            for side, python in sides.items():
                took, (alone,) = together(python, env, args.require, 1)
                lone[side].append(took)
                took, answers = together(python, env, args.require, 8)
                eight[side].append(took)
                differ[side] += sum(a != alone for a in answers)
        print(f"require={args.require}, 8 fake GPUs, {args.rounds} rounds, medians")
        print(f"{'side':5} {'lone s':>7} {'8 together s':>13} {'ratio':>6} "
              f"{'answers unlike the lone one':>28}")
        for side in sides:
            a, b = statistics.median(lone[side]), statistics.median(eight[side])
            print(f"{side:5} {a:7.3f} {b:13.3f} {b / a:6.2f} "
                  f"{differ[side]:>12} of {8 * args.rounds}")


if __name__ == "__main__":
    main()
