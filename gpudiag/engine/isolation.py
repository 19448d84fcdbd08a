"""Run one probe as an isolated child: own session, explicit environment, deadline, group kill.

Nothing a probe does can crash or hang the caller: a hang is killed at the deadline with its
whole process group, a crash or garbage output becomes a ``ProbeRun`` like any other.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from gpudiag.core.probe_run import ProbeRun, bounded_tail
from gpudiag.core.records import dataclass
from gpudiag.engine.forkclient import AFTER_KILL_WAIT_S, ForkServer, collect

STDOUT_LIMIT_BYTES = 16 * 1024 * 1024


def probe_argv(backend: str, options: Mapping[str, Any] | None = None,
               interpreter: Sequence[str] | None = None) -> list[str]:
    """The argv of a probe child: ``python -m gpudiag.probes NAME [OPTIONS-JSON]``, or with
    ``interpreter`` (a runtime's Python and the probe archive) ``PYTHON -s ARCHIVE NAME ...``."""
    start = list(interpreter) if interpreter else [sys.executable, "-m", "gpudiag.probes"]
    argv = [*start, backend]
    if options:
        argv.append(json.dumps(dict(options), sort_keys=True))
    return argv


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_probe(backend: str, *, env: Mapping[str, str], timeout_s: float,
              options: Mapping[str, Any] | None = None,
              forker: ForkServer | None = None,
              interpreter: Sequence[str] | None = None,
              identity: tuple[int, int] | None = None) -> ProbeRun:
    """Run one probe child to completion or to its deadline; never raises for the probe's sake.

    With ``forker`` the child is forked by the probe fork server when it can (the same child,
    without a fresh interpreter); otherwise, or when the server is gone, it is spawned.
    ``interpreter``: another Python runs it (a runtime's, engine/runtimes.py, or the job's,
    engine/jobpython.py): spawned.
    ``identity``: the (uid, gid) it runs as, with no supplementary group (a runtime's
    children run with no more privilege than its jobs: docs/security.md)."""
    argv = probe_argv(backend, options, interpreter)
    if forker is not None and interpreter is None and identity is None:
        forked = _run_forked(forker, backend, env, timeout_s, options)
        if forked is not None:
            return _result(backend, argv, timeout_s, forked)
    return _result(backend, argv, timeout_s, _run_spawned(argv, env, timeout_s, identity))


@dataclass(frozen=True)
class _Ended:
    """How a probe child ended, before its output is read: the raw facts of either path."""

    duration_s: float
    returncode: int | None
    timed_out: bool
    out: bytes
    err: bytes
    start_error: str | None = None


def as_identity(identity: tuple[int, int] | None) -> dict[str, Any]:
    """subprocess's arguments that start a child as ``identity`` (uid, gid) with no
    supplementary groups, in "/" (the daemon's folder may be closed to it); {} for None or
    the daemon's own identity."""
    if identity is None or identity == (os.geteuid(), os.getegid()):
        return {}
    return {"user": identity[0], "group": identity[1], "extra_groups": [], "cwd": "/"}


def _run_spawned(argv: list[str], env: Mapping[str, str], timeout_s: float,
                 identity: tuple[int, int] | None = None) -> _Ended:
    started = time.monotonic()
    try:
        proc = subprocess.Popen(  # noqa: S603 - fixed argv, no shell
            argv, env={**env, "GPUDIAG_PROBE_PARENT_PID": str(os.getpid())},
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True, close_fds=True,
            **as_identity(identity),
        )
    except OSError as e:
        return _Ended(time.monotonic() - started, None, False, b"", b"",
                      f"could not start the probe child: {e}")
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc.pid)
        out, err = proc.communicate()
    finally:
        # Grandchildren (nvidia-smi, compilers) must not outlive the probe either.
        _kill_group(proc.pid)
    return _Ended(time.monotonic() - started, proc.returncode, timed_out, out, err)


