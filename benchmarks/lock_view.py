"""What "is this GPU's lock held?" and admission's wait cost, with foreign locks on the host.

Run: .venv/bin/python benchmarks/lock_view.py [--foreign 0,50000] [--gpus 8] [--rounds 200]

Other processes (the "foreign" holders, several: RLIMIT_NOFILE caps one process's descriptors)
hold N flocks on their own files, as any user can. Then, per GPU lock (one of ``--gpus`` held
by a job, the rest free):
- ``held_test_us``: the held-or-not test now (engine/locks.lock_state: a non-blocking attempt
  on a fresh open file description, let go at once), per GPU;
- ``table_test_us``: the same question as it was asked before (one read of /proc/locks,
  parsed, then the GPU's entries looked up: engine/locks.read_lock_table unbounded), per view
  of every GPU;
- ``wait_wake_ms`` / ``wait_cpu_s``: a job waiting for a held GPU, from the holder's release
  to the waiter's wake, and the waiter's CPU over a 2 s wait: now (a blocking flock in a helper
  thread, engine/locks.wait_for_free) and before (polling /proc/locks at 0.05 s backing off to
  0.5 s, as runner/admission did).
Prints one JSON line per foreign-lock count.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpudiag.core.proclocks import flocks_on  # noqa: E402
from gpudiag.engine.locks import (  # noqa: E402
    lock_state,
    read_lock_table,
    release,
    try_lock,
    wait_for_free,
)
from tests.support.flocks import hold_foreign  # noqa: E402


def uuids(n: int) -> list[str]:
    return [f"GPU-f00d{i:04x}-0000-4000-8000-{i:012x}" for i in range(n)]


JOB = """
import sys, time
from pathlib import Path
from gpudiag.engine.locks import try_lock
lk = try_lock(Path(sys.argv[1]), sys.argv[2])
print("held", flush=True)
sys.stdin.readline()
"""


def job_holding(lock_dir: Path, uuid: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", JOB, str(lock_dir), uuid], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _key(path: Path) -> tuple[int, int, int]:
    st = os.stat(path)
    return os.major(st.st_dev), os.minor(st.st_dev), st.st_ino


def old_wait(path: Path, timeout_s: float) -> bool:
    """Before: poll the kernel's table until the lock has no holder, backing off."""
    key, pause, until = _key(path), 0.05, time.monotonic() + timeout_s
    while time.monotonic() < until:
        table = read_lock_table(deadline_s=3600.0, limit=1 << 40)
        if table is not None and not flocks_on(table, *key):
            return True
        time.sleep(pause)
        pause = min(0.5, pause * 2)
    return False


def wake(lock_dir: Path, uuid: str, new: bool) -> tuple[float, float]:
    """(ms from the holder's release to the waiter's wake, waiter CPU-s over the wait)."""
    job = job_holding(lock_dir, uuid)
    woke: list[float] = []
    cpu: list[float] = []

    def waiter() -> None:
        t0 = resource.getrusage(resource.RUSAGE_THREAD)
        ok = (wait_for_free(lock_dir, [uuid], 30.0) is not None if new
              else old_wait(lock_dir / f"{uuid}.lock", 30.0))
        woke.append(time.monotonic())
        t1 = resource.getrusage(resource.RUSAGE_THREAD)
        cpu.append(t1.ru_utime + t1.ru_stime - t0.ru_utime - t0.ru_stime)
        assert ok

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(2.0)  # a wait of 2 s before the holder lets go
    assert job.stdin is not None
    released = time.monotonic()
    job.stdin.close()
    job.wait()
    thread.join()
    # The blocking wait's own thread (engine/locks) is not this one: its CPU is the kernel's
    # sleep, nothing to add.
    return (woke[0] - released) * 1000, cpu[0]


def measure(foreign: int, gpus: int, rounds: int, work: Path) -> dict[str, object]:
    holders = hold_foreign(foreign, work / "foreign")
    lock_dir = work / "locks"
    try:
        names = uuids(gpus)
        for u in names:
            lk = try_lock(lock_dir, u)
            assert lk is not None
            release([lk])
        job = job_holding(lock_dir, names[0])
        t0 = time.perf_counter()
        for _ in range(rounds):
            states = [lock_state(lock_dir, u) for u in names]
        held_us = (time.perf_counter() - t0) / (rounds * gpus) * 1e6
        assert states[0] == "exclusive" and set(states[1:]) == {"free"}, states
        table_rounds = max(1, rounds // 20) if foreign else rounds
        keys = [_key(lock_dir / f"{u}.lock") for u in names]
        t0 = time.perf_counter()
        for _ in range(table_rounds):
            table = read_lock_table(deadline_s=3600.0, limit=1 << 40)
            assert table is not None
            held = [bool(flocks_on(table, *k)) for k in keys]
        table_ms = (time.perf_counter() - t0) / table_rounds * 1000
        assert held[0] and not any(held[1:])
        assert job.stdin is not None
        job.stdin.close()
        job.wait()
        new_ms, new_cpu = wake(lock_dir, names[1], new=True)
        old_ms, old_cpu = wake(lock_dir, names[2], new=False)
        return {"foreign_locks": foreign, "gpus": gpus,
                "held_test_us_per_gpu": round(held_us, 2),
                "table_test_ms_per_view": round(table_ms, 2),
                "table_test_us_per_gpu": round(table_ms * 1000 / gpus, 1),
                "wait_wake_ms": {"kernel": round(new_ms, 2), "polling": round(old_ms, 2)},
                "wait_cpu_s": {"kernel": round(new_cpu, 4), "polling": round(old_cpu, 4)}}
    finally:
        for p in holders:
            assert p.stdin is not None
            p.stdin.close()
            p.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--foreign", default="0,50000")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    for n in (int(x) for x in args.foreign.split(",")):
        with tempfile.TemporaryDirectory(prefix="gpudiag-lockview-") as tmp:
            (Path(tmp) / "foreign").mkdir()
            print(json.dumps(measure(n, args.gpus, args.rounds, Path(tmp))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
