"""Qualify idle GPUs: pick the FREE ones, run the qualify child on each under its lock, score.

docs/design-notes.md "Busy GPUs": NVML is read first (no context); only GPUs FREE in that
reading are claimed, one at a time, each under its full-UUID lock (engine.guard.claim_free, the lock
`gpudiag run` takes), so that no job waits on a GPU this run is not measuring. The child
re-reads NVML before its first context and every 0.25 s after, and stops within 1 s when
another process appears. Results are scored (core.qualify_score) against the reference
table, this node's peers and the GPU's own history, then appended to the history.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import field
from pathlib import Path
from typing import Any

from gpudiag.core.clock import now_rfc3339
from gpudiag.core.environment import probe_environment
from gpudiag.core.gpunames import GpuNameError, NamedGpu, is_gpu_name, resolve
from gpudiag.core.observations import NvmlObservation
from gpudiag.core.probe_run import ProbeRun
from gpudiag.core.qualify import ABORTED, TIERS, ReferenceModel
from gpudiag.core.qualify_golden import resolve_goldens
from gpudiag.core.qualify_score import (
    GpuResult,
    Qualification,
    ResultError,
    Thresholds,
    child_results,
    coverage,
    parse_result,
    score,
)
from gpudiag.core.records import dataclass
from gpudiag.core.sdc import XLA_DETERMINISTIC_FLAGS
from gpudiag.core.visibility import pinned_to
from gpudiag.engine.guard import claim_free, visible_uuids
from gpudiag.engine.isolation import run_probe
from gpudiag.engine.locks import default_lock_dir, waiting_path
from gpudiag.engine.occupancy_view import occupancy_view
from gpudiag.engine.qualify_history import GoldenStore, HistoryUnavailable, QualificationHistory
from gpudiag.engine.qualify_inventory import inventories, read_inventories, with_side_effects

REPORT_SCHEMA = "gpudiag.qualify-report/1"
PLATFORMS = ("cuda", "cpu")
# Beyond the tier's own deadline (which the child keeps): Python and JAX start-up.
CHILD_MARGIN_S = 20.0
EXIT_ABORTED = 75  # gpudiag.probes.qualify's watcher ended a child that did not stop


class QualifyError(ValueError):
    """A request that cannot be run as given (the message names the fix)."""


@dataclass(frozen=True)
class QualifyOptions:
    """What to qualify and how to judge it."""

    tier: str = "quick"
    gpus: tuple[str, ...] | None = None   # indices or full UUIDs; None: every visible GPU
    platform: str = "cuda"                # cpu: JAX's CPU devices, no GPU needed
    cpu_devices: int = 8
    table: tuple[ReferenceModel, ...] | None = None
    thresholds: Thresholds = Thresholds()
    state_dir: Path | None = None         # where the history lives; None: no history
    lock_dir: Path | None = None


@dataclass(frozen=True)
class QualifyReport:
    """One qualification run: per GPU its scored result, and the GPUs left alone and why."""

    tier: str
    platform: str
    checked_at: str
    qualifications: tuple[Qualification, ...]
    left_alone: Mapping[str, str] = field(default_factory=dict)
    history_error: str | None = None

    @property
    def failed(self) -> bool:
        """Whether a GPU failed: a wrong answer, or too slow with qualification.block."""
        return any(q.severity == "blocker" for q in self.qualifications)

    @property
    def measured_nothing(self) -> str | None:
        """Why gpudiag measured nothing on any GPU it set out to, or None. A run that
        yielded to a job (the busy rule) is not gpudiag failing; anything else is."""
        if any(coverage(q.result).measured_anything for q in self.qualifications):
            return None
        failures = [q for q in self.qualifications if not q.result.yielded]
        if not failures:
            return None
        return "; ".join(f"GPU {q.result.index if q.result.index is not None else q.result.uuid}"
                         f": {q.result.aborted or 'no check covered anything'}"
                         for q in failures)

    def record(self) -> dict[str, Any]:
        """The report's JSON (schema gpudiag.qualify-report/1; docs/qualify.md)."""
        return {"schema": REPORT_SCHEMA, "tier": self.tier, "platform": self.platform,
                "checked_at": self.checked_at, "failed": self.failed,
                "measured_nothing": self.measured_nothing,
                "gpus": [q.record() for q in self.qualifications],
                "left_alone": dict(self.left_alone), "history_error": self.history_error}


