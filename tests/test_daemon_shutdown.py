"""The daemon stops within its documented time whatever it is doing (issue 24's CI hang).

SIGTERM lands during a `gpudiag clear` whose history write waits on a locked database, during
a probe round whose child hangs in cuInit, during a history write that waits on the lock,
and during slow requests (a preflight waiting for that hung probe, a client trickling its
head). Each time the daemon must log "stopping" and "stopped" and exit 0 within
``SHUTDOWN_LIMIT_S`` (docs/daemon.md), leaving no probe child behind.
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import termios
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpudiag.daemon.service import SHUTDOWN_LIMIT_S
from tests.fakes.build import FakeDriver, write_state_file
from tests.support.daemon import Daemon, daemon_toml, host_env, wait_for, write_config
from tests.support.host import processes_with_env, run_gpudiag

F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ (Linux)


class Rig:
    """A running daemon on a fake 2-GPU host whose state file the test rewrites."""

    def __init__(self, fakes: FakeDriver, tmp: Path) -> None:
        self.tmp, self.state_file, self.state_dir = tmp, tmp / "gpu-state", tmp / "state"
        write_state_file(self.state_file, {"FAKE_NVML_DEVICE_COUNT": 2})
        self.env = host_env(fakes, tmp / "host", gpus=2, FAKE_GPU_STATE_FILE=str(self.state_file))
        toml = daemon_toml({"backends.cuda": {"interval_s": 0.5, "deadline_s": 60},
                            "": {"preflight_wait_s": 60}})
        self.daemon = Daemon(self.env, write_config(tmp / "gpudiag.toml", toml), self.state_dir)
        self.daemon.wait_ready()

    def lock_history(self) -> sqlite3.Connection:
        """Hold the history's write lock, as a stuck writer would (the daemon waits on it)."""
        db = sqlite3.connect(self.state_dir / "history.sqlite3", isolation_level=None)
        db.execute("BEGIN IMMEDIATE")
        return db

    def stop_timed(self) -> float:
        start = time.monotonic()
        rc = self.daemon.stop()
        took = time.monotonic() - start
        log = "\n".join(self.daemon.lines[-30:])
        assert rc == 0, log
        assert '"stopping"' in log and '"stopped"' in log, log
        return took


@pytest.fixture
def rig(fakes: FakeDriver, tmp_path: Path) -> Iterator[Rig]:
    r = Rig(fakes, tmp_path)
    yield r
    r.daemon.stop()
    wait_for(lambda: not processes_with_env(str(r.state_file)), 10)


def _during_a_clear(rig: Rig) -> Callable[[], None]:
    db = rig.lock_history()
    proc = run_gpudiag(["clear", "--all", "--state-dir", str(rig.state_dir)], rig.env)
    assert proc.returncode == 0, proc.stderr
    # The scheduler's loop picks it up and waits on the locked history to record it.
    wait_for(lambda: any("cleared by uid" in ln for ln in rig.daemon.lines)
             or not any(rig.state_dir.joinpath("clear-requests").glob("*.json")), 10)
    return db.close


def _during_a_probe_round(rig: Rig) -> Callable[[], None]:
    write_state_file(rig.state_file, {"FAKE_NVML_DEVICE_COUNT": 2, "FAKE_CUDA_INIT_HANG": 1})
    # A cuda child hung in cuInit (its deadline is 60 s): killed on the way out.
    wait_for(lambda: processes_with_env(str(rig.state_file), "gpudiag.probes"), 10)
    return lambda: None


def _during_a_history_write(rig: Rig) -> Callable[[], None]:
    db = rig.lock_history()
    # A verdict change (one GPU gone) that the writer must store while the history is locked.
    write_state_file(rig.state_file, {"FAKE_NVML_DEVICE_COUNT": 1})
    wait_for(lambda: any("verdict changed" in ln and "history_pending" in ln
                         for ln in rig.daemon.lines) or _preflight_blocked(rig), 15)
    return db.close


