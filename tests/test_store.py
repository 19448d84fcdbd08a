"""The SQLite history: changes only, blocker episodes, retention, readers, SIGKILL safety."""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from gpudiag.daemon.config import BackendConfig
from gpudiag.daemon.scheduler import Scheduler
from gpudiag.daemon.store import HistoryError, HistoryStore
from tests.fakes.build import FakeDriver
from tests.support.daemon import Runs, host_env, quick_config, real_runs
from tests.support.host import run_gpudiag
from tests.support.verdicts import verdict


def test_only_changes_are_recorded_and_survive_a_reopen(tmp_path: Path) -> None:
    path = tmp_path / "h.sqlite3"
    store = HistoryStore(path)
    first = store.record(verdict())
    assert first is not None
    assert store.record(verdict()) is None  # same verdict: no row
    second = store.record(verdict(("gpu_lost", "GPU-1")))
    assert second is not None and second > first
    store.close()
    reopened = HistoryStore(path)
    assert reopened.record(verdict(("gpu_lost", "GPU-1"))) is None
    entries = reopened.verdicts()
    assert [e.gpu_validation_blocker for e in entries] == ["gpu_lost", "none"]
    assert entries[0].blockers == ("gpu_lost",) and entries[0].ready is False
    record = reopened.verdict_record(second)
    assert record is not None and record["blockers"][0]["device"] == "GPU-1"


def test_blocker_episodes_open_and_close_with_evidence(tmp_path: Path) -> None:
    clock = iter([10.0, 20.0, 30.0])
    store = HistoryStore(tmp_path / "h.sqlite3", clock=lambda: next(clock))
    store.record(verdict(("gpu_lost", "GPU-1"), stderr="Xid 79 seen"))
    store.record(verdict(("gpu_lost", "GPU-1"), ("cuda_no_device", "")))
    store.record(verdict())
    eps = {(e.code, e.device): e for e in store.episodes()}
    lost = eps[("gpu_lost", "GPU-1")]
    assert (lost.started, lost.ended) == (10.0, 30.0)
    assert lost.evidence["probe_stderr"] == "Xid 79 seen"
    assert lost.evidence["driver"] == {"version": "570"}
    assert (eps[("cuda_no_device", None)].started, eps[("cuda_no_device", None)].ended) == (
        20.0, 30.0)
    assert [e.id for e in store.episodes(since=25.0)] == [e.id for e in store.episodes()]
    assert store.episodes(since=31.0) == []


def test_retention_by_age_keeps_the_newest_verdict(tmp_path: Path) -> None:
    store = HistoryStore(tmp_path / "h.sqlite3", retention_s=50)
    store.record(verdict(), now=0.0)
    store.record(verdict(("gpu_lost", "GPU-0")), now=10.0)
    store.record(verdict(), now=20.0)
    store.prune(now=65.0)
    assert [e.ts for e in store.verdicts()] == [20.0]
    assert len(store.episodes()) == 1  # it ended at 20, inside the 50 s window
    store.prune(now=75.0)
    assert store.episodes() == []
    store.prune(now=10_000.0)
    assert [e.ts for e in store.verdicts()] == [20.0]


def test_retention_by_size_bounds_the_file(tmp_path: Path) -> None:
    store = HistoryStore(tmp_path / "h.sqlite3", max_bytes=256 * 1024)
    for i in range(300):
        store.record(verdict(("gpu_lost", f"GPU-{i}"), big=3000), now=float(i))
    store.prune(now=300.0)
    assert store.size_bytes() <= 256 * 1024
    ids = [e.id for e in store.verdicts(limit=1000)]
    assert ids[0] == 300 and len(ids) < 300  # the newest stay, the oldest went
    assert store.integrity() == "ok"