def _run_forked(forker: ForkServer, backend: str, env: Mapping[str, str], timeout_s: float,
                options: Mapping[str, Any] | None) -> _Ended | None:
    """The forked child's end; None when the server could not fork it or died meanwhile
    (the caller spawns it then: a server's end is not the probe's)."""
    started = time.monotonic()
    child = forker.fork(backend, options, env)
    if child is None:
        return None
    if child.asked_at is not None:  # asked for ahead (ForkServer.ask_ahead): it ran since
        started = child.asked_at
    try:
        got = collect(child, started + timeout_s)
        timed_out = got.status is None and not got.server_gone
        if timed_out:
            _kill_group(child.pid)
            # Killed: its pipes end and the server reports the signal (bounded, if it is gone).
            got = collect(child, time.monotonic() + AFTER_KILL_WAIT_S, got)
    finally:
        _kill_group(child.pid)
        for fd in (child.stdout, child.stderr, child.status):
            os.close(fd)
        forker.done()
    if got.status is None:
        return None if not timed_out else _Ended(
            time.monotonic() - started, -signal.SIGKILL, True, got.out, got.err)
    return _Ended(time.monotonic() - started, os.waitstatus_to_exitcode(got.status),
                  timed_out, got.out, got.err)


def _result(backend: str, argv: list[str], timeout_s: float, end: _Ended) -> ProbeRun:
    """The ProbeRun of a child that ended (spawned or forked: one reading of both)."""
    duration, code, argv_t = end.duration_s, end.returncode, tuple(argv)
    if end.start_error is not None:
        return ProbeRun(backend, None, duration, error=end.start_error, argv=argv_t)
    tail = bounded_tail(end.err)
    sig = -code if code is not None and code < 0 else None
    if end.timed_out:
        return ProbeRun(backend, None, duration, None, sig, True, tail,
                        f"probe {backend} missed its {timeout_s:g} s deadline and was killed",
                        argv_t)
    if sig is not None:
        name = signal.Signals(sig).name if sig in signal.valid_signals() else str(sig)
        return ProbeRun(backend, None, duration, code, sig, False, tail,
                        f"probe {backend} was killed by signal {sig} ({name})", argv_t)
    observation, parse_error = _parse_observation(end.out)
    if code != 0:
        return ProbeRun(backend, observation, duration, code, None, False, tail,
                        f"probe {backend} exited with status {code}", argv_t)
    if observation is None:
        return ProbeRun(backend, None, duration, code, None, False, tail,
                        f"probe {backend} printed no valid observation: {parse_error}", argv_t)
    # Building the run parses the observation into its typed record, once, here; a malformed
    # one becomes a probe_error run naming the field (gpudiag.core.observations).
    return ProbeRun(backend, observation, duration, code, None, False, tail, None, argv_t)


def _parse_observation(out: bytes) -> tuple[dict[str, Any] | None, str | None]:
    if len(out) > STDOUT_LIMIT_BYTES:
        return None, f"{len(out)} bytes of output, over the {STDOUT_LIMIT_BYTES} byte limit"
    text = out.decode("utf-8", errors="replace").strip()
    if not text:
        return None, "empty output"
    # The observation is the last line; anything a library printed before it is ignored.
    last = text.splitlines()[-1]
    try:
        value = json.loads(last)
    except json.JSONDecodeError as e:
        return None, f"not JSON ({e.msg} at column {e.colno}): {last[:200]!r}"
    except RecursionError:
        return None, f"JSON nested too deeply to read: {last[:200]!r}"
    if not isinstance(value, dict):
        return None, f"a JSON {type(value).__name__}, not an object"
    return value, None


def run_probes(requests: Sequence[tuple[str, Mapping[str, Any] | None]], *,
               env: Mapping[str, str], timeouts: Mapping[str, float],
               envs: Mapping[str, Mapping[str, str]] | None = None,
               forker: ForkServer | None = None,
               interpreters: Mapping[str, Sequence[str]] | None = None
               ) -> dict[str, ProbeRun]:
    """Run several probes in parallel, each in its own child with its own deadline
    (``envs`` gives a probe its own environment instead of ``env``; ``interpreters`` its
    own Python and probe archive: the job's, engine/jobpython.py)."""
    if not requests:
        return {}
    own = envs or {}
    pythons = interpreters or {}
    if len(requests) == 1:  # no thread for one child (nor concurrent.futures' import)
        name, opts = requests[0]
        return {name: run_probe(name, env=own.get(name, env), timeout_s=timeouts[name],
                                options=opts, forker=forker,
                                interpreter=pythons.get(name))}
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        futures = {
            name: pool.submit(run_probe, name, env=own.get(name, env),
                              timeout_s=timeouts[name], options=opts, forker=forker,
                              interpreter=pythons.get(name))
            for name, opts in requests
        }
        return {name: f.result() for name, f in futures.items()}
