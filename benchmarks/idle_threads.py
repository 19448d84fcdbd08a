"""Where an idle daemon's CPU goes: each of its threads and each child, side by side in one run.

Run: .venv/bin/python benchmarks/idle_threads.py [--idle-s 120] [--base DIR]

On the fake driver (8 fake GPUs) with two runtimes (venvs of this suite's CPU-only JAX and
IREE, tests/support/venvs.py), the daemon at its default settings is started under a
launcher that names every Python thread after its ``threading`` name (``prctl(PR_SET_NAME)``),
so ``/proc/PID/task/TID/stat`` tells which thread spent what. After the first round (every
runtime proven, its children reaped) the window starts; at its end the script prints the
tree's CPU share, each thread's and each child's (the probe fork server counts the probe
children it reaped). With ``--base DIR`` (another checkout, e.g. ``git worktree add --detach
DIR 3ae9147``) the same is measured for that checkout's daemon with no runtimes, one after
the other. Use a window that is a multiple of 60 s: the host and cuda probes run every 60 s,
and a shorter window catches a different number of their rounds in each daemon.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.runtimes import cpu_s, runs_done, start_daemon  # noqa: E402
from tests.fakes.build import build_fakes  # noqa: E402
from tests.support.host import clean_env, make_host_dirs  # noqa: E402
from tests.support.venvs import make_venv  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
# Names each thread natively, then runs `gpudiag ARGS` as the console entry does.
LAUNCHER = """
import ctypes, sys, threading
libc = ctypes.CDLL(None)
_boot = threading.Thread._bootstrap_inner
def _named(self):
    libc.prctl(15, self.name[:15].encode(), 0, 0, 0)  # PR_SET_NAME
    _boot(self)
threading.Thread._bootstrap_inner = _named
sys.argv = ["gpudiag", *sys.argv[1:]]
from gpudiag.cli.entry import main
sys.exit(main())
"""


def _with_reaped_s(pid: int) -> float:
    """A process's CPU seconds with its reaped children's (utime, stime, cutime, cstime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / CLK_TCK


def _threads(pid: int) -> dict[str, float]:
    """CPU seconds per thread name (threads of one name summed)."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            text = (task / "stat").read_text()
        except OSError:
            continue
        name = text[text.index("(") + 1:text.rindex(")")]
        fields = text.rsplit(")", 1)[1].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def measure(tmp: Path, env: dict[str, str], config: str, want_runs: int, idle_s: float
            ) -> dict[str, float]:
    """Percent of a core over the window: the tree, each thread, each child."""
    proc, sock = start_daemon(tmp, env, sys.executable, config,
                              head=[sys.executable, "-c", LAUNCHER])
    try:
        end = time.monotonic() + 300
        while want_runs and not runs_done(sock, want_runs) and time.monotonic() < end:
            time.sleep(0.5)
        time.sleep(8)  # the first round's children reaped
        kids = psutil.Process(proc.pid).children(recursive=True)
        kid_a = {k.pid: _with_reaped_s(k.pid) for k in kids}
        threads_a, tree_a, t0 = _threads(proc.pid), cpu_s(proc.pid), time.monotonic()
        time.sleep(idle_s)
        threads_b, tree_b = _threads(proc.pid), cpu_s(proc.pid)
        dt = time.monotonic() - t0
        share = {"whole tree": (tree_b - tree_a) / dt * 100}
        for name, s in threads_b.items():
            share[f"thread {name}"] = (s - threads_a.get(name, 0.0)) / dt * 100
        for kid in kids:
            with_kids = " ".join(kid.cmdline()[1:4])[:60]
            try:
                share[f"child {with_kids}"] = (_with_reaped_s(kid.pid) - kid_a[kid.pid]) / dt * 100
            except OSError:
                continue
        return share
    finally:
        proc.terminate()
        proc.wait(20)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--idle-s", type=float, default=120.0)
    ap.add_argument("--base", type=Path, default=None)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gpudiag-bench-idle-threads-"))
    fakes = build_fakes(tmp / "fakes")
    dev, proc_dir = make_host_dirs(tmp / "host")
    env = fakes.env(base={**clean_env(), "GPUDIAG_DEVICE_DIR": str(dev),
                          "GPUDIAG_DRIVER_PROC_DIR": str(proc_dir)})
    venvs = [make_venv(tmp / name, with_jax=True) for name in ("train", "infer")]
    runtimes = "".join(f'[runtimes.{p.parent.parent.name}]\npython = "{p}"\nuser = "root"\n'
                       for p in venvs)
    print(f"load average {os.getloadavg()[0]:.2f}; window {args.idle_s:g} s")
    columns = {"this tree (two runtimes)": measure(tmp / "this", env, runtimes, 4, args.idle_s)}
    if args.base is not None:
        base_env = {**env, "PYTHONPATH": str(args.base)}
        columns[f"base {args.base} (one environment)"] = measure(tmp / "base", base_env, "", 0,
                                                                 args.idle_s)
    rows = sorted({r for c in columns.values() for r in c},
                  key=lambda r: (r != "whole tree", -max(c.get(r, 0.0) for c in columns.values())))
    print(f"{'% of a core':48s}" + "".join(f"{name[:30]:>32s}" for name in columns))
    for row in rows:
        values = [c.get(row) for c in columns.values()]
        if all(v is None or v < 0.005 for v in values):
            continue
        print(f"{row[:48]:48s}" + "".join(f"{'-' if v is None else f'{v:.3f}%':>32s}"
                                           for v in values))
    return 0


if __name__ == "__main__":
    sys.exit(main())
