"""What the busy-GPU safety rule costs an inline preflight, side by side in one run.

Run: .venv/bin/python benchmarks/busy_guard.py [--base OTHER_CHECKOUT/.venv/bin/python]
     [--rounds 7]

Since issue 12 an inline `gpudiag preflight --require cuda` reads NVML first and only then
runs the cuda probe on the FREE GPUs under their locks (before, host, nvml and cuda ran in
parallel, and cuda made a context on every GPU). This prints, for 8 fake GPUs, the median wall
time of `gpudiag preflight --require cuda --no-daemon` on an idle node and on a node whose
GPUs 0-3 run other people's jobs, interleaved round by round; with ``--base`` (the interpreter
of a checkout from before the change, e.g. a worktree at the commit before) the same for that
checkout and the ratio. Contexts made on busy GPUs are counted from the fake driver's log.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fakes.build import build_fakes  # noqa: E402
from tests.fakes.jobs import FakeJobs, read_context_log  # noqa: E402
from tests.support.host import clean_env, make_host_dirs  # noqa: E402


def one(python: str, env: dict[str, str]) -> float:
    # Run from the interpreter's own checkout (python is CHECKOUT/.venv/bin/python): `-m`
    # puts the working folder first on sys.path, so another folder would test other code.
    start = time.perf_counter()
    proc = subprocess.run([python, "-m", "gpudiag", "preflight", "--require", "cuda",
                           "--no-daemon", "--format", "json"], env=env, capture_output=True,
                          check=False, timeout=120, cwd=Path(python).parents[2])
    took = time.perf_counter() - start
    if proc.returncode not in (0, 1):
        raise SystemExit(f"{python}: gpudiag preflight exit {proc.returncode}: "
                         f"{proc.stderr[-500:]}")
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", help="python of a checkout from before the busy-GPU rule")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    sides = {"this": sys.executable, **({"base": args.base} if args.base else {})}
    with tempfile.TemporaryDirectory() as tmp_text:
        tmp = Path(tmp_text)
        fakes = build_fakes(tmp / "fakes")
        dev, proc = make_host_dirs(tmp / "host", gpus=8)
        times: dict[tuple[str, str], list[float]] = {}
        touched: dict[tuple[str, str], int] = {}
        for node in ("idle", "busy"):
            with FakeJobs(tmp / f"state-{node}", compute_modes=dict.fromkeys(range(4), 3)) as jobs:
                if node == "busy":
                    for gpu in range(4):
                        jobs.start(gpu, memory_mib=100_000)
                envs = {side: fakes.env(base={
                    **clean_env(), "GPUDIAG_DEVICE_DIR": str(dev),
                    "GPUDIAG_DRIVER_PROC_DIR": str(proc), "GPUDIAG_LOCK_DIR": str(tmp / "locks"),
                    "FAKE_GPU_STATE_FILE": str(jobs.state_file),
                    "FAKE_CUDA_CONTEXT_LOG": str(tmp / f"ctx-{node}-{side}.jsonl")})
                    for side in sides}
                for side, python in sides.items():
                    one(python, envs[side])  # warm the page cache
                for _ in range(args.rounds):
                    for side, python in sides.items():
                        times.setdefault((node, side), []).append(one(python, envs[side]))
                for side in sides:
                    events = read_context_log(tmp / f"ctx-{node}-{side}.jsonl")
                    touched[(node, side)] = len(jobs.contexts_while_busy(events))
        print(f"{'node':6} {'side':5} {'median s':>9} {'min s':>7} {'contexts on busy GPUs':>22}")
        for (node, side), values in times.items():
            print(f"{node:6} {side:5} {statistics.median(values):9.3f} {min(values):7.3f} "
                  f"{touched[(node, side)]:22d}")
        if args.base:
            for node in ("idle", "busy"):
                ratio = (statistics.median(times[(node, "this")])
                         / statistics.median(times[(node, "base")]))
                print(f"{node}: this / base = {ratio:.2f}")


if __name__ == "__main__":
    main()
