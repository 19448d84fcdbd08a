"""The systemd unit: verify is clean, the hardening score is recorded, and the watchdog
keep-alive rides on the scheduler loop, so a wedged loop stops it."""

from __future__ import annotations

import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpudiag.daemon.config import DaemonConfig, load_config
from tests.support.deploy import UNIT, unit_settings
from tests.support.host import EnvFactory

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_CONFIG = ROOT / "systemd" / "gpudiag.toml"
DOCS = ROOT / "docs" / "operations.md"
INSTALLED_BINARY = "/opt/gpudiag/bin/gpudiag"
MAX_EXPOSURE = 4.0
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(SYSTEMD_ANALYZE is None,
                                   reason="systemd-analyze not installed (apt-get install systemd)")


def one(settings: dict[str, list[str]], key: str) -> str:
    values = settings.get(key)
    assert values, f"{key}= missing from {UNIT.name}"
    return values[-1]


@pytest.fixture
def testable_unit(tmp_path: Path) -> Path:
    """A copy of the unit whose ExecStart names this checkout's gpudiag (verify needs it)."""
    gpudiag = Path(sys.executable).with_name("gpudiag")
    assert gpudiag.exists(), f"{gpudiag} missing: pip install -e ."
    text = UNIT.read_text()
    assert INSTALLED_BINARY in text
    copy = tmp_path / UNIT.name
    copy.write_text(text.replace(INSTALLED_BINARY, str(gpudiag)))
    return copy


@needs_analyze
def test_systemd_analyze_verify_is_silent(testable_unit: Path) -> None:
    assert SYSTEMD_ANALYZE is not None
    proc = subprocess.run([SYSTEMD_ANALYZE, "verify", str(testable_unit)],
                          capture_output=True,
                          text=True, timeout=60, check=False, cwd=testable_unit.parent)
    # Unknown keys and bad values only warn with exit 0: the stderr is what counts.
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr


def exposure(unit: Path) -> tuple[float, str]:
    assert SYSTEMD_ANALYZE is not None
    proc = subprocess.run([SYSTEMD_ANALYZE, "security", "--offline=yes", "--no-pager",
                           str(unit)], capture_output=True, text=True, timeout=60,
                          check=False, cwd=unit.parent)
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+) (\w+)", proc.stdout)
    assert match, f"no exposure line:\n{proc.stdout}\n{proc.stderr}"
    return float(match.group(1)), match.group(2)


@needs_analyze
def test_security_exposure_is_at_most_4_and_recorded_in_docs(testable_unit: Path) -> None:
    score, rating = exposure(testable_unit)
    print(f"systemd-analyze security --offline=yes gpudiag.service: {score} {rating}")
    assert score <= MAX_EXPOSURE
    recorded = re.search(r"exposure level[^\n]*?(\d+\.\d+)", DOCS.read_text())
    assert recorded, f"{DOCS} does not record the exposure level"
    assert float(recorded.group(1)) == score, (
        f"{DOCS} records {recorded.group(1)}, measured {score}: update the docs")


@pytest.mark.parametrize(("key", "expected"), [
    ("Type", "notify"),
    ("NotifyAccess", "main"),
    ("ProtectSystem", "strict"),
    ("ProtectHome", "yes"),
    ("NoNewPrivileges", "yes"),
    ("PrivateTmp", "yes"),
    ("DevicePolicy", "closed"),
    ("Restart", "on-failure"),
    ("CapabilityBoundingSet", ""),
])
def test_unit_hardening_setting(key: str, expected: str) -> None:
    assert one(unit_settings(UNIT.read_text()), key) == expected


def test_unit_runs_as_a_dedicated_user_with_gpu_nodes_only() -> None:
    s = unit_settings(UNIT.read_text())
    assert one(s, "User") not in {"", "root", "0"}
    assert one(s, "DynamicUser") == "yes"
    assert any("nvidia" in v and v.endswith("rw") for v in s["DeviceAllow"])
    assert one(s, "StateDirectory") == "gpudiag"
    families = one(s, "RestrictAddressFamilies").split()
    assert set(families) == {"AF_UNIX", "AF_INET", "AF_INET6"}


