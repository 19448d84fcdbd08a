"""Inline runs: pick the probes a requirement needs and run them as isolated children."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

from gpudiag.core import registry
from gpudiag.core.clock import now_rfc3339
from gpudiag.core.environment import probe_environment
from gpudiag.core.probe_run import ProbeRun
from gpudiag.core.readiness import ProbeScope
from gpudiag.core.records import dataclass
from gpudiag.core.verdict import Requirement
from gpudiag.engine.forkclient import ForkServer
from gpudiag.engine.isolation import run_probes
from gpudiag.engine.locks import default_lock_dir
from gpudiag.engine.plan import probes_for
from gpudiag.engine.round import Request, RoundPolicy, is_active, prove_round

TYPE_CHECKING = False
if TYPE_CHECKING:
    from gpudiag.engine.jobpython import JobPython


@dataclass(frozen=True)
class InlineRun:
    """What one inline round observed: the probe runs, when, and what they could touch."""

    runs: dict[str, ProbeRun]
    checked_at: str
    scope: ProbeScope | None = None


def run_inline(requirement: Requirement, *, env: Mapping[str, str] | None = None,
               timeout_s: float | None = None,
               timeouts: Mapping[str, float] | None = None, only: Collection[str] | None = None,
               lock_dir: Path | None = None, held: Collection[str] = (),
               forker: ForkServer | None = None, python: JobPython | None = None
               ) -> InlineRun:
    """Run the probes a requirement needs, GPU-touching ones only on FREE GPUs
    (docs/design-notes.md "Busy GPUs"): nvml first, then cuda, jax and iree under the GPUs'
    locks; host beside.
    ``held``: full UUIDs the caller already holds a job's lock on (it proves them as its own).
    ``forker``: a fork server the caller started ahead for this run's probe environment (it
    stays the caller's to close); else the run starts its own.
    ``python``: the job's interpreter (engine/jobpython.py; found from ``env`` when None):
    the environment-dependent probes (JAX, IREE) run under it, the device layer's here.
    """
    checked_at = now_rfc3339()
    requests = probes_for(requirement, only=only)
    limits = registry.timeouts_s()
    limits.update(timeouts or {})
    if timeout_s is not None:
        limits = {k: timeout_s for k in limits}
    # nvidia-smi hangs with a hung driver too: its own deadline must end before the host
    # probe's, so the host observation still arrives and says that nvidia-smi timed out.
    smi_timeout = {"nvidia_smi_timeout_s": round(min(5.0, limits["host"] * 0.5), 3)}
    requests = [(name, smi_timeout if name == "host" else opts) for name, opts in requests]
    base = os.environ if env is None else env
    child_env = probe_environment(base)
    pythons = job_interpreters(requests, base, python)
    # Two or more children: one interpreter start (the fork server's) instead of one each,
    # or none when this process may fork itself into the server (started now, before the
    # round's threads: docs/design-notes.md "Probe fork server").
    with contextlib.ExitStack() as stack:
        if forker is None or not forker.serves(child_env):
            forker = stack.enter_context(ForkServer(
                child_env, probes=[name for name, _ in requests if name not in pythons],
                fork_here=True))
        used = forker if len(requests) > 1 else None
        if used is not None:
            used.start()
        return _run_all(requests, child_env, limits, lock_dir or default_lock_dir(base), held,
                        checked_at, used, pythons)


def job_interpreters(requests: Sequence[Request], env: Mapping[str, str],
                     python: JobPython | None) -> dict[str, list[str]]:
    """The argv start of each environment-dependent probe run under the job's interpreter
    (none when it is this interpreter: those run as ``-m gpudiag.probes`` here)."""
    wanted = [name for name, _ in requests if registry.environment_dependent(name)]
    if not wanted:
        return {}
    from gpudiag.engine import jobpython

    start = jobpython.probe_interpreter(python or jobpython.find(env))
    if start is None:
        return {}
    return dict.fromkeys(wanted, start)


def _run_all(requests: Sequence[Request], child_env: Mapping[str, str],
             limits: Mapping[str, float], lock_dir: Path, held: Collection[str],
             checked_at: str, forker: ForkServer | None,
             pythons: Mapping[str, Sequence[str]]) -> InlineRun:
    """The passive probes beside the nvml -> active chain (or all at once without one)."""
    active = [r for r in requests if is_active(*r)]
    if not active:
        return InlineRun(run_probes(requests, env=child_env, timeouts=limits, forker=forker,
                                    interpreters=pythons), checked_at)
    passive = [r for r in requests if r not in active and r[0] != "nvml"]
    # Occupancy needs NVML's reading first, even when only cuda was asked for; the other
    # passive probes (host: nvidia-smi, the slowest) run beside the nvml -> active chain.
    wanted_nvml = any(name == "nvml" for name, _ in requests)
    runs: dict[str, ProbeRun] = {}
    if not passive:  # nothing beside the chain: no thread (nor concurrent.futures' import)
        nvml_run, (active_runs, scope) = _chain(active, child_env, limits, lock_dir, held,
                                                forker, pythons)
    else:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="passive") as pool:
            beside = pool.submit(run_probes, passive, env=child_env, timeouts=limits,
                                 forker=forker, interpreters=pythons)
            nvml_run, (active_runs, scope) = _chain(active, child_env, limits, lock_dir,
                                                    held, forker, pythons)
            runs = beside.result()
    if wanted_nvml:
        runs["nvml"] = nvml_run
    runs.update(active_runs)
    return InlineRun(runs, checked_at, scope)


def _chain(active: Sequence[Request], child_env: Mapping[str, str],
           limits: Mapping[str, float], lock_dir: Path, held: Collection[str],
           forker: ForkServer | None, pythons: Mapping[str, Sequence[str]]
           ) -> tuple[ProbeRun, tuple[dict[str, ProbeRun], ProbeScope]]:
    """nvml, then the active probes on the FREE GPUs of its reading."""
    nvml_run = run_probes([("nvml", None)], env=child_env, timeouts=limits,
                          forker=forker)["nvml"]
    return nvml_run, _run_active(active, nvml_run, child_env, limits, lock_dir, held, forker,
                                 pythons)


def _run_active(active: Sequence[Request], nvml_run: ProbeRun, child_env: Mapping[str, str],
                limits: Mapping[str, float], lock_dir: Path, held: Collection[str] = (),
                forker: ForkServer | None = None,
                pythons: Mapping[str, Sequence[str]] | None = None
                ) -> tuple[dict[str, ProbeRun], ProbeScope]:
    """The active probes on the FREE GPUs of NVML's reading, under their locks: the one
    busy-GPU round (engine/round.py), every active probe at once, from the first free GPU."""

    def run(requests: Sequence[Request], pinned: Mapping[str, Mapping[str, str]]
            ) -> dict[str, ProbeRun]:
        envs = {name: {**child_env, **variables} for name, variables in pinned.items()}
        return run_probes(requests, env=child_env, timeouts=limits, envs=envs, forker=forker,
                          interpreters=pythons)

    done = prove_round(nvml_run, active, visibility_env=child_env, lock_dir=lock_dir, run=run,
                       policy=RoundPolicy(held=held))
    return done.runs, done.scope()
