"""The numbers nobody publishes (docs/numbers.md), end to end on the fakes through the real
daemon and CLI: time to detect, faults flagged before their XID, false blockers, the GPU's own
history by serial, allocations as a join, per-job energy, and the catch rate's blocks."""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpudiag.core.attribution import JOB_INBOX
from gpudiag.core.usage import BlockRecord, GpuUsage
from gpudiag.daemon.allocations import AllocationCollector, Allocations
from gpudiag.daemon.closeouts import JobInbox
from gpudiag.daemon.numbers import (
    ENERGY_BUCKETS_J,
    FAULT_BUCKETS_S,
    INCIDENT_BUCKETS_S,
    Histogram,
    Numbers,
    NumbersCollector,
)
from gpudiag.daemon.runs import OpenRun, Peer
from gpudiag.daemon.store import SCHEMA_VERSION, HistoryStore
from tests.fakes.build import FakeDriver, write_state_file
from tests.support.daemon import Daemon, daemon_toml, host_env, wait_for, write_config
from tests.support.host import run_gpudiag
from tests.support.prometheus import PROMTOOL, promtool

UUIDS = [f"GPU-f00d{i:04x}-0000-4000-8000-{i:012x}" for i in range(4)]
SERIALS = [f"16500000000{i:02d}" for i in range(4)]


def _samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [(s.labels, s.value) for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == name]


def _value(text: str, name: str, **labels: str) -> float | None:
    found = [v for lab, v in _samples(text, name) if all(lab.get(k) == w
                                                          for k, w in labels.items())]
    return found[0] if found else None


# -- the pieces --------------------------------------------------------------------------------
def test_a_histogram_counts_into_its_buckets_and_renders_cumulatively() -> None:
    h = Histogram((1.0, 10.0)).observe(0.5).observe(5.0).observe(50.0).observe(1.0)
    assert h.counts == (2, 1, 1) and h.count == 4 and h.total == 56.5
    reg = CollectorRegistry()
    reg.register(NumbersCollector(lambda: Numbers().state()))
    text = generate_latest(reg).decode()
    assert 'gpudiag_fault_to_verdict_seconds_bucket{le="+Inf"} 0.0' in text
    assert "gpudiag_faults_total 0.0" in text
    assert "gpudiag_faults_flagged_before_xid_total 0.0" in text
    # 15 minutes to 30 days between incidents; energy up to a gigajoule.
    assert INCIDENT_BUCKETS_S[0] == 900 and INCIDENT_BUCKETS_S[-1] == 30 * 86400
    assert FAULT_BUCKETS_S[0] < 1 and ENERGY_BUCKETS_J[-1] == 1e9
    assert len(_samples(text, "gpudiag_gpu_incident_interval_seconds_bucket")) == len(
        INCIDENT_BUCKETS_S) + 1


def test_every_number_renders_once_it_has_counts() -> None:
    numbers = Numbers()
    numbers.blocked(BlockRecord(1, "gpu_lost", ("gpu_lost",), 1.0))
    numbers.blocked(BlockRecord(2, "devices_busy", ("devices_busy",), 2.0))
    reg = CollectorRegistry()
    reg.register(NumbersCollector(numbers.state))
    text = generate_latest(reg).decode()
    assert _value(text, "gpudiag_preflight_blocks_total", code="gpu_lost", layer="device") == 1
    assert _value(text, "gpudiag_preflight_blocks_total", code="devices_busy",
                  layer="admission") == 1
    assert _samples(text, "gpudiag_false_blockers_total") == []  # codes seen only


def test_blocks_and_jobs_from_the_inbox_are_counted_and_their_energy_observed(
        tmp_path: Path) -> None:
    numbers = Numbers()
    inbox = JobInbox(tmp_path, record=lambda job, uid, *how: True, on_job=numbers.job,
                     on_block=numbers.blocked)
    inbox.prepare()
    block = BlockRecord(10, "gpu_lost", ("gpu_lost",), 100.0, "77")
    (inbox.folder / "1.json").write_text(json.dumps(block.record()))
    from tests.support.run import job_record

    job = job_record(20, [])
    job = type(job)(**{**job.__dict__, "gpu_usage": (GpuUsage(UUIDS[0], 1500.0, 2**30),)})
    (inbox.folder / "2.json").write_text(json.dumps(job.record()))
    assert [j.pid for j in inbox.poll()] == [20]
    assert list(inbox.folder.iterdir()) == []
    state = numbers.state()
    assert dict(state.preflight_blocks) == {"gpu_lost": 1}
    assert state.job_energy.count == 1 and state.job_energy.total == 1500.0