def _check(options: QualifyOptions) -> None:
    if options.tier not in TIERS:
        raise QualifyError(f"unknown tier {options.tier!r}; use one of {', '.join(TIERS)}")
    if options.platform not in PLATFORMS:
        raise QualifyError(f"unknown platform {options.platform!r}; use cuda or cpu")
    for g in options.gpus or ():
        if not is_gpu_name(g):
            raise QualifyError(f"--gpus: {g!r} is not a GPU name: an index, a full UUID or a "
                               "unique prefix of one, or a PCI bus id (gpudiag probe lists "
                               "them)")


def qualify(options: QualifyOptions, *, env: Mapping[str, str] | None = None) -> QualifyReport:
    """Qualify the idle GPUs ``options`` name (or JAX's CPU devices) and score them."""
    _check(options)
    base = dict(os.environ if env is None else env)
    checked_at = now_rfc3339()
    left: dict[str, str] = {}
    if options.platform == "cpu":
        results = _run_cpu(options, probe_environment(base))
    else:
        results, left = _run_cuda(options, probe_environment(base),
                                  options.lock_dir or default_lock_dir(base))
    history = QualificationHistory.in_state_dir(options.state_dir) if options.state_dir else None
    past: list[dict[str, Any]] = []
    history_error = None
    try:
        past = history.records() if history else []
    except HistoryUnavailable as e:
        history_error = str(e)
    if options.tier == "sdc":
        results, golden_error = _goldens(results, past, options.state_dir, checked_at)
        history_error = history_error or golden_error
    scored = judge(results, past, options)
    if history is not None and history_error is None:
        try:
            history.append([q.record() for q in scored])
        except HistoryUnavailable as e:
            history_error = str(e)
    return QualifyReport(options.tier, options.platform, checked_at, tuple(scored), left,
                         history_error)


def _goldens(results: list[GpuResult], past: Sequence[Mapping[str, Any]],
             state_dir: Path | None, at: str) -> tuple[list[GpuResult], str | None]:
    """Judge the run's golden hashes against the node and the store; store new goldens."""
    store = GoldenStore.in_state_dir(state_dir) if state_dir else None
    parsed = []
    for rec in past:
        try:
            parsed.append(parse_result(rec))
        except ResultError:
            continue  # a damaged line is not evidence
    try:
        stored = store.hashes() if store else {}
    except HistoryUnavailable as e:
        return resolve_goldens(results, parsed, {})[0], str(e)
    judged, updates = resolve_goldens(results, parsed, stored)
    try:
        if store is not None:
            store.record(updates, at)
    except HistoryUnavailable as e:
        return judged, str(e)
    return judged, None


def judge(results: Sequence[GpuResult], past: Sequence[Mapping[str, Any]],
          options: QualifyOptions) -> list[Qualification]:
    """Score each result against the table, this run's and the history's peers, and its own
    history (records oldest first)."""
    parsed: list[tuple[GpuResult, str | None]] = []
    for rec in past:
        try:
            parsed.append((parse_result(rec), str(rec.get("code"))))
        except ResultError:
            continue  # a damaged line is not evidence
    here = {r.uuid for r in results}
    latest: dict[str, GpuResult] = {}
    for r, code in parsed:
        if r.uuid not in here and r.aborted is None and code != "gpu_compute_mismatch":
            latest[r.uuid] = r
    peers = [*results, *latest.values()]
    out = []
    for r in results:
        # Its own results that measured (not aborted, no wrong answer): a slow one counts
        # too, so that a GPU slow since its first run is left to the table and its peers.
        own = [p for p, code in parsed if p.uuid == r.uuid
               and code in ("none", "gpu_underperforming")]
        previous = next((code for p, code in reversed(parsed)
                         if p.uuid == r.uuid and code != ABORTED), None)
        out.append(score(r, peers=peers, history=own, previous_code=previous,
                         table=options.table, thresholds=options.thresholds))
    return out


def _nvml(env: Mapping[str, str]) -> NvmlObservation:
    run = run_probe("nvml", env=env, timeout_s=10.0)
    nvml = run.nvml if run.ok else None
    if nvml is None or not nvml.ok:
        why = (nvml.library_error or (nvml.error.message if nvml.error else None)
               if nvml is not None else run.error) or "no answer"
        raise QualifyError(f"NVML could not be read ({why}), so no GPU is known to be idle: "
                           "run `gpudiag probe --backend nvml` to see why")
    return nvml


