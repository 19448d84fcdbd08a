"""A run's failure attribution: evidence gathered while the job runs, the answer at its end.

Where the evidence comes from:
- the run's verdict came from the node's daemon: the daemon's history (``/v1/history``: its
  XID timeline and the blocker episodes of its probes) over the run's window;
- otherwise: the run's own XID watcher (``gpudiag.probes.xid_watch``), started detached
  before the job and stopped after it, so that it covers the whole run.
The rules themselves are pure (gpudiag.core.attribution). A run that asked a daemon on its
unix socket announces itself there once its GPUs are locked, passing its lock descriptors,
and hands its closeout over there at its end (``POST /v1/runs/begin`` and ``/end``,
gpudiag.engine.announce): its window is the kernel's word (issues 38, 49), and the record
reaches the daemon it asked whoever runs it (a non-root job cannot write into a DynamicUser
daemon's 0750 state directory). Any other run drops a ``gpudiag.job/1`` record into the
default state directory's ``job-closeouts/`` inbox: the daemon keeps it only when root wrote
it. Either way the daemon counts the run (``gpudiag_job_failures_total``), and ``gpudiag
explain --pid``/``--slurm-job`` find it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import field, replace
from typing import Any

from gpudiag.core.attribution import (
    AFTER_END_S,
    APPLICATION_KIND,
    JOB_INBOX,
    SOFTWARE_CODES,
    UNKNOWN,
    Attribution,
    JobEvent,
    JobRecord,
    Source,
    Window,
    attribute,
    history_events,
    xid_event,
)
from gpudiag.core.environment import probe_environment
from gpudiag.core.fileio import atomic_write
from gpudiag.core.observations import parse_watcher_line
from gpudiag.core.probe_run import bounded_tail
from gpudiag.core.records import dataclass
from gpudiag.core.requirement import parse_requirement
from gpudiag.core.usage import GpuUsage, merge_xids
from gpudiag.engine.announce import begin_run, end_body, end_run
from gpudiag.engine.client import DaemonUrlError, daemon_get
from gpudiag.engine.route import daemon_else_inline
from gpudiag.engine.statedir import default_state_dir
from gpudiag.runner.closeout import Closeout

WATCHER = "run watcher"
HISTORY = "daemon history"
WATCH_START_S = 10.0  # Python, pynvml and nvmlInit; a hung driver must not hold the job
LATE_EVENT_WAIT_S = 0.5  # a failed job often ends a moment before its XID is delivered
HISTORY_LIMIT = 1000
SILENCE_S = 5.0  # the watcher beats every 0.5 s; past this it did not watch
LINE_LIMIT = 1 << 20
POST_RUN_CHECK_S = 20.0  # the cuda probe's deadline after a failed run without a daemon
PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 36, 37


def _prctl_subreaper(value: int | None) -> int | None:
    """Read (value None) or set this process's child-subreaper flag; None when unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if value is None:
            flag = ctypes.c_int(0)
            ok = int(libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0)) == 0
            return flag.value if ok else None
        return 0 if int(libc.prctl(PR_SET_CHILD_SUBREAPER, value, 0, 0, 0)) == 0 else None
    except (OSError, AttributeError):
        return None


@dataclass
class _Seen:
    """What the watcher said so far (written by the reader thread only)."""

    hello_at: float | None = None
    registered: tuple[str, ...] = ()  # the GPUs the watcher registered for XID events
    error: str | None = None
    ended_at: float | None = None  # its stdout closed
    last_line_at: float | None = None
    longest_silence_s: float = 0.0  # between two of its lines (it beats every 0.5 s)
    events: list[JobEvent] = field(default_factory=list)
    stderr: bytearray = field(default_factory=bytearray)


