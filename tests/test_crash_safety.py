"""SIGKILL at random points of every write: never a torn file, a corrupt database, or a lock
that stays held by a dead process.

Writers run in forked children (no interpreter start-up, so each kill costs milliseconds) and
are killed after a random delay, wherever they are: inside SQLite's commit, between fsync and
rename, halfway through a lock holder record. ``gpudiag run`` itself is killed for real too.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import pytest

from gpudiag.core.fileio import atomic_write
from gpudiag.core.verdict import Finding, Requirement, Verdict
from gpudiag.daemon.store import HistoryStore
from gpudiag.engine.locks import lock_holder, release, try_lock
from gpudiag.runner.closeout import closeout_kv
from gpudiag.runner.execute import _write_closeout
from tests.support.host import EnvFactory, processes_with_env

KILLS = 40


def _verdict(n: int) -> Verdict:
    """Verdict n: alternately ready and blocked, so that every record() writes a row."""
    blockers = (Finding.of("gpu_lost", "GPU 0 fell off the bus", backend="nvml",
                           device=f"GPU-{n % 3}"),) if n % 2 else ()
    return Verdict(requirement=Requirement(), blockers=blockers, warnings=(), devices=(),
                   backends={}, evidence={"probe_stderr": {"nvml": "x" * (n % 7) * 500}},
                   preallocation_disabled=True, host="node1",
                   checked_at="2026-11-29T00:00:00.000Z")


def _kill_at_random(child: Callable[[], None], rng: random.Random, max_delay_s: float,
                    ready: bool = True) -> None:
    """Fork ``child`` (looping forever), SIGKILL it after a random delay, reap it."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            os.write(w, b"r")
            child()
        finally:
            os._exit(0)
    os.close(w)
    if ready:
        os.read(r, 1)  # started: the delay counts from inside the loop's first iteration
    time.sleep(rng.uniform(0, max_delay_s))
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    os.close(r)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, \
        f"the writer ended on its own (status {status}): the kill hit nothing"


def _forever(step: Callable[[int], object]) -> NoReturn:
    n = 0
    while True:
        step(n)
        n += 1