def test_allocations_are_the_attested_runs_gpus_once_per_leaf(tmp_path: Path) -> None:
    def run(pid: int, gpus: tuple[str, ...], job: str | None, began: float) -> OpenRun:
        return OpenRun(f"r{pid}", Peer(0, pid, None, None), began, gpus, job)

    runs = [run(os.getpid(), (UUIDS[0], UUIDS[1]), "77", 10.0),
            run(os.getpid() + 1, (UUIDS[1],), "78", 20.0),
            run(os.getpid() + 2, (UUIDS[2], "GPU-not-a-full-uuid"), None, 5.0)]
    allocations = Allocations(lambda: runs, owner_name=lambda uid: f"user{uid}")
    got = allocations.poll()
    assert [(a.uuid, a.job, a.scheduler, a.user) for a in got] == [
        (UUIDS[0], "77", "slurm", "user0"), (UUIDS[1], "77", "slurm", "user0"),
        (UUIDS[2], f"pid-{os.getpid() + 2}", "none", "user0")]  # the earliest run per leaf
    reg = CollectorRegistry()
    reg.register(AllocationCollector(allocations.current))
    text = generate_latest(reg).decode()
    assert len(_samples(text, "gpudiag_gpu_allocation_info")) == 3
    assert all(set(lab) == {"uuid", "job_id", "user", "scheduler"}
               for lab, _ in _samples(text, "gpudiag_gpu_allocation_info"))
    # Only leaves the daemon sees: a run's GPU outside them adds no series.
    seen = Allocations(lambda: runs, leaves=lambda: {UUIDS[1]})
    assert [a.uuid for a in seen.poll()] == [UUIDS[1]]
    runs.clear()
    assert allocations.poll() == ()


def test_a_planted_allocation_file_changes_no_metric(tmp_path: Path) -> None:
    """The allocations/ inbox is gone: a claim file anywhere in the state folder is read by
    nothing (only attested runs make the series)."""
    (tmp_path / "allocations").mkdir()
    (tmp_path / "allocations" / "x.json").write_text(json.dumps({
        "schema": "gpudiag.allocation/1", "pid": os.getpid(), "gpus": UUIDS,
        "job": "planted", "scheduler": "slurm", "since": 0}))
    allocations = Allocations(lambda: ())
    assert allocations.poll() == ()


def test_a_refused_run_s_code_outside_the_catalog_counts_as_other() -> None:
    numbers = Numbers()
    for code in ("gpu_lost", "invented_code_1", "invented_code_2"):
        numbers.blocked(BlockRecord(1, code, (), 0.0, None))
    assert dict(numbers.state().preflight_blocks) == {"gpu_lost": 1, "other": 2}


@pytest.mark.parametrize("energy", [float("inf"), float("nan"), -1.0, 1e12])
def test_energy_that_is_not_physical_is_not_observed(energy: float) -> None:
    from tests.support.run import job_record

    numbers = Numbers()
    job = job_record(20, [])  # held UUIDS[0] for 10 s
    job = type(job)(**{**job.__dict__, "gpu_usage": (GpuUsage(UUIDS[0], energy, 2**30),)})
    numbers.job(job)
    assert numbers.state().job_energy.count == 0


def test_energy_of_a_gpu_the_job_did_not_hold_is_not_observed() -> None:
    from tests.support.run import job_record

    numbers = Numbers()
    job = job_record(20, [])  # held UUIDS[0] for 10 s
    job = type(job)(**{**job.__dict__, "gpu_usage": (GpuUsage(UUIDS[1], 100.0, 2**30),
                                                     GpuUsage(UUIDS[0], 100.0, 2**30))})
    numbers.job(job)
    assert numbers.state().job_energy.count == 1