def _targets(nvml: NvmlObservation | None, env: Mapping[str, str],
             wanted: tuple[str, ...] | None) -> list[dict[str, Any]]:
    visible = visible_uuids(nvml, env)
    here = [dev for dev in (nvml.devices if nvml else ()) if dev.uuid in visible]
    if wanted is not None:
        # One way to name a GPU everywhere (core.gpunames): index, UUID, prefix, PCI bus id.
        named = [NamedGpu(d.index, d.uuid or "", d.pci_bus_id) for d in here]
        try:
            picked = {resolve(g, named).uuid for g in wanted}
        except GpuNameError as e:
            raise QualifyError(f"--gpus: {e}") from None
        wanted = tuple(picked)
    out = []
    for dev in here:
        if wanted is not None and dev.uuid not in wanted:
            continue
        memory = dev.readings.memory
        out.append({"uuid": dev.uuid, "index": dev.index, "name": dev.name,
                    "memory_total_bytes": memory.total_bytes if memory else None,
                    "mig": bool(dev.mig is not None and dev.mig.enabled)})
    return out


def _run_cuda(options: QualifyOptions, env: Mapping[str, str], lock_dir: Path
              ) -> tuple[list[GpuResult], dict[str, str]]:
    nvml = _nvml(env)
    targets = _targets(nvml, env, options.gpus)
    # The one view: a sibling probe is a user to a measurement; the claim answers the locks.
    occupancy = occupancy_view(nvml, lock_dir=lock_dir, siblings=False, locks=False).gpus
    results: list[GpuResult] = []
    left: dict[str, str] = {}
    before = inventories(nvml)  # diagnostic_side_effect: read again after each GPU's run
    for target in targets:
        uuid = str(target["uuid"])
        if target["mig"]:
            left[uuid] = "mig"  # a MIG GPU's instances are others' to use: not qualified
            continue
        # One GPU at a time, its lock held only while it is measured.
        with claim_free(occupancy, [uuid], lock_dir=lock_dir, purpose="qualify") as claim:
            if uuid not in claim.claimed:
                left[uuid] = claim.left_alone.get(uuid, "unknown")
                continue
            child_env = {**env, **pinned_to([uuid]), "JAX_PLATFORMS": "cuda"}
            if options.tier == "sdc":
                child_env["XLA_FLAGS"] = deterministic_xla_flags(env.get("XLA_FLAGS", ""))
            # A job waiting for this GPU (its waiting mark held) stops the measurement.
            measured = _run_child(options, [target], child_env, "cuda",
                                  yield_to=str(waiting_path(lock_dir, uuid)))
            after = read_inventories(env)
            results += with_side_effects(measured, before, after)
            before = after or before
    return results, left


def deterministic_xla_flags(flags: str) -> str:
    """XLA_FLAGS with XLA's deterministic-ops settings added (the sdc tier's products must be
    bit-identical run to run and GPU to GPU)."""
    have = flags.split()
    return " ".join([*have, *(f for f in XLA_DETERMINISTIC_FLAGS if f not in have)])


def _run_cpu(options: QualifyOptions, env: Mapping[str, str]) -> list[GpuResult]:
    n = options.cpu_devices
    if not 1 <= n <= 64:
        raise QualifyError(f"cpu_devices {n}: give 1 to 64")
    if any(not g.isdigit() or int(g) >= n for g in options.gpus or ()):
        raise QualifyError(f"--gpus: the CPU platform has devices 0 to {n - 1}")
    indices = [int(g) for g in options.gpus] if options.gpus else list(range(n))
    targets = [{"uuid": f"CPU-{i}", "index": i, "name": "cpu"} for i in indices]
    flags = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}".strip()
    if options.tier == "sdc":
        flags = deterministic_xla_flags(flags)
    return _run_child(options, targets, {**env, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags},
                      "cpu")


def _run_child(options: QualifyOptions, targets: list[dict[str, Any]],
               env: Mapping[str, str], platform: str, yield_to: str | None = None
               ) -> list[GpuResult]:
    spec = TIERS[options.tier]
    run = run_probe("qualify", env=env, options={
        "tier": options.tier, "platform": platform, "targets": targets,
        "deadline_s": spec.deadline_s, "yield_to": yield_to},
        timeout_s=spec.deadline_s * len(targets) + CHILD_MARGIN_S)
    parsed = child_results(run, len(targets))
    if isinstance(parsed, list):
        return parsed
    why = parsed or _why_no_result(run)
    return [GpuResult(str(t["uuid"]), t.get("name"), t.get("index"), options.tier, platform,
                      aborted=why, started_at=time.time(), duration_s=run.duration_s,
                      yielded=not parsed and run.exit_code == EXIT_ABORTED)
            for t in targets]


def _why_no_result(run: ProbeRun) -> str:
    if run.exit_code == EXIT_ABORTED:
        lines = [ln for ln in run.stderr_tail.splitlines() if "gpudiag-qualify: aborted" in ln]
        return lines[-1].split("aborted: ", 1)[-1] if lines else "another process appeared"
    return run.error or "the qualification child returned no result"
