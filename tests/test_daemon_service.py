"""The daemon as an object (gpudiag.daemon.service): started and stopped in this process.

A real DaemonService on the fake driver (probe children, the XID watcher child, TCP on port 0
and a unix socket), asked to stop the way SIGTERM asks it: nothing it started may outlive
``stop()``, neither a thread, a child, the socket file nor the state directory's lock.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from gpudiag.daemon.config import DaemonConfig, from_mapping
from gpudiag.daemon.service import CannotListen, DaemonService, StateDirUnusable
from gpudiag.daemon.statedir import lock_state_dir

EnvFactory = Callable[..., dict[str, str]]


def config(listen: str = "127.0.0.1:0", **top: Any) -> DaemonConfig:
    """Quick ticks, host/nvml/cuda only, a fast XID watcher heartbeat."""
    return from_mapping({"listen": listen, **top, "scheduler": {"tick_s": 0.05},
                         "backends": {"jax": {"enabled": False}, "iree": {"enabled": False}},
                         "xid": {"heartbeat_s": 0.2}})


@pytest.fixture
def runtime_dir() -> Iterator[Path]:
    """A short folder (unix socket paths have a 108-byte cap), like $RUNTIME_DIRECTORY."""
    folder = Path(tempfile.mkdtemp(prefix="gds"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def switch_interval() -> Iterator[None]:
    """start() tunes the interpreter's switch interval for the daemon: undone for pytest."""
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


class Lines(logging.Handler):
    """The daemon's log messages, in order."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def daemon_log() -> Iterator[Lines]:
    logger = logging.getLogger("gpudiag.daemon")
    lines, level = Lines(), logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)


def get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def settled(check: Callable[[], list[Any]], timeout_s: float = 10.0) -> list[Any]:
    """What ``check`` still finds once it finds nothing, or after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while (left := check()) and time.monotonic() < end:
        time.sleep(0.1)
    return left


class Notifications:
    """systemd's side of NOTIFY_SOCKET: a reader keeps the queue empty (a full one drops)."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.1)
        self.got: list[str] = []
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read, name="test-notify", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                self.got.append(self.sock.recv(4096).decode())
            except TimeoutError:
                if self._closed.is_set():
                    return  # after what was already sent is read

    def first(self, prefix: str, timeout_s: float = 10.0) -> str:
        """The first message that starts with ``prefix`` (keep-alives come between)."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            found = [m for m in self.got if m.startswith(prefix)]
            if found:
                return found[0]
            time.sleep(0.05)
        raise AssertionError(f"no {prefix} in {self.got}")

    def close(self) -> None:
        self._closed.set()
        self._reader.join()
        self.sock.close()


def new_threads(before: set[threading.Thread]) -> Callable[[], list[str]]:
    return lambda: sorted(t.name for t in threading.enumerate()
                          if t.is_alive() and t not in before)


def children() -> list[str]:
    return [" ".join(p.cmdline()[:4]) for p in psutil.Process().children(recursive=True)]


def test_a_started_service_serves_and_its_stop_leaves_nothing_behind(
        gpu_env: EnvFactory, tmp_path: Path, runtime_dir: Path, switch_interval: None,
        daemon_log: Lines) -> None:
    notify = Notifications(runtime_dir / "notify")
    env = gpu_env()
    env.update(NOTIFY_SOCKET=str(runtime_dir / "notify"), RUNTIME_DIRECTORY=str(runtime_dir))
    state, sock = tmp_path / "state", runtime_dir / "gpudiag.sock"
    threads = set(threading.enumerate())
    service = DaemonService(config(), state, env=env)
    try:
        service.start()
        ready = notify.first("READY=1")
        assert ready == f"READY=1\nSTATUS=serving on {service.url} and unix:{sock}"
        assert service.url.startswith("http://127.0.0.1:") and sock.is_socket()
        end = time.monotonic() + 30
        while get(service.url + "/readyz")[0] != 200 and time.monotonic() < end:
            time.sleep(0.1)
        status, answer = get(service.url + "/v1/health")
        assert status == 200 and answer["gpu_validation_blocker"] == "none", answer
        # The XID watcher runs as a child: what the check below must find gone.
        assert any("gpudiag.probes.xid_watch" in c for c in children()), children()
        with pytest.raises(StateDirUnusable, match=f"another gpudiag daemon.*{state}"):
            DaemonService(config(), state, env=env).start()
        service.request_stop()
        assert service.wait() is None  # asked to stop, no listener died
    finally:
        service.stop()
        notify.close()
    assert "STOPPING=1" in notify.got
    assert settled(new_threads(threads)) == []
    assert settled(children) == []
    assert not sock.exists()
    lock_state_dir(state).release()  # free again: a successor starts at once
    assert daemon_log.messages[-2:] == ["stopping", "stopped"]
    assert f"listening on {service.url}" in daemon_log.messages
    service.stop()  # a second stop does nothing
    assert daemon_log.messages.count("stopping") == 1


def test_a_port_in_use_fails_the_start_and_leaves_the_state_dir_free(
        gpu_env: EnvFactory, tmp_path: Path, switch_interval: None) -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    threads = set(threading.enumerate())
    service = DaemonService(config(f"127.0.0.1:{port}", socket=""), tmp_path / "state",
                            env=gpu_env())
    try:
        with pytest.raises(CannotListen, match=f"cannot listen on 127.0.0.1:{port}: "):
            service.start()
    finally:
        busy.close()
    assert CannotListen.exit_code == 2
    assert settled(new_threads(threads)) == []  # the qualifier started first, and stopped
    lock_state_dir(tmp_path / "state").release()
    # The history was closed again: a new start opens it, serves, and stops.
    again = DaemonService(config(socket=""), tmp_path / "state", env=gpu_env())
    again.start()
    again.stop()
    assert settled(new_threads(threads)) == []
    assert os.listdir(tmp_path / "state")
