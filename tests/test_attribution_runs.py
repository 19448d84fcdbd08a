"""Failure attribution end to end: real `gpudiag run`, its XID watcher or a real daemon, fakes.

XIDs and cuInit failures are injected mid-run through the fakes' state file, which the fake
NVML and libcuda re-read while they run.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.build import FakeDriver, write_state_file
from tests.support.daemon import Daemon, daemon_toml, wait_for, write_config
from tests.support.host import processes_with_env
from tests.support.run import Rig, decided

UUID0 = "GPU-f00d0000-0000-4000-8000-000000000000"




@pytest.fixture
def rig(fakes: FakeDriver, tmp_path: Path) -> Rig:
    return Rig(fakes, tmp_path)


@pytest.fixture
def daemon(rig: Rig) -> Iterator[Daemon]:
    # cuda and nvml are probed every second, so what starts failing mid-run is seen mid-run.
    toml = daemon_toml({"backends.cuda": {"interval_s": 1}, "backends.nvml": {"interval_s": 1}})
    d = Daemon(rig.env, write_config(rig.root / "gpudiag.toml", toml), rig.state_dir)
    try:
        d.wait_ready()
        yield d
    finally:
        assert d.stop() == 0


def taken_in(daemon: Daemon, kind: str) -> None:
    """Wait until the daemon counted one run of ``kind`` in gpudiag_job_failures_total."""
    line = f'gpudiag_job_failures_total{{attribution="{kind}"}} 1.0'
    wait_for(lambda: line in daemon.get("/metrics")[1], 15, interval=0.1)


def _kv(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)




def _attribution(closeout: Mapping[str, Any]) -> tuple[str, str, list[Any]]:
    return decided(closeout["attribution"])


def test_an_xid_79_during_a_run_without_a_daemon_is_hardware_with_the_xid(rig: Rig) -> None:
    rig.later(0.5, FAKE_NVML_XIDS="0:79")
    proc, closeout, text = rig.run("sleep", "3")
    assert proc.returncode == 0, proc.stderr
    gpu = closeout["gpus"][0]["uuid"]
    assert gpu == UUID0
    assert _attribution(closeout) == ("hardware", "hardware_xid", [(79, "gpu_lost", gpu)])
    assert closeout["attribution"]["events"][0]["source"] == "watcher"
    assert (_kv(text)["gpu_failure_attribution"]
            == f"hardware rule=hardware_xid xid=79 gpu={gpu}")
    rig.explain_agrees(closeout, "the run's own record")


def test_an_application_xid_with_exit_1_is_the_application(rig: Rig) -> None:
    rig.later(0.5, FAKE_NVML_XIDS="0:13")
    proc, closeout, text = rig.run("sh", "-c", "sleep 2; exit 1")
    assert proc.returncode == 1
    assert _attribution(closeout) == ("application", "application_xid",
                                      [(13, "gpu_xid_application", UUID0)])
    assert _kv(text)["gpu_failure_attribution"].startswith("application rule=application_xid")
    rig.explain_agrees(closeout, "the run's own record")


def test_exit_1_with_no_gpu_event_is_the_application(rig: Rig) -> None:
    proc, closeout, text = rig.run("sh", "-c", "exit 1")
    assert proc.returncode == 1
    assert _attribution(closeout) == ("application", "exit_without_gpu_event", [])
    assert closeout["attribution"]["missing"] == []
    assert _kv(text)["gpu_failure_attribution"] == "application rule=exit_without_gpu_event"
    rig.explain_agrees(closeout, "the run's own record")


def test_cuinit_failing_mid_run_without_a_daemon_is_software_by_the_post_run_check(
        rig: Rig) -> None:
    rig.later(0.3, FAKE_CUDA_INIT_ERROR=999)
    proc, closeout, text = rig.run("sh", "-c", "sleep 1; exit 1")
    assert proc.returncode == 1
    kind, rule, events = _attribution(closeout)
    assert (kind, rule, events) == ("software", "backend_stopped",
                                    [(None, "cuda_init_failed", None)])
    assert closeout["attribution"]["events"][0]["source"] == "post-run check"
    assert (_kv(text)["gpu_failure_attribution"]
            == "software rule=backend_stopped code=cuda_init_failed")
    rig.explain_agrees(closeout, "the run's own record")


def test_an_xid_on_another_gpu_is_not_the_jobs(rig: Rig) -> None:
    rig.later(0.5, FAKE_NVML_XIDS="1:79")
    proc, closeout, _ = rig.run("sh", "-c", "sleep 2; exit 3")
    assert proc.returncode == 3
    assert _attribution(closeout) == ("application", "exit_without_gpu_event", [])


def test_a_clean_run_is_none_and_the_watcher_is_gone_after_it(rig: Rig) -> None:
    proc, closeout, text = rig.run(sys.executable, "-c", "pass")
    assert proc.returncode == 0
    assert _attribution(closeout) == ("none", "job_succeeded", [])
    assert _kv(text)["gpu_failure_attribution"] == "none rule=job_succeeded"
    # The detached watcher was ended with the run: nothing of it is left.
    assert processes_with_env(f"FAKE_GPU_STATE_FILE={rig.state_file}", "xid_watch") == []


# -- with the node's daemon: its history is the evidence ---------------------------------------
def test_an_xid_79_during_a_run_with_a_daemon_is_hardware_from_its_history(
        rig: Rig, daemon: Daemon) -> None:
    rig.later(0.5, FAKE_NVML_XIDS="0:79")
    proc, closeout, text = rig.run("sleep", "3", daemon=daemon)
    assert proc.returncode == 0, proc.stderr
    assert closeout["verdict_source"] == "daemon"
    kind, rule, events = _attribution(closeout)
    assert (kind, rule) == ("hardware", "hardware_xid")
    assert events[0] == (79, "gpu_lost", UUID0)
    assert {e["source"] for e in closeout["attribution"]["events"]} == {"daemon"}
    assert (_kv(text)["gpu_failure_attribution"]
            == f"hardware rule=hardware_xid xid=79 gpu={UUID0}")
    taken_in(daemon, "hardware")
    answer = rig.explain_agrees(closeout, "daemon history")
    what = {(row["what"], row["gpu"]) for row in answer["timeline"]}
    assert {("xid", UUID0), ("job_began", UUID0), ("job_ended", UUID0)} <= what


def test_cuinit_failing_mid_run_is_software(rig: Rig, daemon: Daemon) -> None:
    rig.later(0.5, FAKE_CUDA_INIT_ERROR=999)
    proc, closeout, text = rig.run("sh", "-c", "sleep 3; exit 1", daemon=daemon)
    assert proc.returncode == 1, proc.stderr
    kind, rule, events = _attribution(closeout)
    assert (kind, rule) == ("software", "backend_stopped"), closeout["attribution"]
    assert ("cuda_init_failed" in {code for _, code, _ in events})
    assert _kv(text)["gpu_failure_attribution"].startswith(
        "software rule=backend_stopped code=cuda_init_failed")
    taken_in(daemon, "software")
    rig.explain_agrees(closeout, "daemon history")


def test_a_row_remap_failure_mid_run_is_hardware_from_the_daemons_nvml_probe(
        rig: Rig, daemon: Daemon) -> None:
    rig.later(0.5, FAKE_NVML_REMAPPED_ROWS="0:0/1/0/1")
    proc, closeout, text = rig.run("sh", "-c", "sleep 3; exit 1", daemon=daemon)
    assert proc.returncode == 1, proc.stderr
    assert _attribution(closeout) == ("hardware", "ecc_uncorrectable",
                                      [(None, "gpu_ecc_uncorrectable", UUID0)])
    assert (_kv(text)["gpu_failure_attribution"]
            == f"hardware rule=ecc_uncorrectable code=gpu_ecc_uncorrectable gpu={UUID0}")
    taken_in(daemon, "hardware")
    rig.explain_agrees(closeout, "daemon history")


def test_no_history_and_no_watcher_is_unknown_naming_why(fakes: FakeDriver,
                                                         tmp_path: Path) -> None:
    rig = Rig(fakes, tmp_path)
    # The history cannot be opened (a folder where its file belongs): the daemon answers
    # verdicts, keeps no history, and a run that asks it runs no watcher of its own.
    (rig.state_dir / "history.sqlite3").mkdir()
    d = Daemon(rig.env, write_config(tmp_path / "gpudiag.toml", daemon_toml()), rig.state_dir)
    try:
        d.wait_ready()
        proc, closeout, text = rig.run("sh", "-c", "exit 2", daemon=d)
        taken_in(d, "unknown")
    finally:
        assert d.stop() == 0
    assert proc.returncode == 2
    assert _attribution(closeout) == ("unknown", "evidence_missing", [])
    (missing,) = closeout["attribution"]["missing"]
    assert missing.startswith("daemon history: daemon at ") and "503" in missing
    assert "history_unavailable" in missing and "could not be opened" in missing
    assert (_kv(text)["gpu_failure_attribution"]
            == f"unknown rule=evidence_missing missing={missing}")
    # The daemon could not keep the record, so it stays in the inbox, where explain finds it.
    rig.explain_agrees(closeout, "the run's own record")


def test_a_watcher_that_cannot_register_for_xids_leaves_a_failed_run_unknown(
        fakes: FakeDriver, tmp_path: Path) -> None:
    rig = Rig(fakes, tmp_path)
    rig.knobs["FAKE_NVML_UNSUPPORTED"] = "events"
    write_state_file(rig.state_file, rig.knobs)
    proc, closeout, text = rig.run("sh", "-c", "exit 1")
    assert proc.returncode == 1
    assert _attribution(closeout) == ("unknown", "evidence_missing", [])
    assert closeout["attribution"]["missing"] == [
        f"run watcher: the XID watcher could not register for XID events on {UUID0}"]
    assert _kv(text)["gpu_failure_attribution"] == (
        "unknown rule=evidence_missing missing=run watcher: the XID watcher could not "
        f"register for XID events on {UUID0}")
    rig.explain_agrees(closeout, "the run's own record")
