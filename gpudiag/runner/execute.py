"""The ``gpudiag run`` execution route: preflight, admit, plan, launch, wait, release, close out.

The plan is written and fsynced before launch and the child environment is derived from the
plan alone. The child starts with shell=False in a new session; this process becomes a child
subreaper, so every descendant (orphans too) stays its child until reaped, and the GPU locks
are released only once the child and every descendant have ended. The lock files are also
inherited by the child, so the kernel keeps a GPU locked while any of its processes lives,
even if this process is SIGKILLed.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import field, replace
from pathlib import Path
from types import FrameType
from typing import IO, Any, BinaryIO

from gpudiag.core.child import (
    REPORT_DIR_VAR,
    env_sha256,
    preallocation_off,
    sitecustomize_source,
    xla_allocator,
)
from gpudiag.core.environment import gpudiag_variables
from gpudiag.core.fileio import atomic_write, write_error
from gpudiag.core.limits import EXIT_CANNOT_EXECUTE, EXIT_NOT_FOUND, EXIT_REFUSED
from gpudiag.core.records import dataclass
from gpudiag.core.termsafe import terminal_safe
from gpudiag.core.verdict import Requirement, Verdict
from gpudiag.core.version import __version__
from gpudiag.engine import jobpython
from gpudiag.engine.jobpython import JobPython
from gpudiag.engine.locks import LockFailed, default_lock_dir, try_lock
from gpudiag.engine.locks import release as release_locks
from gpudiag.engine.processes import cmdline, descendants
from gpudiag.runner.admission import (
    Admission,
    AdmissionError,
    Admitter,
    Hook,
    preflight_for_admission,
)
from gpudiag.runner.artifacts import (
    UntrustedFolder,
    create_new,
    fresh_subfolder,
    prepare_folder,
    read_own,
)
from gpudiag.runner.attribution import GpuEvents, close_attribution, gpus_of
from gpudiag.runner.closeout import Closeout, GpuSlot, closeout_kv
from gpudiag.runner.usage import JobMeter, report_block

PLAN_SCHEMA = "gpudiag.plan/1"
PR_SET_CHILD_SUBREAPER = 36
TICK_S = 0.05
MAX_TRACKED = 4096
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
ARTIFACT_NAMES = {
    "plan": "plan.json", "environment": "environment.json", "verdict": "verdict.json",
    "result": "result.json", "stdout": "stdout.log", "stderr": "stderr.log",
    "closeout_json": "closeout.json", "closeout_txt": "closeout.txt",
    "child_reports": "child-reports",
}


class RunnerError(Exception):
    """gpudiag could not get as far as launching (bad artifacts dir, unusable plan)."""


class ArtifactError(RunnerError):
    """An artifact could not be written (full disk, vanished folder); the message names it."""


def _artifact_error(path: str | os.PathLike[str], e: OSError) -> ArtifactError:
    return ArtifactError(write_error(path, e))


def _write(path: str | os.PathLike[str], text: str) -> None:
    """atomic_write for an artifact: the old file or the new one, never half of one."""
    try:
        atomic_write(path, text)
    except OSError as e:
        raise _artifact_error(path, e) from e


@dataclass(frozen=True)
class RunOptions:
    """Everything one ``gpudiag run`` needs."""

    argv: tuple[str, ...]
    requirement: Requirement
    artifacts: Path
    lock_dir: Path | None  # None: default_lock_dir(), resolved only when GPUs are admitted
    gpus: int
    min_free_memory_bytes: int | None = None
    timeout_s: float | None = None
    kill_grace_s: float = 5.0
    lock_timeout_s: float = 60.0
    probe_timeout_s: float | None = None
    image: str | None = None
    docker: str = "docker"
    cwd: Path = field(default_factory=Path.cwd)
    daemon_url: str | None = None  # ask this daemon for the verdict first; None: inline
    xla_allocator: str = "platform"  # "keep": the job's own allocator (core.environment)
    # The job's interpreter as given (``--python``); None: found (engine/jobpython.find:
    # $GPUDIAG_JOB_PYTHON, ARGV's own Python, the job's venv or PATH).
    python: str | None = None


@dataclass(frozen=True)
class RunOutcome:
    """The exit code ``gpudiag run`` returns and the closeout it wrote."""

    exit_code: int
    closeout: Closeout


def set_child_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux 3.4+)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _now() -> str:
    from gpudiag.core.clock import now_rfc3339

    return now_rfc3339()


def _paths(artifacts: Path) -> dict[str, str]:
    return {k: str(artifacts / v) for k, v in ARTIFACT_NAMES.items()}


def _json(data: Any) -> str:
    return json.dumps(data, indent=2, sort_keys=False, default=str) + "\n"


# --- plan and environment ------------------------------------------------------------------


def build_plan(options: RunOptions, admission: Admission, base_env: Mapping[str, str],
               hook_dir: Path | None) -> dict[str, Any]:
    """The plan record: what will run, where, on which leaves, with which variables."""
    variables = gpudiag_variables(admission.uuids, admission.jax_platforms,
                                  options.xla_allocator)
    python_path: str | None = None
    report_dir: str | None = None
    if hook_dir is not None:
        python_path = os.pathsep.join(
            [str(hook_dir), *([base_env["PYTHONPATH"]] if base_env.get("PYTHONPATH") else [])])
        report_dir = str(options.artifacts / ARTIFACT_NAMES["child_reports"])
    plan: dict[str, Any] = {
        "schema": PLAN_SCHEMA,
        "created_at": _now(),
        "host": socket.gethostname(),
        "gpudiag_version": __version__,
        "argv": list(options.argv),
        "cwd": str(options.cwd),
        "image": options.image,
        "requirement": admission.requirement.record(),
        "timeout_s": options.timeout_s,
        "admission": admission.record(),
        "environment": {
            "set": variables,
            "python_hook": {"PYTHONPATH": python_path, REPORT_DIR_VAR: report_dir},
            "base_sha256": env_sha256(base_env),
        },
        "docker": None,
    }
    return plan


def environment_from_plan(plan: Mapping[str, Any], base_env: Mapping[str, str]
                          ) -> dict[str, str]:
    """The exact child environment, from the plan alone (plus the caller's base env)."""
    spec = plan["environment"]
    env = dict(base_env)
    env.update({str(k): str(v) for k, v in spec["set"].items()})
    for key, value in (spec.get("python_hook") or {}).items():
        if value is not None:
            env[str(key)] = str(value)
    return env


def fingerprint(plan: Mapping[str, Any]) -> str:
    """A hash of the plan without its own fingerprint and timestamps."""
    body = {k: v for k, v in plan.items() if k not in ("fingerprint", "created_at")}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def environment_record(env: Mapping[str, str], plan: Mapping[str, Any]) -> dict[str, Any]:
    """environment.json: the variables gpudiag set, every name, and a hash of the whole."""
    set_keys = dict(plan["environment"]["set"])
    hook = {k: v for k, v in (plan["environment"].get("python_hook") or {}).items()
            if v is not None}
    return {"set_by_gpudiag": {**set_keys, **hook}, "keys": sorted(env),
            "sha256": env_sha256(env), "count": len(env)}


# --- process tree ---------------------------------------------------------------------------


@dataclass
class _Descendant:
    pid: int
    ppid: int
    comm: str
    first_seen: float
    last_seen: float
    cmdline: list[str]
    reaped: bool = False
    status: int | None = None


class Tree:
    """Every descendant of this process seen so far (it is their subreaper)."""

    def __init__(self) -> None:
        self.seen: dict[int, _Descendant] = {}
        self.total = 0
        self.root = os.getpid()

    def scan(self) -> list[int]:
        """Refresh; returns the pids alive below this process now."""
        alive: list[int] = []
        now = time.time()
        for proc in descendants(self.root):
            alive.append(proc.pid)
            d = self.seen.get(proc.pid)
            if d is None:
                self.total += 1
                if len(self.seen) < MAX_TRACKED:  # a fork loop must not grow the record
                    self.seen[proc.pid] = _Descendant(proc.pid, proc.ppid, proc.comm, now, now,
                                                      cmdline(proc.pid))
            else:
                d.last_seen, d.comm = now, proc.comm
        return alive

    def reaped(self, pid: int, status: int) -> None:
        d = self.seen.get(pid)
        if d is None:
            if len(self.seen) >= MAX_TRACKED:
                return
            self.total += 1
            now = time.time()
            d = self.seen[pid] = _Descendant(pid, -1, "?", now, now, [])
        d.reaped, d.status = True, status

    def record(self) -> list[dict[str, Any]]:
        return [{"pid": d.pid, "ppid": d.ppid, "comm": d.comm, "cmdline": d.cmdline,
                 "first_seen": d.first_seen, "last_seen": d.last_seen, "reaped": d.reaped,
                 "wait_status": d.status} for d in sorted(self.seen.values(),
                                                         key=lambda x: x.first_seen)]


class _Tee(threading.Thread):
    """Copy one pipe to a log file and a stream, hashing what passed."""

    def __init__(self, pipe: IO[bytes], log: Path, stream: BinaryIO | None) -> None:
        super().__init__(daemon=True)
        self.pipe, self.log, self.stream = pipe, log, stream
        self.sha = hashlib.sha256()
        self.size = 0
        self.error: str | None = None  # why the log file is incomplete (full disk, ...)

    def run(self) -> None:
        out: BinaryIO | None = None
        try:
            # A new file, never a symlink's target (closed below, also after a failure).
            out = os.fdopen(create_new(self.log), "wb")
        except OSError as e:
            self.error = str(_artifact_error(self.log, e))
        try:
            # The pipe is drained to the end whatever happens to the file: a child must
            # never block on a full pipe because the disk under its log filled up.
            while True:
                chunk = os.read(self.pipe.fileno(), 65536)
                if not chunk:
                    break
                if out is not None:
                    try:
                        out.write(chunk)
                        out.flush()
                    except OSError as e:
                        self.error = str(_artifact_error(self.log, e))
                        with contextlib.suppress(OSError):
                            out.close()
                        out = None
                self.sha.update(chunk)
                self.size += len(chunk)
                if self.stream is not None:
                    with contextlib.suppress(OSError, ValueError):
                        self.stream.write(chunk)
                        self.stream.flush()
            if out is not None:
                try:
                    out.flush()
                    os.fsync(out.fileno())
                except OSError as e:
                    self.error = str(_artifact_error(self.log, e))
        finally:
            if out is not None:
                with contextlib.suppress(OSError):
                    out.close()


def _signal_all(pids: Sequence[int], pgid: int, sig: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(pgid, sig)
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, sig)


@dataclass
class _Wait:
    main_status: int | None = None
    timed_out: bool = False
    term_sent_at: float | None = None
    kill_sent_at: float | None = None
    forwarded: list[dict[str, Any]] = field(default_factory=list)


def _wait_tree(proc: subprocess.Popen[bytes], tree: Tree, timeout_s: float | None,
               grace_s: float, state: _Wait) -> None:
    """Reap the child and every descendant; on the deadline, TERM then KILL the whole tree."""
    started = time.monotonic()
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return  # no child left: the child and every descendant have ended
        if pid != 0:
            tree.reaped(pid, status)
            if pid == proc.pid:
                state.main_status = status
                proc.returncode = os.waitstatus_to_exitcode(status)
            continue
        alive = tree.scan()
        now = time.monotonic()
        if timeout_s is not None and now - started >= timeout_s:
            if state.term_sent_at is None:
                state.timed_out = True
                state.term_sent_at = now
                _signal_all(alive, proc.pid, signal.SIGTERM)
            elif now - state.term_sent_at >= grace_s:
                state.kill_sent_at = state.kill_sent_at or now
                _signal_all(alive, proc.pid, signal.SIGKILL)
        time.sleep(TICK_S)


# --- closeout -------------------------------------------------------------------------------


def _write_closeout(paths: Mapping[str, str], record: Mapping[str, Any]) -> None:
    _write(paths["closeout_json"], _json(record))
    _write(paths["closeout_txt"], closeout_kv(record))


def _close_out(paths: Mapping[str, str], result: Mapping[str, Any], closeout: Closeout,
               err: BinaryIO | None) -> Closeout:
    """Write result.json and the closeout and say where it went; a failure is said, never
    raised: the exit code stays the one the run earned (a job that ran must not look like
    one that never did)."""
    try:
        _write(paths["result"], _json(result))
        _write_closeout(paths, closeout.record())
    except ArtifactError as e:
        _say(err, f"gpudiag run: artifacts incomplete: {e}\n")
        return replace(closeout, error=f"artifacts incomplete: {e}")
    _say(err, f"gpudiag run: closeout {paths['closeout_txt']}\n")
    return closeout


def child_reports(folder: Path) -> list[dict[str, Any]]:
    """The reports Python processes of the run wrote about themselves."""
    out: list[dict[str, Any]] = []
    if not folder.is_dir():
        return out
    for path in sorted(folder.glob("child-*.json")):
        with contextlib.suppress(OSError, ValueError):
            value = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(value, dict):
                out.append(value)
    return out


def preallocation_verdict(env: Mapping[str, str], reports: Sequence[Mapping[str, Any]]
                          ) -> tuple[bool, str, list[dict[str, Any]]]:
    """yes/no, its source (child or plan), and what each reporting child saw."""
    planned = preallocation_off(env)
    seen = []
    for r in reports:
        startup = (r.get("startup") or {}).get("preallocation_disabled")
        now = (r.get("now") or {}).get("preallocation_disabled")
        seen.append({"pid": r.get("pid"), "argv": r.get("argv"), "startup": startup,
                     "at_report": now, "jax": r.get("jax"),
                     "environment_matches_plan": (r.get("startup") or {}).get("sha256")
                     == env_sha256(env)})
    if not reports:
        return planned, "plan", seen
    ok = planned and all(s["startup"] is True and s["at_report"] is True for s in seen)
    return ok, "child", seen


def physical_gpus(slots: Sequence[GpuSlot]) -> list[str]:
    """The physical GPUs of the job's leaves (a MIG leaf's parent): what NVML meters."""
    found = (s.parent_uuid or s.uuid for s in slots)
    return list(dict.fromkeys(u for u in found if u))


def _gpu_slots(admission: Admission) -> tuple[GpuSlot, ...]:
    return tuple(GpuSlot(lf.uuid, lf.kind, lf.parent_uuid, lf.name, lf.index,
                         lf.memory_total_bytes, lf.memory_free_bytes)
                 for lf in admission.leaves)


def _base_closeout(options: RunOptions, paths: Mapping[str, str], started: str) -> Closeout:
    """A refused run's closeout: what every run starts as until it gets further."""
    return Closeout(started_at=started, host=socket.gethostname(),
                    gpudiag_version=__version__, container_image=options.image,
                    artifacts=dict(paths), exit_code=EXIT_REFUSED)


def _refused(options: RunOptions, paths: Mapping[str, str], closeout: Closeout,
             verdict: Verdict, t0: float, err: BinaryIO | None,
             base: Mapping[str, str]) -> RunOutcome:
    record = verdict.record()
    closeout = replace(
        closeout, gpu_validation_blocker=verdict.gpu_validation_blocker, ready=False,
        blockers=tuple(record["blockers"]), ended_at=_now(),
        duration_s=round(time.monotonic() - t0, 3),
        evidence=record["evidence"].get("admission") or _blocker_evidence(record))
    primary = verdict.primary
    # Counted by the node's daemon (gpudiag_preflight_blocks_total{code}): the catch rate.
    report_block(verdict.gpu_validation_blocker, sorted({b.code for b in verdict.blockers}),
                 base, options.daemon_url)
    _say(err, f"gpudiag run: refused: {verdict.gpu_validation_blocker}: "
              f"{primary.message if primary else ''}\n")
    if primary is not None:
        _say(err, f"gpudiag run: fix: {primary.remediation}\n")
    try:
        _write(paths["verdict"], _json(record))
    except ArtifactError as e:
        closeout = replace(closeout, error=f"artifacts incomplete: {e}")
        _say(err, f"gpudiag run: artifacts incomplete: {e}\n")
    else:
        closeout = _close_out(paths, {"launched": False, "exit_code": EXIT_REFUSED,
                                      "reason": verdict.gpu_validation_blocker}, closeout, err)
    return RunOutcome(EXIT_REFUSED, closeout)


def _blocker_evidence(record: Mapping[str, Any]) -> dict[str, Any]:
    ev = record.get("evidence") or {}
    return {"driver": ev.get("driver"), "environment": ev.get("environment"),
            "device_nodes": ev.get("device_nodes"), "probe_stderr": ev.get("probe_stderr")}


def _say(err: BinaryIO | None, text: str) -> None:
    """One stderr line: its data (probe messages, lock paths) with control characters
    written out (core/termsafe), the line's own newline kept."""
    if err is not None:
        body, nl = (text[:-1], "\n") if text.endswith("\n") else (text, "")
        with contextlib.suppress(OSError, ValueError):
            err.write((terminal_safe(body, one_line=True) + nl).encode("utf-8", "replace"))
            err.flush()


# --- the route ------------------------------------------------------------------------------


def execute(options: RunOptions, env: Mapping[str, str] | None = None, *,
            out: BinaryIO | None = None, err: BinaryIO | None = None,
            after_first_observation: Hook | None = None) -> RunOutcome:
    """Run ``options.argv`` the gpudiag way; returns the exit code and the closeout.

    This process becomes a subreaper and reaps every child it has: call it from a process
    that owns no other children (the CLI does).
    """
    t0 = time.monotonic()
    started = _now()
    base = dict(os.environ if env is None else env)
    try:
        prepare_folder(options.artifacts)
    except UntrustedFolder as e:
        raise RunnerError(f"refusing the artifacts dir: {e}") from e
    except OSError as e:
        raise RunnerError(f"cannot create the artifacts dir {options.artifacts}: "
                          f"{e.strerror or e}") from e
    paths = _paths(options.artifacts)
    closeout = _base_closeout(options, paths, started)
    python = job_python(options, base)
    verdict, first = preflight_for_admission(options.requirement, options.gpus, base,
                                             options.probe_timeout_s, options.daemon_url,
                                             python)
    closeout = replace(closeout, verdict_source=verdict.source)
    lock_dir = options.lock_dir
    if lock_dir is None:
        lock_dir = default_lock_dir(base) if options.gpus else Path(os.devnull)
    admitter = Admitter(env=base, lock_dir=lock_dir, gpus=options.gpus,
                        min_free_memory_bytes=options.min_free_memory_bytes,
                        lock_timeout_s=options.lock_timeout_s,
                        after_first_observation=after_first_observation,
                        on_wait=lambda text: _say(err, f"gpudiag run: {text}\n"),
                        python=python)
    try:
        admission = admitter.admit(
            _with_requirement(verdict, options.requirement), first)
    except AdmissionError as e:
        return _refused(options, paths, closeout, e.verdict, t0, err, base)
    for uuid, why in admission.unusable_locks:
        _say(err, f"gpudiag run: passed over {uuid}: {why}\n")
    try:
        return _launch(options, base, admission, paths, closeout, t0, out, err)
    finally:
        admission.release()


def job_python(options: RunOptions, env: Mapping[str, str]) -> JobPython | None:
    """The run's job interpreter: ``--python``, else $GPUDIAG_JOB_PYTHON, ARGV's own Python
    (``python3 train.py``, a script whose #! names one), the job's venv or PATH; in a
    container image the image's Python cannot be asked here: what the job's environment
    here says stands (engine/jobpython.py)."""
    from gpudiag.engine.route import needs_job_python

    if options.python is None and not needs_job_python(options.requirement):
        return None  # a run on the device layer alone never looks for one
    command = None if options.image is not None else options.argv
    return jobpython.find(env, explicit=options.python, command=command)


def _with_requirement(verdict: Verdict, requirement: Requirement) -> Verdict:
    return replace(verdict, requirement=requirement)


def _launch(options: RunOptions, base: Mapping[str, str], admission: Admission,
            paths: Mapping[str, str], closeout: Closeout, t0: float,
            out: BinaryIO | None, err: BinaryIO | None) -> RunOutcome:
    """Write the plan, start the child from it, wait for its whole tree, close out."""
    written, env, injection = _write_plan(options, base, admission, paths)
    closeout = replace(closeout, gpu_injection=injection, gpus=_gpu_slots(admission),
                       ready=True)
    asked = closeout.verdict_source in ("daemon", "hybrid")  # a daemon answered (a part)
    gpu_events = GpuEvents.begin(gpus_of([g.record() for g in closeout.gpus]), base,
                                 options.daemon_url if asked else None,
                                 [lk.fd for lk in admission.locks])
    meter = JobMeter(physical_gpus(closeout.gpus), base)
    meter.start()
    # Its allocation series (gpudiag_gpu_allocation_info) is the daemon's, from the run's
    # attested begin above: no file is dropped for it.
    try:
        ran = _run_child(options, written["launch_argv"], env, admission, paths, out, err)
    finally:
        usage = meter.stop()
    if isinstance(ran, OSError):
        gpu_events.close()
        return _launch_failed(written["launch_argv"][0], ran, paths, closeout, t0, err)
    locks = _release_and_check(admission)
    code, sig = _exit_code(ran.status)
    prealloc, source, seen = preallocation_verdict(
        env, child_reports(options.artifacts / ARTIFACT_NAMES["child_reports"]))
    result = _result_record(ran, written, options, code, sig, locks, seen)
    timed_out = ran.state.timed_out
    closeout = replace(
        closeout, launched=True, status="timed_out" if timed_out else (
            "signaled" if sig is not None else "exited"),
        exit_code=code, exit_signal=sig, timed_out=timed_out,
        preallocation_disabled="yes" if prealloc else "no", preallocation_source=source,
        xla_allocator=xla_allocator(env), ended_at=_now(),
        duration_s=round(time.monotonic() - t0, 3),
        evidence={"child_reports": seen, "plan_fingerprint": written["fingerprint"]})
    closeout = close_attribution(gpu_events, closeout, written["launch_argv"], ran.pid, code,
                                 base, usage)
    broken = [t.error for t in ran.tees if t.error]
    if broken:
        closeout = replace(closeout, error="artifacts incomplete: " + "; ".join(broken))
        _say(err, f"gpudiag run: {closeout.error}\n")
    closeout = _close_out(paths, result, closeout, err)
    if timed_out:
        _say(err, f"gpudiag run: timed out after {options.timeout_s:g} s; the whole tree "
                  f"was ended (exit {code})\n")
    return RunOutcome(code, closeout)


@dataclass(frozen=True)
class _Ran:
    """A child that started, its whole tree waited for: what the closeout records of it."""

    pid: int
    tees: tuple[_Tee, _Tee]
    tree: Tree
    state: _Wait
    subreaper: bool
    started_at: str
    duration_s: float

    @property
    def status(self) -> int:
        """The child's wait status (0 when it was never reaped as such)."""
        return self.state.main_status if self.state.main_status is not None else 0


def _run_child(options: RunOptions, argv: Sequence[str], env: Mapping[str, str],
               admission: Admission, paths: Mapping[str, str], out: BinaryIO | None,
               err: BinaryIO | None) -> _Ran | OSError:
    """Start the child (the OSError when it cannot start) and wait for its whole tree."""
    subreaper = set_child_subreaper()
    tree = Tree()
    state = _Wait()
    start_wall, start_mono = _now(), time.monotonic()
    try:
        proc = subprocess.Popen(  # noqa: S603 - argv as given, never a shell
            argv, env=env, cwd=str(options.cwd), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True, close_fds=True,
            pass_fds=[lk.fd for lk in admission.locks])
    except OSError as e:
        return e
    assert proc.stdout is not None and proc.stderr is not None
    tees = (_Tee(proc.stdout, Path(paths["stdout"]), out),
            _Tee(proc.stderr, Path(paths["stderr"]), err))
    for t in tees:
        t.start()
    previous = _forward_signals(proc.pid, state)
    try:
        _wait_tree(proc, tree, options.timeout_s, options.kill_grace_s, state)
    finally:
        _restore_signals(previous)
    end_mono = time.monotonic()
    for t in tees:
        t.join(timeout=5.0)
    return _Ran(proc.pid, tees, tree, state, subreaper, start_wall,
                round(end_mono - start_mono, 3))


def _result_record(ran: _Ran, written: Mapping[str, Any], options: RunOptions, code: int,
                   sig: int | None, locks: dict[str, Any], seen: list[dict[str, Any]]
                   ) -> dict[str, Any]:
    """The closeout's result: how the child ran and ended, its outputs, tree and locks."""
    state = ran.state
    return {
        "launched": True, "argv": written["launch_argv"], "pid": ran.pid,
        "exit_code": code, "exit_signal": sig, "wait_status": ran.status,
        "timed_out": state.timed_out, "started_at": ran.started_at, "ended_at": _now(),
        "duration_s": ran.duration_s,
        "kill": {"grace_s": options.kill_grace_s, "term_sent": state.term_sent_at is not None,
                 "kill_sent": state.kill_sent_at is not None},
        "forwarded_signals": state.forwarded,
        "outputs": {name: {"path": str(t.log), "bytes": t.size, "sha256": t.sha.hexdigest(),
                           "error": t.error}
                    for name, t in (("stdout", ran.tees[0]), ("stderr", ran.tees[1]))},
        "descendants": ran.tree.record(), "descendants_seen": ran.tree.total,
        "subreaper": ran.subreaper, "locks": locks, "child_reports": seen,
        "plan_fingerprint": written["fingerprint"],
    }


def _write_plan(options: RunOptions, base: Mapping[str, str], admission: Admission,
                paths: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str], str | None]:
    """Plan, verdict and environment on disk in full; the plan as read back, the child's
    environment derived from it alone, and how --image injects the GPUs (None: no image)."""
    hook_dir: Path | None = None
    if options.image is None:
        hook_dir = options.artifacts / "python-hook"
        for folder in (hook_dir, options.artifacts / ARTIFACT_NAMES["child_reports"]):
            try:
                # Made anew: what runs in the child (the hook) is only ever what we wrote.
                fresh_subfolder(folder)
            except OSError as e:
                raise _artifact_error(folder, e) from e
        _write(hook_dir / "sitecustomize.py", sitecustomize_source())
    plan = build_plan(options, admission, base, hook_dir)
    argv: list[str] = list(options.argv)
    injection: str | None = None
    if options.image is not None:
        from gpudiag.runner.containers import plan_docker

        docker = plan_docker(options.image, options.argv, admission.uuids,
                             plan["environment"]["set"], docker=options.docker,
                             name=f"gpudiag-{os.getpid()}-{int(time.time())}")
        plan["docker"] = docker.record()
        argv = list(docker.argv)
        injection = docker.injection
    plan["launch_argv"] = argv
    plan["fingerprint"] = fingerprint(plan)
    # Nothing starts unless plan, verdict and environment are on disk in full: the plan
    # is what the closeout vouches for.
    _write(paths["plan"], _json(plan))
    _write(paths["verdict"], _json(admission.verdict.record()))
    # Derived from the plan as written, read back: nothing else decides the environment.
    try:
        written = json.loads(read_own(Path(paths["plan"])).decode("utf-8"))
    except OSError as e:
        raise ArtifactError(f"cannot read back {paths['plan']}: {e.strerror or e}") from e
    env = environment_from_plan(written, base)
    _write(paths["environment"], _json(environment_record(env, written)))
    return written, env, injection


