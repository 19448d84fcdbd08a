"""Other people's jobs on the fake GPUs, and the fake CUDA driver's context log.

:class:`FakeJobs` makes jobs come and go on fake GPUs while gpudiag runs: each job is a real
sleeping process (a real PID, detached so that it is not in the caller's process tree), published
to the fakes through the ``FAKE_GPU_STATE_FILE`` it owns (``FAKE_NVML_PROCESSES``,
``FAKE_NVML_COMPUTE_MODE``, ``FAKE_NVML_MEMORY_USED_MIB``), which every fake re-reads while it
runs. The fake libcuda then refuses contexts on those GPUs as the real driver would (see
fake_cuda.c): 46 in EXCLUSIVE_PROCESS mode, out of memory when a job leaves too little free.

:func:`read_context_log` parses the ``FAKE_CUDA_CONTEXT_LOG`` written by the fake libcuda (one
JSON line per context creation attempt and per device allocation, from every process), and
:meth:`FakeJobs.contexts_while_busy` names the attempts made on a GPU while a job held it::

    with FakeJobs(tmp / "state", compute_modes={0: 3}) as jobs:
        env = driver.env(FAKE_GPU_STATE_FILE=jobs.state_file, FAKE_CUDA_CONTEXT_LOG=log)
        job = jobs.start(0, memory_mib=70_000)   # GPU 0 busy from here ...
        ...                                       # run the daemon on env
        jobs.stop(job)                            # ... to here
        assert jobs.contexts_while_busy(read_context_log(log)) == []
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tests.fakes.build import write_state_file

__all__ = ["DeviceEvent", "FakeJob", "FakeJobs", "read_context_log"]

#: The state-file keys a FakeJobs owns: it always writes them, so the environment's values of
#: these knobs never apply while it runs (give them to FakeJobs instead).
OWNED_KNOBS = ("FAKE_NVML_PROCESSES", "FAKE_NVML_COMPUTE_MODE", "FAKE_NVML_MEMORY_USED_MIB")

#: Environment variable set in every job process (find leftovers with processes_with_env).
JOB_MARKER = "GPUDIAG_FAKE_JOB"

# The job launcher: started through a short-lived intermediate that exits at once, so that it
# and the jobs it forks are re-parented away from the caller (nobody's descendants in the caller's
# process tree). It forks a `sleep` per "start" and kills and reaps it on "stop PID", so that no
# zombie stays behind; at EOF on its stdin (FakeJobs closed, or the test process died) it ends
# every job it started and exits.
_LAUNCHER = """
import os, signal, sys
if os.fork():
    os._exit(0)
os.setsid()
null = os.open(os.devnull, os.O_RDWR)
jobs = set()
while True:
    line = sys.stdin.readline()
    if not line:
        break
    cmd = line.split()
    if cmd[0] == "start":
        pid = os.fork()
        if pid == 0:
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.execvp("sleep", ["sleep", sys.argv[1]])
        jobs.add(pid)
        print(pid, flush=True)
    elif cmd[0] == "stop":
        pid = int(cmd[1])
        if pid in jobs:
            jobs.discard(pid)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        print("stopped", pid, flush=True)
for pid in jobs:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
"""


def _device_key(device: int | str) -> str:
    """Normalises "IDX" or "IDX.J" (an int is a whole GPU); raises ValueError otherwise."""
    text = str(device).strip()
    parts = text.split(".")
    if len(parts) > 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"a fake GPU is IDX or IDX.J (a MIG instance), not {device!r}")
    return ".".join(str(int(p)) for p in parts)


def _gpu_of(key: str) -> int:
    return int(key.split(".")[0])


@dataclass(frozen=True)
class FakeJob:
    """One job: a sleeping process on a fake GPU (``"IDX"``) or MIG instance (``"IDX.J"``).

    ``started_at`` is the Unix time just before the fakes could first see the job,
    ``stopped_at`` the time just after they could no longer see it (None while it runs).
    """

    device: str
    pid: int
    memory_mib: int
    started_at: float
    stopped_at: float | None = None

    @property
    def gpu(self) -> int:
        """Physical GPU index."""
        return _gpu_of(self.device)

    @property
    def mig(self) -> int | None:
        """MIG instance index, None for a whole-GPU job."""
        parts = self.device.split(".")
        return int(parts[1]) if len(parts) == 2 else None

    def held_at(self, t: float, grace_s: float = 0.0) -> bool:
        """True when the job was on its GPU at Unix time ``t`` (and had been for ``grace_s``)."""
        return self.started_at + grace_s <= t and (self.stopped_at is None or t <= self.stopped_at)


@dataclass(frozen=True)
class DeviceEvent:
    """One line of the fake libcuda's FAKE_CUDA_CONTEXT_LOG."""

    event: str  # "context" (a creation attempt), "alloc" (a device allocation) or "copy"
    call: str | None  # the driver entry point, e.g. "cuCtxCreate_v2"
    pid: int
    ordinal: int  # the device ordinal the caller used
    gpu: int  # the physical GPU it maps to
    mig: int | None
    uuid: str  # the device's full GPU- or MIG- UUID
    gpu_uuid: str  # the physical GPU's full UUID
    result: int  # CUresult: 0 success, 46 device unavailable, 2 out of memory, ...
    time: float  # Unix seconds
    cuda_visible_devices: str | None
    bytes: int | None = None  # allocations only

    @property
    def ok(self) -> bool:
        """True when the driver call succeeded (a context or allocation now exists)."""
        return self.result == 0

    @classmethod
    def from_json(cls, record: Mapping[str, Any]) -> DeviceEvent:
        """Builds an event from one parsed log line."""
        return cls(
            event=str(record["event"]), call=record.get("call"), pid=int(record["pid"]),
            ordinal=int(record["ordinal"]), gpu=int(record["gpu"]),
            mig=None if record.get("mig") is None else int(record["mig"]),
            uuid=str(record["uuid"]), gpu_uuid=str(record["gpu_uuid"]),
            result=int(record["result"]), time=float(record["time"]),
            cuda_visible_devices=record.get("cuda_visible_devices"),
            bytes=None if record.get("bytes") is None else int(record["bytes"]),
        )


