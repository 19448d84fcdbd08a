"""The daemon for tests and benchmarks: real probe runs on the fakes, replayed; real daemons.

The probes run for real once, as children on the fake driver; the scheduler tests then replay
those ProbeRuns so that scheduling, HTTP and metrics can be tested in milliseconds.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

from prometheus_client.parser import text_string_to_metric_families

from gpudiag.core.environment import probe_environment
from gpudiag.core.probe_run import ProbeRun
from gpudiag.daemon.config import BackendConfig, DaemonConfig, XidConfig
from gpudiag.daemon.scheduler import Scheduler
from gpudiag.daemon.snapshot import Snapshot, WatcherState
from gpudiag.engine.isolation import run_probe
from tests.fakes.build import FakeDriver
from tests.support.host import clean_env, make_host_dirs

# Recorded probe runs by backend name, as real_runs returns them and Replay answers with.
Runs: TypeAlias = dict[str, ProbeRun]


def host_env(fakes: FakeDriver, root: Path, gpus: int = 8, **knobs: str | int) -> dict[str, str]:
    """An environment of a host with the fake driver and healthy device nodes."""
    dev, proc = make_host_dirs(root, gpus=gpus)
    env = clean_env()
    env["GPUDIAG_DEVICE_DIR"] = str(dev)
    env["GPUDIAG_DRIVER_PROC_DIR"] = str(proc)
    return fakes.env(base=env, **knobs)


def real_runs(env: Mapping[str, str], names: tuple[str, ...] = ("host", "nvml", "cuda")
              ) -> dict[str, ProbeRun]:
    """Run the probes for real (children on the fakes) and keep what they returned."""
    child_env = probe_environment(env)
    return {n: run_probe(n, env=child_env, timeout_s=30) for n in names}


@dataclass
class Replay:
    """A ProbeRunner that answers with recorded runs; counts calls; can be held on a gate."""

    runs: dict[str, ProbeRun]
    gate: threading.Event | None = None
    calls: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, backend: str, env: Mapping[str, str], timeout_s: float,
                 options: Mapping[str, Any] | None) -> ProbeRun:
        with self.lock:
            self.calls.append(backend)
        if self.gate is not None:
            self.gate.wait(10)
        return self.runs[backend]


def quick_config(**changes: Any) -> DaemonConfig:
    """host/nvml/cuda on short intervals, jax/iree off, no watcher (unit tests)."""
    backends = {
        "host": BackendConfig(True, 60.0, 10.0), "nvml": BackendConfig(True, 60.0, 10.0),
        "cuda": BackendConfig(True, 60.0, 10.0), "jax": BackendConfig(False, 300.0, 60.0),
        "iree": BackendConfig(False, 300.0, 60.0)}
    base = DaemonConfig(backends=backends, xid=XidConfig(enabled=False), tick_s=0.05,
                        preflight_wait_s=5.0)
    from dataclasses import replace

    return replace(base, **changes)


def wsgi(app: Any, path: str, method: str = "GET", body_length: int = 0,
         ) -> tuple[int, dict[str, str], bytes]:
    """Call a WSGI app without a socket."""
    p, _, q = path.partition("?")
    environ = {"REQUEST_METHOD": method, "PATH_INFO": p, "QUERY_STRING": q,
               "CONTENT_LENGTH": str(body_length), "wsgi.input": None}
    got: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]]) -> None:
        got["status"], got["headers"] = int(status.split()[0]), dict(headers)

    body = b"".join(app(environ, start_response))
    return got["status"], got["headers"], body


def write_config(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# The one daemon config of the tests and benchmarks, by TOML table ("" is the top level):
# quick ticks, host/nvml/cuda on short intervals, jax/iree off, a fast XID watcher heartbeat.
DAEMON_CONFIG: dict[str, dict[str, Any]] = {
    "": {},
    "scheduler": {"tick_s": 0.05, "jitter_ratio": 0.05, "backoff_max_s": 2},
    "backends.host": {"interval_s": 5},
    "backends.nvml": {"interval_s": 0.5, "deadline_s": 10},
    "backends.cuda": {"interval_s": 2},
    "backends.jax": {"enabled": False},
    "backends.iree": {"enabled": False},
    "xid": {"heartbeat_s": 0.2, "telemetry_s": 1, "gap_warning_s": 5},
}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value)  # numbers and (simple) strings are the same in TOML


def daemon_toml(changes: Mapping[str, Mapping[str, Any]] | None = None) -> str:
    """DAEMON_CONFIG as TOML with ``changes`` merged in per table (None: leave the key out)."""
    tables = {name: dict(keys) for name, keys in DAEMON_CONFIG.items()}
    for name, keys in (changes or {}).items():
        tables.setdefault(name, {}).update(keys)
    lines: list[str] = []
    for name, keys in tables.items():
        if name:
            lines.append(f"[{name}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in keys.items() if v is not None]
    return "\n".join(lines) + "\n"


class Daemon:
    """A real `gpudiag serve` child on 127.0.0.1 port 0; its stderr (JSON logs) is collected.

    ``prefix`` runs it under a wrapper that execs it (e.g. unshare: same pid).
    """

    def __init__(self, env: Mapping[str, str], config: Path, state_dir: Path,
                 extra_args: tuple[str, ...] = (), prefix: tuple[str, ...] = ()) -> None:
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "gpudiag", "serve", "--listen", "127.0.0.1:0",
             "--config", str(config), "--state-dir", str(state_dir), "--log-format", "json",
             *extra_args],
            env=dict(env), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.url_ready = threading.Event()
        self.url = ""
        self.server_ms = float("nan")
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self.url_ready.wait(30):
            self.stop()
            raise AssertionError("daemon did not start:\n" + "\n".join(self.lines[-40:]))

    @classmethod
    def ready(cls, env: Mapping[str, str], config: Path, state_dir: Path,
              timeout: float = 60, **kwargs: Any) -> Daemon:
        """A daemon started and ready (``/readyz``); stopped when it never gets there."""
        daemon = cls(env, config, state_dir, **kwargs)
        try:
            daemon.wait_ready(timeout)
        except BaseException:
            daemon.stop()
            raise
        return daemon

    @property
    def log_lines(self) -> int:
        """How many log lines the daemon has written so far."""
        return len(self.lines)

    @property
    def instance(self) -> str:
        """HOST:PORT, as Prometheus labels the target."""
        return self.url.removeprefix("http://")

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            if not self.url:
                try:
                    url = json.loads(line).get("url")
                except (ValueError, AttributeError):
                    url = None
                if url:
                    self.url = str(url)
                    self.url_ready.set()

    def get(self, path: str, timeout: float = 30) -> tuple[int, Any]:
        """GET path; (status, JSON or text)."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                status, data, headers = r.status, r.read(), r.headers
        except urllib.error.HTTPError as e:
            status, data, headers = e.code, e.read(), e.headers
        timing = str(headers.get("Server-Timing") or "")
        self.server_ms = float(timing.partition("dur=")[2] or "nan")
        text = data.decode(errors="replace")
        try:
            return status, json.loads(text)
        except ValueError:
            return status, text

    def wait_ready(self, timeout: float = 20) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.get("/readyz")[0] == 200:
                return
            time.sleep(0.05)
        raise AssertionError("daemon never became ready:\n" + "\n".join(self.lines[-30:]))

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._reader.join(5)
        return int(self.proc.returncode)