def test_a_reader_reads_while_the_writer_holds_the_database(tmp_path: Path) -> None:
    path = tmp_path / "h.sqlite3"
    writer = HistoryStore(path)
    writer.record(verdict(("gpu_lost", "GPU-0")))
    reader = HistoryStore(path, readonly=True)
    assert [e.gpu_validation_blocker for e in reader.verdicts()] == ["gpu_lost"]
    writer.record(verdict())
    assert len(reader.verdicts()) == 2
    with pytest.raises(sqlite3.OperationalError):
        reader._db.execute("DELETE FROM verdicts")


def test_a_missing_history_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(HistoryError, match="no history at .*gpudiag serve"):
        HistoryStore(tmp_path / "none.sqlite3", readonly=True)


class Flipping:
    """A runner replaying real runs; every nvml run flips GPU 1 between healthy and lost."""

    def __init__(self, healthy: Runs, lost: Runs) -> None:
        self.healthy, self.lost, self.n = healthy, lost, 0

    def __call__(self, backend: str, env: Any, timeout_s: float, options: Any) -> Any:
        if backend != "nvml":
            return self.healthy[backend]
        self.n += 1
        return (self.lost if self.n % 2 else self.healthy)["nvml"]


def _daemon_writer(path: Path, fd: int, runs: tuple[Runs, Runs]) -> None:
    """Child after fork: the daemon's write path (scheduler -> snapshot -> history)."""
    try:
        backends = dict(quick_config().backends)
        backends["nvml"] = BackendConfig(True, 0.005, 10.0)
        sched = Scheduler(quick_config(backends=backends, jitter_ratio=0.0, tick_s=0.005),
                          runner=Flipping(*runs), env={})
        store = HistoryStore(path)

        def record(snap: Any) -> None:
            if snap.full is not None:
                row = store.record(snap.full)
                if row is not None:  # acknowledged: committed and fsynced
                    os.write(fd, f"{row}\n".encode())

        sched.on_snapshot(record)
        sched.start()
        time.sleep(60)
    finally:
        os._exit(1)


@pytest.fixture(scope="module")
def flip_runs(fakes: FakeDriver, tmp_path_factory: pytest.TempPathFactory) -> tuple[Runs, Runs]:
    healthy = real_runs(host_env(fakes, tmp_path_factory.mktemp("ok"), FAKE_NVML_DEVICE_COUNT=2))
    lost = real_runs(host_env(fakes, tmp_path_factory.mktemp("lost"), FAKE_NVML_DEVICE_COUNT=2,
                              FAKE_NVML_DEVICE_ERRORS="1:15"), names=("nvml",))
    return healthy, lost


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork to kill writers quickly")
def test_sigkill_while_the_daemon_writes_200_times_loses_no_acknowledged_verdict(
        tmp_path: Path, flip_runs: tuple[Runs, Runs]) -> None:
    path = tmp_path / "h.sqlite3"
    rng = random.Random(4)
    acked: list[int] = []
    for n in range(200):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            os.close(r)
            _daemon_writer(path, w, flip_runs)
        os.close(w)
        want = rng.randint(1, 4)
        buf = b""
        got: list[int] = []
        while len(got) < want:
            chunk = os.read(r, 4096)
            if not chunk:
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            got += [int(x) for x in lines if x]
        os.kill(pid, signal.SIGKILL)  # the next verdict is most likely being written
        _, status = os.waitpid(pid, 0)
        os.close(r)
        assert os.WIFSIGNALED(status), f"writer {n} exited on its own (status {status})"
        assert len(got) >= want, f"writer {n} acknowledged {got}, wanted {want}"
        acked += got
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    stored = {row[0] for row in db.execute("SELECT id FROM verdicts")}
    assert len(acked) >= 200 and set(acked) <= stored
    # Episodes stayed consistent across the kills: at most one open gpu_lost episode.
    assert db.execute("SELECT COUNT(*) FROM episodes WHERE ended IS NULL").fetchone()[0] <= 1


