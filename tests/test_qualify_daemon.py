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
        assert status == 202 and body["accepted"] == {
            "gpus": ["3"], "tier": "quick", "uuids": ["GPU-f00d0003-0000-4000-8000-000000000003"],
            "budget_gpu_s": 10.0}
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
    assert (cfg.max_request_gpu_s, cfg.max_queued) == (480.0, 8)  # the defaults
    for bad, said in [({"peer_ratio": 1.5}, "qualification.peer_ratio"),
                      ({"tier": "slow"}, "qualification.tier"),
                      ({"reference_file": "t.json"}, "absolute path"),
                      ({"reference_file": str(tmp_path / "none.json")}, "cannot read"),
                      ({"idle": 5}, "unknown key(s) qualification.idle"),
                      ({"max_request_gpu_s": 5}, "qualification.max_request_gpu_s = 5"),
                      ({"max_request_gpu_s": "1h"}, "qualification.max_request_gpu_s"),
                      ({"max_queued": 0}, "qualification.max_queued = 0"),
                      ({"max_queued": True}, "qualification.max_queued")]:
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
    from gpudiag.daemon.qualify_schedule import Qualifier
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
    # Two on-demand runs, one after the other (one per GPU at a time): the second aborts,
    # and the first's outcome stands.
    q.request([uuid], "quick")
    q.start()
    try:
        wait_for(lambda: len(runs) == 1 and q.current() is None, 10)
        q.request(["0"], "quick")
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


# --- issue 38, class 4: POST /v1/qualify is bounded; a waiting job stops a qualification ---

GPU0 = "GPU-f00d0000-0000-4000-8000-000000000000"


def _holds(pid: int, path: Path) -> bool:
    """Whether the kernel says ``pid`` holds a flock on ``path`` (/proc/locks)."""
    import os

    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino} "
    return any(f" {pid} {key}" in line for line in Path("/proc/locks").read_text().splitlines())


def _qualifying_daemon(fakes: FakeDriver, tmp_path: Path, gpus: int,
                       **qualification: Any) -> tuple[Daemon, dict[str, str], Path]:
    """A daemon on ``gpus`` slow fake GPUs (a full tier runs to its 60 s deadline), its
    schedule off so that only requests qualify, with its own lock folder."""
    locks = tmp_path / "locks"
    locks.mkdir()
    env = host_env(fakes, tmp_path / "host", gpus=gpus, FAKE_NVML_DEVICE_COUNT=gpus,
                   GPUDIAG_LOCK_DIR=str(locks),
                   FAKE_CUDA_COPY_GBPS=",".join(f"{i}:0.005" for i in range(gpus)), **SMALL_GPU)
    config = write_config(tmp_path / "d.toml", daemon_toml({"qualification": {
        "enabled": False, "tick_s": 0.1, **qualification}}))
    daemon = Daemon(env, config, tmp_path / "state")
    daemon.wait_ready()
    return daemon, env, locks


def _until_daemon_holds(daemon: Daemon, lock: Path) -> None:
    wait_for(lambda: _holds(daemon.proc.pid, lock), 30, interval=0.02)


