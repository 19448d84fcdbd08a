"""What the job watch costs (issue 53): 8 GPUs under one run, against no run open.

Run: .venv/bin/python benchmarks/job_watch.py [--window-s 60] [--gpus 8] [--interval-s 1]

On the fake driver (the fake libnvidia-ml answers every call at once, so the NVML time here
is Python's and pynvml's, not a real driver's), the daemon's job watch part
(daemon/job_watch.py) runs in this process at its default interval. Two windows, one after
the other: no run open (the part's thread only looks at the open runs), then one run on
every GPU at 100% utilization (its NVML child samples each GPU every interval). It prints
the CPU seconds of the part's thread and of the child over each window, as a share of one
core. The goal: at most 0.2% of a core for 8 GPUs under a run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpudiag.core.environment import probe_environment  # noqa: E402
from gpudiag.core.job_watch import JobWatchPolicy  # noqa: E402
from gpudiag.daemon.job_watch import JobWatch  # noqa: E402
from tests.fakes.build import build_fakes  # noqa: E402
from tests.support.host import clean_env, make_host_dirs  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Run:
    id: str
    gpus: tuple[str, ...]


def _thread_s(tid: int) -> float:
    fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def _children_s() -> float:
    """CPU seconds of this process's live children (the job watch child)."""
    total = 0.0
    for child in psutil.Process().children():
        try:
            t = child.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _thread(name: str) -> threading.Thread:
    return next(t for t in threading.enumerate() if t.name == name)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--interval-s", type=float, default=1.0)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="gpudiag-bench-watch-"))
    fakes = build_fakes(base / "fakes")
    dev, proc = make_host_dirs(base / "host", gpus=args.gpus)
    env = probe_environment(fakes.env(
        base={**clean_env(), "GPUDIAG_DEVICE_DIR": str(dev), "GPUDIAG_DRIVER_PROC_DIR": str(proc)},
        FAKE_NVML_DEVICE_COUNT=args.gpus,
        FAKE_NVML_UTILIZATION=",".join(f"{i}:100" for i in range(args.gpus)),
        FAKE_NVML_LINK_KBPS=",".join(f"{i}:1000" for i in range(args.gpus))))
    listed = subprocess.run(
        [sys.executable, "-c", "import pynvml; pynvml.nvmlInit(); print(','.join(pynvml."
         "nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range("
         f"{args.gpus})))"], env=env, capture_output=True, text=True, check=True)
    gpus = tuple(listed.stdout.strip().split(","))
    runs: list[Run] = []
    watch = JobWatch(JobWatchPolicy(interval_s=args.interval_s), env, lambda: list(runs))
    watch.start()
    try:
        tid = _thread("job-watch").native_id
        assert tid is not None
        t0, w0 = time.monotonic(), _thread_s(tid)
        time.sleep(args.window_s)
        idle_thread = _thread_s(tid) - w0
        idle_s = time.monotonic() - t0
        runs.append(Run("bench", gpus))
        deadline = time.monotonic() + 30
        while not watch.state().running and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(3 * args.interval_s)  # past the child's start (imports, nvmlInit)
        t0, w0, c0 = time.monotonic(), _thread_s(tid), _children_s()
        time.sleep(args.window_s)
        run_thread, run_child = _thread_s(tid) - w0, _children_s() - c0
        run_s = time.monotonic() - t0
        samples = watch.evidence()[1]["open"][0]["samples"]
    finally:
        watch.stop()
    print(f"job watch, {args.gpus} fake GPUs, interval {args.interval_s:g} s, windows of "
          f"{args.window_s:g} s")
    print(f"  no run open:   thread {idle_thread:.3f} s = {100 * idle_thread / idle_s:.3f}% "
          "of a core; no child")
    total = run_thread + run_child
    print(f"  one run open:  thread {run_thread:.3f} s + child {run_child:.3f} s = "
          f"{100 * total / run_s:.3f}% of a core ({samples} samples)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