class RunWatcher:
    """The run's own XID watcher child, detached from the run's process tree."""

    def __init__(self, env: Mapping[str, str], gpus: frozenset[str] = frozenset()) -> None:
        """``gpus``: the job's GPUs, which the watcher must have registered to cover it."""
        self._env = probe_environment(env)
        self._gpus = gpus
        self._seen = _Seen()
        self._ready = threading.Event()
        self._pid: int | None = None
        self._pidfd: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._thread: threading.Thread | None = None
        self.start_error: str | None = None

    def start(self, timeout_s: float = WATCH_START_S) -> None:
        """Start the watcher and wait for its hello (its GPUs are registered for XIDs)."""
        options = json.dumps({"heartbeat_s": 0.5, "telemetry_s": 3600})
        argv = [sys.executable, "-m", "gpudiag.runner.detach",
                sys.executable, "-m", "gpudiag.probes.xid_watch", options]
        # The orphan must not come back to this process: a subreaper (a run before this one
        # in the same process) would inherit it and then wait for it with the job's tree.
        was = _prctl_subreaper(None)
        if was:
            _prctl_subreaper(0)
        try:
            self._proc = subprocess.Popen(  # noqa: S603 - fixed argv, no shell
                argv, env=self._env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, close_fds=True)
            pid = self._read_pid(self._proc, timeout_s)
            self._proc.wait(timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired, ValueError) as e:
            self.start_error = f"the XID watcher could not be started: {e}"
            self._close_pipes()
            return
        finally:
            if was:
                _prctl_subreaper(1)
        self._pid = pid
        with contextlib.suppress(OSError, AttributeError):
            self._pidfd = os.pidfd_open(pid)  # signals then reach this process, never a reuse
        self._thread = threading.Thread(target=self._read, name="gpudiag-run-watcher",
                                        daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            self.start_error = f"the XID watcher said nothing within {timeout_s:g} s"

    @staticmethod
    def _read_pid(proc: subprocess.Popen[bytes], timeout_s: float) -> int:
        assert proc.stderr is not None
        line = b""
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stderr, selectors.EVENT_READ)
            while not line.endswith(b"\n"):
                if not sel.select(max(0.0, deadline - time.monotonic())):
                    raise ValueError("no pid from the detach helper")
                chunk = os.read(proc.stderr.fileno(), 1)
                if not chunk:
                    raise ValueError("the detach helper ended without a pid")
                line += chunk
        return int(line.strip())

    def _read(self) -> None:
        proc = self._proc
        assert proc is not None and proc.stdout is not None and proc.stderr is not None
        seen, buf = self._seen, b""
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ, "out")
            sel.register(proc.stderr, selectors.EVENT_READ, "err")
            while sel.get_map():
                for key, _ in sel.select():
                    chunk = os.read(key.fileobj.fileno(), 65536)  # type: ignore[union-attr]
                    if not chunk:
                        sel.unregister(key.fileobj)
                        if key.data == "out":
                            seen.ended_at = time.time()
                    elif key.data == "err":
                        seen.stderr += chunk
                        del seen.stderr[:-4096]
                    else:
                        *lines, buf = (buf + chunk).split(b"\n")
                        if len(buf) > LINE_LIMIT:
                            buf = b""  # not one of its lines: a library's endless print
                        for line in lines:
                            self._line(line)
        self._ready.set()

    def _line(self, line: bytes) -> None:
        now = time.time()
        if self._seen.last_line_at is not None:
            self._seen.longest_silence_s = max(self._seen.longest_silence_s,
                                               now - self._seen.last_line_at)
        self._seen.last_line_at = now
        msg = parse_watcher_line(line)
        if msg is None:
            return
        if msg.kind == "hello":
            self._seen.registered = msg.device_uuids
            self._seen.hello_at = time.time()
            self._ready.set()
        elif msg.kind == "xid" and msg.xid is not None:
            self._seen.events.append(xid_event(time.time(), msg.xid, msg.uuid, "watcher"))
        elif msg.kind == "error":
            self._seen.error = str(msg.message)
            self._ready.set()

    def so_far(self) -> tuple[list[JobEvent], Source]:
        """Its events until now and whether it has covered the time since its start."""
        return list(self._seen.events), self._source(self._seen.ended_at)

    def stop(self) -> tuple[list[JobEvent], Source]:
        """End the watcher; its events and whether it covered the run."""
        ended_before = self._seen.ended_at
        if self._thread is not None and ended_before is None:
            with contextlib.suppress(OSError, AttributeError):
                if self._pidfd is not None:
                    signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
                elif self._pid is not None:  # its stdout is still open here: it still lives
                    os.kill(self._pid, signal.SIGKILL)
            self._thread.join(5.0)
        self._close_pipes()
        return list(self._seen.events), self._source(ended_before)

    def _source(self, ended_before: float | None) -> Source:
        seen = self._seen
        tail = bounded_tail(bytes(seen.stderr), 300).strip()
        if self.start_error is not None or seen.hello_at is None:
            why = seen.error or self.start_error or "the XID watcher never said hello"
            return Source(WATCHER, False, why + (f"; stderr: {tail}" if tail else ""))
        if seen.error is not None:
            return Source(WATCHER, False, f"the XID watcher failed during the run: {seen.error}")
        last = seen.last_line_at or seen.hello_at
        silence = max(seen.longest_silence_s, time.time() - last)
        if silence > SILENCE_S:
            # A hung driver stops the heartbeats: an XID in that time may never have come.
            return Source(WATCHER, False, f"the XID watcher was silent for {silence:.1f} s "
                          "during the run (a hung driver?)")
        if self._gpus and not self._gpus & set(seen.registered):
            # NVML refused event registration for the job's GPUs (e.g. not supported there).
            return Source(WATCHER, False, "the XID watcher could not register for XID events "
                          f"on {', '.join(sorted(self._gpus))}")
        if ended_before is not None:
            return Source(WATCHER, False, "the XID watcher ended during the run"
                          + (f"; stderr: {tail}" if tail else ""))
        return Source(WATCHER, True)

    def _close_pipes(self) -> None:
        if self._pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
            self._pidfd = None
        proc = self._proc
        if proc is not None:
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                proc.wait(timeout=1.0)