def read_context_log(path: Path | str, *, event: str | None = "context") -> list[DeviceEvent]:
    """The log's events in order (only ``event`` ones; None for all); [] when there is no log.

    A last line without its newline is still being written and is left out.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    lines = text.split("\n")[:-1]  # whatever follows the last newline is incomplete
    events = [DeviceEvent.from_json(json.loads(line)) for line in lines if line.strip()]
    return [e for e in events if event is None or e.event == event]


class FakeJobs:
    """Starts and stops other people's jobs on fake GPUs through one FAKE_GPU_STATE_FILE.

    ``knobs`` are further state-file knobs written with every update (change them with
    :meth:`set_knobs`); ``compute_modes`` maps a physical GPU to its NVML compute mode (3 is
    EXCLUSIVE_PROCESS); ``memory_used_mib`` is a GPU's (``"IDX[.J]"``) used memory besides the
    jobs'. Jobs are real ``sleep`` processes (ending by themselves after ``lifetime_s``), started
    by a detached launcher that ends them all when this object is closed or its process dies.
    Use as a context manager: leaving it stops every job and leaves the state file with
    ``knobs`` and no job.

    The state file is written at once and always holds the three OWNED_KNOBS, so the
    environment's values of those knobs never apply; point the processes under test at it with
    ``FAKE_GPU_STATE_FILE=jobs.state_file``.
    """

    def __init__(
        self,
        state_file: Path | str,
        *,
        knobs: Mapping[str, str | int] | None = None,
        compute_modes: Mapping[int, int] | None = None,
        memory_used_mib: Mapping[int | str, int] | None = None,
        lifetime_s: float = 600.0,
    ) -> None:
        self.state_file = Path(state_file)
        self._knobs = self._checked_knobs(knobs or {})
        self._modes = {int(g): int(m) for g, m in (compute_modes or {}).items()}
        self._baseline = {_device_key(d): int(m) for d, m in (memory_used_mib or {}).items()}
        self._lifetime_s = lifetime_s
        self._lock = threading.RLock()
        self._running: list[FakeJob] = []
        self._history: list[FakeJob] = []
        self._children: dict[int, subprocess.Popen[bytes]] = {}
        self._launcher: subprocess.Popen[str] | None = None
        self._publish()

    # ---- the jobs ------------------------------------------------------------------------

    def start(self, device: int | str, *, memory_mib: int = 1024,
              detach: bool = True) -> FakeJob:
        """Starts a job on ``device`` (``IDX`` or ``"IDX.J"``) using ``memory_mib`` of it.

        With ``detach=False`` the job is a plain child of this process (in the caller's process
        tree), to test that gpudiag does not count its own tree's processes as foreign.
        """
        key = _device_key(device)
        if memory_mib < 0:
            raise ValueError(f"memory_mib must be >= 0, not {memory_mib}")
        pid = self._spawn(detach)
        with self._lock:
            job = FakeJob(device=key, pid=pid, memory_mib=memory_mib, started_at=time.time())
            self._running.append(job)
            self._publish()
        return job

    def stop(self, job: FakeJob) -> FakeJob:
        """Ends the job: the fakes stop listing it, then its process is killed."""
        with self._lock:
            current = next((j for j in self._running if j.pid == job.pid), None)
            if current is None:
                raise ValueError(f"job {job.pid} on GPU {job.device} is not running")
            self._running.remove(current)
            self._publish()
            done = replace(current, stopped_at=time.time())
            self._history.append(done)
        self._kill(done)
        return done

    def stop_all(self) -> None:
        """Stops every running job."""
        with self._lock:
            running = list(self._running)
        for job in running:
            self.stop(job)

    @property
    def running(self) -> tuple[FakeJob, ...]:
        """The jobs running now, oldest first."""
        with self._lock:
            return tuple(self._running)

    @property
    def history(self) -> tuple[FakeJob, ...]:
        """Every job started so far (stopped ones with ``stopped_at``), in start order."""
        with self._lock:
            return tuple(sorted([*self._history, *self._running], key=lambda j: j.started_at))

    def busy(self, gpu: int, mig: int | None = None, at: float | None = None,
             grace_s: float = 0.0) -> bool:
        """True when a job held the device at Unix time ``at`` (default: now).

        A whole GPU is busy when a job is on it or on any of its MIG instances; a MIG instance
        when a job is on it or on the whole GPU. A job counts from ``grace_s`` after its start.
        """
        t = time.time() if at is None else at
        for job in self.history:
            if job.gpu != gpu or not job.held_at(t, grace_s):
                continue
            if mig is None or job.mig is None or job.mig == mig:
                return True
        return False

    def contexts_while_busy(self, events: Iterable[DeviceEvent],
                            grace_s: float = 0.0) -> list[DeviceEvent]:
        """The context attempts (any result) made on a device while a job held it.

        An attempt within ``grace_s`` after a job started is excused: a probe that saw the GPU
        free just before the job arrived cannot have known.
        """
        return [e for e in events
                if e.event == "context" and self.busy(e.gpu, e.mig, at=e.time, grace_s=grace_s)]

    # ---- the node's settings -------------------------------------------------------------

    def set_compute_mode(self, gpu: int, mode: int | None) -> None:
        """Sets a physical GPU's NVML compute mode (None: back to DEFAULT)."""
        with self._lock:
            if mode is None:
                self._modes.pop(int(gpu), None)
            else:
                self._modes[int(gpu)] = int(mode)
            self._publish()

    def set_knobs(self, **knobs: str | int | None) -> None:
        """Adds, changes or (with None) removes other state-file knobs."""
        with self._lock:
            merged: dict[str, str | int] = dict(self._knobs)
            for key, value in knobs.items():
                if value is None:
                    merged.pop(key, None)
                else:
                    merged[key] = value
            self._knobs = self._checked_knobs(merged)
            self._publish()

    def close(self) -> None:
        """Stops every job and leaves the state file with the other knobs only."""
        with self._lock:
            self.stop_all()
            launcher, self._launcher = self._launcher, None
        if launcher is not None and launcher.stdin is not None and launcher.stdout is not None:
            launcher.stdin.close()  # EOF: the launcher exits
            launcher.stdout.read()
            launcher.stdout.close()

    def __enter__(self) -> FakeJobs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals -----------------------------------------------------------------------

    @staticmethod
    def _checked_knobs(knobs: Mapping[str, str | int]) -> dict[str, str | int]:
        owned = sorted(set(knobs) & set(OWNED_KNOBS))
        if owned:
            raise ValueError(f"FakeJobs writes {', '.join(owned)} itself: pass compute_modes, "
                             "memory_used_mib or jobs instead")
        return dict(knobs)

    def _state(self) -> dict[str, str | int]:
        used = dict(self._baseline)
        for job in self._running:
            used[job.device] = used.get(job.device, 0) + job.memory_mib
            if job.mig is not None:  # the whole GPU's used memory includes its instances'
                used[str(job.gpu)] = used.get(str(job.gpu), 0) + job.memory_mib
        return {
            **self._knobs,
            "FAKE_NVML_PROCESSES": ",".join(
                f"{j.device}:{j.pid}:{j.memory_mib}" for j in self._running),
            "FAKE_NVML_COMPUTE_MODE": ",".join(f"{g}:{m}" for g, m in sorted(self._modes.items())),
            "FAKE_NVML_MEMORY_USED_MIB": ",".join(f"{d}:{m}" for d, m in sorted(used.items())),
        }

    def _publish(self) -> None:
        with self._lock:
            write_state_file(self.state_file, self._state())

    def _spawn(self, detach: bool) -> int:
        env = {**os.environ, JOB_MARKER: str(self.state_file)}
        lifetime = str(max(1, int(self._lifetime_s)))
        if not detach:
            proc = subprocess.Popen(["sleep", lifetime], env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self._children[proc.pid] = proc
            return proc.pid
        with self._lock:
            if self._launcher is None:
                self._launcher = subprocess.Popen(
                    [sys.executable, "-c", _LAUNCHER, lifetime], env=env, text=True,
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                self._launcher.wait(timeout=30)  # the intermediate; the launcher lives on
            return int(self._ask("start"))

    def _ask(self, command: str) -> str:
        with self._lock:  # one command and its answer at a time
            launcher = self._launcher
            assert launcher is not None and launcher.stdin and launcher.stdout
            launcher.stdin.write(command + "\n")
            launcher.stdin.flush()
            answer = launcher.stdout.readline()
        if not answer:
            raise RuntimeError(f"the fake job launcher ended before answering {command!r}")
        return answer.strip()

    def _kill(self, job: FakeJob) -> None:
        child = self._children.pop(job.pid, None)
        if child is not None:
            child.kill()
            child.wait()
        else:
            self._ask(f"stop {job.pid}")  # killed and reaped once this answers
