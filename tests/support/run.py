"""`gpudiag run` as a user runs it (tests of the runner and of failure attribution): with no
daemon to ask, or on a fake host whose state a test changes while the run runs (`Rig`); a job
record as the runner writes one (`job_record`)."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpudiag.core.attribution import JobEvent, JobRecord, Source, Window, attribute
from tests.fakes.build import FakeDriver, write_state_file
from tests.support.daemon import Daemon, host_env
from tests.support.host import run_gpudiag

# The GPU a job record names (the fake host's GPU 0).
GPU = "GPU-f00d0000-0000-4000-8000-000000000000"

# Nothing listens on the discard port: no daemon a developer runs can answer these tests.
NO_DAEMON = "http://127.0.0.1:9"


def gpudiag_run(args: list[str], env: dict[str, str], artifacts: Path, timeout: float = 60
                ) -> subprocess.CompletedProcess[str]:
    env = dict(env)
    env.setdefault("GPUDIAG_DAEMON_URL", NO_DAEMON)
    return run_gpudiag(["run", "--artifacts", str(artifacts), *args], env, timeout)


def run_folder(artifacts: Path) -> Path:
    """The one run folder (``STAMP-xxxxxxxx``) that a `gpudiag run --artifacts DIR` made in DIR."""
    runs = [p for p in artifacts.iterdir() if p.is_dir()]
    assert len(runs) == 1, f"{artifacts} holds {len(runs)} run folders: {runs}"
    return runs[0]


class Rig:
    """A fake host with a state file that tests change while a run runs."""

    def __init__(self, fakes: FakeDriver, root: Path) -> None:
        self.state_file = root / "gpu-state"
        self.knobs: dict[str, str | int] = {"FAKE_NVML_DEVICE_COUNT": 2}
        write_state_file(self.state_file, self.knobs)
        self.state_dir = root / "state"
        self.state_dir.mkdir()
        self.env = host_env(fakes, root / "host", gpus=2,
                            FAKE_GPU_STATE_FILE=str(self.state_file),
                            GPUDIAG_STATE_DIR=str(self.state_dir))
        self.root = root
        self.runs = 0
        self.pending: tuple[float, dict[str, str | int]] | None = None

    def later(self, delay_s: float, **knobs: str | int) -> None:
        """Set ``knobs`` in the state file ``delay_s`` after the next run's job started."""
        self.pending = (delay_s, knobs)

    def _inject(self, artifacts: Path, delay_s: float, knobs: dict[str, str | int]) -> None:
        # stdout.log is opened right after the job started: the fault is surely mid-run.
        deadline = time.monotonic() + 60
        while not any(artifacts.glob("*/stdout.log")) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(delay_s)
        write_state_file(self.state_file, {**self.knobs, **knobs})

    def run(self, *argv: str, daemon: Daemon | None = None, url: str | None = None
            ) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], str]:
        """`gpudiag run` on one GPU; (process, closeout.json, closeout.txt). ``url``: the
        daemon's address to ask (its unix socket, where a run is attested), else its TCP."""
        self.runs += 1
        artifacts = self.root / f"run{self.runs}"
        where = ["--daemon-url", url or daemon.url] if daemon else ["--no-daemon"]
        injector = None
        if self.pending is not None:
            injector = threading.Thread(target=self._inject, args=(artifacts, *self.pending))
            injector.start()
            self.pending = None
        proc = run_gpudiag(["run", "--gpus", "1", "--artifacts", str(artifacts), *where,
                            "--", *argv], self.env)
        if injector is not None:
            injector.join()
        closeout = json.loads((run_folder(artifacts) / "closeout.json").read_text())
        self.last = run_folder(artifacts)
        return proc, closeout, (run_folder(artifacts) / "closeout.txt").read_text()

    def explain_agrees(self, closeout: Mapping[str, Any], source: str) -> dict[str, Any]:
        """`gpudiag explain --pid` (the job's pid) and `--run` say what the closeout said."""
        child_pid = json.loads((self.last / "result.json").read_text())["pid"]
        answer = self.explain("--pid", str(child_pid))
        assert answer["source"] == source
        assert decided(answer["attribution"]) == decided(closeout["attribution"])
        assert answer["job"]["child_pid"] == child_pid
        by_run = self.explain("--run", str(self.last))
        assert decided(by_run["attribution"]) == decided(closeout["attribution"])
        return answer

    def explain(self, *args: str) -> dict[str, Any]:
        proc = run_gpudiag(["explain", *args, "--format", "json"], self.env)
        assert proc.returncode == 0, proc.stderr
        return dict(json.loads(proc.stdout))


def decided(a: Mapping[str, Any]) -> tuple[str, str, list[Any]]:
    """What an attribution decided: its kind, rule and events (xid, code, gpu)."""
    return a["kind"], a["rule"], [(e["xid"], e["code"], e["gpu"]) for e in a["events"]]


def job_record(pid: int, events: list[JobEvent], exit_code: int = 1, slurm: str | None = None,
         started: float = 100.0) -> JobRecord:
    window = Window(started, started + 10, frozenset({GPU}))
    got = attribute(exit_code, window, events, [Source("run watcher", True)])
    return JobRecord(pid, pid + 1, ("python", "train.py"), slurm, "node1", window.start,
                     window.end, exit_code, (GPU,), got, None)