def daemon_history(url: str, env: Mapping[str, str], start: float, now: float
                   ) -> tuple[list[JobEvent], Source]:
    """The daemon's XIDs and blocker episodes since ``start``, and whether it could say."""
    since_s = max(1.0, now - start + 60.0)
    try:
        reply = daemon_get(url, "/v1/history", {"since_s": f"{since_s:.0f}",
                                                "limit": str(HISTORY_LIMIT)},
                           env=env, connect_timeout_s=1.0, read_timeout_s=10.0)
    except DaemonUrlError as e:
        return [], Source(HISTORY, False, str(e))
    if reply.status != 200:
        return [], Source(HISTORY, False, reply.why)
    events = history_events(reply.data)
    if events is None:
        return [], Source(HISTORY, False, f"the daemon at {url} keeps no XID timeline (a "
                          "gpudiag older than failure attribution)")
    return events, Source(HISTORY, True)


class GpuEvents:
    """Gathers a run's GPU events from start to finish (the daemon's, or its own watcher's)."""

    def __init__(self, gpus: Sequence[str], env: Mapping[str, str],
                 daemon_url: str | None) -> None:
        self.gpus = frozenset(gpus)
        self._env = dict(env)
        self._daemon_url = daemon_url
        self._watcher: RunWatcher | None = None
        self.started = time.time()
        self.events: list[JobEvent] = []  # the events the last attribution looked at
        # The daemon's id of this run's attested window (None: not announced, and why).
        self.run_id: str | None = None
        self.unannounced = "the run asked no daemon"

    @classmethod
    def begin(cls, gpus: Sequence[str], env: Mapping[str, str], daemon_url: str | None,
              lock_fds: Sequence[int] = ()) -> GpuEvents:
        """Start gathering: the run's own watcher unless a daemon keeps the history (then
        the run announces itself there, passing ``lock_fds``, its GPU locks' descriptors)."""
        gathering = cls(gpus, env, daemon_url)
        if gpus and daemon_url is None:
            gathering._watcher = RunWatcher(env, gathering.gpus)
            gathering._watcher.start()
        elif gpus and daemon_url is not None:
            # Its GPUs are locked by now: the daemon checks that with the kernel, on the very
            # descriptors passed (any pid namespace).
            gathering.run_id, gathering.unannounced = begin_run(
                daemon_url, sorted(gathering.gpus), env.get("SLURM_JOB_ID") or None, env,
                lock_fds)
        gathering.started = time.time()
        return gathering

    def hand_over(self, job: JobRecord) -> dict[str, Any] | None:
        """The run's end on the daemon that attested its start: where its record went
        (None: not handed over, and ``unannounced`` says why)."""
        if self.run_id is None or self._daemon_url is None:
            return None
        body = end_body(job.argv, job.closeout, [u.record() for u in job.gpu_usage])
        answer, why = end_run(self._daemon_url, self.run_id, job.exit_code,
                              job.child_pid or 0, body, self._env)
        if answer is None:
            self.unannounced = f"the daemon did not take the run's end: {why}"
            return None
        # The daemon's job watch's warnings on the run (job_stalled, gpu_straggler_suspect).
        warnings = answer.get("warnings")
        return {"path": None, "daemon": self._daemon_url, "run": self.run_id,
                "attested": "socket", "error": None,
                "warnings": warnings if isinstance(warnings, list) else []}

    def close(self) -> None:
        """Stop the watcher without an answer (the job never started)."""
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None

    def attribute(self, exit_code: int, window: Window) -> Attribution:
        """Attribute a part of the gathering time (a test of a session), gathering on."""
        if not window.gpus:
            # No GPU, so no GPU event could be missed.
            return attribute(exit_code, window, [], [Source("no GPU", True)])
        if self._watcher is not None:
            events, source = self._watcher.so_far()
        elif self._daemon_url is not None:
            events, source = daemon_history(self._daemon_url, self._env, window.start,
                                            window.end)
        else:
            return attribute(exit_code, window, [], [])
        self.events = events
        return attribute(exit_code, window, events, [source])

    def finish(self, exit_code: int) -> tuple[Attribution, Window]:
        """Stop gathering and attribute the run that exited with ``exit_code``."""
        if exit_code != 0:
            time.sleep(LATE_EVENT_WAIT_S)
        window = Window(self.started, time.time(), self.gpus)
        try:
            got = self.attribute(exit_code, window)
            if exit_code != 0 and self._watcher is not None and got.kind in (
                    APPLICATION_KIND, UNKNOWN):
                # No daemon watched the backends: a watcher sees XIDs, not a driver or cuInit
                # that stopped working, so a failed run with no GPU event checks them now.
                got = self._after_check(exit_code, window, got)
            return got, window
        finally:
            self.close()

    def _after_check(self, exit_code: int, window: Window, got: Attribution) -> Attribution:
        events, source = self._watcher.so_far() if self._watcher else ([], None)
        checked = post_run_check(self._env)
        if not checked:
            return got
        # Seen at the end of the run: the backend stopped proving by then.
        found = [replace(e, ts=window.end) for e in checked]
        return attribute(exit_code, window, [*events, *found],
                         [source] if source is not None else [])