def _yield_and_stop(daemon: Daemon, locks: Path, uuid: str = GPU0) -> None:
    """End a qualification the way a job does (hold the GPU's waiting mark), then the daemon."""
    import fcntl
    import os

    fd = os.open(locks / f"{uuid}.waiting", os.O_CREAT | os.O_RDONLY, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        wait_for(lambda: not _holds(daemon.proc.pid, locks / f"{uuid}.lock"), 10)
    finally:
        os.close(fd)
        assert daemon.stop() == 0


def test_qualify_requests_are_bounded_per_gpu_by_gpu_seconds_and_in_number(
        fakes: FakeDriver, tmp_path: Path) -> None:
    daemon, _, locks = _qualifying_daemon(fakes, tmp_path, 3, max_request_gpu_s=60,
                                          max_queued=1)
    try:
        # Every GPU at the full tier: 3 x 60 GPU-seconds, over the cap of 60.
        status, body = _post(daemon, "/v1/qualify?tier=full")
        assert status == 400 and body["error"]["code"] == "over_budget", body
        said = body["error"]["message"]
        assert "180 GPU-seconds" in said and "qualification.max_request_gpu_s" in said, said
        status, body = _post(daemon, "/v1/qualify?gpus=7")
        assert status == 400 and body["error"]["code"] == "unknown_gpu", body
        status, body = _post(daemon, "/v1/qualify?gpus=0&tier=full")
        assert status == 202 and body["accepted"]["uuids"] == [GPU0], body
        assert body["accepted"]["budget_gpu_s"] == 60
        _until_daemon_holds(daemon, locks / f"{GPU0}.lock")
        # One per GPU: the running one is named, whatever the second asks.
        status, body = _post(daemon, f"/v1/qualify?gpus={GPU0}&tier=quick")
        assert status == 409 and body["error"]["code"] == "qualification_pending", body
        assert (f"the requested full-tier qualification of GPU 0 ({GPU0}), running for"
                in body["error"]["message"]), body
        status, body = _post(daemon, "/v1/qualify?gpus=1")
        assert status == 202 and body["queued"] == 1, body
        status, body = _post(daemon, "/v1/qualify?gpus=1,2")
        assert status == 409 and "quick-tier qualification of GPU 1" in body["error"][
            "message"] and "queued" in body["error"]["message"], body
        # The queue as a whole: max_queued = 1 is taken by GPU 1's.
        req = urllib.request.Request(daemon.url + "/v1/qualify?gpus=2", method="POST", data=b"")
        try:
            urllib.request.urlopen(req, timeout=30)
            raise AssertionError("a second request was queued past max_queued = 1")
        except urllib.error.HTTPError as e:
            full = json.loads(e.read())
            assert e.code == 429 and full["error"]["code"] == "queue_full", full
            assert int(e.headers["Retry-After"]) >= 1
            assert "qualification.max_queued = 1" in full["error"]["message"]
    finally:
        _yield_and_stop(daemon, locks)


def test_serve_check_config_refuses_a_bad_qualify_bound_naming_the_key(tmp_path: Path
                                                                       ) -> None:
    import os

    from tests.support.host import run_gpudiag

    for line, key in (("max_request_gpu_s = 5", "qualification.max_request_gpu_s = 5"),
                      ("max_queued = -1", "qualification.max_queued = -1")):
        config = write_config(tmp_path / "q.toml", f"[qualification]\n{line}\n")
        proc = run_gpudiag(["serve", "--config", str(config), "--check-config"],
                           dict(os.environ))
        assert proc.returncode == 2 and key in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr


def test_a_full_qualification_by_the_daemon_yields_to_a_waiting_job_within_1_s(
        fakes: FakeDriver, tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.support.host import run_gpudiag
    from tests.support.run import run_folder

    daemon, env, locks = _qualifying_daemon(fakes, tmp_path, 1)
    lock, waiting = locks / f"{GPU0}.lock", locks / f"{GPU0}.waiting"
    job: subprocess.Popen[str] | None = None
    try:
        env = {**env, "GPUDIAG_DAEMON_URL": daemon.url}
        assert _post(daemon, "/v1/qualify?gpus=0&tier=full")[0] == 202
        _until_daemon_holds(daemon, lock)
        holder = f"a qualification by the gpudiag daemon (pid {daemon.proc.pid}, uid "
        # Not waiting (--lock-timeout 0): refused, naming the daemon's qualification.
        refused = run_gpudiag(["run", "--artifacts", str(tmp_path / "refused"), "--gpus", "1",
                               "--lock-timeout", "0", "--", "true"], env)
        assert refused.returncode == 125 and holder in refused.stderr, refused.stderr
        assert "stops within 1 s for a job that waits" in refused.stderr
        close = json.loads((run_folder(tmp_path / "refused") / "closeout.json").read_text())
        assert close["gpu_validation_blocker"] == "lock_timeout"
        (held,) = close["evidence"]["held_by_others"]
        assert held["holder"]["qualifying"] and held["holder"]["daemon"], held
        assert _holds(daemon.proc.pid, lock), "a job that did not wait stopped it"
        # Waiting: the job holds the waiting mark, the daemon lets go within 1 s.
        job = subprocess.Popen([sys.executable, "-m", "gpudiag", "run", "--artifacts",
                                str(tmp_path / "run"), "--gpus", "1", "--lock-timeout", "30",
                                "--", "true"], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        waited = wait_for(lambda: _holds(job.pid, waiting) and time.monotonic(), 60,
                          interval=0.01)
        freed = wait_for(lambda: not _holds(daemon.proc.pid, lock) and time.monotonic(), 10,
                         interval=0.01)
        print(f"the daemon's qualification let go {freed - waited:.3f} s after the job waited")
        # The product's 1 s, with room for a loaded machine (the figure: benchmarks/qualify.py).
        assert freed - waited <= 5.0, f"it took {freed - waited:.2f} s"
        _, err = job.communicate(timeout=60)
        assert job.returncode == 0, err
        assert "waiting up to" in err and holder in err, err
        assert wait_for(lambda: qualification_outcomes(daemon).get("0"), 10) == (
            "qualification_aborted")
    finally:
        if job is not None and job.poll() is None:
            job.kill()
            job.wait(10)
        _yield_and_stop(daemon, locks)