def test_a_version_1_history_gains_serial_columns_and_old_rows_read_none(
        tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite3"
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        INSERT INTO meta VALUES ('schema_version', '1');
        CREATE TABLE verdicts (id INTEGER PRIMARY KEY, ts REAL NOT NULL, checked_at TEXT NOT
            NULL, requirement TEXT NOT NULL, blocker TEXT NOT NULL, ready INTEGER NOT NULL,
            blockers TEXT NOT NULL, warnings TEXT NOT NULL, fingerprint TEXT NOT NULL,
            record TEXT NOT NULL);
        CREATE TABLE episodes (id INTEGER PRIMARY KEY, code TEXT NOT NULL, layer TEXT NOT NULL,
            backend TEXT, device TEXT, started REAL NOT NULL, ended REAL, message TEXT NOT NULL,
            evidence TEXT NOT NULL);
        INSERT INTO episodes VALUES (1, 'gpu_lost', 'device', 'nvml', 'GPU-x', 5.0, NULL,
            'GPU 0: XID 79 (fallen off the bus)', '{}');
        CREATE TABLE xids (id INTEGER PRIMARY KEY, ts REAL NOT NULL, xid INTEGER NOT NULL,
            gpu INTEGER, uuid TEXT);
        CREATE TABLE clears (id INTEGER PRIMARY KEY, ts REAL NOT NULL, uid INTEGER NOT NULL,
            gpu TEXT, reason TEXT NOT NULL, released INTEGER NOT NULL);
        INSERT INTO clears VALUES (1, 6.0, 0, 'GPU-x', 'reseated', 1);
    """)
    db.commit()
    db.close()
    old = HistoryStore(path, readonly=True)  # an older daemon's file, not migrated yet
    try:
        assert [e.serial for e in old.episodes()] == [None] and old.worst(3) == []
        assert [c.no_repair for c in old.clears()] == [None]
    finally:
        old.close()
    store = HistoryStore(path)
    try:
        assert store.schema_version() == SCHEMA_VERSION == 2
        assert [e.record()["serial"] for e in store.episodes()] == [None]
        store.record_clear(uid=0, gpu=None, reason="x", released=0, no_repair=True,
                           codes=["gpu_lost"])
        assert [(c.no_repair, c.codes) for c in store.clears()] == [
            (True, ("gpu_lost",)), (None, ())]  # an old clear: not known
    finally:
        store.close()


def test_worst_does_not_count_a_blocker_cleared_with_no_repair(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite3"
    HistoryStore(path).close()
    db = sqlite3.connect(path)
    db.executemany("INSERT INTO episodes (code, layer, device, started, ended, message, "
                   "evidence, serial) VALUES (?, 'device', ?, ?, ?, 'm', '{}', ?)", [
                       ("gpu_lost", "GPU-a", 10.0, 21.0, "S-A"),   # cleared, no repair
                       ("gpu_lost", "GPU-a", 30.0, None, "S-A"),   # a real one later
                       ("gpu_lost", "GPU-b", 10.0, 21.0, "S-B"),   # cleared after a repair
                       ("gpu_reset_required", "GPU-c", 10.0, 23.0, "S-C"),  # other code
                       ("gpu_lost", "GPU-d", 10.0, 23.0, "S-D")])  # the all-GPU clear's
    db.commit()
    db.close()
    store = HistoryStore(path)
    try:
        store.record_clear(uid=0, gpu="GPU-a", reason="false", released=1, now=20.0,
                           no_repair=True, codes=["gpu_lost"])
        store.record_clear(uid=0, gpu="GPU-b", reason="reseated", released=1, now=20.0,
                           codes=["gpu_lost"])
        store.record_clear(uid=0, gpu=None, reason="false", released=1, now=22.0,
                           no_repair=True, codes=["gpu_lost"])
        got = {o.serial: o.incidents for o in store.worst(10)}
    finally:
        store.close()
    assert got == {"S-A": 1, "S-B": 1, "S-C": 1}


# -- end to end: a real daemon on the fakes ----------------------------------------------------
def _metrics(daemon: Daemon) -> str:
    status, text = daemon.get("/metrics")
    assert status == 200
    return str(text)


def _findings(daemon: Daemon) -> list[dict[str, Any]]:
    status, rec = daemon.get("/v1/preflight?require=cuda")
    assert status == 200, rec
    return [*rec["blockers"], *rec["warnings"]]


def _history(env: dict[str, str], state: Path, *args: str) -> dict[str, Any]:
    proc = run_gpudiag(["history", *args, "--json", "--state-dir", str(state)], env)
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(proc.stdout))


@pytest.mark.slow
def test_xids_are_timed_to_their_verdict_false_blockers_counted_and_history_follows_the_serial(
        fakes: FakeDriver, tmp_path: Path) -> None:
    state_file = tmp_path / "gpu-state"
    knobs: dict[str, str | int] = {"FAKE_NVML_DEVICE_COUNT": 4}
    write_state_file(state_file, knobs)
    env = host_env(fakes, tmp_path / "host", gpus=4, FAKE_GPU_STATE_FILE=str(state_file))
    state = tmp_path / "state"
    toml = daemon_toml({"backends.nvml": {"interval_s": 1}})
    daemon = Daemon(env, write_config(tmp_path / "gpudiag.toml", toml), state)
    try:
        daemon.wait_ready()
        # GPU 1's link narrows first (a warning): its XID then comes to a GPU already flagged.
        knobs["FAKE_NVML_PCIE"] = "1:5/5/8/16"
        write_state_file(state_file, knobs)
        wait_for(lambda: any(f["code"] == "gpu_pcie_link_degraded" and f["device"] == UUIDS[1]
                             for f in _findings(daemon)), 15, interval=0.1)
        # GPU 1 and 2 fall off the bus; GPU 0's GSP times out (XID 119); GPU 3's SRAM has an
        # uncontained error (XID 95): docs/faults.md's coverage table cites this test for both.
        knobs["FAKE_NVML_XIDS"] = "1:79,2:79,0:119,3:95"
        write_state_file(state_file, knobs)
        text = wait_for(lambda: (t := _metrics(daemon)) and _value(
            t, "gpudiag_fault_to_verdict_seconds_count") == 4 and t, 20, interval=0.1)
        assert _value(text, "gpudiag_faults_total") == 4
        assert _value(text, "gpudiag_faults_flagged_before_xid_total") == 1
        assert (_value(text, "gpudiag_fault_to_verdict_seconds_bucket", le="10") or 0) == 4
        blocked = {(f["device"], f["code"]) for f in _findings(daemon) if "XID" in f["message"]}
        assert blocked >= {(UUIDS[0], "gpu_reset_required"), (UUIDS[3], "gpu_reset_required")}
        # GPU 2: nothing was wrong after all (a false blocker); GPU 1 was reseated.
        for gpu, extra in ((UUIDS[2], ["--no-repair"]), (UUIDS[1], [])):
            proc = run_gpudiag(["clear", "--gpu", gpu, *extra, "--reason", "checked",
                                "--state-dir", str(state)], env)
            assert proc.returncode == 0, proc.stderr
        text = wait_for(lambda: (t := _metrics(daemon)) and _value(
            t, "gpudiag_false_blockers_total", code="gpu_lost") == 1 and t, 20, interval=0.1)
        assert [lab["code"] for lab, _ in _samples(text, "gpudiag_false_blockers_total")] == [
            "gpu_lost"]
        wait_for(lambda: not any("XID" in f["message"] and f["device"] in UUIDS[1:3]
                                 for f in _findings(daemon)), 15, interval=0.1)
        # GPU 2 fails again: its second incident, an interval under 15 minutes.
        knobs["FAKE_NVML_XIDS"] = "1:79,2:79,0:119,3:95,2:79"
        write_state_file(state_file, knobs)
        text = wait_for(lambda: (t := _metrics(daemon)) and _value(
            t, "gpudiag_gpu_incident_interval_seconds_count") == 1 and t, 20, interval=0.1)
        assert _value(text, "gpudiag_gpu_incident_interval_seconds_bucket", le="900") == 1
        # GPU 1's board moves to slot 3 (and slot 3's to 1): its history follows the serial.
        knobs["FAKE_NVML_SERIAL"] = f"1:{SERIALS[3]},3:{SERIALS[1]}"
        write_state_file(state_file, knobs)

        def moved() -> dict[str, Any] | None:
            got = _history(env, state, "--serial", SERIALS[1])
            slots = {i["gpu_index"] for i in got["identities"]}
            return got if slots == {1, 3} else None

        got = wait_for(moved, 20, interval=0.2)
        assert {i["uuid"] for i in got["identities"]} == {UUIDS[1], UUIDS[3]}
        assert {e["code"] for e in got["episodes"]} == {"gpu_lost"}
        assert [x["xid"] for x in got["xids"]] == [79]
        assert [(c["no_repair"], c["codes"]) for c in got["clears"]] == [(False, ["gpu_lost"])]
        two = _history(env, state, "--serial", SERIALS[2])
        assert [(c["no_repair"], c["codes"]) for c in two["clears"]] == [(True, ["gpu_lost"])]
        worst = _history(env, state, "--worst", "4")["worst"]
        # GPU 2's first blocker was cleared with --no-repair (false): its second counts alone.
        assert (worst[0]["serial"], worst[0]["incidents"]) == (SERIALS[2], 1)
        assert sorted((w["serial"], w["incidents"]) for w in worst[1:]) == [
            (SERIALS[0], 1), (SERIALS[1], 1), (SERIALS[3], 1)]
        text_out = run_gpudiag(["history", "--worst", "1", "--state-dir", str(state)], env)
        assert SERIALS[2] in text_out.stdout and "1 incident(s)" in text_out.stdout
    finally:
        assert daemon.stop() == 0


@pytest.mark.slow
def test_a_run_asking_a_daemon_with_another_state_directory_shows_while_it_runs(
        fakes: FakeDriver, tmp_path: Path) -> None:
    """The series is the attested run's, not a file in the run's default state directory:
    a daemon whose state directory is not the run's shows it all the same."""
    from tests.support.run import Rig

    rig = Rig(fakes, tmp_path)
    toml = daemon_toml({"backends.nvml": {"interval_s": 1}})
    sock = tmp_path / "d.sock"
    daemon = Daemon(rig.env, write_config(tmp_path / "gpudiag.toml", toml),
                    tmp_path / "elsewhere", extra_args=("--socket", str(sock)))
    try:
        daemon.wait_ready()
        seen: list[list[dict[str, str]]] = []
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                seen.append([lab for lab, v in _samples(
                    _metrics(daemon), "gpudiag_gpu_allocation_info") if v == 1])
                time.sleep(0.1)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            proc, closeout, _ = rig.run("python3", "-c", "import time; time.sleep(2.0)",
                                        daemon=daemon, url=f"unix:{sock}")
        finally:
            done.set()
            watcher.join()
        assert proc.returncode == 0, proc.stderr
        (slot,) = closeout["gpus"]
        assert [s[0]["uuid"] for s in seen if s] and all(
            s[0]["uuid"] == slot["uuid"] for s in seen if s)
        assert not (rig.state_dir / "allocations").exists()  # no file written for it
        wait_for(lambda: not _samples(_metrics(daemon), "gpudiag_gpu_allocation_info"), 10,
                 interval=0.1)
    finally:
        daemon.stop()


@pytest.mark.slow
def test_a_run_shows_one_allocation_series_then_closes_out_with_energy_and_a_refusal_counts(
        fakes: FakeDriver, tmp_path: Path) -> None:
    from tests.support.run import Rig

    rig = Rig(fakes, tmp_path)
    rig.knobs["FAKE_NVML_POWER_MW"] = "0:300000,1:300000"
    write_state_file(rig.state_file, rig.knobs)
    toml = daemon_toml({"backends.cuda": {"interval_s": 1}, "backends.nvml": {"interval_s": 1}})
    sock = tmp_path / "d.sock"  # where a run is attested: the allocation series' source
    daemon = Daemon(rig.env, write_config(tmp_path / "gpudiag.toml", toml), rig.state_dir,
                    extra_args=("--socket", str(sock)))
    try:
        daemon.wait_ready()
        seen: list[list[dict[str, str]]] = []
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                seen.append([lab for lab, v in _samples(
                    _metrics(daemon), "gpudiag_gpu_allocation_info") if v == 1])
                time.sleep(0.1)

        watcher = threading.Thread(target=watch)
        watcher.start()
        rig.later(0.3, FAKE_NVML_MEMORY_USED_MIB="0:1000,1:1000",
                  FAKE_NVML_CLOCKS_EVENT_REASONS="0:64,1:64", FAKE_NVML_XIDS="0:13,1:13")
        try:
            proc, closeout, text = rig.run(
                "python3", "-c", "import time; time.sleep(2.5)", daemon=daemon,
                url=f"unix:{sock}")
        finally:
            done.set()
            watcher.join()
        assert proc.returncode == 0, proc.stderr
        (slot,) = closeout["gpus"]
        held = [s for s in seen if s]
        assert held and all(len(s) == 1 and s[0]["uuid"] == slot["uuid"] for s in held)
        (first,) = held[0]
        assert first["user"] and first["scheduler"] == "none" and first["job_id"].startswith("pid-")
        # One label set per GPU: no job label on any other per-GPU series.
        assert all("job_id" not in lab for fam in text_string_to_metric_families(_metrics(daemon))
                   for s in fam.samples for lab in [s.labels]
                   if s.name != "gpudiag_gpu_allocation_info")
        (usage,) = closeout["gpu_usage"]
        assert usage["uuid"] == slot["uuid"] and usage["why_missing"] is None, usage
        assert 300 * 2.5 <= usage["energy_joules"] <= 300 * 20  # the fake's 300 W, the job's time
        assert usage["peak_memory_used_bytes"] == 1000 * 2**20
        assert usage["throttle_reasons"] == ["hw_thermal_slowdown"]
        assert usage["xids"] == [13]
        assert f"gpu_usage.0.uuid={slot['uuid']}" in text
        m = wait_for(lambda: (t := _metrics(daemon)) and _value(
            t, "gpudiag_job_gpu_energy_joules_count") == 1 and t, 15, interval=0.1)
        assert _value(m, "gpudiag_job_gpu_energy_joules_sum") == usage["energy_joules"]
        wait_for(lambda: not _samples(_metrics(daemon), "gpudiag_gpu_allocation_info"), 10,
                 interval=0.1)
        # Both GPUs fall off the bus: the next run is refused, and that block is counted.
        rig.knobs["FAKE_NVML_DEVICE_ERRORS"] = "0:15,1:15"
        write_state_file(rig.state_file, rig.knobs)
        wait_for(lambda: sum(f["code"] == "gpu_lost" for f in _findings(daemon)) == 2, 15,
                 interval=0.1)
        proc, closeout, _ = rig.run("true", daemon=daemon)
        assert proc.returncode == 125 and closeout["gpu_validation_blocker"] == "gpu_lost"
        assert "gpu_usage" not in closeout
        m = wait_for(lambda: (t := _metrics(daemon)) and _value(
            t, "gpudiag_preflight_blocks_total", code="gpu_lost") == 1 and t, 15, interval=0.1)
        assert not list((rig.state_dir / JOB_INBOX).iterdir())
    finally:
        assert daemon.stop() == 0


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")
def test_the_weekly_numbers_recording_rules_pass_their_promtool_cases() -> None:
    proc = promtool("test", "rules", "gpudiag.numbers.test.yml")
    assert proc.returncode == 0 and "SUCCESS" in proc.stdout, proc.stdout + proc.stderr


def test_the_coverage_table_names_real_codes_and_tests() -> None:
    """docs/faults.md's Llama 3 coverage: every cause the issue names is a row, every covered
    row names catalog codes and tests that exist (fault-matrix cases by their ids)."""
    import re

    from gpudiag.core.catalog import BLOCKERS, WARNINGS
    from tests import test_fault_matrix as matrix

    root = Path(__file__).resolve().parent.parent
    text = (root / "docs" / "faults.md").read_text()
    table = text.split("<!-- BEGIN coverage -->", 1)[1].split("<!-- END coverage -->", 1)[0]
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in table.strip().splitlines()[2:]]
    causes = {r[0] for r in rows}
    for cause in ("faulty GPU", "GPU HBM3", "GPU SRAM", "GPU system processor (GSP)",
                  "PCIe/NVLink", "NIC", "thermal interface/sensor",
                  "SDC (silent data corruption)", "software bug", "host maintenance"):
        assert cause in causes, cause
    def param(c: Any) -> str:
        return ("warning:" if c in matrix.WARNING_CASES else "") + str(c.id)

    ids = {f"test_daemon_metrics_history_and_cli_agree[{param(c)}]"
           for c in matrix.DAEMON_CASES}
    ids |= {f"test_qualification_blockers_with_block_true[{c.id}]"
            for c in matrix.QUALIFY_BLOCK_CASES}
    ids |= {f"test_job_and_admission_faults_agree_in_exporter_and_history[{c.id}]"
            for c in matrix.OTHER_CASES}
    ids |= {f"test_fabric_faults_agree_in_daemon_metrics_and_history[{c.id}]"
            for c in matrix.FABRIC_CASES}
    for cause, _share, how, codes, tests in rows:
        covered = how != "not detected"
        assert covered == bool(tests), f"{cause}: a covered row names its tests, others none"
        for code in re.findall(r"`([a-z_]+)`", codes) if covered else ():
            if code.startswith(("gpu_", "cuda_", "driver_", "jax_", "node_", "nic_")):
                assert code in BLOCKERS or code in WARNINGS, f"{cause}: {code}"
        for ref in re.findall(r"`tests/([a-z_]+)\.py::([^`]+)`", tests):
            module, test = ref
            if module == "test_fault_matrix":
                assert test in ids, f"{cause}: no fault-matrix case {test}"
            else:
                mod = __import__(f"tests.{module}", fromlist=["_"])
                assert hasattr(mod, test.split("[", 1)[0]), f"{cause}: no test {test}"