def test_unit_bounds_memory_restarts_with_backoff_and_has_a_watchdog() -> None:
    s = unit_settings(UNIT.read_text())
    assert re.fullmatch(r"\d+[KMGT]", one(s, "MemoryMax"))
    assert re.fullmatch(r"\d+s", one(s, "RestartSec"))
    assert int(one(s, "StartLimitBurst")) >= 2
    watchdog = one(s, "WatchdogSec")
    assert re.fullmatch(r"\d+s", watchdog)
    # The loop ticks every tick_s; the keep-alive must come many times per watchdog period.
    assert int(watchdog[:-1]) >= 20 * DaemonConfig().tick_s


def test_unit_execstart_uses_the_example_config_path() -> None:
    exec_start = one(unit_settings(UNIT.read_text()), "ExecStart").split()
    assert exec_start[:2] == [INSTALLED_BINARY, "serve"]
    assert exec_start[exec_start.index("--config") + 1] == "/etc/gpudiag/gpudiag.toml"
    # `systemctl reload` sends SIGHUP, which re-reads the config (tests/test_reload.py).
    assert one(unit_settings(UNIT.read_text()), "ExecReload") == "/bin/kill -HUP $MAINPID"


def test_unit_runtime_directory_holds_the_socket_clients_ask_by_default() -> None:
    from gpudiag.daemon.effective import SOCKET_NAME
    from gpudiag.engine.client import DEFAULT_SOCKET

    s = unit_settings(UNIT.read_text())
    runtime = one(s, "RuntimeDirectory")
    assert f"/run/{runtime}/{SOCKET_NAME}" == DEFAULT_SOCKET
    # Not /run/gpudiag itself: systemd removes it on stop, with `gpudiag run`'s locks in it.
    assert runtime != "gpudiag"
    assert one(s, "RuntimeDirectoryMode") == "0755"  # local users reach the 0666 socket


def test_example_config_loads_and_documents_the_defaults() -> None:
    assert load_config(EXAMPLE_CONFIG) == DaemonConfig()


# --- the watchdog path --------------------------------------------------------------------

@pytest.fixture
def notify_socket() -> Iterator[tuple[socket.socket, str]]:
    """A datagram socket standing in for systemd's NOTIFY_SOCKET (short path: 108-byte cap)."""
    folder = tempfile.mkdtemp(prefix="gdn")
    path = f"{folder}/notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0.05)
    try:
        yield sock, path
    finally:
        sock.close()
        shutil.rmtree(folder, ignore_errors=True)


def received(sock: socket.socket, seconds: float) -> list[str]:
    """Every message that arrives within ``seconds``."""
    out: list[str] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            out.append(sock.recv(4096).decode())
        except TimeoutError:
            continue
    return out


class GateWatcher:
    """An XID-watcher source whose state() can be made to hang: the loop calls it each tick."""

    def __init__(self) -> None:
        self.wedged = threading.Event()
        self.release = threading.Event()

    def state(self):  # type: ignore[no-untyped-def]
        from gpudiag.daemon.snapshot import WatcherState

        if self.wedged.is_set():
            self.release.wait(30)
        return WatcherState()