def wait_for(predicate: Any, timeout: float, interval: float = 0.05) -> Any:
    """Poll until predicate() is truthy; returns its value or raises."""
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)


class FixedWatcher:
    """A WatcherSource with a fixed state (the supervisor itself is tested elsewhere)."""

    def __init__(self, state: WatcherState) -> None:
        self._state = state

    def state(self) -> WatcherState:
        return self._state


def snapshot_of(runs: Runs, watcher: WatcherState | None = None) -> Snapshot:
    sched = Scheduler(quick_config(), runner=Replay(dict(runs)), env={},
                      watcher=FixedWatcher(watcher) if watcher else None)
    try:
        sched.start()
        snapshot: Snapshot = wait_for(lambda: (s := sched.snapshot()).round_complete and s, 5)
        return snapshot
    finally:
        sched.stop()


def metric_samples(daemon: Daemon, name: str) -> list[tuple[dict[str, str], float]]:
    """``name``'s samples (labels, value) in the daemon's /metrics."""
    status, text = daemon.get("/metrics")
    assert status == 200
    return [(s.labels, s.value) for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == name]


def qualification_outcomes(daemon: Daemon) -> dict[str, str]:
    """GPU -> the code of its last qualification outcome (the series that is 1)."""
    return {lab["gpu"]: lab["code"] for lab, v in
            metric_samples(daemon, "gpudiag_gpu_qualification_outcome") if v == 1}