def _launch_failed(program: str, e: OSError, paths: Mapping[str, str], closeout: Closeout,
                   t0: float, err: BinaryIO | None) -> RunOutcome:
    """The child could not start: 127 not found, 126 not executable, else 125."""
    code = (EXIT_NOT_FOUND if isinstance(e, FileNotFoundError)
            else EXIT_CANNOT_EXECUTE if isinstance(e, PermissionError) else EXIT_REFUSED)
    closeout = replace(closeout, status="launch_failed", exit_code=code, ended_at=_now(),
                       duration_s=round(time.monotonic() - t0, 3),
                       error=f"cannot start {program!r}: {e.strerror or e}")
    _say(err, f"gpudiag run: {closeout.error}\n")
    closeout = _close_out(paths, {"launched": False, "exit_code": code,
                                  "error": closeout.error}, closeout, err)
    return RunOutcome(code, closeout)


def _release_and_check(admission: Admission) -> dict[str, Any]:
    """Release the GPUs once the whole tree has ended, with the evidence that nothing kept
    the locks: each can be taken (and dropped) right away."""
    descendants_ended_at = _now()
    admission.release()
    released_at = _now()
    free_after = {}
    for lk in admission.locks:
        try:
            again = try_lock(Path(lk.path).parent, lk.uuid)
        except LockFailed:  # replaced by something else meanwhile: not free for us
            again = None
        free_after[lk.uuid] = again is not None
        if again is not None:
            release_locks([again])
    return {"released": True, "descendants_ended_at": descendants_ended_at,
            "released_at": released_at, "free_after_release": free_after,
            "held": [lk.record() for lk in admission.locks]}


def _exit_code(status: int) -> tuple[int, int | None]:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return 128 + sig, sig
    return os.WEXITSTATUS(status), None


SignalHandler = Callable[[int, FrameType | None], Any] | int | None


def _forward_signals(pgid: int, state: _Wait) -> dict[int, SignalHandler]:
    def forward(signum: int, _frame: FrameType | None) -> None:
        state.forwarded.append({"signal": signum, "at": time.time()})
        with contextlib.suppress(OSError):
            os.killpg(pgid, signum)

    previous: dict[int, SignalHandler] = {}
    for sig in FORWARDED_SIGNALS:
        with contextlib.suppress(ValueError, OSError):  # not the main thread: no forwarding
            previous[sig] = signal.signal(sig, forward)
    return previous


def _restore_signals(previous: Mapping[int, SignalHandler]) -> None:
    for sig, handler in previous.items():
        with contextlib.suppress(ValueError, OSError, TypeError):
            signal.signal(sig, handler)

