"""Faults of the host under the daemon's store: a full disk, a damaged history, a held lock.

The disk is a real small tmpfs (tests/support/host_disk.py): SQLite and the OS answer as they
would on a node. The end-to-end tests with a real `gpudiag serve` are in test_host_faults_daemon.py.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from gpudiag.core.verdict import Verdict
from gpudiag.daemon.exporter import HistoryCollector
from gpudiag.daemon.recorder import HistoryHealth, HistoryRecorder
from gpudiag.daemon.statedir import (
    LOCK_NAME,
    StateDirBusy,
    StateDirError,
    damaged_histories,
    lock_state_dir,
    open_history,
)
from gpudiag.daemon.store import (
    HistoryDamagedError,
    HistoryStore,
    HistoryWriteError,
    fingerprint,
)
from tests.support.host_disk import fill, small_tmpfs
from tests.support.verdicts import verdict


class FlakyStore:
    """A store whose writes fail while ``failing`` is set (the seam of the recorder)."""

    def __init__(self) -> None:
        self.failing = False
        self.rows: list[tuple[float, str]] = []
        self._last: str | None = None

    @property
    def last_fingerprint(self) -> str | None:
        return self._last

    def record(self, v: Verdict, now: float | None = None) -> int | None:
        if self.failing:
            try:
                raise sqlite3.OperationalError("database or disk is full")
            except sqlite3.OperationalError as e:
                raise HistoryWriteError("cannot write history h.sqlite3: " + str(e)) from e
        fp = fingerprint(v)
        if fp == self._last:
            return None
        self._last = fp
        self.rows.append((float(now or 0.0), v.gpu_validation_blocker))
        return len(self.rows)


CHANGES = [verdict(), verdict(("gpu_lost", "GPU-0")), verdict(("cuda_no_device", "")),
           verdict(warnings=("gpu_xid_application",)), verdict(("gpu_lost", "GPU-1"))]


def _clock() -> object:
    ticks = iter(float(i) for i in range(1000))
    return lambda: next(ticks)


def test_a_failing_store_is_one_line_down_one_line_up_and_every_change_lands_in_order(
        caplog: pytest.LogCaptureFixture) -> None:
    store = FlakyStore()
    rec = HistoryRecorder(store, clock=_clock())  # type: ignore[arg-type]
    caplog.set_level(logging.INFO, logger="gpudiag.daemon.history")
    assert [w.history_id for w in rec.record(CHANGES[0])] == [1]
    store.failing = True
    for v in CHANGES[1:4]:
        said = rec.record(v)
        assert [(w.verdict, w.history_id) for w in said] == [(v, None)]  # said, not yet stored
        assert rec.record(v) == []  # the same verdict again is no change (but a retry)
    health = rec.health()
    assert (health.writable, health.pending, health.dropped) == (False, 3, 0)
    assert health.write_errors == 6 and health.last_error == "database or disk is full"
    store.failing = False
    said = rec.record(CHANGES[4])
    assert [w.history_id for w in said] == [2, 3, 4, 5]
    assert [b for _, b in store.rows] == ["none", "gpu_lost", "cuda_no_device", "none",
                                          "gpu_lost"]
    assert [t for t, _ in store.rows] == sorted(t for t, _ in store.rows)  # their own times
    assert rec.health() == HistoryHealth(True, 6, 0, 0, "database or disk is full")
    lines = [r for r in caplog.records if r.name == "gpudiag.daemon.history"]
    assert [r.getMessage().split(":")[0] for r in lines] == ["history not writable",
                                                           "history writable again"]
    assert "database or disk is full" in lines[0].getMessage()
    assert all(r.exc_info is None for r in caplog.records)


def test_past_the_bound_the_oldest_waiting_changes_are_dropped_said_once_and_counted(
        caplog: pytest.LogCaptureFixture) -> None:
    store = FlakyStore()
    rec = HistoryRecorder(store, max_pending=2, clock=_clock())  # type: ignore[arg-type]
    store.failing = True
    for v in CHANGES:
        rec.record(v)
    assert (rec.health().pending, rec.health().dropped) == (2, 3)
    store.failing = False
    rec.record(CHANGES[4])  # no change: the waiting ones are still written
    assert [b for _, b in store.rows] == ["none", "gpu_lost"]  # the newest two, in order
    dropped = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert len(dropped) == 2  # one when dropping starts, one in the recovery line
    assert "3 dropped" in dropped[-1].getMessage()
    assert "checked at 2026-11-29T00:00:00.000Z" in dropped[0].getMessage()  # which, said


def test_history_metrics_render_the_health() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    health = HistoryHealth(False, 7, 2, 1, "disk full", ("history.sqlite3.damaged-x",))
    registry.register(HistoryCollector(lambda: health))
    text = generate_latest(registry).decode()
    for line in ("gpudiag_history_writable 0.0", "gpudiag_history_write_errors_total 7.0",
                 "gpudiag_history_pending 2.0", "gpudiag_history_dropped_total 1.0",
                 "gpudiag_history_damaged_files 1.0"):
        assert line in text.splitlines(), text


def test_store_on_a_full_disk_says_why_rolls_back_cleanly_and_writes_again(
        tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "disk", "512k") as disk:
        store = HistoryStore(disk / "history.sqlite3")
        assert store.record(verdict()) == 1
        filler = fill(disk)
        with pytest.raises(HistoryWriteError) as err:
            store.record(verdict(("gpu_lost", "GPU-0"), big=20000))
        assert "database or disk is full" in str(err.value)
        assert "rollback" not in str(err.value).lower()  # the real cause, not ROLLBACK's
        assert isinstance(err.value.__cause__, sqlite3.Error)
        filler.unlink()
        row = store.record(verdict(("gpu_lost", "GPU-0"), big=20000))
        assert row is not None and store.ids() == [1, row]
        assert store.integrity() == "ok"
        store.close()


@pytest.mark.parametrize("content", [os.urandom(8192), b"SQLite format 3\x00" + b"\xff" * 4080],
                         ids=["random-bytes", "torn-header"])
def test_a_damaged_history_is_moved_aside_with_its_wal_and_a_fresh_one_starts(
        tmp_path: Path, content: bytes, caplog: pytest.LogCaptureFixture) -> None:
    db = tmp_path / "history.sqlite3"
    db.write_bytes(content)
    (tmp_path / "history.sqlite3-wal").write_bytes(b"old wal")
    with pytest.raises(HistoryDamagedError):
        HistoryStore(db, check=True)
    opened = open_history(tmp_path, retention_s=3600, max_bytes=2**20, wall=lambda: 0.0)
    assert opened.moved_aside == tmp_path / "history.sqlite3.damaged-19700101T000000Z"
    assert opened.moved_aside.read_bytes() == content  # kept as it was, never deleted
    assert (tmp_path / "history.sqlite3.damaged-19700101T000000Z-wal").read_bytes() == b"old wal"
    assert opened.damaged == ("history.sqlite3.damaged-19700101T000000Z",)
    assert opened.store.record(verdict()) == 1 and opened.store.integrity() == "ok"
    opened.store.close()
    assert any("moved it aside" in r.getMessage() and r.exc_info is None
               for r in caplog.records)
    # A second one in the same second never overwrites the first.
    db.write_bytes(content)
    again = open_history(tmp_path, retention_s=3600, max_bytes=2**20, wall=lambda: 0.0)
    again.store.close()
    assert damaged_histories(tmp_path) == ("history.sqlite3.damaged-19700101T000000Z",
                                           "history.sqlite3.damaged-19700101T000000Z.2")


def test_a_healthy_history_is_kept(tmp_path: Path) -> None:
    store = HistoryStore(tmp_path / "history.sqlite3")
    store.record(verdict(("gpu_lost", "GPU-0")))
    store.close()
    opened = open_history(tmp_path, retention_s=3600, max_bytes=2**20)
    assert opened.moved_aside is None and opened.damaged == ()
    assert [v.gpu_validation_blocker for v in opened.store.verdicts()] == ["gpu_lost"]
    opened.store.close()


def test_the_state_dir_lock_names_its_holder_and_a_dead_holder_never_blocks(
        tmp_path: Path) -> None:
    held = lock_state_dir(tmp_path)
    with pytest.raises(StateDirBusy) as busy:
        lock_state_dir(tmp_path)  # flock: a second open file description conflicts
    assert busy.value.pid == os.getpid() and f"PID {os.getpid()}" in str(busy.value)
    held.release()
    # A lock file left by a process that died (its PID inside, no flock held): no obstacle.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    (tmp_path / LOCK_NAME).write_text(dead.stdout)
    again = lock_state_dir(tmp_path)
    assert (tmp_path / LOCK_NAME).read_text().strip() == str(os.getpid())
    again.release()


def test_a_state_dir_that_is_a_file_is_unusable(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(StateDirError, match="file"):
        lock_state_dir(tmp_path / "file")


def test_a_history_that_cannot_open_at_start_is_retried_on_each_change() -> None:
    store = FlakyStore()
    attempts: list[int] = []

    def opener() -> FlakyStore:
        attempts.append(1)
        if len(attempts) < 3:
            raise HistoryWriteError("cannot open history h.sqlite3: database or disk is full")
        return store

    rec = HistoryRecorder(None, opener=opener, clock=_clock(),  # type: ignore[arg-type]
                          open_error=HistoryWriteError("cannot open: disk full"))
    assert rec.health().writable is False and rec.health().write_errors == 1
    rec.record(CHANGES[0])
    rec.record(CHANGES[1])
    assert rec.store is None and rec.health().pending == 2
    rec.record(CHANGES[2])
    assert rec.store is store and [b for _, b in store.rows] == ["none", "gpu_lost",
                                                                 "cuda_no_device"]
    assert rec.health().writable is True and rec.health().write_errors == 3


def test_metrics_never_wait_on_a_write_stuck_in_the_disk() -> None:
    import threading

    gate, entered = threading.Event(), threading.Event()

    class StuckStore(FlakyStore):
        def record(self, v: Verdict, now: float | None = None) -> int | None:
            entered.set()
            gate.wait(10)  # a write hung in D state on a dying disk or NFS
            return super().record(v, now)

    rec = HistoryRecorder(StuckStore(), clock=_clock())  # type: ignore[arg-type]
    writer = threading.Thread(target=rec.record, args=(CHANGES[1],))
    writer.start()
    assert entered.wait(5)
    done = threading.Event()

    def ask() -> None:
        rec.health()
        done.set()

    threading.Thread(target=ask, daemon=True).start()
    assert done.wait(1.0), "health() waited on the stuck write"
    gate.set()
    writer.join(5)
    assert rec.health().pending == 0


def test_a_write_stuck_in_the_disk_never_blocks_whoever_publishes_snapshots() -> None:
    import threading
    import time as _time

    from gpudiag.daemon.recorder import RecorderThread, Written

    gate, entered = threading.Event(), threading.Event()

    class StuckStore(FlakyStore):
        def record(self, v: Verdict, now: float | None = None) -> int | None:
            entered.set()
            gate.wait(10)  # the disk hangs until the gate opens
            return super().record(v, now)

    store = StuckStore()
    said: list[tuple[str, int | None]] = []

    def written(v: Verdict | None, changes: list[Written]) -> None:
        said.extend((c.verdict.gpu_validation_blocker, c.history_id) for c in changes)

    submitted = iter(float(t) for t in range(100, 200))
    writer = RecorderThread(HistoryRecorder(store, clock=_clock()),  # type: ignore[arg-type]
                            written, max_queued=2, clock=lambda: next(submitted))
    writer.start()
    t0 = _time.monotonic()
    writer.submit(CHANGES[0], wait_s=0.2)
    assert entered.wait(5)
    for v in [*CHANGES[1:], CHANGES[-1], CHANGES[-1]]:  # repeats are no change: not queued
        writer.submit(v, wait_s=0.2)
    # The publisher waited at most wait_s per change, never on the disk itself.
    assert _time.monotonic() - t0 < 20  # about 1 s; the stuck write would be for ever
    health = writer.health()
    assert health.pending == 2 and health.dropped == 2  # 1 stuck in the write, 2 queued
    assert writer.stop(timeout_s=0.2) is False  # stuck: the daemon exits without waiting
    gate.set()
    _time.sleep(0.5)
    assert [b for _, b in store.rows] == ["none", "gpu_lost", "cuda_no_device"]
    assert [t for t, _ in store.rows] == [100.0, 101.0, 102.0]  # stamped when submitted
    assert said == [("none", 1), ("gpu_lost", 2), ("cuda_no_device", 3)]


def test_on_a_healthy_disk_a_change_is_written_when_submit_returns() -> None:
    from gpudiag.daemon.recorder import RecorderThread

    store = FlakyStore()
    writer = RecorderThread(HistoryRecorder(store), lambda v, c: None)
    writer.start()
    for i, v in enumerate(CHANGES, 1):
        writer.submit(v)
        assert len(store.rows) == i  # as when the listener wrote it itself
    assert writer.stop() is True