def test_history_cli_reads_text_and_json(tmp_path: Path) -> None:
    store = HistoryStore(tmp_path / "history.sqlite3")
    store.record(verdict())
    store.record(verdict(("gpu_lost", "GPU-1")))
    env = {k: v for k, v in os.environ.items() if k != "STATE_DIRECTORY"}
    proc = run_gpudiag(["history", "--state-dir", str(tmp_path), "--json"], env)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert [v["gpu_validation_blocker"] for v in data["verdicts"]] == ["gpu_lost", "none"]
    assert data["episodes"][0]["code"] == "gpu_lost" and data["episodes"][0]["ended"] is None
    proc = run_gpudiag(["history", "--state-dir", str(tmp_path), "--blocked", "--since", "1h"],
                       env)
    assert proc.returncode == 0 and "gpu_lost" in proc.stdout and " none " not in proc.stdout
    proc = run_gpudiag(["history", "--state-dir", str(tmp_path), "--since", "yesterday"], env)
    assert proc.returncode == 2 and "--since 'yesterday'" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_gpudiag(["history", "--state-dir", str(tmp_path / "empty")], env)
    # No state is a usage problem (issue 16): exit 2 with a hint, not 3.
    assert proc.returncode == 2 and "no history at" in proc.stderr
    assert "--state-dir" in proc.stderr and "Traceback" not in proc.stderr


def test_clears_are_recorded_read_back_and_pruned_with_the_history(tmp_path: Path) -> None:
    store = HistoryStore(tmp_path / "h.sqlite3", retention_s=100.0)
    try:
        assert store.clears() == []  # no table until the first clear
        store.record_clear(uid=1000, gpu="GPU-x", reason="reseated", released=2, now=10.0)
        store.record_clear(uid=0, gpu=None, reason="", released=0, now=200.0)
        assert [c.record() for c in store.clears()] == [
            {"id": 2, "ts": 200.0, "uid": 0, "gpu": None, "reason": "", "released_xids": 0,
             "serial": None, "no_repair": False, "codes": []},
            {"id": 1, "ts": 10.0, "uid": 1000, "gpu": "GPU-x", "reason": "reseated",
             "released_xids": 2, "serial": None, "no_repair": False, "codes": []}]
        assert [c.id for c in store.clears(since=100.0)] == [2]
        store.prune(now=250.0)
        assert [c.id for c in store.clears()] == [2]
    finally:
        store.close()


def test_jobs_are_pruned_apart_and_never_cost_the_verdict_history_its_place(
        tmp_path: Path) -> None:
    # Issue 38: 21 MB of closeouts against a 1 MiB bound used to prune the verdict history
    # down to its newest entry and stay 21 MB.
    limit = 1 << 20
    t0 = time.time() - 4000.0
    store = HistoryStore(tmp_path / "h.sqlite3", max_bytes=limit)
    for i in range(50):
        store.record(verdict(("gpu_lost", f"GPU-{i}")), now=t0 + i)
    record = {"schema": "gpudiag.job/1", "argv": ["x" * 7000]}
    for i in range(3000):
        store.record_job(ts=t0 + 100 + i, uid=65534, pid=i, slurm_job_id=str(i),
                         started=t0 + 99 + i, ended=t0 + 100 + i, attribution="application",
                         record=record, attested="socket", run_id=f"{i:016x}")
    store.prune(now=t0 + 4000.0)
    size = store.size_bytes()
    jobs = store.jobs(limit=5000)
    print(f"3000 jobs of 7 KB: history {size / 1024:.0f} KiB (bound {limit // 1024} KiB), "
          f"{len(jobs)} jobs kept")
    assert size <= limit
    assert len(store.verdicts(limit=1000)) == 50  # every verdict change kept
    assert 0 < len(jobs) < 3000 and jobs[0].pid == 2999  # the newest jobs stay
    assert jobs[0].attested == "socket" and jobs[0].run_id == f"{2999:016x}"
    assert store.integrity() == "ok"
