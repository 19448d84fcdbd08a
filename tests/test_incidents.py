"""Issue 52: one incident, one identity: a fault episode of the node has one id that the
history, /v1/health's evidence (and NPD's condition through it), the NFD label and the
metrics all carry; codes joining it never change its id, start or reason.

The rules alone (core.incident), then a real `gpudiag serve` on the fakes with XIDs
injected through the fake NVML's state file.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from gpudiag.core.incident import Incident, advance, broken, incident_id
from gpudiag.core.npd import NPD_PROBLEM, NpdAnswer, from_verdict
from gpudiag.core.verdict import Verdict
from gpudiag.daemon.clears import write_request
from gpudiag.daemon.store import default_path
from tests.fakes.build import FakeDriver, write_state_file
from tests.support.daemon import (
    Daemon,
    daemon_toml,
    host_env,
    metric_samples,
    wait_for,
    write_config,
)

G0 = "GPU-f00d0000-0000-4000-8000-000000000000"
G1 = "GPU-f00d0001-0000-4000-8000-000000000001"


# -- the rules ---------------------------------------------------------------------------------
def test_an_incident_id_says_when_and_which_gpu_and_is_a_label_value() -> None:
    assert incident_id(0.0, G1) == "gpudiag-19700101T000000Z-f00d0001"
    assert incident_id(0.0, None) == "gpudiag-19700101T000000Z-node"
    ident = incident_id(1796439168.5, "GPU-../../x")
    assert len(ident) <= 63 and all(c.isalnum() or c in "-._" for c in ident)


def test_codes_joining_an_open_incident_change_neither_its_id_start_nor_reason() -> None:
    opened = advance(None, [("gpu_reset_required", G1)], 100.0)
    assert opened is not None and opened.code == "gpu_reset_required" and opened.gpu == G1
    joined = advance(opened, [("gpu_lost", G0), ("gpu_reset_required", G1)], 200.0)
    assert joined is not None
    assert (joined.id, joined.started_wall, joined.code, joined.gpu) == (
        opened.id, 100.0, "gpu_reset_required", G1)
    assert joined.codes == ("gpu_reset_required", "gpu_lost")
    assert advance(joined, [("gpu_lost", G0)], 300.0) is joined  # nothing new: the same
    assert advance(joined, [], 400.0) is None  # closed
    reopened = advance(None, [("gpu_lost", G0)], 500.0)
    assert reopened is not None and reopened.id != opened.id


def test_nothing_known_broken_opens_no_incident() -> None:
    verdict = Verdict.from_record(_record(["devices_busy", "backend_unproven"]))
    assert broken(verdict) == [] and broken(None) == []


def test_an_incident_record_reads_back_and_a_damaged_one_is_refused() -> None:
    inc = Incident("gpudiag-19700101T000000Z-node", 1.0, "gpu_lost", None, ("gpu_lost",))
    assert Incident.from_record(inc.record()) == inc
    for bad in ({}, {"id": "x", "started_wall": 1.0, "code": "c"},
                {"id": inc.id, "started_wall": True, "code": "c"}):
        with pytest.raises(ValueError):
            Incident.from_record(bad)


def test_npd_names_the_incident_and_its_reason_for_the_whole_incident() -> None:
    record = _record(["gpu_lost"])
    record["evidence"] = {"incident": {"open": True, "id": "gpudiag-19700101T000000Z-f00d0001",
                                       "code": "gpu_reset_required"}}
    answer = from_verdict(Verdict.from_record(record))
    assert answer == NpdAnswer(NPD_PROBLEM, "gpudiag-19700101T000000Z-f00d0001: gpu_reset_required")
    assert from_verdict(Verdict.from_record(_record(["gpu_lost"]))).message == "gpudiag: gpu_lost"


def _record(codes: list[str]) -> dict[str, Any]:
    blockers = [{"code": c, "layer": "device", "backend": "nvml", "device": G1,
                 "message": c, "remediation": ""} for c in codes]
    return {"schema": "gpudiag.verdict/1", "gpu_validation_blocker": codes[0] if codes else
            "none", "ready": not codes, "blockers": blockers, "warnings": [],
            "requirement": {"backends": ["cuda"], "question": "node_health"}, "devices": [],
            "backends": {}, "evidence": {},
            "preallocation_disabled": "yes", "host": "h", "checked_at": "1970-01-01T00:00:00Z",
            "age_s": 0.0, "source": "daemon", "gpudiag_version": "0"}


# -- a real daemon ---------------------------------------------------------------------------
@pytest.fixture
def node(fakes: FakeDriver, tmp_path: Path) -> dict[str, Any]:
    state_file = tmp_path / "gpu-state"
    write_state_file(state_file, {"FAKE_NVML_DEVICE_COUNT": 2})
    env = host_env(fakes, tmp_path / "host", gpus=2, FAKE_GPU_STATE_FILE=str(state_file))
    return {"env": env, "state_file": state_file, "state": tmp_path / "state",
            "tmp": tmp_path, "nfd": tmp_path / "nfd" / "gpudiag"}


def _start(node: dict[str, Any], **knobs: str | int) -> Daemon:
    write_state_file(node["state_file"], {"FAKE_NVML_DEVICE_COUNT": 2, **knobs})
    node["nfd"].parent.mkdir(exist_ok=True)
    toml = daemon_toml({"": {"nfd_features_file": str(node["nfd"])},
                        "xid": {"hold_s": 3600}, "qualification": {"enabled": False}})
    return Daemon.ready(node["env"], write_config(node["tmp"] / "gpudiag.toml", toml),
                        node["state"])


def _evidence(daemon: Daemon) -> dict[str, Any]:
    status, body = daemon.get("/v1/health")
    assert status == 200, body
    return dict(body["evidence"]["incident"])


def _nfd_label(node: dict[str, Any]) -> str | None:
    try:
        lines = node["nfd"].read_text().splitlines()
    except FileNotFoundError:
        return None
    return next((line.split("=", 1)[1] for line in lines
                 if line.startswith("gpudiag.incident=")), None)


def _open_metric(daemon: Daemon) -> list[dict[str, str]]:
    return [lab for lab, v in metric_samples(daemon, "gpudiag_incident_open") if v == 1]


def _rows(node: dict[str, Any]) -> list[tuple[Any, ...]]:
    db = sqlite3.connect(default_path(node["state"]))
    try:
        return list(db.execute("SELECT id, code, codes, ended FROM incidents ORDER BY started"))
    except sqlite3.OperationalError:
        return []
    finally:
        db.close()


def test_one_incident_one_id_across_history_health_npd_nfd_and_metrics(
        node: dict[str, Any]) -> None:
    daemon = _start(node)
    try:
        assert _evidence(daemon) == {"open": False} and _open_metric(daemon) == []
        # A storm of application XIDs alone is warnings: no incident.
        write_state_file(node["state_file"], {"FAKE_NVML_DEVICE_COUNT": 2,
                                              "FAKE_NVML_XID_STORM": "0:45*500,1:13*2"})
        time.sleep(1.5)
        assert _evidence(daemon) == {"open": False}
        # A reset XID on GPU 1 opens one.
        write_state_file(node["state_file"], {"FAKE_NVML_DEVICE_COUNT": 2,
                                              "FAKE_NVML_XID_STORM": "0:45*500,1:13*2",
                                              "FAKE_NVML_XIDS": "1:48"})
        wait_for(lambda: _evidence(daemon)["open"], 20, interval=0.2)
        opened = _evidence(daemon)
        ident = opened["id"]
        assert ident.startswith("gpudiag-") and ident.endswith("-f00d0001")
        assert opened["code"] == "gpu_reset_required" and opened["gpu"] == G1
        wait_for(lambda: _nfd_label(node) == ident, 10, interval=0.2)
        assert _open_metric(daemon) == [{"incident": ident, "code": "gpu_reset_required",
                                         "gpu": G1}]
        # GPU 0 falls off the bus: it joins the incident, which keeps its id, start, reason.
        write_state_file(node["state_file"], {"FAKE_NVML_DEVICE_COUNT": 2,
                                              "FAKE_NVML_XIDS": "1:48,0:79"})
        wait_for(lambda: "gpu_lost" in _evidence(daemon)["codes"], 20, interval=0.2)
        joined = _evidence(daemon)
        assert (joined["id"], joined["started_wall"], joined["code"]) == (
            ident, opened["started_wall"], "gpu_reset_required")
        _, body = daemon.get("/v1/health")
        assert from_verdict(Verdict.from_record(body)).message == (
            f"{ident}: gpu_reset_required")
        assert _nfd_label(node) == ident
    finally:
        assert daemon.stop() == 0
    # A restart in the middle of it (the XIDs are held): the same incident goes on.
    daemon = _start(node, FAKE_NVML_XIDS="1:48,0:79")
    try:
        wait_for(lambda: _evidence(daemon)["open"], 20, interval=0.2)
        assert _evidence(daemon)["id"] == ident
        # Repaired: one clear of every GPU closes it; the history keeps one row for it.
        write_request(node["state"], None, "repaired")
        wait_for(lambda: not _evidence(daemon)["open"], 20, interval=0.2)
        wait_for(lambda: _nfd_label(node) is None, 10, interval=0.2)
        assert _open_metric(daemon) == []
        ((row_id, code, codes, ended),) = _rows(node)
        assert row_id == ident and code == "gpu_reset_required" and ended is not None
        assert codes.split(",")[:2] == ["gpu_reset_required", "gpu_lost"]
        status, history = daemon.get("/v1/history")
        assert status == 200
        assert [(i["id"], i["code"]) for i in history["incidents"]] == [
            (ident, "gpu_reset_required")]
        assert sum(f"incident {ident} opened" in line for line in daemon.lines) == 0
        assert any(f"incident {ident} closed" in line for line in daemon.lines)
    finally:
        assert daemon.stop() == 0
