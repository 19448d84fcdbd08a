"""Inline runs: pick the probes a requirement needs and run them as isolated children."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpudiag.core import registry
from gpudiag.core.clock import now_rfc3339
from gpudiag.core.environment import probe_environment
from gpudiag.core.probe_run import ProbeRun
from gpudiag.core.readiness import BUSY, GpuOccupancy, ProbeScope
from gpudiag.core.verdict import Requirement
from gpudiag.engine.forkserver import ForkServer
from gpudiag.engine.guard import (
    SIBLING_WAIT_S,
    claim_free,
    driver_absent,
    exclusive_gpus,
    not_foreign,
    occupancy_from_nvml,
    touches_gpu,
    visible_uuids,
    why_unclaimed,
)
from gpudiag.engine.isolation import run_probes
from gpudiag.engine.locks import default_lock_dir
from gpudiag.engine.plan import probes_for

Request = tuple[str, Mapping[str, Any] | None]


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
               forker: ForkServer | None = None) -> InlineRun:
    """Run the probes a requirement needs, GPU-touching ones only on FREE GPUs
    (docs/design-notes.md "Busy GPUs"): nvml first, then cuda, jax and iree under the GPUs'
    locks; host beside.
    ``held``: full UUIDs the caller already holds a job's lock on (it proves them as its own).
    ``forker``: a fork server the caller started ahead for this run's probe environment (it
    stays the caller's to close); else the run starts its own.
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
    # Two or more children: one interpreter start (the fork server's) instead of one each,
    # or none when this process may fork itself into the server (started now, before the
    # round's threads: docs/design-notes.md "Probe fork server").
    with contextlib.ExitStack() as stack:
        if forker is None or not forker.serves(child_env):
            forker = stack.enter_context(ForkServer(
                child_env, probes=[name for name, _ in requests], fork_here=True))
        used = forker if len(requests) > 1 else None
        if used is not None:
            used.start()
        return _run_all(requests, child_env, limits, lock_dir or default_lock_dir(base), held,
                        checked_at, used)


def _run_all(requests: Sequence[Request], child_env: Mapping[str, str],
             limits: Mapping[str, float], lock_dir: Path, held: Collection[str],
             checked_at: str, forker: ForkServer | None) -> InlineRun:
    """The passive probes beside the nvml -> active chain (or all at once without one)."""
    active = [r for r in requests if touches_gpu(*r)]
    if not active:
        return InlineRun(run_probes(requests, env=child_env, timeouts=limits, forker=forker),
                         checked_at)
    passive = [r for r in requests if r not in active and r[0] != "nvml"]
    # Occupancy needs NVML's reading first, even when only cuda was asked for; the other
    # passive probes (host: nvidia-smi, the slowest) run beside the nvml -> active chain.
    wanted_nvml = any(name == "nvml" for name, _ in requests)
    runs: dict[str, ProbeRun] = {}
    if not passive:  # nothing beside the chain: no thread (nor concurrent.futures' import)
        nvml_run, (active_runs, scope) = _chain(active, child_env, limits, lock_dir, held,
                                                forker)
    else:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="passive") as pool:
            beside = pool.submit(run_probes, passive, env=child_env, timeouts=limits,
                                 forker=forker)
            nvml_run, (active_runs, scope) = _chain(active, child_env, limits, lock_dir,
                                                    held, forker)
            runs = beside.result()
    if wanted_nvml:
        runs["nvml"] = nvml_run
    runs.update(active_runs)
    return InlineRun(runs, checked_at, scope)


def _chain(active: Sequence[Request], child_env: Mapping[str, str],
           limits: Mapping[str, float], lock_dir: Path, held: Collection[str],
           forker: ForkServer | None) -> tuple[ProbeRun, tuple[dict[str, ProbeRun], ProbeScope]]:
    """nvml, then the active probes on the FREE GPUs of its reading."""
    nvml_run = run_probes([("nvml", None)], env=child_env, timeouts=limits,
                          forker=forker)["nvml"]
    return nvml_run, _run_active(active, nvml_run, child_env, limits, lock_dir, held, forker)


def _run_active(active: Sequence[Request], nvml_run: ProbeRun, child_env: Mapping[str, str],
                limits: Mapping[str, float], lock_dir: Path, held: Collection[str] = (),
                forker: ForkServer | None = None) -> tuple[dict[str, ProbeRun], ProbeScope]:
    """cuda, jax and iree on the FREE GPUs of NVML's reading, under their locks."""
    nvml = nvml_run.nvml if nvml_run.ok else None
    occupancy = occupancy_from_nvml(nvml, not_foreign(nvml, lock_dir=lock_dir))
    candidates = visible_uuids(nvml, child_env)
    with claim_free(occupancy, candidates, lock_dir=lock_dir, exclusive=exclusive_gpus(nvml),
                    sibling_wait_s=SIBLING_WAIT_S, held=held) as claim:
        for uuid, why in claim.left_alone.items():
            if why == "locked":  # a gpudiag run job holds it (its process may not be up yet)
                occupancy[uuid] = GpuOccupancy(uuid, BUSY, why="locked by a gpudiag run job")
        runs: dict[str, ProbeRun] = {}
        cuda = [(n, o) for n, o in active if n == "cuda"]
        if cuda:
            name, opts = cuda[0]
            runs.update(run_probes([(name, {**(opts or {}), "contexts_on": list(claim.claimed)})],
                                   env=child_env, timeouts=limits, forker=forker))
        # JAX and IREE prove their backend on one free GPU: the other locks go first, so
        # that no `gpudiag run` job waits for GPUs this preflight does not use.
        one_gpu = claim.claimed[0] if claim.claimed else None
        claim.keep_only(one_gpu)
        planned: list[Request] = []
        envs: dict[str, Mapping[str, str]] = {}
        backend_gpu: dict[str, str | None] = {}
        for name, opts in active:
            if name == "cuda":
                continue
            if one_gpu is None and driver_absent(nvml):
                planned.append((name, opts))  # no driver, no GPU in use: name what is missing
                continue
            backend_gpu[name] = one_gpu
            if one_gpu is None:
                # No free GPU: nothing is touched, but what needs no GPU is still read.
                planned.append((name, {**(opts or {}), "static": why_unclaimed(claim)}))
                continue
            envs[name] = {**child_env, "CUDA_VISIBLE_DEVICES": one_gpu,
                          "NVIDIA_VISIBLE_DEVICES": one_gpu}
            planned.append((name, opts))
        runs.update(run_probes(planned, env=child_env, timeouts=limits, envs=envs,
                               forker=forker))
    probed = frozenset(claim.claimed) if "cuda" in runs else frozenset()
    return runs, ProbeScope(occupancy=occupancy, probed=probed, backend_gpu=backend_gpu)
