"""Node health per runtime: the device layer once, each runtime's backends in its own proof.

docs/design-notes.md, "Whose environment is proven". The node-health verdict (``full``:
gpudiag_blocker, /v1/health, NFD, fleet) is the device layer's verdict, plus the findings of
every backend a runtime must serve, each tagged with its runtime. A backend that no runtime
serves is "not checked" (a warning saying how to configure one): never a blocker, never an
alert, never a drain.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gpudiag.core.catalog import WARNINGS
from gpudiag.core.hybrid import with_backends_of
from gpudiag.core.runtime import Runtime
from gpudiag.core.verdict import BackendRequirement, Finding, Requirement, Verdict
from gpudiag.daemon.snapshot import Snapshot, VerdictPolicy, keys_for, verdict_for


def required_by(runtime: Runtime, installed: frozenset[str], enabled: Sequence[str]
                ) -> tuple[str, ...]:
    """The enabled environment-dependent backends ``runtime`` must serve."""
    return tuple(b for b in runtime.required(installed) if b in enabled)


def runtime_verdicts(base: Snapshot, device: Requirement, required: dict[str, tuple[str, ...]],
                     *, now_wall: float, policy: VerdictPolicy) -> dict[str, Verdict]:
    """Each runtime's node-health verdict over the device layer and the backends it serves
    (a runtime whose probes have not all run yet has none)."""
    out: dict[str, Verdict] = {}
    for runtime, names in required.items():
        if not names:
            continue
        requirement = Requirement(
            backends=(*device.backends, *(BackendRequirement(n) for n in names)),
            node_health=True)
        keys = [k.in_runtime(runtime) if k.backend in names else k
                for k in keys_for(requirement)]
        verdict = verdict_for(base, requirement, now_wall=now_wall, policy=policy, keys=keys)
        if verdict is not None:
            out[runtime] = verdict
    return out


def not_checked(backends: Sequence[str], required: dict[str, tuple[str, ...]]
                ) -> list[Finding]:
    """A warning per backend no runtime serves (what nobody configured is not a fault)."""
    served = {b for names in required.values() for b in names}
    entry = WARNINGS["backend_not_checked"]
    return [Finding("backend_not_checked", entry.layer,
                    f"{b} is not checked on this node: no runtime this daemon proves needs "
                    f"it (configure [runtimes.NAME] with the jobs' python, or set "
                    f"[runtimes.gpudiag] require = \"{b}\" for the daemon's own)",
                    entry.remediation, backend=b)
            for b in backends if b not in served]


def node_health(device: Verdict, verdicts: dict[str, Verdict],
                required: dict[str, tuple[str, ...]], unchecked: list[Finding],
                own: Callable[[str], bool]) -> Verdict:
    """The device layer's verdict with every runtime's backend findings and the warnings of
    what nobody checks; the daemon's own runtime also gives its backends' statuses."""
    out = device
    for runtime, verdict in verdicts.items():
        out = with_backends_of(out, verdict, required[runtime],
                               runtime=None if own(runtime) else runtime,
                               statuses=own(runtime))
    if unchecked:
        from dataclasses import replace

        out = replace(out, warnings=(*out.warnings, *unchecked))
    return out