def post_run_check(env: Mapping[str, str], timeout_s: float = POST_RUN_CHECK_S
                   ) -> list[JobEvent]:
    """The driver and CUDA blockers of an inline node-health check (cuda), as node events."""
    requirement = parse_requirement("cuda", node_health=True)
    try:
        verdict = daemon_else_inline(requirement, use_daemon=False, env=env,
                                     timeout_s=timeout_s).verdict
    except (OSError, ValueError):
        return []
    now = time.time()
    return [JobEvent(now, "post-run check", None, b.code, None, b.message)
            for b in verdict.blockers if b.code in SOFTWARE_CODES]


def gpus_of(slots: Sequence[Mapping[str, Any]]) -> list[str]:
    """The full UUIDs a job's events may name: its leaves and their physical GPUs."""
    out: list[str] = []
    for slot in slots:
        for key in ("uuid", "parent_uuid"):
            value = slot.get(key)
            if isinstance(value, str) and value and value not in out:
                out.append(value)
    return out


def report_job(job: JobRecord, env: Mapping[str, str], unattested: str = ""
               ) -> dict[str, Any]:
    """Drop the job's record into the daemon's inbox; says where, or why not (and, with
    ``unattested``, why no daemon attested the run: such a record decides nothing)."""
    folder = default_state_dir(env) / JOB_INBOX
    said = {"attested": None, "unattested": unattested} if unattested else {}
    if not folder.parent.is_dir():
        return {"path": None, **said,
                "error": f"no daemon state directory at {folder.parent}"}
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        final = atomic_write(folder / f"{time.time_ns()}-{job.pid}.json",
                             json.dumps(job.record(), default=str) + "\n", 0o600)
    except OSError as e:
        return {"path": None, **said,
                "error": f"cannot write into {folder}: {e.strerror or e}"}
    return {"path": str(final), **said, "error": None,
            **({"run": job.run} if job.run is not None else {})}


def window_xids(events: Sequence[JobEvent], window: Window) -> list[tuple[str | None, int]]:
    """The XIDs (GPU UUID, XID) on the job's GPUs within its window, oldest first."""
    return [(e.gpu, e.xid) for e in sorted(events, key=lambda e: e.ts)
            if e.xid is not None and e.gpu in window.gpus
            and window.start <= e.ts <= window.end + AFTER_END_S]


def close_attribution(gpu_events: GpuEvents, closeout: Closeout, argv: Sequence[str],
                      child_pid: int, exit_code: int, env: Mapping[str, str],
                      usage: Sequence[GpuUsage] = ()) -> Closeout:
    """The closeout with the run attributed and its GPUs' usage (with the XIDs of its
    window), once reported to the node's daemon."""
    attribution, window = gpu_events.finish(exit_code)
    used = merge_xids(usage, window_xids(gpu_events.events, window))
    job = JobRecord(os.getpid(), child_pid, tuple(argv), env.get("SLURM_JOB_ID") or None,
                    socket.gethostname(), window.start, window.end, exit_code,
                    tuple(sorted(window.gpus)), attribution,
                    closeout.artifacts.get("closeout_json"), used)
    handed = gpu_events.hand_over(job)
    # A run the daemon attested whose end did not reach it: its record names the run's id,
    # so that the daemon matches it to that run (whichever pid it had there).
    reported = handed if handed is not None else report_job(
        replace(job, run=gpu_events.run_id), env,
        gpu_events.unannounced if window.gpus else "")
    # The window too, so that `gpudiag explain --run` can ask the history about it later.
    return replace(closeout, attribution={**attribution.record(), "window": {
        "start": window.start, "end": window.end, "gpus": sorted(window.gpus)}},
        job_record=reported, gpu_usage=used)