def _preflight_blocked(rig: Rig) -> bool:
    return '"ready": false' in _get(rig.daemon.url + "/v1/preflight", 10)


def _get(url: str, timeout: float) -> str:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return str(r.read().decode())
    except OSError as e:
        return str(e)


def _during_slow_requests(rig: Rig) -> Callable[[], None]:
    write_state_file(rig.state_file, {"FAKE_NVML_DEVICE_COUNT": 2, "FAKE_CUDA_INIT_HANG": 1})
    url = rig.daemon.url + "/v1/preflight?require=cuda&max_age_s=0"
    waiting = [threading.Thread(target=_get, args=(url, 90), daemon=True) for _ in range(4)]
    for t in waiting:
        t.start()
    host, _, port = rig.daemon.instance.rpartition(":")
    trickler = socket.create_connection((host, int(port)))
    trickler.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never the rest
    wait_for(lambda: processes_with_env(str(rig.state_file), "gpudiag.probes"), 10)
    time.sleep(0.5)  # the preflights are now waiting on the hung probe
    return trickler.close


@pytest.mark.parametrize("stage", [_during_a_clear, _during_a_probe_round,
                                   _during_a_history_write, _during_slow_requests],
                         ids=["clear", "probe_round", "history_write", "slow_request"])
def test_sigterm_at_any_stage_stops_the_daemon_within_its_limit(
        rig: Rig, stage: Callable[[Rig], Callable[[], None]]) -> None:
    cleanup = stage(rig)
    try:
        took = rig.stop_timed()
    finally:
        cleanup()
    assert took < SHUTDOWN_LIMIT_S, f"stopping took {took:.1f} s"
    wait_for(lambda: not processes_with_env(str(rig.state_file)), 10)


@pytest.mark.slow  # about 19 s: it waits out the 15 s shutdown limit on purpose
def test_sigterm_with_a_stalled_log_still_ends_the_daemon_within_its_limit(
        fakes: FakeDriver, tmp_path: Path) -> None:
    """The CI hang's signature: a log write that never returns blocks every thread that logs,
    the "stopping" line included; the daemon used to stay up forever, saying nothing."""
    state = tmp_path / "gpu-state"
    write_state_file(state, {"FAKE_NVML_DEVICE_COUNT": 2})
    env = host_env(fakes, tmp_path / "host", gpus=2, FAKE_GPU_STATE_FILE=str(state))
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, F_SETPIPE_SZ, 4096)  # the smallest pipe
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpudiag", "serve", "--listen", "127.0.0.1:0", "--config",
         str(write_config(tmp_path / "gpudiag.toml", daemon_toml())), "--state-dir",
         str(tmp_path / "state"), "--log-format", "json"],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=write_end)
    try:
        # Once it logs that it listens, nobody reads the log and the pipe is filled up: the
        # daemon's next log line blocks, and so does every thread that logs after it.
        wait_for(lambda: _queued(read_end) > 0, 30, interval=0.1)
        time.sleep(1.0)
        # Blocking writes from a thread (O_NONBLOCK would be shared with the daemon's fd).
        filler = threading.Thread(target=os.write, args=(
            write_end, b"x" * (4096 - _queued(read_end))), daemon=True)
        filler.start()
        wait_for(lambda: _queued(read_end) >= 4096, 10)
        time.sleep(1.0)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(SHUTDOWN_LIMIT_S + 10)
        took = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        os.close(read_end)
        os.close(write_end)
    assert took < SHUTDOWN_LIMIT_S + 2, f"stopping took {took:.1f} s"
    assert rc == 3  # it did not stop in order: it says so with its exit status
    wait_for(lambda: not processes_with_env(str(state)), 10)


def _queued(fd: int) -> int:
    buf = bytearray(4)
    fcntl.ioctl(fd, termios.FIONREAD, buf)
    return int.from_bytes(buf, sys.byteorder)
