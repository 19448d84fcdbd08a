"""Attested run windows (issues 38, 49): when a job ran is what the kernel says, not a file.

A ``gpudiag run`` that asked this daemon speaks to it on one channel, the unix socket:
``POST /v1/runs/begin`` once its GPUs are locked, ``POST /v1/runs/end`` once its child and
every descendant ended, or ``POST /v1/runs/blocked`` when gpudiag refused it before its start.
The daemon takes the window from the kernel, never from the request:
- who: the socket's peer credentials (uid, pid), a pidfd of that very process (SO_PEERPIDFD,
  which no pid reuse can swap) and the pid's start time where this daemon can see it
  (``/proc/PID``: a sandboxed daemon under ``ProtectProc=invisible`` sees no other user's). A
  peer in a pid namespace this daemon cannot see has pid 0 here: its pidfd is who it is (on
  Linux 6.9+ each process's pidfd has its own inode, the peer's identity across namespaces);
- which GPUs: those whose lock the run's own descriptors hold exclusively. The run passes
  its lock descriptors with its begin (SCM_RIGHTS) and the kernel says, in this daemon's own
  ``/proc/self/fdinfo``, which locks those very open files hold (engine/locks.locked_through):
  no pid is looked up, so it holds across pid namespaces (a run in a container, a daemon
  without hostPID). A run that passes none (a gpudiag before issue 49) is checked by its pid
  (engine/locks.locked_by: the O(1) test, then its ``/proc/PID/fdinfo``), where visible;
- when: the daemon's own clock at begin and at end, the end from the same process (its
  pidfd's identity, else the same uid and pid, its pidfd not exited, its start time unchanged).
What the run says itself (its Slurm job id, exit code, argv, closeout path, GPU usage, its
refusal's codes) is kept as its word beside the attested facts. The job record is built here,
attributed from the daemon's own history (XIDs, blocker episodes) over the attested window. A
refusal counts once per process and at most BLOCKS_PER_UID_MINUTE a minute per uid.

A closeout record in the ``job-closeouts/`` inbox is matched to these windows
(``RunWindows.match``): one that an attested run wrote (its ``/end`` failed) closes that run;
one naming another user's run or Slurm job, a second one for a run already recorded, and one
with no attested run behind it are refused and counted in
``gpudiag_job_records_refused_total{reason}``; a record root wrote (the kernel says root owns
its file) is root's word, kept as such.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
from prometheus_client.core import CounterMetricFamily

from gpudiag.core.ascii_ints import ascii_int
from gpudiag.core.attribution import (
    AFTER_END_S,
    Attribution,
    JobRecord,
    Source,
    Window,
    attribute,
    history_events,
)
from gpudiag.core.environment import is_full_uuid
from gpudiag.core.limits import MAX_DEVICES
from gpudiag.core.records import dataclass
from gpudiag.core.usage import usages_of
from gpudiag.daemon import open_runs
from gpudiag.daemon.collectors import StateCollector
from gpudiag.daemon.store import HistoryError, HistoryStore
from gpudiag.engine.locks import (
    LockFileKey,
    lock_file_key,
    locked_by,
    locked_through,
    still_held,
)

# Open runs at once, and per uid: each holds a pidfd, and a begin needs a GPU lock the
# kernel says the run holds, so a node has about as many open runs as GPU leaves.
MAX_OPEN_RUNS = 256
MAX_OPEN_PER_UID = 64
# Ended runs remembered for matching inbox records (duplicates, another user's).
RECENT_RUNS = 1024
HISTORY_WINDOW_LIMIT = 1000
BEFORE_S = 60.0  # history looked at before a window: what led up to it
MAX_ARGV_ITEMS = 64
MAX_TEXT = 1024
_SLURM_JOB_ID = re.compile(r"[0-9A-Za-z_.+-]{1,64}")
_CODE = re.compile(r"[a-z0-9_]{1,64}")
MAX_BLOCK_CODES = 64
# A run the daemon sees by its lock files alone (pid 0, after a restart) lets them go before
# its end arrives (`gpudiag run` proves them free first: runner/execute._release_and_check);
# it stays open this long after, so that its end is still taken.
LET_GO_GRACE_S = 15.0
# Refusals a uid may report a minute (each process once): a counter a user can raise by
# starting processes rises no faster than this.
BLOCKS_PER_UID_MINUTE = 60
# Why an inbox record was refused: every reason is a series from the start.
REFUSED_REASONS = ("unattested", "foreign", "duplicate", "future_dated", "malformed")


@dataclass(frozen=True)
class RunRefused(Exception):
    """A begin or end the daemon will not attest; the HTTP API answers it as an error."""

    status: int
    code: str
    message: str


@dataclass(frozen=True)
class Peer:
    """The process at the other end of the socket, as the kernel says."""

    uid: int
    pid: int
    started_at: float | None  # its start time (None: this daemon cannot see the process)
    pidfd: int | None  # a pidfd of it (owned by whoever holds the Peer)
    # Its pidfd's inode where each process's is its own (pidfs, Linux 6.9+): who it is, in
    # any pid namespace; None on older kernels (all pidfds share one inode there).
    identity: int | None = None


@dataclass(frozen=True)
class OpenRun:
    """A run that began and has not ended: its attested window so far."""

    id: str
    peer: Peer
    began: float  # the daemon's own clock when the run announced itself
    # The locks the kernel said the run's process held at its begin (GPUs or MIG leaves).
    gpus: tuple[str, ...]
    slurm_job_id: str | None  # the run's own word: checked only against its owner's uid
    # Each GPU's lock file as the kernel named it at the begin (engine/locks.LockFileKey):
    # how a run this daemon cannot see (pid 0) is recognised again after a restart.
    locks: tuple[tuple[str, LockFileKey], ...] = ()


@dataclass(frozen=True)
class EndedRun:
    """A run that ended (or vanished): kept a while to match inbox records against."""

    id: str
    uid: int
    pid: int
    began: float
    ended: float
    gpus: tuple[str, ...]
    slurm_job_id: str | None
    recorded: bool  # its job record is in the history (else it vanished unrecorded)


@dataclass(frozen=True)
class RunReport:
    """What the run says of itself at its end: its word, never a decision's ground."""

    exit_code: int
    child_pid: int | None = None
    argv: tuple[str, ...] = ()
    closeout: str | None = None
    gpu_usage: Any = None  # the gpu_usage list of its closeout (core.usage reads it)


