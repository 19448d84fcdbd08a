"""A run's numbers for the node's daemon: its GPU meter and its refusal.

- ``JobMeter``: the ``gpudiag.probes.job_meter`` child beside the job (NVML only, no CUDA
  context): energy from the total energy counter start to end, peak memory used and the
  throttle reasons seen, per physical GPU; the closeout's ``gpu_usage``.
- ``report_block``: a refused run's word to the daemon it asked, on its unix socket (``POST
  /v1/runs/blocked``), else a ``gpudiag.block/1`` record into the job-closeouts inbox (counted
  only when root wrote it): ``gpudiag_preflight_blocks_total{code}``.
Each is best effort: without a daemon (no state directory) or without NVML the run goes on
and its closeout says what is missing.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gpudiag.core.attribution import JOB_INBOX
from gpudiag.core.environment import probe_environment
from gpudiag.core.fileio import atomic_write
from gpudiag.core.usage import BlockRecord, GpuUsage, usages_of
from gpudiag.engine.announce import block_run
from gpudiag.engine.statedir import default_state_dir
from gpudiag.runner.attribution import RunWatcher, _prctl_subreaper

METER_START_S = 10.0  # Python, pynvml and nvmlInit; a hung driver must not hold the job
METER_STOP_S = 5.0
METER_INTERVAL_S = 0.5


def _read_line(proc: subprocess.Popen[bytes], kind: str, timeout_s: float) -> dict[str, Any]:
    """The child's next JSON line of ``kind`` (others are skipped); {} on timeout or EOF."""
    assert proc.stdout is not None
    end = time.monotonic() + timeout_s
    buf = b""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < end:
            if not sel.select(max(0.0, end - time.monotonic())):
                break
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            *lines, buf = (buf + chunk).split(b"\n")
            for line in lines:
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                if isinstance(msg, dict) and msg.get("type") == kind:
                    return msg
    return {}


class JobMeter:
    """The meter child of one run; ``stop()`` gives each GPU's usage."""

    def __init__(self, gpus: Sequence[str], env: Mapping[str, str],
                 interval_s: float = METER_INTERVAL_S) -> None:
        self.gpus = list(dict.fromkeys(gpus))
        self._env = probe_environment(env)
        self._interval_s = interval_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._pid: int | None = None  # the meter's own (the detach helper's child)
        self.start_error: str | None = None

    def _kill(self) -> None:
        """End the meter if it still runs and close the pipes to it."""
        if self._pid is not None:
            with contextlib.suppress(OSError):
                os.kill(self._pid, signal.SIGKILL)
            self._pid = None
        proc = self._proc
        if proc is not None:
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1.0)

    def start(self, timeout_s: float = METER_START_S) -> None:
        """Start the meter and wait until it took its start readings."""
        if not self.gpus:
            return
        options = json.dumps({"gpus": self.gpus, "interval_s": self._interval_s})
        # Detached, as the run's XID watcher is: `gpudiag run` waits for every process of the
        # job's tree, and the meter must outlive the job's last one to take its end reading.
        argv = [sys.executable, "-m", "gpudiag.runner.detach",
                sys.executable, "-m", "gpudiag.probes.job_meter", options]
        was = _prctl_subreaper(None)
        if was:
            _prctl_subreaper(0)  # the orphan must go to init, not come back to this process
        try:
            self._proc = subprocess.Popen(  # noqa: S603 - fixed argv, no shell
                argv, env=self._env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, close_fds=True)
            self._pid = RunWatcher._read_pid(self._proc, timeout_s)
            self._proc.wait(timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired, ValueError) as e:
            self.start_error = f"the GPU meter could not be started: {e}"
            self._kill()
            return
        finally:
            if was:
                _prctl_subreaper(1)
        if not _read_line(self._proc, "ready", timeout_s):
            # usage also ends the wait: NVML was not usable and it said so at once.
            self.start_error = f"the GPU meter said nothing within {timeout_s:g} s"

    def stop(self, timeout_s: float = METER_STOP_S) -> tuple[GpuUsage, ...]:
        """End the meter (close its stdin) and read each GPU's usage."""
        proc = self._proc
        if proc is None:
            why = self.start_error or "no GPU"
            return tuple(GpuUsage(u, why_missing=why) for u in self.gpus)
        with contextlib.suppress(OSError):
            assert proc.stdin is not None
            proc.stdin.close()
        msg = _read_line(proc, "usage", timeout_s)
        self._kill()
        self._proc = None
        found = {u.uuid: u for u in usages_of(msg.get("gpus"))}
        why = self.start_error or "the GPU meter gave no reading"
        return tuple(found.get(u) or GpuUsage(u, why_missing=why) for u in self.gpus)


def _is_dir(path: Path) -> bool:
    """Whether ``path`` is a folder; False when it cannot even be examined (a state folder
    this user may not search: EACCES): a best-effort record is skipped, the run goes on."""
    try:
        return path.is_dir()
    except OSError:
        return False


def report_block(code: str, codes: Sequence[str], env: Mapping[str, str],
                 daemon_url: str | None = None) -> str | None:
    """Tell the node's daemon that gpudiag refused this run: on ``daemon_url``'s unix
    socket ("socket"), else into its inbox (the file's path); None when neither took it."""
    slurm_job_id = env.get("SLURM_JOB_ID") or None
    if daemon_url is not None and daemon_url.startswith("unix:"):
        counted, _why = block_run(daemon_url, code, codes, slurm_job_id, env)
        if counted:
            return "socket"
    folder = default_state_dir(env) / JOB_INBOX
    if not _is_dir(folder):
        return None
    record = BlockRecord(os.getpid(), code, tuple(codes), time.time(), slurm_job_id)
    try:
        final = atomic_write(folder / f"{time.time_ns()}-{record.pid}-block.json",
                             json.dumps(record.record()) + "\n", 0o600)
    except OSError:
        return None
    return str(final)
