"""One busy-GPU round: the safety rule in one place (docs/design-notes.md, "Busy GPUs").

A probe never touches a GPU that someone else is using. Every active probe (one that makes a
CUDA context: cuda, JAX or IREE on a GPU) runs through ``prove_round``: NVML's reading (no
context) gives each GPU leaf its occupancy, the caller's visibility narrows the candidates,
FREE GPUs are claimed under their full-UUID locks (a job's lock makes a GPU busy), and each
active probe runs on the GPUs its spec declares (``proves_on``: every claimed GPU, or one)
pointed at them the way its spec says (``pointed_by``: the ``contexts_on`` option, or both
visibility variables). A probe with no GPU to touch reads only what needs none (``static``);
with no driver at all it runs as it is, to name what else is missing.

The daemon's scheduler (one backend per call, rotating over the free GPUs, the site's
``probe_busy_gpus``) and inline runs (CLI, API, admission: every active probe at once, the
caller's held GPUs) call this one function; what differs between them is a parameter of
``RoundPolicy``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import field
from pathlib import Path
from typing import Any

from gpudiag.core import registry
from gpudiag.core.backend import EVERY_GPU, POINT_BY_OPTION
from gpudiag.core.probe_run import ProbeRun
from gpudiag.core.readiness import GpuOccupancy, ProbeScope
from gpudiag.core.records import dataclass
from gpudiag.core.visibility import pinned_to
from gpudiag.engine.guard import (
    SIBLING_WAIT_S,
    GpuClaim,
    claim_free,
    driver_absent,
    exclusive_gpus,
    rotated,
    touches_gpu,
    visible_uuids,
    why_unclaimed,
)
from gpudiag.engine.occupancy_view import locked_by_claim, occupancy_view

# Whether a probe child with these options makes a GPU context (its spec says): such a probe
# runs only through prove_round.
is_active = touches_gpu

# (probe name, options): what one active probe child is asked to do.
Request = tuple[str, Mapping[str, Any] | None]
# Runs several probe children at once: the requests and, per probe name, the variables to
# set over the caller's own child environment; returns each probe's run.
Runner = Callable[[Sequence[Request], Mapping[str, Mapping[str, str]]], dict[str, ProbeRun]]


@dataclass(frozen=True)
class RoundPolicy:
    """What differs between the daemon's round and an inline one, said explicitly."""

    # Where the one-GPU backends start among the free GPUs (the daemon rotates, so that over
    # rounds every free GPU proves them; an inline run starts at the first).
    rotation: int = 0
    # Config ``probe_busy_gpus`` (the daemon's; off everywhere else): BUSY GPUs are probed
    # too. UNKNOWN never is.
    probe_busy: bool = False
    # How long to wait for a sibling probe's exclusive lock (exclusive compute modes).
    sibling_wait_s: float = SIBLING_WAIT_S
    # GPUs the caller holds under a job's lock (admission proving what it admits).
    held: Collection[str] = ()


@dataclass(frozen=True)
class RoundResult:
    """What one round ran, and what it could touch."""

    runs: dict[str, ProbeRun]
    occupancy: dict[str, GpuOccupancy]
    # Per one-GPU backend: the GPU it was pointed at (None: no free GPU, static reading).
    backend_gpu: dict[str, str | None] = field(default_factory=dict)
    # The GPUs the every-GPU backends (cuda) made their contexts on.
    probed: frozenset[str] = frozenset()

    def scope(self) -> ProbeScope:
        """The round as classify reads it (core.readiness)."""
        return ProbeScope(occupancy=dict(self.occupancy), probed=self.probed,
                          backend_gpu=dict(self.backend_gpu))


def _proves_on_every(name: str) -> bool:
    spec = registry.spec(name)
    return spec is not None and spec.proves_on == EVERY_GPU


def _pointed(name: str, options: Mapping[str, Any] | None, gpus: Sequence[str]
             ) -> tuple[Mapping[str, Any] | None, Mapping[str, str]]:
    """The options and variables that point ``name``'s child at exactly ``gpus``."""
    spec = registry.spec(name)
    if spec is not None and spec.pointed_by == POINT_BY_OPTION:
        return {**(options or {}), "contexts_on": list(gpus)}, {}
    return options, pinned_to(gpus)


def prove_round(nvml_run: ProbeRun, active: Sequence[Request], *,
                visibility_env: Mapping[str, str], lock_dir: Path, run: Runner,
                policy: RoundPolicy = RoundPolicy()) -> RoundResult:
    """Run the active probes on the FREE GPUs of NVML's reading, under their locks.

    ``visibility_env`` holds the caller's visibility variables (the job's view: never
    widened). The every-GPU probes run first on every claimed GPU; then the other locks go,
    so that no `gpudiag run` job waits for GPUs this round does not use, and the one-GPU
    probes run together on the first claimed GPU in rotation order.
    """
    nvml = nvml_run.nvml if nvml_run.ok else None
    # The one view; its lock answer is the claim's (which takes the lock in the same step).
    view = occupancy_view(nvml, lock_dir=lock_dir, locks=False)
    candidates = rotated(visible_uuids(nvml, visibility_env), policy.rotation)
    every = [r for r in active if _proves_on_every(r[0])]
    one = [r for r in active if not _proves_on_every(r[0])]
    with claim_free(view.gpus, candidates, lock_dir=lock_dir, probe_busy=policy.probe_busy,
                    limit=None if every else 1, exclusive=exclusive_gpus(nvml),
                    sibling_wait_s=policy.sibling_wait_s, held=policy.held) as claim:
        occupancy = locked_by_claim(view.gpus, claim.left_alone)
        runs = _run_on(every, list(claim.claimed), claim, nvml_run, run) if every else {}
        gpu = claim.claimed[0] if claim.claimed else None
        claim.keep_only(gpu)
        backend_gpu: dict[str, str | None] = {}
        if one:
            if gpu is not None or not driver_absent(nvml):
                backend_gpu = dict.fromkeys((name for name, _ in one), gpu)
            runs.update(_run_on(one, [gpu] if gpu is not None else [], claim, nvml_run, run))
    probed = frozenset(claim.claimed) if every and any(n in runs for n, _ in every) \
        else frozenset()
    return RoundResult(runs, occupancy, backend_gpu, probed)


def _run_on(requests: Sequence[Request], gpus: list[str], claim: GpuClaim, nvml_run: ProbeRun,
            run: Runner) -> dict[str, ProbeRun]:
    """Run ``requests`` pointed at ``gpus``; with none, only what needs no GPU is read."""
    nvml = nvml_run.nvml if nvml_run.ok else None
    planned: list[Request] = []
    envs: dict[str, Mapping[str, str]] = {}
    for name, options in requests:
        spec = registry.spec(name)
        by_option = spec is not None and spec.pointed_by == POINT_BY_OPTION
        if not gpus and driver_absent(nvml) and not by_option:
            planned.append((name, options))  # no driver, no GPU in use: name what is missing
        elif not gpus and not by_option:
            # No free GPU: nothing is touched, but what needs no GPU is still read.
            planned.append((name, {**(options or {}), "static": why_unclaimed(claim)}))
        else:
            pointed_options, variables = _pointed(name, options, gpus)
            planned.append((name, pointed_options))
            if variables:
                envs[name] = variables
    return run(planned, envs)
