"""Node health per runtime: the device layer once, each runtime's backends in its own proof.

docs/design-notes.md, "Whose environment is proven". The node's verdict (``full``:
gpudiag_blocker, GpudiagNodeBlocked, NFD, fleet, remediation) is the device layer's: the
node's own faults. A runtime is a promise the node makes to the jobs of one environment, and
its findings are that runtime's, reported as such: ``gpudiag_runtime_blocker{runtime,...}``,
the runtime section of /v1/health (``evidence.runtimes``), the warning alert
GpudiagRuntimeFailing. A backend that no runtime serves is "not checked" (a warning saying
how to configure one): never a blocker, never an alert, never a drain.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from gpudiag.core import registry
from gpudiag.core.catalog import WARNINGS
from gpudiag.core.hybrid import with_backends_of
from gpudiag.core.runtime import Runtime
from gpudiag.core.verdict import BackendRequirement, Finding, Requirement, Verdict
from gpudiag.daemon.snapshot import Snapshot, VerdictPolicy, keys_for, verdict_for

TYPE_CHECKING = False
if TYPE_CHECKING:
    from gpudiag.core.verdict import JSONValue


def required_by(runtime: Runtime, installed: frozenset[str], enabled: Sequence[str]
                ) -> tuple[BackendRequirement, ...]:
    """The enabled environment-dependent backends ``runtime`` must serve."""
    return tuple(b for b in runtime.required(installed) if b.name in enabled)


def runtime_verdicts(base: Snapshot, device: Requirement,
                     required: Mapping[str, tuple[BackendRequirement, ...]], *,
                     now_wall: float, policy: VerdictPolicy) -> dict[str, Verdict]:
    """Each runtime's node-health verdict over the device layer and the backends it serves
    (a runtime whose probes have not all run yet has none)."""
    out: dict[str, Verdict] = {}
    for runtime, entries in required.items():
        if not entries:
            continue
        names = {e.name for e in entries}
        requirement = Requirement(backends=(*device.backends, *entries), node_health=True)
        keys = [k.in_runtime(runtime) if k.backend in names else k
                for k in keys_for(requirement)]
        verdict = verdict_for(base, requirement, now_wall=now_wall, policy=policy, keys=keys)
        if verdict is not None:
            out[runtime] = verdict
    return out


def not_checked(backends: Sequence[str],
                required: Mapping[str, tuple[BackendRequirement, ...]]) -> list[Finding]:
    """A warning per backend no runtime serves (what nobody configured is not a fault)."""
    served = {b.name for entries in required.values() for b in entries}
    entry = WARNINGS["backend_not_checked"]
    return [Finding("backend_not_checked", entry.layer,
                    f"{b} is not checked on this node: no runtime this daemon proves needs "
                    f"it (configure [runtimes.NAME] with the jobs' python, or set "
                    f"[runtimes.gpudiag] require = \"{b}\" for the daemon's own)",
                    entry.remediation, backend=b)
            for b in backends if b not in served]


def node_health(device: Verdict, verdicts: Mapping[str, Verdict],
                required: Mapping[str, tuple[BackendRequirement, ...]],
                unchecked: list[Finding], own: Callable[[str], bool]) -> Verdict:
    """The node's own verdict: the device layer's, with the warnings of what nobody checks.
    The daemon's own runtime gives its backends' statuses (gpudiag_backend_up); no runtime's
    findings enter it (they are the runtime's: ``runtime_findings``)."""
    out = device
    for runtime, verdict in verdicts.items():
        if own(runtime):
            out = with_backends_of(out, verdict, [e.name for e in required[runtime]],
                                   statuses=True)
            wanted = {e.name for e in required[runtime]}
            out = replace(out, blockers=tuple(b for b in out.blockers
                                              if b.backend not in wanted),
                          warnings=tuple(w for w in out.warnings if w.backend not in wanted))
    if unchecked:
        out = replace(out, warnings=(*out.warnings, *unchecked))
    return out


def runtime_backends(verdict: Verdict) -> tuple[str, ...]:
    """The environment-dependent backends a runtime's verdict is about (its ``require``)."""
    return tuple(b.name for b in verdict.requirement.backends if b.name in _environment())


def runtime_findings(verdict: Verdict, *, warnings: bool = False) -> tuple[Finding, ...]:
    """A runtime's own findings in its verdict: those of the backends it serves (the device
    layer's are the node's, said once in the node's verdict)."""
    names = set(runtime_backends(verdict))
    found = verdict.warnings if warnings else verdict.blockers
    return tuple(f for f in found if f.backend in names)


def runtime_section(snapshot: Snapshot) -> dict[str, JSONValue]:
    """Per configured runtime that serves a backend: what /v1/health says of it
    (``evidence.runtimes``; docs/reference.md, "Runtimes and fingerprints")."""
    out: dict[str, JSONValue] = {}
    for runtime in snapshot.runtimes:
        verdict = snapshot.runtime_health.get(runtime.name)
        found = snapshot.fingerprints.get(runtime.name)
        refused = snapshot.runtime_refused.get(runtime.name)
        if verdict is None and refused is None and runtime.own and not runtime.require:
            continue  # the daemon's own environment, serving nobody: nothing to say
        blockers = runtime_findings(verdict) if verdict is not None else ()
        state = ("refused" if refused is not None else "unproven" if verdict is None
                 else "blocked" if blockers else "ok")
        entry: dict[str, JSONValue] = {
            "python": runtime.python or (found.interpreter.get("executable", "")
                                         if found is not None else ""),
            "require": list(runtime.require) if runtime.require is not None else None,
            "state": state,
            "ready": state == "ok",
            "blocker": blockers[0].code if blockers and refused is None else "none",
            "blockers": [b.record() for b in blockers] if refused is None else [],
            "warnings": [w.record() for w in (runtime_findings(verdict, warnings=True)
                                              if verdict is not None else ())],
            # The backends it promises, known even while unproven or refused.
            "serves": list(runtime_backends(verdict)) if verdict is not None else [
                b.name for b in required_by(runtime, snapshot.installed_in(runtime.name),
                                            sorted(_environment()))],
            "backends": {n: verdict.backends[n].status for n in runtime_backends(verdict)
                         if n in verdict.backends} if verdict is not None else {},
            "refused": refused,
        }
        if found is not None and found.error is not None:
            entry["fingerprint_error"] = found.error
        out[runtime.name] = entry
    return out


def _environment() -> frozenset[str]:
    return frozenset(s.name for s in registry.specs() if s.environment is not None)