def test_wedged_scheduler_loop_stops_the_watchdog_keepalive(
        notify_socket: tuple[socket.socket, str], gpu_env: EnvFactory) -> None:
    from gpudiag.daemon.config import from_mapping
    from gpudiag.daemon.scheduler import Scheduler
    from gpudiag.daemon.sdnotify import Notifier

    sock, path = notify_socket
    config = from_mapping({"scheduler": {"tick_s": 0.05},
                           "backends": {"jax": {"enabled": False},
                                        "iree": {"enabled": False}},
                           "xid": {"enabled": False}})
    gate = GateWatcher()
    scheduler = Scheduler(config, env=gpu_env(), watcher=gate,
                          notifier=Notifier(env={"NOTIFY_SOCKET": path,
                                                 "WATCHDOG_USEC": "1000000"}))
    scheduler.start()
    try:
        healthy = received(sock, 0.6)
        assert healthy.count("WATCHDOG=1") >= 4, healthy
        gate.wedged.set()
        received(sock, 0.2)  # the tick in flight when the loop wedged
        wedged = received(sock, 1.0)
        assert "WATCHDOG=1" not in wedged, wedged
        assert not scheduler.alive(limit_s=0.5)
        gate.wedged.clear()
        gate.release.set()
        recovered = received(sock, 0.6)
        assert recovered.count("WATCHDOG=1") >= 2, recovered
        assert scheduler.alive(limit_s=0.5)
    finally:
        gate.release.set()
        scheduler.stop()


def test_gpudiag_serve_notifies_ready_then_keepalives_that_stop_when_frozen(
        notify_socket: tuple[socket.socket, str], gpu_env: EnvFactory,
        tmp_path: Path) -> None:
    """The real daemon: READY=1 once serving, WATCHDOG=1 while the loop runs, none while the
    process is frozen (what systemd's watchdog sees of a hung daemon), STOPPING=1 on TERM."""
    sock, path = notify_socket
    config = tmp_path / "gpudiag.toml"
    config.write_text('listen = "127.0.0.1:0"\n[scheduler]\ntick_s = 0.1\n'
                      "[backends.jax]\nenabled = false\n[backends.iree]\nenabled = false\n")
    env = gpu_env()
    env.update(NOTIFY_SOCKET=path, WATCHDOG_USEC="2000000")
    gpudiag = Path(sys.executable).with_name("gpudiag")
    proc = subprocess.Popen([str(gpudiag), "serve", "--config", str(config),
                             "--state-dir", str(tmp_path / "state")], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        first = received(sock, 2.5)
        ready = [m for m in first if m.startswith("READY=1")]
        assert ready and "STATUS=serving on http://127.0.0.1:" in ready[0], first
        assert first.count("WATCHDOG=1") >= 5, first
        proc.send_signal(signal.SIGSTOP)
        received(sock, 0.3)
        assert received(sock, 1.0) == []
        proc.send_signal(signal.SIGCONT)
        assert received(sock, 1.0).count("WATCHDOG=1") >= 3
        proc.terminate()
        assert proc.wait(15) == 0
        assert "STOPPING=1" in received(sock, 0.5)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait()


def test_gpudiag_serve_under_systemd_serves_its_runtime_directory_socket(
        notify_socket: tuple[socket.socket, str], gpu_env: EnvFactory,
        tmp_path: Path) -> None:
    """$RUNTIME_DIRECTORY/gpudiag.sock, 0666 despite UMask=0077, bound before READY=1."""
    import os
    import stat

    sock, path = notify_socket
    runtime = Path(tempfile.mkdtemp(prefix="gdr"))
    config = tmp_path / "gpudiag.toml"
    config.write_text('listen = "127.0.0.1:0"\n[backends.jax]\nenabled = false\n'
                      "[backends.iree]\nenabled = false\n")
    env = gpu_env()
    env.update(NOTIFY_SOCKET=path, RUNTIME_DIRECTORY=str(runtime))
    gpudiag = Path(sys.executable).with_name("gpudiag")
    proc = subprocess.Popen([str(gpudiag), "serve", "--config", str(config),
                             "--state-dir", str(tmp_path / "state")], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=lambda: os.umask(0o077))
    try:
        first = received(sock, 2.5)
        ready = [m for m in first if m.startswith("READY=1")]
        assert ready and f"and unix:{runtime}/gpudiag.sock" in ready[0], first
        mode = os.stat(runtime / "gpudiag.sock").st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o666
        proc.terminate()
        assert proc.wait(15) == 0
        assert not (runtime / "gpudiag.sock").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(runtime, ignore_errors=True)
