"""Qualification in the real daemon: the schedule on idle fake GPUs, metrics, POST /v1/qualify."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.fakes.build import FakeDriver
from tests.support.daemon import (
    Daemon,
    daemon_toml,
    host_env,
    metric_samples,
    qualification_outcomes,
    wait_for,
    write_config,
)

SMALL_GPU: dict[str, str | int] = {
    "FAKE_GPU_MEMORY_TOTAL_MIB": 80, "FAKE_CUDA_CONTEXT_MIB": 1,
    # No row in the data-sheet table: the node's peers and history judge.
    "FAKE_GPU_NAME": "Fake GPU"}


def _post(daemon: Daemon, path: str) -> tuple[int, Any]:
    req = urllib.request.Request(daemon.url + path, method="POST", data=b"")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_daemon_qualifies_idle_gpus_and_exports_what_it_found(
        fakes: FakeDriver, tmp_path: Path) -> None:
    speeds = ",".join(f"{i}:{0.1 if i == 3 else 0.4}" for i in range(8))
    env = host_env(fakes, tmp_path / "host", gpus=8, FAKE_CUDA_COPY_GBPS=speeds,
                   FAKE_CUDA_CORRUPT_COPY="5:7", **SMALL_GPU)
    config = write_config(tmp_path / "d.toml", daemon_toml({"qualification": {
        "idle_s": 0.2, "tick_s": 0.1, "max_age_s": 3600}}))
    daemon = Daemon(env, config, tmp_path / "state")
    try:
        outcomes = wait_for(lambda: (o := qualification_outcomes(daemon)) and len(o) == 8 and o,
                            120, interval=0.5)
        assert outcomes == {str(i): {3: "gpu_underperforming", 5: "gpu_compute_mismatch"}.get(
            i, "none") for i in range(8)}
        ratios = {(lab["gpu"], lab["measure"], lab["reference"]): v for lab, v in
                  metric_samples(daemon, "gpudiag_gpu_qualification_ratio")}
        assert ratios[("3", "memory_bandwidth", "peers")] < 0.5
        bandwidth = {lab["gpu"]: v for lab, v in
                     metric_samples(daemon, "gpudiag_gpu_qualification_bytes_per_second")
                     if lab["measure"] == "memory_bandwidth"}
        assert bandwidth["0"] > 2 * bandwidth["3"]
        assert all(v <= 8 * 2 ** 20 for _, v in metric_samples(daemon,
                                                          "gpudiag_gpu_qualification_bytes"))
        (cost,) = metric_samples(daemon, "gpudiag_qualification_gpu_seconds_total")
        assert cost[1] > 0
        # On demand: queued at once; bad parameters are 400 with the envelope.
        status, body = _post(daemon, "/v1/qualify?gpus=3&tier=quick")
        assert status == 202 and body["accepted"] == {"gpus": ["3"], "tier": "quick"}
        status, body = _post(daemon, "/v1/qualify?tier=extreme")
        assert status == 400 and "tier" in body["error"]["message"]
        status, body = _post(daemon, "/v1/qualify?gpus=GPU-nope")
        assert status == 400 and body["error"]["code"] == "bad_parameter"
        runs = {lab["outcome"]: v for lab, v in
                metric_samples(daemon, "gpudiag_qualification_runs_total")}
        assert wait_for(lambda: sum(v for _, v in metric_samples(
            daemon, "gpudiag_qualification_runs_total")) > sum(runs.values()), 60)
    finally:
        assert daemon.stop() == 0
    history = (tmp_path / "state" / "qualifications.jsonl").read_text().splitlines()
    assert len(history) >= 9


def test_the_off_switch_and_read_only_tcp(fakes: FakeDriver, tmp_path: Path) -> None:
    env = host_env(fakes, tmp_path / "host", gpus=8, **SMALL_GPU)
    config = write_config(tmp_path / "d.toml", daemon_toml({
        "": {"tcp_read_only": True},
        "qualification": {"enabled": False, "idle_s": 0.1, "tick_s": 0.1}}))
    daemon = Daemon(env, config, tmp_path / "state")
    try:
        daemon.wait_ready()
        time.sleep(1.5)  # long past idle_s: a schedule that is on would have begun
        assert qualification_outcomes(daemon) == {}
        status, body = _post(daemon, "/v1/qualify")
        assert status == 403 and "read-only" in json.dumps(body)
    finally:
        assert daemon.stop() == 0
    assert not (tmp_path / "state" / "qualifications.jsonl").exists()


def test_the_qualification_config_is_checked_key_by_key(tmp_path: Path) -> None:
    import pytest

    from gpudiag.daemon.config import ConfigError, from_mapping

    table = tmp_path / "t.json"
    table.write_text('{"models": [{"names": ["h200"], "source": "site", '
                     '"peaks": {"memory_bandwidth": 4e12}}]}')
    cfg = from_mapping({"qualification": {"enabled": False, "block": True, "peer_ratio": 0.7,
                                          "reference_file": str(table)}}).qualification
    assert (cfg.enabled, cfg.thresholds.block, cfg.thresholds.peer_ratio) == (False, True, 0.7)
    assert cfg.table is not None and cfg.table[0].source == "site"
    for bad, said in [({"peer_ratio": 1.5}, "qualification.peer_ratio"),
                      ({"tier": "slow"}, "qualification.tier"),
                      ({"reference_file": "t.json"}, "absolute path"),
                      ({"reference_file": str(tmp_path / "none.json")}, "cannot read"),
                      ({"idle": 5}, "unknown key(s) qualification.idle")]:
        with pytest.raises(ConfigError, match=said.replace("(", r"\(").replace(")", r"\)")):
            from_mapping({"qualification": bad})


def _report(uuid: str, code_bw: float, aborted: str | None = None) -> Any:
    from gpudiag.core.qualify_score import GpuResult, Measurement, score
    from gpudiag.engine.qualify import QualifyReport

    result = GpuResult(uuid, "Fake GPU", 0, "quick", "cuda",
                       (Measurement("memory_bandwidth", code_bw),), aborted=aborted,
                       started_at=1000.0, gpu_seconds=0.5, bytes_used=1 << 20)
    return QualifyReport("quick", "cuda", "t", (score(result),))


def test_the_schedule_waits_for_idle_s_and_max_age_and_keeps_aborts_out(tmp_path: Path
                                                                           ) -> None:
    from gpudiag.core.readiness import BUSY, FREE, GpuOccupancy
    from gpudiag.daemon.config import QualificationConfig
    from gpudiag.daemon.qualifier import Qualifier
    from gpudiag.engine.qualify_history import QualificationHistory

    uuid = "GPU-f00d0000-0000-4000-8000-000000000000"
    occupancy = {uuid: GpuOccupancy(uuid, FREE)}
    runs: list[Any] = []
    answers = [_report(uuid, 1e9), _report(uuid, 0.0, aborted="process 7 appeared")]

    def runner(options: Any) -> Any:
        runs.append(options)
        return answers[len(runs) - 1]

    cfg = QualificationConfig(idle_s=10.0, max_age_s=100.0, tick_s=0.02)
    q = Qualifier(cfg, tmp_path, lambda: occupancy, runner=runner)
    assert q.due(0.0) == [] and q.due(9.0) == [] and q.due(10.0) == [uuid]
    occupancy[uuid] = GpuOccupancy(uuid, BUSY)
    assert q.due(11.0) == []  # busy once: idle_s starts again
    occupancy[uuid] = GpuOccupancy(uuid, FREE)
    assert q.due(12.0) == [] and q.due(22.0) == [uuid]
    # Two on-demand runs: the second aborts, and the first's outcome stands.
    q.request([uuid], "quick")
    q.request(["0"], "quick")
    q.start()
    try:
        wait_for(lambda: len(runs) == 2 and not q.state().running, 10)
    finally:
        q.stop()
    state = q.state()
    assert state.latest[uuid].code == "none" and state.runs == {
        "none": 1, "qualification_aborted": 1}
    assert state.gpu_seconds_total == 1.0
    assert q.due(1000.0 + 50.0) == []  # qualified at 1000: not due again before max_age_s
    # A restart finds the outcome (and its figures) in the history the engine keeps.
    QualificationHistory.in_state_dir(tmp_path).append([a.qualifications[0].record()
                                                        for a in answers])
    again = Qualifier(cfg, tmp_path, lambda: occupancy, runner=runner)
    again.load()
    assert again.state().latest[uuid] == answers[0].qualifications[0]