def start_time(pid: int) -> float | None:
    """The process's start time (epoch seconds, as psutil reads /proc/PID/stat); None when
    this process cannot see it."""
    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.Error, OSError):
        return None


def hold(opener: Callable[[], int | None], pid: int) -> int | None:
    """A pidfd of the socket's peer: the kernel's own (SO_PEERPIDFD), else (before Linux
    6.5) one opened by pid while the peer waits for this answer, so it is still that
    process unless it was killed in between; None when neither can be had (pid 0: a
    process of a pid namespace this daemon cannot see)."""
    fd = opener()
    if fd is None and pid > 0:
        with contextlib.suppress(OSError, AttributeError):
            fd = os.pidfd_open(pid)
    return fd


_SHARED_INODE: list[int | None] = []  # this process's own pidfd's inode, once read


def identity(pidfd: int | None) -> int | None:
    """The pidfd's inode when it names its process alone (pidfs: a pidfd of this process
    has another inode); None without a pidfd, or where every pidfd shares one inode."""
    if pidfd is None:
        return None
    try:
        ino = os.fstat(pidfd).st_ino
        if not _SHARED_INODE:
            own = os.pidfd_open(os.getpid())
            try:
                _SHARED_INODE.append(os.fstat(own).st_ino)
            finally:
                os.close(own)
    except (OSError, AttributeError):
        return None
    return None if ino == _SHARED_INODE[0] else ino