def test_history_database_survives_sigkill_anywhere_in_record_and_prune(tmp_path: Path
                                                                         ) -> None:
    path = tmp_path / "history.sqlite3"
    rng = random.Random(8)
    rows_seen = 0

    def writer() -> None:
        # Tiny retention and size limits: prune, incremental vacuum and the WAL checkpoint
        # (TRUNCATE) all run inside the window the kill can land in.
        store = HistoryStore(path, retention_s=1.0, max_bytes=4096,
                             clock=lambda: time.time() + rng.random() * 5)
        _forever(lambda n: store.record(_verdict(n)))

    for _ in range(KILLS):
        _kill_at_random(writer, rng, 0.05)
        db = sqlite3.connect(path)
        try:
            assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            tables = {r[0] for r in db.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table'")}
            # The schema is created in one transaction: all of it or (killed first) none.
            assert tables in (set(), {"meta", "verdicts", "episodes", "xids",
                                      "gpu_identities"}), tables
            if tables:
                assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
                for (record,) in db.execute("SELECT record FROM verdicts"):
                    json.loads(record)
                for (evidence,) in db.execute("SELECT evidence FROM episodes"):
                    json.loads(evidence)
                rows_seen = max(rows_seen, db.execute(
                    "SELECT MAX(id) FROM verdicts").fetchone()[0] or 0)
        finally:
            db.close()
        # The daemon's own open after a crash works and sees the same rows.
        store = HistoryStore(path)
        assert store.integrity() == "ok"
        store.close()
    # Liveness only (how much a writer gets done before its kill depends on the host's load:
    # 2 cores shared by the suite's workers): some writer got rows in.
    assert rows_seen > 0, "no writer ever wrote a row: the kills tested nothing"


def test_atomic_write_leaves_the_old_file_or_the_new_one_never_half(tmp_path: Path) -> None:
    # What --record and every run artifact use.
    target = tmp_path / "verdict.json"
    payloads = [json.dumps({"n": i, "pad": chr(97 + i) * (300_000 + i * 7919)}) + "\n"
                for i in range(3)]
    rng = random.Random(5)
    seen = set()
    for _ in range(KILLS):
        _kill_at_random(lambda: _forever(lambda n: atomic_write(target, payloads[n % 3])),
                        rng, 0.03)
        if target.exists():
            text = target.read_text()
            assert text in payloads, f"torn file: {len(text)} bytes"
            seen.add(payloads.index(text))
            assert (target.stat().st_mode & 0o777) == 0o644
    assert len(seen) >= 2, "every kill landed before the first rename"
    # Temporaries of killed writers may stay behind, never under the target's name.
    assert all(p.name.startswith(".verdict.json.") and p.name.endswith(".tmp")
               for p in tmp_path.iterdir() if p != target)


def test_closeout_files_are_whole_after_sigkill(tmp_path: Path) -> None:
    paths = {"closeout_json": str(tmp_path / "closeout.json"),
             "closeout_txt": str(tmp_path / "closeout.txt")}
    closeouts = [{"schema": "gpudiag.closeout/1", "exit_code": n, "gpu_validation_blocker":
                  "none" if n % 2 else "gpu_lost", "gpu_execution_route": "gpudiag-run",
                  "preallocation_disabled": "yes",
                  "gpus": [{"uuid": f"GPU-{n:04d}", "name": "NVIDIA H200"}] * 64,
                  "artifacts": {f"a{k}": f"/runs/{n}/{k}" for k in range(200)}}
                 for n in range(4)]
    whole_txt = {closeout_kv(c) for c in closeouts}
    rng = random.Random(6)
    for _ in range(KILLS):
        _kill_at_random(lambda: _forever(lambda n: _write_closeout(paths, closeouts[n % 4])),
                        rng, 0.03)
        js, txt = Path(paths["closeout_json"]), Path(paths["closeout_txt"])
        if js.exists():
            assert json.loads(js.read_text()) in closeouts
        if txt.exists():
            assert txt.read_text() in whole_txt


GPU_UUIDS = [f"GPU-f00d{i:04x}-0000-4000-8000-00000000{i:04x}" for i in range(4)]


def test_a_killed_lock_holder_never_keeps_the_lock(tmp_path: Path) -> None:
    lock_dir = tmp_path / "locks"
    rng = random.Random(7)

    def holder() -> None:
        def step(n: int) -> None:
            held = [lk for u in GPU_UUIDS[:2] if (lk := try_lock(lock_dir, u)) is not None]
            if n % 3:
                release(held)  # a lock/release cycle, or keep holding them
        _forever(step)

    for _ in range(KILLS):
        _kill_at_random(holder, rng, 0.02)
        # The kernel dropped the flocks at the holder's death: they are free now, not later.
        locks = [try_lock(lock_dir, u) for u in GPU_UUIDS[:2]]
        assert all(lk is not None for lk in locks), "a dead process still holds a GPU lock"
        release([lk for lk in locks if lk is not None])
        for u in GPU_UUIDS[:2]:
            holder_record = lock_holder(lock_dir, u)  # evidence only: whole, empty or None
            assert holder_record is None or set(holder_record) >= {"pid", "since", "uuid"}


@pytest.mark.parametrize("seed", range(6))
def test_gpudiag_run_killed_anywhere_leaves_whole_artifacts_and_free_locks(
        gpu_env: EnvFactory, tmp_path: Path, seed: int) -> None:
    lock_dir = tmp_path / "locks"
    marker = uuid.uuid4().hex
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=4, GPUDIAG_LOCK_DIR=str(lock_dir),
                  GPUDIAG_DAEMON_URL="http://127.0.0.1:9", GPUDIAG_CRASH_MARKER=marker)
    art = tmp_path / "art"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpudiag", "run", "--gpus", "2", "--artifacts", str(art),
         "--", sys.executable, "-c", "import time; time.sleep(0.3)"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # Anywhere from admission (locks being taken) to closeout (the child has ended).
    time.sleep(random.Random(seed).uniform(0.3, 2.5))
    proc.kill()
    proc.wait(10)
    end = time.monotonic() + 10
    while processes_with_env(marker) and time.monotonic() < end:  # the job itself may still run
        time.sleep(0.05)
    assert not processes_with_env(marker), "processes of the killed run outlived the job"
    locks = [try_lock(lock_dir, u) for u in GPU_UUIDS]
    assert all(lk is not None for lk in locks), "a GPU stayed locked after every holder died"
    release([lk for lk in locks if lk is not None])
    for path in art.rglob("*.json"):
        json.loads(path.read_text())  # never torn: every artifact is whole or absent
    for path in art.rglob("closeout.txt"):
        assert path.read_text().endswith("\n")
