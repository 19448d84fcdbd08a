"""Holds survive restarts: held XIDs come back from the history until a clear or expiry."""

from __future__ import annotations

import logging
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from gpudiag.core.classify import NodeFacts, classify
from gpudiag.core.findings import XidEvent
from gpudiag.core.requirement import parse_requirement
from gpudiag.daemon.config import XidConfig
from gpudiag.daemon.holds import HistoryAtStart, XidKeeper, held_xids, restore_holds
from gpudiag.daemon.recorder import HistoryRecorder, RecorderThread
from gpudiag.daemon.statedir import start_history
from gpudiag.daemon.store import HistoryError, HistoryStore, default_path
from gpudiag.daemon.watcher import XidWatcher
from tests.fakes.build import FakeDriver, write_state_file
from tests.support.daemon import (
    Daemon,
    daemon_toml,
    host_env,
    real_runs,
    wait_for,
    write_config,
)
from tests.support.host import run_gpudiag

UUID0 = "GPU-f00d0000-0000-4000-8000-000000000000"
UUID1 = "GPU-f00d0001-0000-4000-8000-000000000001"
T0 = 1_800_000_000.0


def _store(tmp_path: Path) -> HistoryStore:
    return HistoryStore(default_path(tmp_path), clock=lambda: T0)