def peer_of(uid: int, pid: int, pidfd: int | None) -> Peer:
    """The socket's peer as the kernel says (pid 0: not visible here, no start time)."""
    return Peer(uid, pid, start_time(pid) if pid > 0 else None, pidfd, identity(pidfd))


def exited(pidfd: int) -> bool:
    """Whether the pidfd's process has exited (a pidfd polls readable then)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


def attribute_window(store: HistoryStore, window: Window, exit_code: int | None, *,
                     every_gpu: bool = False) -> tuple[Attribution, Window]:
    """The window attributed from the history's XIDs and blocker episodes, and the window so
    completed (``every_gpu``: a window without GPUs covers every GPU that had an event)."""
    since, until = window.start - BEFORE_S, window.end + AFTER_END_S
    xids = store.xids(since=since, until=until, limit=HISTORY_WINDOW_LIMIT)
    episodes = store.episodes(since=since, limit=HISTORY_WINDOW_LIMIT)
    events = history_events({"xids": [x.record() for x in xids],
                             "episodes": [e.record() for e in episodes]}) or []
    if every_gpu and not window.gpus:
        window = Window(window.start, window.end, frozenset(e.gpu for e in events if e.gpu))
    return attribute(exit_code, window, events, [Source("daemon history", True)]), window


def parse_gpus(text: str | None) -> tuple[str, ...]:
    """``gpus=UUID,...`` of a begin: full GPU-/MIG- UUIDs; RunRefused otherwise."""
    names = [g for g in (text or "").split(",") if g]
    if not names or len(names) > 8 * MAX_DEVICES or not all(map(is_full_uuid, names)):
        raise RunRefused(400, "bad_parameter", "gpus= must name the run's locked GPUs as full "
                         "GPU-/MIG- UUIDs, comma-separated")
    return tuple(dict.fromkeys(names))


def parse_slurm_job_id(text: str | None) -> str | None:
    if text is None or text == "":
        return None
    if not _SLURM_JOB_ID.fullmatch(text):
        raise RunRefused(400, "bad_parameter", f"slurm_job_id={text[:80]!r} is not a job id")
    return text


def parse_block(params: Mapping[str, str]) -> tuple[str, tuple[str, ...]]:
    """A refusal's ``code`` and ``codes`` (a run's own word; a code outside the catalog
    counts as ``other``): RunRefused(400) unless code names (lowercase, digits, _)."""
    code = params.get("code", "")
    codes = tuple(dict.fromkeys(c for c in params.get("codes", "").split(",") if c))
    if not _CODE.fullmatch(code) or len(codes) > MAX_BLOCK_CODES or not all(
            _CODE.fullmatch(c) for c in codes):
        raise RunRefused(400, "bad_parameter", "code= (and codes=, comma-separated) must be "
                         f"blocker codes ([a-z0-9_], at most {MAX_BLOCK_CODES})")
    return code, codes


def parse_report(params: Mapping[str, str], body: bytes) -> RunReport:
    """An end's exit code and child pid (query) and its JSON body (argv, closeout,
    gpu_usage); RunRefused(400) when malformed."""
    code, child = ascii_int(params.get("exit_code", "")), params.get("child_pid")
    child_pid = ascii_int(child) if child is not None else None
    if code is None or code > 255 or (child is not None and child_pid is None):
        raise RunRefused(400, "bad_parameter", "exit_code= (0 to 255) and child_pid= must be "
                         "ASCII integers")
    try:
        data = json.loads(body) if body.strip() else {}
    except (ValueError, RecursionError) as e:
        raise RunRefused(400, "bad_body", f"the body is not JSON: {e}") from e
    if not isinstance(data, dict):
        raise RunRefused(400, "bad_body", "the body must be a JSON object")
    argv = data.get("argv")
    argv = argv if isinstance(argv, list) else []
    closeout = data.get("closeout")
    return RunReport(code, child_pid, tuple(str(a)[:MAX_TEXT] for a in argv[:MAX_ARGV_ITEMS]),
                     closeout[:MAX_TEXT] if isinstance(closeout, str) else None,
                     data.get("gpu_usage"))


class RunWindows:
    """The open and recently ended runs; begin/end from the HTTP API, poll each loop."""

    def __init__(self, lock_dir: Path, history: Callable[[], HistoryStore | None], *,
                 clock: Callable[[], float] = time.time, kept: Path | None = None,
                 mig_parents: Callable[[], Mapping[str, str]] = dict) -> None:
        """``kept``: where the open runs are written, to be read back after a restart
        (daemon/open_runs.py); None keeps them in memory only. ``mig_parents``: each MIG
        instance's physical GPU as the daemon's NVML reading has it (an XID names the GPU,
        a MIG run locks its instance: its window covers both)."""
        self.lock_dir = lock_dir
        self._history = history
        self._clock = clock
        self._kept = kept
        self._mig_parents = mig_parents
        self._lock = threading.Lock()
        self._open: dict[str, OpenRun] = {}
        self._recent: deque[EndedRun] = deque(maxlen=RECENT_RUNS)
        # Runs seen by their lock files alone: when none of those was held any more.
        self._let_go: dict[str, float] = {}
        # Refusals reported: each process's once (its identity, or pid and start time), and
        # when, per uid, over the last minute.
        self._blocked: deque[tuple[int | None, int, float | None]] = deque(maxlen=RECENT_RUNS)
        self._block_times: dict[int, deque[float]] = {}

    def open_runs(self) -> tuple[OpenRun, ...]:
        """The runs attested and not ended, oldest first (the allocation series' source)."""
        with self._lock:
            return tuple(sorted(self._open.values(), key=lambda r: r.began))

    def restore(self) -> int:
        """Open again the runs an earlier daemon attested that are still running (the kernel
        checks each again: daemon/open_runs.py); how many."""
        if self._kept is None:
            return 0
        back, ended = open_runs.restore(self._kept, self.lock_dir, start_time, identity)
        now = self._clock()
        with self._lock:
            for r in back:
                peer = Peer(r.uid, r.pid, r.started_at, r.pidfd, r.identity)
                self._open[r.id] = OpenRun(r.id, peer, r.began, r.gpus, r.slurm_job_id,
                                           r.locks)
            # Ended while the daemon was down: closed now, unrecorded; the inbox record it
            # left (naming its run id) still closes it, its window ending by now at latest.
            for r in ended:
                self._recent.append(EndedRun(r.id, r.uid, r.pid, r.began, now, r.gpus,
                                             r.slurm_job_id, False))
            self._save()
        return len(back)

    def _save(self) -> None:
        """Keep the open runs for a restart (called with ``_lock`` held)."""
        if self._kept is not None:
            open_runs.save(self._kept, [open_runs.Restored(
                r.id, r.peer.uid, r.peer.pid, r.peer.started_at, None, r.began, r.gpus,
                r.slurm_job_id, r.peer.identity, r.locks) for r in self._open.values()])

    def opened(self) -> list[OpenRun]:
        """The runs open now (the job watch's narrow view: each one's id and GPUs)."""
        with self._lock:
            return list(self._open.values())

    def begin(self, peer: Peer, gpus: Sequence[str], slurm_job_id: str | None,
              fds: Sequence[int] = ()) -> OpenRun:
        """Open a run for ``peer`` on the GPUs it holds locked; RunRefused otherwise.
        ``fds``: the lock descriptors it passed (SCM_RIGHTS). The Peer's pidfd is the run's
        from now on (closed at its end)."""
        if peer.pidfd is None and peer.started_at is None:
            raise RunRefused(403, "cannot_attest", f"pid {peer.pid} can be neither held (no "
                             "pidfd) nor seen (/proc): its window cannot be attested")
        if fds:
            # The kernel's word on the very open files the run passed: no pid involved.
            held = locked_through(self.lock_dir, gpus, fds)
            how = f"the {len(fds)} lock descriptor(s) pid {peer.pid} passed hold"
        else:
            # Held exclusively (O(1)), and by this very process (its own descriptors' locks;
            # the global table only where those cannot be read): a pid it must see.
            held = tuple(g for g in gpus if peer.pid > 0
                         and locked_by(self.lock_dir, g, peer.pid))
            how = f"pid {peer.pid} holds"
        if not held:
            raise RunRefused(409, "gpus_not_locked", f"the kernel says {how} none of the "
                             f"locks of {', '.join(gpus)} in {self.lock_dir} (the daemon's "
                             "lock folder): a run announces itself once its GPUs are locked "
                             "there, passing their descriptors")
        with self._lock:
            mine = sum(1 for r in self._open.values() if r.peer.uid == peer.uid)
            if len(self._open) >= MAX_OPEN_RUNS or mine >= MAX_OPEN_PER_UID:
                raise RunRefused(429, "too_many_runs", f"{len(self._open)} runs open "
                                 f"({mine} of uid {peer.uid}); the limits are "
                                 f"{MAX_OPEN_RUNS} and {MAX_OPEN_PER_UID} per uid")
            run = OpenRun(secrets.token_hex(8), peer, self._clock(), held, slurm_job_id,
                          _lock_keys(self.lock_dir, held))
            self._open[run.id] = run
            self._save()
        return run

    def end(self, peer: Peer, run_id: str, report: RunReport) -> tuple[OpenRun, JobRecord]:
        """The job record of a run that ``peer`` (the very process that began it) ends now;
        RunRefused otherwise. The run stays open until ``recorded``."""
        with self._lock:
            run = self._open.get(run_id)
        if run is None:
            raise RunRefused(404, "unknown_run", f"no open run {run_id[:40]!r} (ended "
                             "already, or it ended while the daemon was away)")
        if not self._same(run.peer, peer):
            raise RunRefused(403, "not_the_run", f"pid {peer.pid} uid {peer.uid} is not the "
                             f"process that began run {run_id}")
        return run, self._job(run, self._clock(), report)

    @staticmethod
    def _same(began: Peer, peer: Peer) -> bool:
        """Whether ``peer`` is the process that began a run: its pidfd's identity where the
        kernel gives one (any pid namespace), else the same uid and pid, its pidfd not
        exited and its start time unchanged."""
        if began.uid != peer.uid:
            return False
        if began.identity is not None and peer.identity is not None:
            return began.identity == peer.identity
        return began.pid == peer.pid and began.pid > 0 and not (
            began.pidfd is not None and exited(began.pidfd)) and not (
            began.started_at is not None and peer.started_at != began.started_at)

    def blocked(self, peer: Peer) -> None:
        """A refusal ``peer`` reports may count: RunRefused when this process reported one
        already, or its uid reached BLOCKS_PER_UID_MINUTE in the last minute."""
        key = (peer.identity, peer.pid, peer.started_at)
        now = self._clock()
        with self._lock:
            if peer.identity is None and (peer.pid <= 0 or peer.started_at is None):
                raise RunRefused(403, "cannot_attest", f"pid {peer.pid} cannot be told from "
                                 "another process here (no pidfd identity, no start time)")
            if key in self._blocked:
                raise RunRefused(409, "already_blocked", f"pid {peer.pid} reported its "
                                 "refusal already")
            for uid, seen in list(self._block_times.items()):
                while seen and seen[0] <= now - 60.0:
                    seen.popleft()
                if not seen:
                    del self._block_times[uid]
            times = self._block_times.setdefault(peer.uid, deque())
            if len(times) >= BLOCKS_PER_UID_MINUTE:
                raise RunRefused(429, "too_many_blocks", f"uid {peer.uid} reported "
                                 f"{len(times)} refusals in the last minute (at most "
                                 f"{BLOCKS_PER_UID_MINUTE})")
            times.append(now)
            self._blocked.append(key)

    def recorded(self, run: OpenRun, ended: float, *, kept: bool = True) -> None:
        """The run's record is kept (or it vanished): it leaves the open runs."""
        with self._lock:
            self._let_go.pop(run.id, None)
            if self._open.pop(run.id, None) is None:
                return
            self._save()
            self._recent.append(EndedRun(run.id, run.peer.uid, run.peer.pid, run.began,
                                         ended, run.gpus, run.slurm_job_id, kept))
        if run.peer.pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(run.peer.pidfd)

    def poll(self) -> None:
        """Runs whose process is gone without an end leave the open runs (no record)."""
        with self._lock:
            runs = list(self._open.values())
        now = self._clock()
        for run in runs:
            fd, start = run.peer.pidfd, run.peer.started_at
            if fd is not None:
                gone = exited(fd)
            elif run.peer.pid > 0:
                gone = start_time(run.peer.pid) != start
            else:
                # Reopened after a restart, seen by no pid: open while one of its very lock
                # files is held (the kernel's O(1) answer, any pid namespace), and for
                # LET_GO_GRACE_S after, while its end is on its way.
                gone = self._let_go_long_ago(run, now)
            if gone:
                self.recorded(run, now, kept=False)

    def _let_go_long_ago(self, run: OpenRun, now: float) -> bool:
        """Whether run's lock files have all been let go for LET_GO_GRACE_S."""
        held = any(still_held(self.lock_dir, gpu, key) for gpu, key in run.locks)
        with self._lock:
            if held:
                self._let_go.pop(run.id, None)
                return False
            since = self._let_go.setdefault(run.id, now)
        return now - since >= LET_GO_GRACE_S

    def match(self, job: JobRecord, uid: int) -> tuple[str, JobRecord | None, str | None]:
        """What an inbox record (written by ``uid``) is: ("socket", record, run id) when it
        ends an attested run that has no record yet, ("root", job, None) for root's own
        word, else (refusal reason, None, None). A record naming its run's id (``run``) is
        that run's alone: kept when the file's owner is the run's uid."""
        if job.run is not None:
            return self._match_id(job, job.run, uid)
        with self._lock:
            open_runs = [r for r in self._open.values() if r.peer.pid == job.pid]
            recent = [r for r in self._recent if r.pid == job.pid
                      and r.began <= job.ended and job.started <= r.ended + AFTER_END_S]
            slurm = [r.peer.uid for r in self._open.values()
                     if job.slurm_job_id and r.slurm_job_id == job.slurm_job_id]
            slurm += [r.uid for r in self._recent
                      if job.slurm_job_id and r.slurm_job_id == job.slurm_job_id]
        if any(r.peer.uid != uid for r in open_runs) or any(r.uid != uid for r in recent) or (
                uid != 0 and any(u != uid for u in slurm)):
            return "foreign", None, None
        report = _report(job)
        if open_runs:
            run = open_runs[0]
            ended = max(run.began, min(job.ended, self._clock()))
            return "socket", self._job(run, ended, report), run.id
        unrecorded = [r for r in recent if not r.recorded]
        if unrecorded:
            r = unrecorded[0]
            run = OpenRun(r.id, Peer(r.uid, r.pid, None, None), r.began, r.gpus,
                          r.slurm_job_id)
            return "socket", self._job(run, max(r.began, min(job.ended, r.ended)),
                                       report), r.id
        if recent:
            return "duplicate", None, None
        return ("root", job, None) if uid == 0 else ("unattested", None, None)

    def _match_id(self, job: JobRecord, run_id: str, uid: int
                  ) -> tuple[str, JobRecord | None, str | None]:
        """An inbox record naming run ``run_id`` (the id the daemon gave the run at its
        begin): the run's end when the kernel says its owner wrote the file."""
        with self._lock:
            run = self._open.get(run_id)
            ended = next((r for r in self._recent if r.id == run_id), None)
        owner = run.peer.uid if run is not None else (ended.uid if ended else None)
        if owner is None:
            return ("root", job, None) if uid == 0 else ("unattested", None, None)
        if owner != uid:
            return "foreign", None, None
        if run is not None:
            return "socket", self._job(run, max(run.began, min(job.ended, self._clock())),
                                       _report(job)), run.id
        assert ended is not None
        if ended.recorded:
            return "duplicate", None, None
        run = OpenRun(ended.id, Peer(ended.uid, ended.pid, None, None), ended.began,
                      ended.gpus, ended.slurm_job_id)
        return "socket", self._job(run, max(ended.began, min(job.ended, ended.ended)),
                                   _report(job)), ended.id

    def close_matched(self, run_id: str, ended: float) -> None:
        """An inbox record closed run ``run_id`` (open, or vanished unrecorded)."""
        with self._lock:
            run = self._open.get(run_id)
            for i, r in enumerate(self._recent):
                if r.id == run_id:
                    self._recent[i] = replace(r, recorded=True)
        if run is not None:
            self.recorded(run, ended)

    def _job(self, run: OpenRun, ended: float, report: RunReport) -> JobRecord:
        """The run's job record: the attested window, the daemon's attribution, its word."""
        parents = self._mig_parents()
        # Its leaves and their physical GPUs, as a runner's own record names them (an XID
        # names the GPU; a MIG run locks its instance).
        gpus = tuple(dict.fromkeys([*run.gpus, *(parents[g] for g in run.gpus if g in parents)]))
        window = Window(run.began, ended, frozenset(gpus))
        store = self._history()
        if store is None:
            got = attribute(report.exit_code, window, [], [Source(
                "daemon history", False, "the history is not open")])
        else:
            try:
                got, _ = attribute_window(store, window, report.exit_code)
            except HistoryError as e:
                got = attribute(report.exit_code, window, [], [Source(
                    "daemon history", False, str(e))])
        return JobRecord(run.peer.pid, report.child_pid, report.argv, run.slurm_job_id,
                         socket.gethostname(), run.began, ended, report.exit_code,
                         gpus, got, report.closeout, usages_of(report.gpu_usage))


def _report(job: JobRecord) -> RunReport:
    """What an inbox record says of its run: its word, as an end's report."""
    return RunReport(job.exit_code, job.child_pid, job.argv, job.closeout,
                     [u.record() for u in job.gpu_usage])


def _lock_keys(lock_dir: Path, gpus: Sequence[str]) -> tuple[tuple[str, LockFileKey], ...]:
    """Each GPU's lock file as the kernel names it now (the run holds them all)."""
    return tuple((gpu, key) for gpu in gpus if (key := lock_file_key(lock_dir, gpu)))


class RefusedRecords:
    """``gpudiag_job_records_refused_total{reason}``'s counts (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(REFUSED_REASONS, 0)
        self._said: dict[str, float] = {}

    def add(self, reason: str, now: float = 0.0, say_every_s: float = 0.0) -> bool:
        """Count one; True when it is to be said (the first of ``reason`` in
        ``say_every_s``)."""
        with self._lock:
            self._counts[reason] = self._counts.get(reason, 0) + 1
            last = self._said.get(reason)
            if last is not None and now - last < say_every_s:
                return False
            self._said[reason] = now
            return True

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class RefusedRecordsCollector(StateCollector[dict[str, int]]):
    """``gpudiag_job_records_refused_total{reason}``, every reason present from the start."""

    def render(self, state: dict[str, int]) -> Iterator[CounterMetricFamily]:
        """The one counter, a sample per reason."""
        family = CounterMetricFamily(
            "gpudiag_job_records_refused",
            "Job records in the job-closeouts inbox that decide nothing: no run the daemon "
            "attested (unattested), another user's run or Slurm job (foreign), a second "
            "record of a run already recorded (duplicate), a window ending in the future "
            "(future_dated), not a job record (malformed).", labels=["reason"])
        for reason in REFUSED_REASONS:
            family.add_metric([reason], float(state.get(reason, 0)))
        yield family
