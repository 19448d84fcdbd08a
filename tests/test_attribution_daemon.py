"""The daemon's side of failure attribution: the XID timeline and the jobs in the history, the
job-closeouts inbox and its counter, and `gpudiag explain`'s usage errors."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gpudiag.core.attribution import (
    JOB_INBOX,
    Attribution,
    JobRecord,
    Window,
    xid_event,
)
from gpudiag.core.findings import XidEvent
from gpudiag.daemon.closeouts import JobFailuresCollector, JobInbox, record_job
from gpudiag.daemon.explain import explain
from gpudiag.daemon.store import HistoryStore
from tests.support.host import run_gpudiag
from tests.support.run import job_record

GPU = "GPU-f00d0000-0000-4000-8000-000000000000"




def test_the_store_keeps_xids_and_jobs_and_prunes_them_with_the_history(tmp_path: Path) -> None:
    store = HistoryStore(tmp_path / "h.sqlite3", retention_s=1000.0)
    assert store.xids() == [] and store.jobs() == []  # tables are made on first use
    store.record_xids([XidEvent(79, 0, GPU, 105.0)])
    store.record_xids([XidEvent(13, 1, None, 2000.0)])
    assert [(x.xid, x.uuid) for x in store.xids(since=100.0, until=200.0)] == [(79, GPU)]
    job = job_record(10, [xid_event(105.0, 79, GPU, "watcher")], slurm="77")
    store.record_job(ts=job.ended, uid=0, pid=job.pid, slurm_job_id=job.slurm_job_id,
                     started=job.started, ended=job.ended, attribution=job.attribution.kind,
                     record=job.record())
    for pid in (10, 11):  # the run's pid or its job's
        (found,) = store.jobs(pid=pid)
        assert JobRecord.from_record(found.record) == job
    assert [j.attribution for j in store.jobs(slurm_job_id="77")] == ["hardware"]
    assert store.jobs(pid=12) == [] and store.jobs(slurm_job_id="78") == []
    store.prune(now=1500.0)
    assert [x.xid for x in store.xids()] == [13] and store.jobs() == []


def test_the_inbox_counts_keeps_and_removes_records(tmp_path: Path) -> None:
    store = HistoryStore(tmp_path / "h.sqlite3")
    inbox = JobInbox(tmp_path, record=lambda job, uid, *how: record_job(store, job, uid, *how))
    inbox.prepare()
    assert stat.S_IMODE(inbox.folder.stat().st_mode) == 0o1733
    jobs = [job_record(10, [xid_event(105.0, 79, GPU, "watcher")]), job_record(20, []),
            job_record(30, [], exit_code=0)]
    for i, job in enumerate(jobs):
        (inbox.folder / f"{i}.json").write_text(json.dumps(job.record()))
    (inbox.folder / "9.json").write_text("{not json")
    assert [j.pid for j in inbox.poll()] == [10, 20, 30]
    assert inbox.counts() == {"hardware": 1, "software": 0, "application": 1, "unknown": 0}
    assert list(inbox.folder.iterdir()) == []  # taken in, and the bad one dropped
    assert sorted(j.pid or 0 for j in store.jobs()) == [10, 20, 30]
    assert store.jobs()[0].uid == os.getuid()
    registry = CollectorRegistry()
    registry.register(JobFailuresCollector(inbox.counts))
    text = generate_latest(registry).decode()
    assert 'gpudiag_job_failures_total{attribution="hardware"} 1.0' in text
    assert 'gpudiag_job_failures_total{attribution="unknown"} 0.0' in text


def test_a_record_the_history_cannot_keep_stays_in_the_inbox_counted_once(
        tmp_path: Path) -> None:
    kept: list[int] = []
    ok = [False]

    def keep(job: JobRecord, uid: int, *how: str | None) -> bool:
        if ok[0]:
            kept.append(job.pid)
        return ok[0]

    inbox = JobInbox(tmp_path, record=keep)
    inbox.prepare()
    (inbox.folder / "1.json").write_text(json.dumps(job_record(10, []).record()))
    assert len(inbox.poll()) == 1 and len(inbox.poll()) == 0
    assert inbox.counts()["application"] == 1 and (inbox.folder / "1.json").exists()
    ok[0] = True
    inbox.poll()
    assert kept == [10] and inbox.counts()["application"] == 1
    assert not (inbox.folder / "1.json").exists()


def test_the_inbox_refuses_links_and_folders(tmp_path: Path) -> None:
    inbox = JobInbox(tmp_path, record=lambda job, uid, *how: True)
    inbox.prepare()
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps(job_record(10, []).record()))
    (inbox.folder / "link.json").symlink_to(target)
    (inbox.folder / "dir.json").mkdir()
    assert inbox.poll() == [] and inbox.poll() == []
    assert target.exists()  # a planted link never makes the daemon read or delete its target


def test_explain_from_the_history_applies_the_closeouts_rules(tmp_path: Path) -> None:
    store = HistoryStore(tmp_path / "h.sqlite3")
    store.record_xids([XidEvent(79, 0, GPU, 105.0)])
    got = explain(store, Window(100.0, 110.0, frozenset({GPU})), 1)
    assert (got.attribution.kind, got.attribution.rule) == ("hardware", "hardware_xid")
    assert [(r["what"], r["gpu"]) for r in got.timeline] == [("xid", GPU)]
    # Without --gpus, a window covers every GPU the history names.
    assert explain(store, Window(100.0, 110.0, frozenset()), None).attribution.kind == "hardware"
    none = explain(None, Window(100.0, 110.0, frozenset({GPU})), 1, store_why="no history at X")
    assert none.attribution == Attribution("unknown", "evidence_missing", (),
                                           ("daemon history: no history at X",))


@pytest.mark.parametrize(("args", "message"), [
    ([], "exactly one of --run CLOSEOUT, --pid PID"),
    (["--pid", "1", "--slurm-job", "2"], "exactly one of"),
    (["--since", "2026-12-01T00:00:00Z"], "exactly one of"),
    (["--since", "yesterday", "--until", "now"], "neither epoch seconds nor an RFC 3339"),
    (["--since", "200", "--until", "100"], "--until is before --since"),
    (["--pid", "1", "--gpus", GPU], "--gpus goes with --since/--until"),
    (["--since", "1", "--until", "2", "--gpus", "3"], "no GPU named '3'"),
    (["--since", "1", "--until", "2", "--gpus", "banana"], "not GPU names"),
])
def test_explain_usage_errors_say_what_to_do(args: list[str], message: str,
                                            tmp_path: Path) -> None:
    proc = run_gpudiag(["explain", *args, "--state-dir", str(tmp_path)], os.environ)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_explain_of_an_unknown_run_exits_1_saying_where_it_looked(tmp_path: Path) -> None:
    (tmp_path / JOB_INBOX).mkdir()
    proc = run_gpudiag(["explain", "--pid", "999999", "--state-dir", str(tmp_path)],
                       os.environ)
    assert proc.returncode == 1
    assert f"no run with pid 999999 in the history or the inbox of {tmp_path}" in proc.stderr
    proc = run_gpudiag(["explain", "--run", str(tmp_path), "--state-dir", str(tmp_path)],
                       os.environ)
    assert proc.returncode == 1 and "cannot read the closeout" in proc.stderr
