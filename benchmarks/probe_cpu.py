"""What each probe child costs in CPU-ms, and what the daemon's rounds cost at default intervals.

Run: .venv/bin/python benchmarks/probe_cpu.py [--runs 5] [--backends host,nvml,cuda,jax,iree]

Each probe runs through the daemon's own path (``gpudiag.engine.isolation.run_probe``: its
own child, its session, its deadline) on the fake driver (8 GPUs), once per round, in turn,
both ways: spawned (a fresh interpreter, GPUDIAG_PROBE_FORK_SERVER=0) and forked by the
daemon's probe fork server; beside two baselines: ``python -c pass`` and a bare
``import pynvml; nvmlInit; count``. The CPU of a spawned child and its descendants comes
from ``RUSAGE_CHILDREN`` around each run (user + system); a forked child's from its fork
server's own and children's CPU times (the fork is the server's; read in 10 ms ticks, so
each forked measurement runs the probe 10 times and divides). The last lines turn the
medians into the daemon's idle load at its default intervals
(each backend spec's ``interval_s``): the sum of CPU-ms per interval.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpudiag.core import registry  # noqa: E402
from gpudiag.engine.forkclient import OFF_SWITCH, ForkServer  # noqa: E402
from gpudiag.engine.isolation import run_probe  # noqa: E402
from tests.fakes.build import build_fakes  # noqa: E402
from tests.support.host import clean_env, make_host_dirs  # noqa: E402

# A forked child's CPU is read from /proc in 10 ms ticks: each measurement runs it this often.
FORKED_REPEAT = 10
# The daemon's default interval of each probe (gpudiag/core/backends/*: ``interval_s``).
DEFAULT_INTERVALS_S = {s.name: s.interval_s for s in registry.specs()}
BARE_NVML = "import pynvml; pynvml.nvmlInit(); pynvml.nvmlDeviceGetCount()"


def children_cpu_ms() -> float:
    """CPU time of every waited-for child so far, user + system, in ms."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (usage.ru_utime + usage.ru_stime) * 1000


def server_cpu_ms(server: ForkServer) -> float:
    """CPU time of the fork server, its own and its reaped children's, in ms."""
    if server.pid is None:
        return 0.0
    t = psutil.Process(server.pid).cpu_times()
    return (t.user + t.system + t.children_user + t.children_system) * 1000


def measured(fn: Callable[[], None], server: ForkServer) -> tuple[float, float]:
    """(CPU ms of the children fn waited for, directly or through the server, wall ms)."""
    cpu, wall = children_cpu_ms() + server_cpu_ms(server), time.perf_counter()
    fn()
    cpu_after = children_cpu_ms() + server_cpu_ms(server)
    return cpu_after - cpu, (time.perf_counter() - wall) * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--backends", default="host,nvml,cuda,jax,iree")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gpudiag-bench-"))
    fakes = build_fakes(tmp / "fakes")
    dev, proc_dir = make_host_dirs(tmp / "host", gpus=8)
    env = clean_env()
    env.update(GPUDIAG_DEVICE_DIR=str(dev), GPUDIAG_DRIVER_PROC_DIR=str(proc_dir))
    env = fakes.env(base=env, FAKE_NVML_DEVICE_COUNT=8)

    def child(code: str) -> Callable[[], None]:
        return lambda: subprocess.run([sys.executable, "-c", code], env=env, check=True)

    server = ForkServer(env)
    spawn_env = {**env, OFF_SWITCH: "0"}

    def probe(name: str, forked: bool) -> Callable[[], None]:
        def run() -> None:
            done = run_probe(name, env=env if forked else spawn_env, timeout_s=120,
                             forker=server)
            if done.observation is None:
                raise SystemExit(f"probe {name} failed: {done.error} {done.stderr_tail[-300:]}")
        return run

    def repeated(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(FORKED_REPEAT):
                fn()
        return run

    cases: dict[str, Callable[[], None]] = {"python -c pass": child("pass"),
                                            "bare pynvml init + count": child(BARE_NVML)}
    names = [n.strip() for n in args.backends.split(",") if n.strip()]
    for name in names:
        cases[f"probe child: {name}"] = probe(name, forked=False)
    for name in names:
        cases[f"forked probe child: {name}"] = repeated(probe(name, forked=True))
    for fn in cases.values():  # warm-up: page cache, IREE's module cache
        fn()
    cpu: dict[str, list[float]] = {name: [] for name in cases}
    wall: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.runs):
        for name, fn in cases.items():
            c, w = measured(fn, server)
            cpu[name].append(c)
            wall[name].append(w)
    floor = statistics.median(cpu["python -c pass"])
    print(f"runs={args.runs}, children in turn; load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores; median CPU-ms (user+system) and wall ms")
    width = max(map(len, cases))
    for name in cases:
        c, w = statistics.median(cpu[name]), statistics.median(wall[name])
        if name.startswith("forked"):
            c, w = c / FORKED_REPEAT, w / FORKED_REPEAT
            cpu[name] = [x / FORKED_REPEAT for x in cpu[name]]
        print(f"{name:<{width}}  CPU {c:7.1f} ms ({c / floor:5.2f}x python -c pass)  "
              f"wall {w:7.1f} ms")
    every = ", ".join(f"{n} every {DEFAULT_INTERVALS_S[n]:g} s" for n in names)
    for how, prefix in (("spawned", "probe child"), ("forked", "forked probe child")):
        load = sum(statistics.median(cpu[f"{prefix}: {n}"]) / DEFAULT_INTERVALS_S[n]
                   for n in names) / 10  # ms per s -> % of a core
        print(f"{how} probe children at the default intervals ({every}): "
              f"{load:.2f}% of a core")
    server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