@pytest.mark.slow
def test_the_meter_says_why_energy_is_missing_and_never_makes_up_a_zero(
        fakes: FakeDriver, tmp_path: Path) -> None:
    from gpudiag.runner.usage import JobMeter

    env = host_env(fakes, tmp_path / "host", gpus=2, FAKE_NVML_DEVICE_COUNT=2,
                   FAKE_NVML_UNSUPPORTED="energy", FAKE_NVML_MEMORY_USED_MIB="1:512")
    meter = JobMeter([UUIDS[1]], env, interval_s=0.1)
    meter.start()
    time.sleep(0.3)
    (usage,) = meter.stop()
    assert usage.energy_joules is None and "energy" in (usage.why_missing or "")
    assert usage.peak_memory_used_bytes == 512 * 2**20 and usage.samples >= 2
    lost = JobMeter(["GPU-f00d0009-0000-4000-8000-000000000009"], env, interval_s=0.1)
    lost.start()
    (gone,) = lost.stop()
    assert gone.energy_joules is None and gone.why_missing


def test_history_of_a_serial_no_gpu_had_exits_2_naming_the_serials_known(
        tmp_path: Path) -> None:
    HistoryStore(tmp_path / "history.sqlite3").close()
    db = sqlite3.connect(tmp_path / "history.sqlite3")
    db.execute("INSERT INTO gpu_identities VALUES ('1650000000003', 'GPU-a', 0, NULL, 1, 2)")
    db.commit()
    db.close()
    proc = run_gpudiag(["history", "--serial", "999", "--state-dir", str(tmp_path)],
                       dict(os.environ))
    assert proc.returncode == 2, proc.stdout
    assert "no GPU with serial '999'" in proc.stderr and "1650000000003" in proc.stderr
    assert "Traceback" not in proc.stderr
    ok = run_gpudiag(["history", "--serial", "1650000000003", "--state-dir", str(tmp_path)],
                     dict(os.environ))
    assert ok.returncode == 0 and "GPU serial 1650000000003:" in ok.stdout, ok.stderr



def test_a_state_folder_the_run_cannot_examine_skips_its_records_and_the_run_goes_on(
        tmp_path: Path) -> None:
    """An error examining the best-effort record's folder (EACCES for a state folder the
    run may not search; here ENAMETOOLONG, which root meets too) is "no daemon here", never
    a failure before launch (exit 125)."""
    from gpudiag.runner.usage import report_block

    env = {"GPUDIAG_STATE_DIR": str(tmp_path / ("x" * 300))}
    with pytest.raises(OSError):
        (tmp_path / ("x" * 300)).is_dir()  # what aborted the run before
    assert report_block("gpu_lost", [], env) is None
