"""Scheduler (backoff, jitter, errors, keep-alives), sd_notify, and the watcher supervisor."""

from __future__ import annotations

import random
import socket
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gpudiag.core.probe_run import ProbeRun
from gpudiag.daemon.config import BackendConfig, XidConfig
from gpudiag.daemon.scheduler import Scheduler, failure_signature
from gpudiag.daemon.sdnotify import Notifier
from gpudiag.daemon.snapshot import ProbeKey, Snapshot, WatcherState
from gpudiag.daemon.watcher import XidWatcher
from tests.fakes.build import FakeDriver
from tests.support.daemon import Replay, quick_config, wait_for

NVML = ProbeKey("nvml")
HUNG = ProbeRun("nvml", None, 2.0, timed_out=True, error="probe nvml missed its deadline")
CRASHED = ProbeRun("nvml", None, 0.1, signal=11, error="probe nvml was killed by signal 11")
HEALTHY = ProbeRun("nvml", {"ok": True, "devices": []}, 0.1, exit_code=0)
NO_DRIVER = ProbeRun("nvml", {"ok": False, "error": {"code": 9}}, 0.1, exit_code=0)


class FakeClock:
    """Monotonic and wall time that only move when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return 1_700_000_000.0 + self.now


class Sequence_:
    """A runner answering with the next run of a list."""

    def __init__(self, runs: list[ProbeRun]) -> None:
        self.runs = list(runs)

    def __call__(self, backend: str, env: Mapping[str, str], timeout_s: float,
                 options: Mapping[str, Any] | None) -> ProbeRun:
        return self.runs.pop(0)


def _scheduler(runs: list[ProbeRun], **cfg: Any) -> tuple[Scheduler, FakeClock]:
    clock = FakeClock()
    backends = dict(quick_config().backends)
    backends["nvml"] = BackendConfig(True, 10.0, 5.0)
    config = quick_config(backends=backends, jitter_ratio=0.0, backoff_max_s=35.0, **cfg)
    return Scheduler(config, runner=Sequence_(runs), clock=clock, env={}), clock


def _run_once(sched: Scheduler) -> float:
    flight = sched.trigger([NVML])[NVML]
    assert flight.done.wait(5)
    due = sched.due_in(NVML)
    assert due is not None
    return due


def test_a_backend_failing_the_same_way_backs_off_up_to_the_cap() -> None:
    sched, _ = _scheduler([HUNG] * 5 + [HEALTHY])
    try:
        delays = [_run_once(sched) for _ in range(6)]
    finally:
        sched.stop()
    assert delays == [10.0, 20.0, 35.0, 35.0, 35.0, 10.0]


def test_a_different_failure_restarts_the_backoff() -> None:
    sched, _ = _scheduler([HUNG, HUNG, CRASHED, NO_DRIVER, NO_DRIVER])
    try:
        delays = [_run_once(sched) for _ in range(5)]
    finally:
        sched.stop()
    assert delays == [10.0, 20.0, 10.0, 10.0, 20.0]


def test_jitter_spreads_runs_within_the_ratio() -> None:
    backends = dict(quick_config().backends)
    backends["nvml"] = BackendConfig(True, 10.0, 5.0)
    sched = Scheduler(quick_config(backends=backends, jitter_ratio=0.1),
                      runner=Sequence_([HEALTHY] * 20), clock=FakeClock(),
                      rng=random.Random(7), env={})
    try:
        delays = [_run_once(sched) for _ in range(20)]
    finally:
        sched.stop()
    assert all(9.0 <= d <= 11.0 for d in delays) and len(set(delays)) > 10


@pytest.mark.parametrize("run, signature", [
    (HEALTHY, None), (HUNG, "timeout:None:None"), (CRASHED, "crashed:None:11"),
    (NO_DRIVER, "obs:9"),
    (ProbeRun("cuda", {"init": {"ok": False, "code": 100}}, 0.1, exit_code=0), "init:100"),
])
def test_failure_signature(run: ProbeRun, signature: str | None) -> None:
    assert failure_signature(run) == signature


def test_a_runner_exception_becomes_probe_error_not_a_dead_worker() -> None:
    def broken(*_: Any) -> ProbeRun:
        raise OSError("fork failed")

    sched = Scheduler(quick_config(), runner=broken, env={})
    try:
        sched.start()
        snap = wait_for(lambda: (s := sched.snapshot()).round_complete and s, 5)
    finally:
        sched.stop()
    assert snap.ready is not None and snap.ready.gpu_validation_blocker == "probe_error"
    assert "fork failed" in snap.ready.blockers[0].message
    assert snap.stats[NVML].runs_by_outcome["error"] >= 1


def test_every_probe_publishes_a_new_immutable_snapshot() -> None:
    replay = Replay({"host": HEALTHY, "nvml": HEALTHY, "cuda": HEALTHY})
    sched = Scheduler(quick_config(), runner=replay, env={})
    seen: list[int] = []
    sched.on_snapshot(lambda s: seen.append(s.seq))
    try:
        sched.start()
        first: Snapshot = wait_for(lambda: (s := sched.snapshot()).round_complete and s, 5)
        sched.trigger([NVML])[NVML].done.wait(5)
        later = sched.snapshot()
    finally:
        sched.stop()
    assert seen == sorted(seen) and len(seen) >= 4
    assert later.seq > first.seq and later.results[NVML] is not first.results[NVML]
    with pytest.raises(AttributeError):
        first.seq = 0  # type: ignore[misc]


def _notify_socket(tmp_path: Path) -> tuple[socket.socket, dict[str, str]]:
    path = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0.5)
    return sock, {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000"}


def _drain(sock: socket.socket, seconds: float) -> list[str]:
    got, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            got.append(sock.recv(4096).decode())
        except TimeoutError:
            pass
    return got


def test_sd_notify_messages_reach_the_socket(tmp_path: Path) -> None:
    sock, env = _notify_socket(tmp_path)
    n = Notifier(env)
    assert n.enabled and n.watchdog_usec == 1_000_000
    assert n.ready("serving") and n.watchdog() and n.stopping()
    assert _drain(sock, 0.2) == ["READY=1\nSTATUS=serving", "WATCHDOG=1", "STOPPING=1"]
    assert Notifier({}).notify("READY=1") is False  # no socket: a no-op, never an error
    sock.close()
    assert n.watchdog() is False  # systemd gone: False, not an exception


class WedgingWatcher:
    """A watcher source whose state() blocks once ``wedge`` is set: a wedged loop."""

    def __init__(self) -> None:
        self.wedge = threading.Event()
        self.release = threading.Event()

    def state(self) -> WatcherState:
        if self.wedge.is_set():
            self.release.wait(10)
        return WatcherState()


def test_the_loop_sends_keepalives_and_stops_when_wedged(tmp_path: Path) -> None:
    sock, env = _notify_socket(tmp_path)
    watcher = WedgingWatcher()
    sched = Scheduler(quick_config(), runner=Replay({"host": HEALTHY, "nvml": HEALTHY,
                                                     "cuda": HEALTHY}),
                      notifier=Notifier(env), watcher=watcher, env={})
    try:
        sched.start()
        alive = _drain(sock, 0.5)
        assert alive.count("WATCHDOG=1") >= 3 and sched.alive()
        watcher.wedge.set()
        time.sleep(0.3)
        _drain(sock, 0.05)  # what was sent before the loop reached the wedge
        wedged = _drain(sock, 0.6)
        assert wedged.count("WATCHDOG=1") == 0
        assert not sched.alive(limit_s=0.5)
    finally:
        watcher.release.set()
        sched.stop()
        sock.close()


def _script_watcher(tmp_path: Path, body: str, **cfg: Any) -> XidWatcher:
    script = tmp_path / "child.py"
    script.write_text(body)
    config = replace(XidConfig(heartbeat_s=0.1, telemetry_s=0.1, restart_backoff_max_s=0.5),
                     **cfg)
    return XidWatcher(config, {}, argv=[sys.executable, str(script)])


HELLO_XIDS_EXIT = """
import json, sys, time
def say(**m): print(json.dumps(m), flush=True)
say(type="hello", devices=[{"index": 0, "uuid": "GPU-a"}])
say(type="xid", xid=79, device_index=0, uuid="GPU-a")
say(type="xid", xid=13, device_index=0, uuid="GPU-a")
say(type="telemetry", gpus=[{"index": 0, "temperature_c": 50}], ts=time.time())
time.sleep(0.2)
sys.exit(3)
"""


def test_the_watcher_counts_xids_and_restarts_a_dead_child(tmp_path: Path) -> None:
    w = _script_watcher(tmp_path, HELLO_XIDS_EXIT)
    w.start()
    try:
        st = wait_for(lambda: (s := w.state()).restarts >= 2 and s, 10)
    finally:
        w.stop()
    counts = {(c.gpu, c.xid): c.count for c in st.xid_counts}
    assert counts[(0, 79)] >= 2 and counts[(0, 13)] >= 2  # each run of the child sent them
    assert {x.xid for x in st.recent} == {79, 13}
    assert "exit status 3" in (st.last_error or "")
    assert st.telemetry[0].temperature_c == 50
    assert st.gap_total_s(time.time()) > 0


def test_a_silent_watcher_is_killed_and_restarted(tmp_path: Path) -> None:
    body = ("import json, time\nprint(json.dumps({'type': 'hello', 'devices': []}), "
            "flush=True)\ntime.sleep(60)\n")
    w = _script_watcher(tmp_path, body)
    w.start()
    try:
        st = wait_for(lambda: (s := w.state()).restarts >= 1 and s, 10)
    finally:
        w.stop()
    assert "silent for more than" in (st.last_error or "")


def test_xids_older_than_the_hold_time_leave_the_verdict(tmp_path: Path) -> None:
    w = _script_watcher(tmp_path, HELLO_XIDS_EXIT, hold_s=0.3)
    w.start()
    try:
        wait_for(lambda: w.state().recent, 10)
        wait_for(lambda: not w.state().recent, 10)
        assert w.state().xid_counts  # counters stay; only the verdict's hold expires
    finally:
        w.stop()


def test_probe_children_do_not_inherit_the_systemd_channel() -> None:
    from gpudiag.core.environment import probe_environment

    env = probe_environment({"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "1", "PATH": "/bin",
                             "CUDA_VISIBLE_DEVICES": "0"})
    assert "NOTIFY_SOCKET" not in env and "WATCHDOG_USEC" not in env
    assert env["PATH"] == "/bin" and env["CUDA_VISIBLE_DEVICES"] == "0"
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"


def _watch_lines(env: Mapping[str, str], count: int) -> tuple[list[dict[str, Any]], int | None]:
    import json
    import subprocess

    proc = subprocess.Popen([sys.executable, "-m", "gpudiag.probes.xid_watch",
                             json.dumps({"heartbeat_s": 0.1, "telemetry_s": 0.3})],
                            env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    lines: list[dict[str, Any]] = []
    try:
        for _ in range(count):
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(json.loads(line))
    finally:
        code = proc.poll()
        proc.kill()
        proc.wait()
    return lines, code


def test_the_watcher_child_streams_xids_and_telemetry_from_nvml(fakes: FakeDriver,
                                                                tmp_path: Path) -> None:
    from tests.support.daemon import host_env

    env = host_env(fakes, tmp_path, gpus=2, FAKE_NVML_DEVICE_COUNT=2,
                   FAKE_NVML_XIDS="1:48,0:13", FAKE_NVML_TEMPERATURE_C="0:61")
    lines, _ = _watch_lines(env, 6)
    kinds = [m["type"] for m in lines]
    assert kinds[:2] == ["hello", "telemetry"] and "heartbeat" in kinds
    assert [d["index"] for d in lines[0]["devices"]] == [0, 1]
    assert lines[1]["gpus"][0]["temperature_c"] == 61
    xids = [(m["device_index"], m["xid"], m["uuid"][-1]) for m in lines if m["type"] == "xid"]
    assert xids == [(1, 48, "1"), (0, 13, "0")]


def test_the_watcher_child_reports_nvml_init_failure_and_exits(fakes: FakeDriver,
                                                               tmp_path: Path) -> None:
    from tests.support.daemon import host_env

    env = host_env(fakes, tmp_path, gpus=2, FAKE_NVML_INIT_ERROR=9)
    lines, _ = _watch_lines(env, 1)
    assert lines[0]["type"] == "error" and lines[0]["code"] == 9
    assert "nvmlInit failed" in lines[0]["message"]