# -- the history keeps XIDs and says which are still held --------------------------------------
def test_kept_xids_are_held_unless_expired_or_cleared_after_them(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.record_xids([XidEvent(79, 0, UUID0, T0 - 7200)])       # past a 1 h hold
    store.record_xids([XidEvent(79, 1, UUID1, T0 - 60)])
    store.record_xids([XidEvent(48, 0, UUID0, T0 - 30)])
    assert held_xids(store, T0 - 3600) == [XidEvent(79, 1, UUID1, T0 - 60),
                                          XidEvent(48, 0, UUID0, T0 - 30)]
    # A clear of GPU 0 releases GPU 0's XIDs seen before it, and only those.
    store.record_clear(uid=0, gpu=UUID0, reason="reseated", released=1, now=T0 - 10)
    assert held_xids(store, T0 - 3600) == [XidEvent(79, 1, UUID1, T0 - 60)]
    # An XID after a clear holds its GPU again; a clear of all GPUs releases everything before.
    store.record_xids([XidEvent(74, 0, UUID0, T0 - 5)])
    store.record_clear(uid=0, gpu=None, reason="node serviced", released=2, now=T0 - 2)
    store.record_xids([XidEvent(79, 0, UUID0, T0 - 1)])
    assert held_xids(store, T0 - 3600) == [XidEvent(79, 0, UUID0, T0 - 1)]
    store.close()


def test_pruning_drops_kept_xids_past_the_retention(tmp_path: Path) -> None:
    store = HistoryStore(default_path(tmp_path), retention_s=100.0)
    store.record_xids([XidEvent(79, 0, UUID0, T0 - 500)])
    store.record_xids([XidEvent(79, 1, UUID1, T0 - 50)])
    store.prune(now=T0)
    assert held_xids(store, 0.0) == [XidEvent(79, 1, UUID1, T0 - 50)]
    store.close()


def test_an_open_xid_episode_of_an_older_history_is_held_again(
        fakes: FakeDriver, tmp_path: Path) -> None:
    # A history written before XIDs were kept has only the episode the XID opened: its
    # blocker, worded by classify itself, is read back.
    env = host_env(fakes, tmp_path / "host", gpus=2, FAKE_NVML_DEVICE_COUNT=2)
    runs = real_runs(env, ("host", "nvml"))
    verdict = classify(runs, parse_requirement("nvml", node_health=True), host="h",
                       checked_at="2027-01-15T08:00:00Z",
                       facts=NodeFacts(xids=[XidEvent(79, 1, UUID1, T0)]))
    assert verdict.gpu_validation_blocker == "gpu_lost"
    store = _store(tmp_path / "state")
    store.record(verdict, now=T0 + 0.5)
    assert held_xids(store, T0 - 3600) == [XidEvent(79, 1, UUID1, T0 + 0.5)]
    assert held_xids(store, T0 + 1) == []  # expired by then
    store.record_clear(uid=0, gpu=UUID1, reason="replaced", released=0, now=T0 + 2)
    assert held_xids(store, T0 - 3600) == []
    store.close()


def test_xids_are_kept_in_batches_on_the_writer_thread_and_a_failure_is_said_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    recorder = start_history(tmp_path, retention_s=86400.0, max_bytes=2**26)
    writer = RecorderThread(recorder, lambda verdict, changes: None)
    keep = XidKeeper(writer)
    for i in range(50):  # queued before the writer runs: one batch, one commit
        keep(XidEvent(13, i % 2, UUID1 if i % 2 else UUID0, T0 + i))
    writer.start()
    store = recorder.store
    assert isinstance(store, HistoryStore)
    wait_for(lambda: len(held_xids(store, 0.0)) == 50, 5)
    assert held_xids(store, 0.0)[-1] == XidEvent(13, 1, UUID1, T0 + 49)
    assert writer.stop()
    store.close()
    # No writable history (a full disk at start): said once, not once per XID.
    caplog.set_level(logging.WARNING, "gpudiag.daemon.holds")
    broken = RecorderThread(HistoryRecorder(None, open_error=HistoryError("disk full")),
                            lambda verdict, changes: None)
    broken.start()
    keep = XidKeeper(broken)
    for i in range(5):
        keep(XidEvent(79, 0, UUID0, T0 + 100 + i))
        time.sleep(0.05)
    wait_for(lambda: caplog.records, 5)
    time.sleep(0.2)
    lost = [r.getMessage() for r in caplog.records if "not kept in the history" in
            r.getMessage()]
    assert len(lost) == 1 and "not writable" in lost[0], lost
    assert broken.stop()


# -- what restore_holds says about the history -------------------------------------------------
def _restore(state: Path, hold_s: float = 3600.0) -> tuple[Any, XidWatcher]:
    before = HistoryAtStart.look(state)
    recorder = start_history(state, retention_s=86400.0, max_bytes=2**26)
    watcher = XidWatcher(XidConfig(enabled=False, hold_s=hold_s), {})
    got = restore_holds(before, recorder, watcher, hold_s=hold_s, now=T0)
    store = recorder.store
    assert isinstance(store, HistoryStore)
    store.close()
    return got, watcher


def test_a_first_start_says_the_history_was_missing(tmp_path: Path) -> None:
    got, watcher = _restore(tmp_path / "state")
    assert (got.state, got.rearmed_xids) == ("missing", 0)
    assert "not known" in str(got.reason) and watcher.state().recent == ()
    assert got.record()["started_at"].startswith("2027-01-15T")


def test_a_restart_re_arms_what_the_history_holds(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    store = _store(state)
    store.record_xids([XidEvent(79, 1, UUID1, T0 - 60)])
    store.close()
    got, _ = _restore(state)
    assert (got.state, got.reason, got.rearmed_xids) == ("ok", None, 1)


def test_a_damaged_history_says_so_and_names_where_it_went(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    default_path(state).write_bytes(b"not a database at all, " * 100)
    got, _ = _restore(state)
    assert got.state == "damaged" and got.rearmed_xids == 0
    assert "history.sqlite3.damaged-" in str(got.reason) and "not known" in str(got.reason)
    # The next start finds a sound history again: the old damaged file is not news.
    assert _restore(state)[0].state == "ok"


# -- a real daemon, stopped with SIGTERM and started again -------------------------------------
@pytest.fixture
def node(fakes: FakeDriver, tmp_path: Path) -> dict[str, Any]:
    state_file = tmp_path / "gpu-state"
    write_state_file(state_file, {"FAKE_NVML_DEVICE_COUNT": 2})
    env = host_env(fakes, tmp_path / "host", gpus=2, FAKE_GPU_STATE_FILE=str(state_file))
    return {"env": env, "state_file": state_file, "state": tmp_path / "state", "tmp": tmp_path}


def _start(node: dict[str, Any], hold_s: float = 3600) -> Daemon:
    toml = daemon_toml({"xid": {"hold_s": hold_s}})
    daemon = Daemon(node["env"], write_config(node["tmp"] / "gpudiag.toml", toml),
                    node["state"])
    daemon.wait_ready()
    return daemon


def _xid_79_on_gpu_1(node: dict[str, Any], daemon: Daemon) -> None:
    write_state_file(node["state_file"], {"FAKE_NVML_DEVICE_COUNT": 2,
                                          "FAKE_NVML_XIDS": "1:79"})
    wait_for(lambda: daemon.get("/v1/health")[1]["gpu_validation_blocker"] == "gpu_lost", 15)
    # The XID source goes quiet: the next daemon's watcher sees nothing new.
    write_state_file(node["state_file"], {"FAKE_NVML_DEVICE_COUNT": 2})
    # Kept in the history (on its writer thread) before the daemon is stopped.
    wait_for(lambda: any("XID 79" in line for line in daemon.lines), 5)
    time.sleep(0.3)


def _lost(rec: dict[str, Any]) -> bool:
    return bool(rec["gpu_validation_blocker"] == "gpu_lost"
                and rec["blockers"][0]["device"] == UUID1)


def test_an_xid_held_before_a_restart_blocks_until_gpudiag_clear(node: dict[str, Any]) -> None:
    daemon = _start(node)
    assert daemon.get("/v1/health")[1]["evidence"]["history"]["state"] == "missing"
    _xid_79_on_gpu_1(node, daemon)
    assert daemon.stop() == 0
    # The XID itself is in the history, with its GPU and time (not only the episode).
    db = sqlite3.connect(default_path(node["state"]))
    try:
        assert db.execute("SELECT xid, gpu, uuid FROM xids").fetchall() == [(79, 1, UUID1)]
    finally:
        db.close()
    daemon = _start(node)
    try:
        health = daemon.get("/v1/health")[1]
        assert _lost(health), health["blockers"]
        assert "XID 79" in health["blockers"][0]["message"]
        assert health["evidence"]["history"] == {**health["evidence"]["history"],
                                                 "state": "ok", "reason": None,
                                                 "rearmed_xids": 1}
        job = daemon.get("/v1/preflight?devices=1")[1]
        assert _lost(job) and job["ready"] is False
        assert any("held again from the history" in line for line in daemon.lines)
        proc = run_gpudiag(["clear", "--gpu", UUID1, "--reason", "reseated",
                            "--state-dir", str(node["state"])], node["env"])
        assert proc.returncode == 0, proc.stderr
        wait_for(lambda: daemon.get("/v1/health")[1]["gpu_validation_blocker"] == "none", 15)
    finally:
        assert daemon.stop() == 0
    # The clear is in the history after the XID: the next start does not hold it again.
    daemon = _start(node)
    try:
        health = daemon.get("/v1/health")[1]
        assert health["gpu_validation_blocker"] == "none", health["blockers"]
        assert health["evidence"]["history"]["rearmed_xids"] == 0
        assert daemon.get("/v1/preflight?devices=1")[1]["ready"] is True
    finally:
        assert daemon.stop() == 0


def test_an_xid_held_before_a_restart_ends_with_its_hold(node: dict[str, Any]) -> None:
    hold_s = 10.0  # long enough to restart a daemon on a loaded machine within it
    daemon = _start(node, hold_s=hold_s)
    _xid_79_on_gpu_1(node, daemon)
    seen_at = time.time()
    assert daemon.stop() == 0
    daemon = _start(node, hold_s=hold_s)
    try:
        assert _lost(daemon.get("/v1/health")[1])
        assert time.time() - seen_at < hold_s - 1, "too slow to see the hold before it ended"
        # Expired: the hold ends on its own time, as it would have without the restart.
        wait_for(lambda: daemon.get("/v1/health")[1]["gpu_validation_blocker"] == "none",
                 hold_s + 5, interval=0.2)
        assert time.time() - seen_at >= hold_s - 1.5
    finally:
        assert daemon.stop() == 0
