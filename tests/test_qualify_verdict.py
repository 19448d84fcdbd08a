"""Qualification outcomes in the daemon's verdicts: a wrong answer blocks the GPU, a slow GPU
warns (blocks with qualification.block), an aborted run changes nothing, a pass clears."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

from gpudiag.core.qualify_score import GpuResult, Qualification
from gpudiag.core.qualify_verdict import qualification_findings
from tests.fakes.build import FakeDriver, write_state_file
from tests.support.daemon import (
    Daemon,
    daemon_toml,
    host_env,
    qualification_outcomes,
    wait_for,
    write_config,
)

SMALL_GPU: dict[str, str | int] = {"FAKE_GPU_MEMORY_TOTAL_MIB": 80, "FAKE_CUDA_CONTEXT_MIB": 1,
                                   "FAKE_GPU_NAME": "Fake GPU"}  # peers and history judge
SLOW: dict[str, str | int] = {
    "FAKE_CUDA_COPY_GBPS": ",".join(f"{i}:{0.1 if i == 4 else 0.4}" for i in range(8))}


def _start(fakes: FakeDriver, tmp: Path, knobs: dict[str, str], **qualification: Any
           ) -> tuple[Daemon, Path, dict[str, str]]:
    """A daemon qualifying 8 fake GPUs, GPU 4 slow (its peers qualified before it, one at a
    time, make the median); ``knobs`` go in a state file the test may change."""
    state = tmp / "fake-state"
    write_state_file(state, knobs)
    env = host_env(fakes, tmp / "host", 8, FAKE_GPU_STATE_FILE=str(state), **SLOW, **SMALL_GPU)
    config = write_config(tmp / "d.toml", daemon_toml({"qualification": {
        "idle_s": 0.2, "tick_s": 0.1, "max_age_s": 3600, **qualification}}))
    return Daemon(env, config, tmp / "state"), state, env


def _get(daemon: Daemon, path: str) -> dict[str, Any]:
    status, rec = daemon.get(path)
    assert status == 200, rec
    assert isinstance(rec, dict)
    return rec


def _codes(pool: list[dict[str, Any]], code: str) -> list[str | None]:
    return [f["device"] for f in pool if f["code"] == code]


def _health_once_all_qualified(daemon: Daemon) -> dict[str, Any]:
    """/v1/health once every GPU has a qualification outcome."""
    wait_for(lambda: len(qualification_outcomes(daemon)) == 8, 120, interval=0.3)
    return _get(daemon, "/v1/health?max_age_s=600")


def _uuids(rec: dict[str, Any]) -> dict[int, str]:
    return {d["index"]: d["uuid"] for d in rec["devices"]}


def test_a_wrong_answer_blocks_its_gpu_and_a_slow_one_warns(fakes: FakeDriver,
                                                             tmp_path: Path) -> None:
    daemon, state, env = _start(fakes, tmp_path, {"FAKE_CUDA_CORRUPT_COPY": "1:7"})
    try:
        health = _health_once_all_qualified(daemon)
        uuid = _uuids(health)
        wait_for(lambda: _codes(_get(daemon, "/v1/health")["blockers"],
                                "gpu_compute_mismatch"), 30, interval=0.2)
        health = _get(daemon, "/v1/health")
        assert health["gpu_validation_blocker"] == "gpu_compute_mismatch", health["blockers"]
        assert _codes(health["blockers"], "gpu_compute_mismatch") == [uuid[1]]
        (mismatch,) = [b for b in health["blockers"] if b["code"] == "gpu_compute_mismatch"]
        assert mismatch["layer"] == "device" and mismatch["message"].startswith("GPU 1:")
        # Slow but right: a warning by default, never a blocker.
        assert _codes(health["warnings"], "gpu_underperforming") == [uuid[4]]
        assert not _codes(health["blockers"], "gpu_underperforming")
        # Job readiness on one GPU picks a right one; the broken GPU is named a warning.
        job = _get(daemon, "/v1/preflight?require=cuda&gpus=1&max_age_s=600")
        assert job["ready"] is True and job["gpu_validation_blocker"] == "none", job
        chosen = [d["uuid"] for d in job["devices"] if d["selected"]]
        assert len(chosen) == 1 and chosen[0] != uuid[1]
        outside = [w for w in job["warnings"] if w["code"] == "gpu_fault_outside_selection"]
        assert [w["device"] for w in outside] == [uuid[1]]
        assert "gpu_compute_mismatch" in outside[0]["message"]
        # Every GPU in use by the job: the broken one is among them, so not ready.
        assert _get(daemon, "/v1/preflight?require=cuda&max_age_s=600")["ready"] is False
        # The exporter counts it as a blocker of the node.
        status, text = daemon.get("/metrics")
        assert 'gpudiag_ready 0.0' in text
        # A restart reads the outcome back from qualifications.jsonl: blocked before any run
        # (the schedule off, so no run could have made it).
        assert daemon.stop() == 0
        config = write_config(tmp_path / "off.toml", daemon_toml({"qualification": {
            "enabled": False, "tick_s": 0.1}}))
        daemon = Daemon(env, config, tmp_path / "state")
        wait_for(lambda: _codes(_get(daemon, "/v1/health")["blockers"],
                                "gpu_compute_mismatch") == [uuid[1]], 30, interval=0.2)
        # Repaired and qualified again: the pass replaces the outcome and the blocker goes.
        write_state_file(state, {})
        req = urllib.request.Request(daemon.url + "/v1/qualify?gpus=1", method="POST",
                                     data=b"")
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 202
        wait_for(lambda: not _codes(_get(daemon, "/v1/health")["blockers"],
                                    "gpu_compute_mismatch"), 60, interval=0.3)
        assert _get(daemon, "/v1/health")["gpu_validation_blocker"] == "none"
    finally:
        assert daemon.stop() == 0


def test_a_slow_gpu_blocks_with_qualification_block(fakes: FakeDriver, tmp_path: Path) -> None:
    daemon, _, _ = _start(fakes, tmp_path, {}, block=True)
    try:
        uuid = _uuids(_health_once_all_qualified(daemon))
        wait_for(lambda: _codes(_get(daemon, "/v1/health")["blockers"],
                                "gpu_underperforming"), 30, interval=0.2)
        health = _get(daemon, "/v1/health")
        assert health["gpu_validation_blocker"] == "gpu_underperforming"
        assert _codes(health["blockers"], "gpu_underperforming") == [uuid[4]]
        job = _get(daemon, "/v1/preflight?require=cuda&gpus=7&max_age_s=600")
        assert job["ready"] is True, job["blockers"]
        assert uuid[4] not in [d["uuid"] for d in job["devices"] if d["selected"]]
        assert _get(daemon, "/v1/preflight?require=cuda&gpus=8&max_age_s=600")[
            "ready"] is False
    finally:
        assert daemon.stop() == 0


def _q(uuid: str, code: str, aborted: str | None = None) -> Qualification:
    result = GpuResult(uuid=uuid, name="Fake GPU", index=0, tier="quick", platform="cuda",
                       aborted=aborted)
    return Qualification(result, code, "blocker", "figures")


def test_only_mismatch_and_underperforming_change_verdicts() -> None:
    latest = [_q("GPU-a", "gpu_compute_mismatch"), _q("GPU-b", "gpu_underperforming"),
              _q("GPU-c", "none"), _q("GPU-d", "qualification_aborted", aborted="busy")]
    warn = qualification_findings(latest, block=False)
    assert [(b.code, b.device) for b in warn.blockers] == [("gpu_compute_mismatch", "GPU-a")]
    assert [(w.code, w.device) for w in warn.warnings] == [("gpu_underperforming", "GPU-b")]
    block = qualification_findings(latest, block=True)
    assert [b.code for b in block.blockers] == ["gpu_compute_mismatch", "gpu_underperforming"]
    assert block.warnings == ()
    assert all(f.layer == "device" and f.remediation for f in block.blockers)


def test_records_round_trip_through_json() -> None:
    # What the history gives back at a restart yields the same findings (load()).
    from gpudiag.core.qualify_score import parse_qualification

    q = _q("GPU-a", "gpu_compute_mismatch")
    again = parse_qualification(json.loads(json.dumps(q.record())))
    assert qualification_findings([again], block=False) == qualification_findings(
        [q], block=False)
