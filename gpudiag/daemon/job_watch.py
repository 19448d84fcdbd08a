"""The job watch (issue 53): a part of the daemon naming a hung collective or a straggling GPU.

Over the runs the daemon attested (daemon/runs.py: each open run's id and GPUs is all this
part asks), once every ``[jobs] interval_s``, the NVML readings of each run's GPUs come from
one long-lived child (``python -m gpudiag.probes.job_watch``; the daemon never loads
libnvidia-ml), started when the first run opens and ended when the last one ends, so an idle
daemon pays nothing. The rules are core/job_watch.py's. What the part gives the daemon:

- ``start()``/``stop()``; its thread follows the open runs and supervises the child;
- ``collector()``: ``gpudiag_job_stalled{run}``, ``gpudiag_gpu_straggler_suspect{run,uuid}``
  (a series per open run and its GPUs only: at most runs.MAX_OPEN_RUNS runs) and
  ``gpudiag_job_watch_running``;
- ``evidence()``: the ``runs`` object of /v1/health's evidence (with a version that moves);
- ``keeping(keep)``: the job record of a run, kept with its warnings (the run's closeout in
  the history, which ``gpudiag explain`` reads); ``end_notes(run_id)``: the same warnings in
  the answer to ``POST /v1/runs/end``, which the run writes into its closeout.
Warnings only: nothing here sets a blocker, changes a verdict or drains a node.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import replace
from typing import IO, Any, Protocol

from prometheus_client.core import GaugeMetricFamily

from gpudiag.core.attribution import JobRecord
from gpudiag.core.job_watch import GpuSample, JobWatchPolicy, RunWarning, RunWatch
from gpudiag.core.records import dataclass
from gpudiag.daemon.collectors import StateCollector

log = logging.getLogger("gpudiag.daemon.job_watch")
ENDED_KEPT = 256  # ended runs whose warnings an /end answer or a late record may still ask
LINE_LIMIT = 1 << 20
BACKOFF_MAX_S = 60.0
# With no run open, the open runs are looked at this often (at most ten intervals): an idle
# daemon's thread wakes rarely, and a run's first sample comes within seconds of its begin,
# far inside any stall or straggler window.
IDLE_POLL_S = 5.0
# What a run's job record is kept with (daemon/closeouts.py's Keep): record, uid, how, run id.
Keep = Callable[[JobRecord, int, "str | None", "str | None"], bool]


class WatchedRun(Protocol):
    """What the watch needs of an open run: its id and the GPUs it holds."""

    @property
    def id(self) -> str: ...

    @property
    def gpus(self) -> tuple[str, ...]: ...


@dataclass(frozen=True)
class WatchState:
    """What a scrape shows: per open run, stalled now and its straggling GPUs."""

    running: bool
    runs: tuple[tuple[str, tuple[str, ...], bool, tuple[str, ...]], ...] = ()


def watch_argv(policy: JobWatchPolicy) -> list[str]:
    """The child's argv: no shell, options as one JSON argument."""
    return [sys.executable, "-m", "gpudiag.probes.job_watch",
            json.dumps({"interval_s": policy.interval_s})]


