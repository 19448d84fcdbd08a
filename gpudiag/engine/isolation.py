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
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gpudiag.core.probe_run import ProbeRun, bounded_tail

STDOUT_LIMIT_BYTES = 16 * 1024 * 1024


def probe_argv(backend: str, options: Mapping[str, Any] | None = None) -> list[str]:
    """The argv of a probe child: ``python -m gpudiag.probes NAME [OPTIONS-JSON]``."""
    argv = [sys.executable, "-m", "gpudiag.probes", backend]
    if options:
        argv.append(json.dumps(dict(options), sort_keys=True))
    return argv


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_probe(backend: str, *, env: Mapping[str, str], timeout_s: float,
              options: Mapping[str, Any] | None = None) -> ProbeRun:
    """Run one probe child to completion or to its deadline; never raises for the probe's sake."""
    argv = probe_argv(backend, options)
    started = time.monotonic()
    try:
        proc = subprocess.Popen(  # noqa: S603 - fixed argv, no shell
            argv, env={**env, "GPUDIAG_PROBE_PARENT_PID": str(os.getpid())},
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True, close_fds=True,
        )
    except OSError as e:
        return ProbeRun(backend, None, time.monotonic() - started,
                        error=f"could not start the probe child: {e}", argv=tuple(argv))
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
    duration = time.monotonic() - started
    tail = bounded_tail(err)
    code = proc.returncode
    sig = -code if code is not None and code < 0 else None
    if timed_out:
        return ProbeRun(backend, None, duration, None, sig, True, tail,
                        f"probe {backend} missed its {timeout_s:g} s deadline and was killed",
                        tuple(argv))
    if sig is not None:
        name = signal.Signals(sig).name if sig in signal.valid_signals() else str(sig)
        return ProbeRun(backend, None, duration, code, sig, False, tail,
                        f"probe {backend} was killed by signal {sig} ({name})", tuple(argv))
    observation, parse_error = _parse_observation(out)
    if code != 0:
        return ProbeRun(backend, observation, duration, code, None, False, tail,
                        f"probe {backend} exited with status {code}", tuple(argv))
    if observation is None:
        return ProbeRun(backend, None, duration, code, None, False, tail,
                        f"probe {backend} printed no valid observation: {parse_error}",
                        tuple(argv))
    # Building the run parses the observation into its typed record, once, here; a malformed
    # one becomes a probe_error run naming the field (gpudiag.core.observations).
    return ProbeRun(backend, observation, duration, code, None, False, tail, None, tuple(argv))


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
               envs: Mapping[str, Mapping[str, str]] | None = None) -> dict[str, ProbeRun]:
    """Run several probes in parallel, each in its own child with its own deadline
    (``envs`` gives a probe its own environment instead of ``env``)."""
    if not requests:
        return {}
    own = envs or {}
    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        futures = {
            name: pool.submit(run_probe, name, env=own.get(name, env),
                              timeout_s=timeouts[name], options=opts)
            for name, opts in requests
        }
        return {name: f.result() for name, f in futures.items()}
