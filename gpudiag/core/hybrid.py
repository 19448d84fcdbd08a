"""One verdict from two: a backend's part taken from another verdict (pure).

Two callers, one rule. A daemon's answer leaves the backends no proof of the asker's
environment covers to the asker (``evidence.proof``: ``prove_here``); the client proves those
here and takes their part into the daemon's verdict (``source: hybrid``). The daemon's node
health takes each runtime's backend part into its device-layer verdict. A backend's part is
its status and every finding that names it; the rest (devices, the device layer, the
evidence) stays the base verdict's.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import replace

from gpudiag.core.verdict import Finding, Verdict

TYPE_CHECKING = False
if TYPE_CHECKING:
    from gpudiag.core.verdict import JSONValue


def _tagged(f: Finding, runtime: str | None) -> Finding:
    return f if runtime is None else replace(f, message=f"runtime {runtime}: {f.message}")


def with_backends_of(base: Verdict, other: Verdict, names: Collection[str], *,
                     runtime: str | None = None, statuses: bool = True,
                     proof: Mapping[str, JSONValue] | None = None) -> Verdict:
    """``base`` with ``names``' findings (and statuses) taken from ``other``.

    ``runtime``: the findings say whose environment they are about (node health per runtime).
    ``statuses``: the backends' statuses replace the base's (the hybrid answer); node health
    keeps each runtime's statuses apart and takes only the findings. ``proof``: entries for
    ``evidence.proof`` (where each backend was proven).
    """
    wanted = set(names)
    blockers = [b for b in base.blockers
                if not (statuses and b.backend in wanted)] + [
        _tagged(b, runtime) for b in other.blockers if b.backend in wanted]
    warnings = [w for w in base.warnings if not (statuses and w.backend in wanted)] + [
        _tagged(w, runtime) for w in other.warnings if w.backend in wanted]
    backends = dict(base.backends)
    evidence: dict[str, JSONValue] = dict(base.evidence)
    if statuses:
        backends.update({n: s for n, s in other.backends.items() if n in wanted})
        stderr = dict(_mapping(base.evidence.get("probe_stderr")))
        stderr.update({n: t for n, t in _mapping(other.evidence.get("probe_stderr")).items()
                       if n in wanted})
        evidence["probe_stderr"] = stderr
    if proof:
        evidence["proof"] = {**_mapping(base.evidence.get("proof")), **proof}
    return replace(base, blockers=tuple(_unique(blockers)), warnings=tuple(_unique(warnings)),
                   backends=backends, evidence=evidence,
                   preallocation_disabled=base.preallocation_disabled and (
                       other.preallocation_disabled or not statuses))


def _mapping(value: object) -> dict[str, JSONValue]:
    return dict(value) if isinstance(value, Mapping) else {}


def _unique(findings: list[Finding]) -> list[Finding]:
    """Each finding once (two runtimes with one fingerprint say the same thing once)."""
    return list(dict.fromkeys(findings))