class JobWatch:
    """The job watch part: follows the open runs, feeds their samples to the rules."""

    def __init__(self, policy: JobWatchPolicy, env: Mapping[str, str],
                 open_runs: Callable[[], Iterable[WatchedRun]], *,
                 argv: list[str] | None = None) -> None:
        self.policy = policy
        self._env = dict(env)
        self._open_runs = open_runs
        self._argv = argv or watch_argv(policy)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._sent: tuple[str, ...] = ()
        self._watches: dict[str, RunWatch] = {}
        self._ended: OrderedDict[str, tuple[RunWarning, ...]] = OrderedDict()
        self._version = 0
        self._error: str | None = None
        self._backoff_until = 0.0
        self._backoff_s = 0.5

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start following the runs (nothing when ``[jobs] enabled = false``)."""
        if not self.policy.enabled:
            return
        self._thread = threading.Thread(target=self._loop, name="job-watch", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and the child."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)  # it wakes within an interval, then ends the child
        self._end_child()

    # -- what the daemon shows ---------------------------------------------------------------
    def warnings(self, run_id: str) -> tuple[RunWarning, ...]:
        """The run's warnings so far (open, or ended a short while ago)."""
        with self._lock:
            watch = self._watches.get(run_id)
            if watch is not None:
                return tuple(watch.warnings)
            return self._ended.get(run_id, ())

    def end_notes(self, run_id: str) -> dict[str, Any]:
        """What the answer to ``POST /v1/runs/end`` adds: the run's warnings."""
        return {"warnings": [w.record() for w in self.warnings(run_id)]}

    def keeping(self, keep: Keep) -> Keep:
        """``keep`` with the run's warnings added to its job record first."""
        def keep_with_warnings(job: JobRecord, uid: int, how: str | None,
                               run_id: str | None) -> bool:
            found = self.warnings(run_id) if run_id is not None else ()
            return keep(replace(job, warnings=found) if found else job, uid, how, run_id)
        return keep_with_warnings

    def state(self) -> WatchState:
        """What /metrics shows now."""
        with self._lock:
            runs = tuple((w.run_id, w.gpus, w.stalled_now, tuple(sorted(w.stragglers_now())))
                         for w in self._watches.values())
            return WatchState(self._proc is not None, runs)

    def evidence(self) -> tuple[int, dict[str, Any]]:
        """The ``runs`` object of /v1/health's evidence, and its version."""
        with self._lock:
            return self._version, {
                "watch": {"enabled": self.policy.enabled, "sampling": self._proc is not None,
                          "error": self._error, "interval_s": self.policy.interval_s,
                          "stall_after_s": self.policy.stall_after_s,
                          "straggler_after_s": self.policy.straggler_after_s},
                "open": [w.evidence() for w in self._watches.values()]}

    def collector(self) -> JobWatchCollector:
        """Its metrics, read at each scrape."""
        return JobWatchCollector(self.state)

    # -- the loop ----------------------------------------------------------------------------
    def _loop(self) -> None:
        buf = b""
        while not self._stop.is_set():
            try:
                want = self._follow_runs()
                proc = self._child(want)
                if proc is None:
                    idle = min(IDLE_POLL_S, 10 * self.policy.interval_s)
                    self._stop.wait(self.policy.interval_s if want else idle)
                    continue
                buf = self._read(proc, buf)
            except Exception:  # a bug of ours: said, and the watch goes on
                log.exception("job watch: round failed")
                self._stop.wait(self.policy.interval_s)
        self._end_child()

    def _follow_runs(self) -> tuple[str, ...]:
        """Watch the open runs (new ones start, ended ones keep their warnings a while);
        the physical GPUs to sample (MIG leaves have no utilization of their own)."""
        runs = {r.id: tuple(g for g in r.gpus if g.startswith("GPU-"))
                for r in self._open_runs()}
        with self._lock:
            for run_id in [r for r in self._watches if r not in runs]:
                watch = self._watches.pop(run_id)
                self._ended[run_id] = tuple(watch.warnings)
                while len(self._ended) > ENDED_KEPT:
                    self._ended.popitem(last=False)
                self._version += 1
            for run_id, gpus in runs.items():
                if run_id not in self._watches and gpus:
                    self._watches[run_id] = RunWatch(run_id, gpus, self.policy)
                    self._version += 1
            return tuple(sorted({g for w in self._watches.values() for g in w.gpus}))

    def _child(self, want: tuple[str, ...]) -> subprocess.Popen[bytes] | None:
        """The child sampling ``want`` (started, told or ended as needed); None: none now."""
        proc = self._proc
        if not want:
            if proc is not None:
                self._end_child()
            return None
        if proc is not None and proc.poll() is not None:
            self._went_down(f"the job watch child exited (status {proc.returncode})")
            proc = None
        if proc is None:
            if time.monotonic() < self._backoff_until:
                return None
            try:
                proc = subprocess.Popen(  # noqa: S603 - fixed argv, no shell
                    self._argv, env=self._env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
            except OSError as e:
                self._went_down(f"could not start the job watch child: {e}")
                return None
            with self._lock:
                self._proc, self._sent = proc, ()
        if want != self._sent:
            assert proc.stdin is not None
            try:
                proc.stdin.write(json.dumps({"gpus": list(want)}).encode() + b"\n")
                proc.stdin.flush()
            except OSError as e:
                self._went_down(f"the job watch child stopped reading: {e}")
                return None
            self._sent = want
        return proc

    def _read(self, proc: subprocess.Popen[bytes], buf: bytes) -> bytes:
        """Take the child's lines for about one interval; the partial line left over."""
        assert proc.stdout is not None
        out: IO[bytes] = proc.stdout
        with selectors.DefaultSelector() as sel:
            sel.register(out, selectors.EVENT_READ)
            if not sel.select(timeout=self.policy.interval_s):
                return buf
        chunk = os.read(out.fileno(), 65536)
        if not chunk:
            self._went_down("the job watch child closed its output")
            return b""
        *lines, buf = (buf + chunk).split(b"\n")
        for line in lines:
            self._handle(line)
        return buf if len(buf) <= LINE_LIMIT else b""

    def _handle(self, line: bytes) -> None:
        try:
            msg = json.loads(line)
        except (ValueError, RecursionError):
            return  # a library printed to stdout: not ours
        if not isinstance(msg, dict):
            return
        if msg.get("type") == "error":
            self._went_down(str(msg.get("message"))[:500])
            return
        ts, rows = msg.get("ts"), msg.get("gpus")
        if msg.get("type") != "sample" or not isinstance(ts, (int, float)) \
                or not isinstance(rows, list):
            return
        samples = {s.uuid: s for s in map(GpuSample.from_record, rows) if s is not None}
        with self._lock:
            self._error, self._backoff_s = None, 0.5
            for watch in self._watches.values():
                before = (watch.stalled_now, len(watch.warnings))
                watch.observe(float(ts), samples)
                if (watch.stalled_now, len(watch.warnings)) != before:
                    self._say(watch, before[1])
                self._version += 1

    def _say(self, watch: RunWatch, said: int) -> None:
        """Log each new warning once (as it first crosses its time)."""
        for w in watch.warnings[said:]:
            log.warning("%s: %s", w.code, w.message,
                        extra={"run": watch.run_id, "code": w.code, "gpu": w.gpu,
                               **{k: v for k, v in w.numbers}})

    def _went_down(self, error: str) -> None:
        self._end_child()
        with self._lock:
            if error != self._error:
                log.warning("job watch: %s; retrying in %.1f s", error, self._backoff_s)
            self._error = error
            self._backoff_until = time.monotonic() + self._backoff_s
            self._backoff_s = min(self._backoff_s * 2, BACKOFF_MAX_S)
            self._version += 1

    def _end_child(self) -> None:
        with self._lock:
            proc, self._proc, self._sent = self._proc, None, ()
        if proc is None:
            return
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()  # the child ends when its stdin closes
        try:
            proc.wait(1.0)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


class JobWatchCollector(StateCollector[WatchState]):
    """``gpudiag_job_stalled{run}``, ``gpudiag_gpu_straggler_suspect{run,uuid}``,
    ``gpudiag_job_watch_running``: series for the open runs only."""

    def render(self, state: WatchState) -> Iterator[GaugeMetricFamily]:
        """The job watch's families of one state."""
        stalled = GaugeMetricFamily(
            "gpudiag_job_stalled", "1 while every GPU of the run spins at high utilization "
            "and low power past [jobs] stall_after_s (a hung collective); a series per open "
            "run.", labels=["run"])
        straggler = GaugeMetricFamily(
            "gpudiag_gpu_straggler_suspect", "1 while this GPU's SM clock or power stays "
            "below [jobs] straggler_ratio of its run's median past straggler_after_s.",
            labels=["run", "uuid"])
        running = GaugeMetricFamily(
            "gpudiag_job_watch_running", "1 while the job watch samples the open runs' GPUs "
            "(0: no run open, off, or its NVML child is down).")
        running.add_metric([], 1.0 if state.running else 0.0)
        for run_id, gpus, is_stalled, lagging in state.runs:
            stalled.add_metric([run_id], 1.0 if is_stalled else 0.0)
            for gpu in gpus:
                straggler.add_metric([run_id, gpu], 1.0 if gpu in lagging else 0.0)
        yield from (stalled, straggler, running)
