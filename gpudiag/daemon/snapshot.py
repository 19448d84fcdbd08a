"""The daemon's immutable snapshot: latest probe results, watcher state, derived verdicts.

The scheduler publishes a new Snapshot after every probe; the exporter, the HTTP API and the
history recorder only read snapshots, so none of them ever waits on a probe.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import field, replace
from typing import Any

from gpudiag.core import registry
from gpudiag.core.classify import NodeFacts, classify
from gpudiag.core.classify_nic import remembered
from gpudiag.core.clock import rfc3339
from gpudiag.core.findings import XidEvent
from gpudiag.core.identity import GpuIdentity
from gpudiag.core.nic import NicMemory
from gpudiag.core.nvml_health import NvmlHealthPolicy, NvmlHistory
from gpudiag.core.observations import GpuReadings
from gpudiag.core.probe_run import ProbeRun
from gpudiag.core.qualify_verdict import QualificationFindings
from gpudiag.core.readiness import ProbeScope
from gpudiag.core.records import dataclass
from gpudiag.core.runtime import OWN_RUNTIME, Runtime
from gpudiag.core.verdict import Finding, Requirement, Verdict
from gpudiag.core.xids import XidRules
from gpudiag.engine.plan import probes_for
from gpudiag.engine.runtimes import RuntimeFingerprint

OUTCOMES = ("ok", "error", "timeout", "crashed")
# The backends a requirement names (``--require``): fleet readiness is told per backend.


@dataclass(frozen=True, order=True)
class ProbeKey:
    """One probe child as the scheduler runs it: backend, canonical options JSON, and the
    runtime whose interpreter runs it ("": the daemon's own, core.runtime.OWN_RUNTIME)."""

    backend: str
    options: str = ""
    runtime: str = ""

    @classmethod
    def of(cls, backend: str, options: Mapping[str, Any] | None = None,
           runtime: str = "") -> ProbeKey:
        return cls(backend, json.dumps(dict(options), sort_keys=True) if options else "",
                   "" if runtime == OWN_RUNTIME else runtime)

    def in_runtime(self, runtime: str) -> ProbeKey:
        """The same probe run by ``runtime``'s interpreter."""
        return replace(self, runtime="" if runtime == OWN_RUNTIME else runtime)

    @property
    def runtime_name(self) -> str:
        """The runtime's name as records and metrics write it (``gpudiag`` for the own)."""
        return self.runtime or OWN_RUNTIME

    def options_dict(self) -> dict[str, Any] | None:
        return json.loads(self.options) if self.options else None


def keys_for(requirement: Requirement) -> tuple[ProbeKey, ...]:
    """The probe keys a requirement needs (the same choice inline preflight makes)."""
    return tuple(ProbeKey.of(name, opts) for name, opts in probes_for(requirement))


@dataclass(frozen=True)
class ProbeResult:
    """One finished probe run with its wall-clock times."""

    key: ProbeKey
    run: ProbeRun
    started_wall: float
    finished_wall: float

    @property
    def outcome(self) -> str:
        return outcome_of(self.run)


def outcome_of(run: ProbeRun) -> str:
    """ok, timeout, crashed or error: how the child itself fared (not the host)."""
    if run.timed_out:
        return "timeout"
    if run.signal is not None:
        return "crashed"
    return "ok" if run.ok else "error"


@dataclass(frozen=True)
class BackendStats:
    """The daemon's own health for one probe key."""

    runs_by_outcome: Mapping[str, int] = field(default_factory=dict)
    last_duration_s: float | None = None
    last_success_wall: float | None = None
    consecutive_failures: int = 0


@dataclass(frozen=True)
class XidCount:
    """How often one XID was seen on one GPU, and when last."""

    gpu: int | None
    uuid: str | None
    xid: int
    count: int
    last_timestamp: float
    # Of ``count``, those folded into an open storm window (no finding, log line or history
    # row of their own: docs/xids.md "Storms").
    folded: int = 0


@dataclass(frozen=True)
class WatcherState:
    """The XID watcher as the snapshot shows it; gap time is computed from ``down_since``."""

    enabled: bool = False
    running: bool = False
    restarts: int = 0
    gap_seconds_closed: float = 0.0
    down_since_wall: float | None = None
    last_error: str | None = None
    xid_counts: tuple[XidCount, ...] = ()
    recent: tuple[XidEvent, ...] = ()
    telemetry: Mapping[int, GpuReadings] = field(default_factory=dict)
    telemetry_wall: float | None = None

    def gap_s(self, now_wall: float) -> float:
        """How long the watcher has been down right now (0 while it runs)."""
        if self.down_since_wall is None:
            return 0.0
        return max(0.0, now_wall - self.down_since_wall)

    def gap_total_s(self, now_wall: float) -> float:
        return self.gap_seconds_closed + self.gap_s(now_wall)


@dataclass(frozen=True)
class Snapshot:
    """Everything the daemon knows at one moment; never mutated once published."""

    seq: int
    published_wall: float
    results: Mapping[ProbeKey, ProbeResult]
    stats: Mapping[ProbeKey, BackendStats]
    scheduled: tuple[ProbeKey, ...]
    watcher: WatcherState
    full: Verdict | None
    ready: Verdict | None

    # Occupancy per GPU and what the active probes proved where (core.readiness).
    scope: ProbeScope | None = None
    # (uuid, backend) -> wall time of the last successful active probe on that GPU.
    last_proven: Mapping[tuple[str, str], float] = field(default_factory=dict)
    # NVLink counts seen and clock-event holds, across NVML rounds (core.nvml_health).
    nvml_history: NvmlHistory = field(default_factory=NvmlHistory)
    # What each GPU's latest qualification says (core.qualify_verdict; daemon.qualify_schedule).
    qualification: QualificationFindings = field(default_factory=QualificationFindings)
    # Each GPU index's last identity NVML gave (core.identity): a lost GPU's verdict row and
    # blockers name its last UUID.
    last_seen: Mapping[int, GpuIdentity] = field(default_factory=dict)
    # The runtimes this node serves (the daemon's own first), each one's fingerprint as last
    # read, where each (backend, runtime) last proved itself, and each runtime's node health.
    runtimes: tuple[Runtime, ...] = ()
    fingerprints: Mapping[str, RuntimeFingerprint] = field(default_factory=dict)
    runtime_gpu: Mapping[tuple[str, str], str | None] = field(default_factory=dict)
    runtime_health: Mapping[str, Verdict] = field(default_factory=dict)
    # A runtime the daemon refuses to run (its import path became writable by another user:
    # engine/runtimes.py, import_path_problem): why; its proofs are dropped meanwhile.
    runtime_refused: Mapping[str, str] = field(default_factory=dict)
    # The nic backend's memory since this boot (core.nic): ports seen up, link changes, counters.
    nic_memory: NicMemory | None = None

    @property
    def round_complete(self) -> bool:
        """Whether every scheduled probe has finished at least once."""
        return all(k in self.results for k in self.scheduled)

    def backends_proven(self) -> dict[str, bool]:
        """Per requirement backend: scheduled here, ok in the node-health verdict, and no
        host-wide blocker (one of no backend, or of this backend) stands. Never-probed is
        False: the fleet must not count a backend nobody proved."""
        full = self.full
        scheduled = {key.backend for key in self.scheduled}
        host_wide = [] if full is None else [b for b in full.blockers if b.device is None]
        by_runtime = self.runtime_backends_proven()
        out = {}
        for backend in registry.published():
            spec = registry.spec(backend)
            if spec is not None and spec.environment is not None:
                # Proven in a job environment: some runtime serving it proved it.
                out[backend] = any(ok for (_, b), ok in by_runtime.items() if b == backend)
                continue
            status = full.backends.get(backend) if full is not None else None
            out[backend] = (backend in scheduled and status is not None
                            and status.status == "ok"
                            and not any(b.backend in (None, backend) for b in host_wide))
        return out

    def runtime_backends_proven(self) -> dict[tuple[str, str], bool]:
        """Per (runtime, backend) a runtime must serve: ok in its node-health verdict with no
        host-wide blocker there (the same rule as ``backends_proven``, per runtime)."""
        out: dict[tuple[str, str], bool] = {}
        for runtime, verdict in self.runtime_health.items():
            host_wide = [b for b in verdict.blockers if b.device is None]
            for req in verdict.requirement.backends:
                spec = registry.spec(req.name)
                if spec is None or spec.environment is None:
                    continue
                status = verdict.backends.get(req.name)
                out[(runtime, req.name)] = (
                    status is not None and status.status == "ok"
                    and not any(b.backend in (None, req.name) for b in host_wide))
        return out

    def installed_in(self, runtime: str) -> frozenset[str]:
        """The backends installed in ``runtime``, as its fingerprint last said."""
        found = self.fingerprints.get(runtime)
        return found.installed if found is not None else frozenset()

    def result(self, backend: str) -> ProbeResult | None:
        """The latest result of a scheduled backend."""
        for key in self.scheduled:
            if key.backend == backend:
                return self.results.get(key)
        return None


@dataclass(frozen=True)
class HistoryState:
    """What the daemon could read back from its history at start (daemon/holds.py).

    ``state``: ``ok`` (holds re-armed from it), ``missing`` (no history: a first start, or
    the file was removed), ``damaged`` (moved aside at this start) or ``unreadable`` (it could
    not be opened or read). Anything but ``ok`` means holds from before the start are unknown.
    """

    state: str
    reason: str | None
    rearmed_xids: int
    started_at: str  # RFC 3339: when the daemon read it (the start)

    def record(self) -> dict[str, Any]:
        return {"state": self.state, "reason": self.reason, "rearmed_xids": self.rearmed_xids,
                "started_at": self.started_at}


@dataclass(frozen=True)
class VerdictPolicy:
    """What the snapshot adds to classify: XID hold time, watcher gap limit, expected GPUs,
    and what the history gave back at start (said in every verdict's evidence.history)."""

    xid_hold_s: float = 3600.0
    gap_warning_s: float = 60.0
    expected_gpus: int | None = None
    history: HistoryState | None = None
    nvml: NvmlHealthPolicy = field(default_factory=NvmlHealthPolicy)
    xid_rules: XidRules = field(default_factory=XidRules)


@dataclass(frozen=True)
class Proofs:
    """Where a question's environment-dependent backends are answered from (docs/design-notes.md,
    "Whose environment is proven"): a runtime whose fingerprint matches the asker's, or
    nowhere here, and then the asker proves the backend itself (``prove_here``)."""

    keys: tuple[ProbeKey, ...]          # the results the answer reads
    prove_here: Mapping[str, str] = field(default_factory=dict)  # backend -> why not here
    runtime_of: Mapping[str, str] = field(default_factory=dict)  # backend -> runtime name
    fingerprint: Mapping[str, str] = field(default_factory=dict)  # what the asker sent


NO_FINGERPRINT = ("the question carries no fingerprint of the asker's environment, so no proof "
                  "made here can stand for it (the gpudiag client sends one: `gpudiag "
                  "fingerprint` prints it for the fingerprint= parameter)")


def proofs_for(snapshot: Snapshot, requirement: Requirement,
               fingerprint: Mapping[str, str] | None,
               keys: Sequence[ProbeKey] | None = None) -> Proofs:
    """Which runtime's results answer each backend of ``requirement`` for an asker whose
    environment has these fingerprint ids (backend -> id; None: it sent none)."""
    out: list[ProbeKey] = []
    here: dict[str, str] = {}
    runtime_of: dict[str, str] = {}
    for key in keys if keys is not None else keys_for(requirement):
        spec = registry.spec(key.backend)
        if spec is None or spec.environment is None:
            out.append(key)  # the device layer: the node's fact, shared by every job
            continue
        wanted = None if fingerprint is None else fingerprint.get(key.backend)
        runtime = _matching_runtime(snapshot, key.backend, wanted)
        if runtime is None:
            here[key.backend] = NO_FINGERPRINT if wanted is None else (
                f"no runtime this daemon proves has the asker's {key.backend} environment "
                f"(fingerprint {wanted}); it is proven where the job runs")
            continue
        out.append(key.in_runtime(runtime))
        runtime_of[key.backend] = runtime
    return Proofs(tuple(out), here, runtime_of, dict(fingerprint or {}))


def _matching_runtime(snapshot: Snapshot, backend: str, wanted: str | None) -> str | None:
    """The first runtime whose fingerprint for ``backend`` is ``wanted`` (one proof for two
    runtimes with the same fingerprint: the first configured answers)."""
    if wanted is None:
        return None
    for runtime in snapshot.runtimes:
        found = snapshot.fingerprints.get(runtime.name)
        if found is not None and found.error is None and found.ids.get(backend) == wanted:
            return runtime.name
    return None


def _proof_evidence(snapshot: Snapshot, proofs: Proofs, runs_at: Mapping[str, ProbeResult]
                    ) -> dict[str, Any]:
    """evidence.proof: per environment-dependent backend, where it was proven."""
    out: dict[str, Any] = {}
    for backend, runtime in proofs.runtime_of.items():
        found = snapshot.fingerprints.get(runtime)
        result = runs_at.get(backend)
        out[backend] = {
            "where": "daemon", "runtime": runtime,
            "fingerprint": proofs.fingerprint.get(backend),
            "interpreter": found.interpreter.get("executable") if found is not None else None,
            "proven_at": rfc3339(result.finished_wall) if result is not None else None}
    for backend, why in proofs.prove_here.items():
        out[backend] = {"where": "prove_here", "fingerprint": proofs.fingerprint.get(backend),
                        "reason": why}
    return out


def _runtime_scope(snapshot: Snapshot, proofs: Proofs | None) -> ProbeScope | None:
    """The snapshot's scope with each backend's proof GPU taken from its answering runtime."""
    scope = snapshot.scope
    if scope is None or proofs is None or not proofs.runtime_of:
        return scope
    gpus = dict(scope.backend_gpu)
    for backend, runtime in proofs.runtime_of.items():
        name = "" if runtime == OWN_RUNTIME else runtime
        if (backend, name) in snapshot.runtime_gpu:
            gpus[backend] = snapshot.runtime_gpu[(backend, name)]
    return replace(scope, backend_gpu=gpus)


def verdict_for(snapshot: Snapshot, requirement: Requirement, *, now_wall: float,
                policy: VerdictPolicy, keys: Sequence[ProbeKey] | None = None,
                visibility: tuple[str | None, str | None] | None = None,
                proofs: Proofs | None = None) -> Verdict | None:
    """The verdict for ``requirement`` from the snapshot; None while a needed probe never ran.

    ``visibility`` substitutes the caller's CUDA_/NVIDIA_VISIBLE_DEVICES for the daemon's:
    visibility is classified purely from the host observation, so the daemon can answer for
    a job that sees a subset of the GPUs. ``proofs`` (proofs_for) says which runtime's
    results answer the environment-dependent backends; a backend it leaves to the asker
    reads as unproven here, and ``evidence.proof`` says so.
    """
    needed = proofs.keys if proofs is not None else (
        keys if keys is not None else keys_for(requirement))
    found = [snapshot.results.get(k) for k in needed]
    results = [r for r in found if r is not None]
    if len(results) != len(found):
        return None
    runs = {r.key.backend: r.run for r in results}
    if "nic" in runs:
        runs["nic"] = remembered(runs["nic"], snapshot.nic_memory)
    for backend, why in (proofs.prove_here.items() if proofs is not None else ()):
        runs[backend] = ProbeRun(backend, None, 0.0, skipped=why)
    host_run = runs.get("host")
    host_obs = host_run.host if host_run is not None else None
    overridden = (visibility is not None and host_obs is not None
                  and host_obs.visibility != visibility)
    oldest = min((r.started_wall for r in results), default=now_wall)
    xids = [x for x in snapshot.watcher.recent if now_wall - x.timestamp <= policy.xid_hold_s]
    extra: list[Finding] = []
    watcher = snapshot.watcher
    if watcher.enabled and requirement.needs_gpu:
        gap = watcher.gap_s(now_wall)
        if gap > policy.gap_warning_s:
            why = f": {watcher.last_error}" if watcher.last_error else ""
            extra.append(Finding.of(
                "xid_watcher_gap", f"the XID watcher has been down for {gap:.0f} s "
                f"(limit {policy.gap_warning_s:g} s, {watcher.restarts} restart(s)){why}",
                backend="nvml", warning=True))
    facts = NodeFacts(xids=xids, extra_warnings=extra,
                      device_blockers=snapshot.qualification.blockers,
                      device_warnings=snapshot.qualification.warnings,
                      expected_gpus=policy.expected_gpus, nvml_history=snapshot.nvml_history,
                      nvml_policy=policy.nvml, last_seen=snapshot.last_seen,
                      xid_rules=policy.xid_rules)
    verdict = classify(runs, requirement, host=_hostname(), checked_at=rfc3339(oldest),
                       source="daemon", visibility=visibility,
                       scope=_runtime_scope(snapshot, proofs), facts=facts)
    if overridden:
        # cuInit ran with the daemon's visibility, so its device count is not the job's.
        verdict = replace(verdict, warnings=tuple(
            w for w in verdict.warnings if w.code != "device_count_mismatch"))
    if proofs is not None and (proofs.runtime_of or proofs.prove_here):
        by_backend = {r.key.backend: r for r in results}
        verdict = replace(verdict, evidence={
            **verdict.evidence, "proof": _proof_evidence(snapshot, proofs, by_backend)})
    if policy.history is not None:
        # Whether holds from before this start are known: "none" after a restart that lost
        # its history is not the same claim as after one that re-armed every hold.
        verdict = replace(verdict, evidence={**verdict.evidence,
                                             "history": policy.history.record()})
    return verdict.with_source("daemon", max(0.0, now_wall - oldest))


_HOST: list[str] = []


def _hostname() -> str:
    if not _HOST:
        import socket

        _HOST.append(socket.gethostname())
    return _HOST[0]
