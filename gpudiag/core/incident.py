"""One incident, one identity (issue 52): a fault episode of the node has one id that every
consumer carries (the history, /v1/health's evidence, the NFD label, NPD's condition, the
metrics the alerts read), so that an operator can follow it across them. Pure: no I/O.

An incident opens when the node-health verdict first blocks on something broken (not the
"nothing known broken" codes: busy, unproven, a lock timeout), and closes when it no longer
does. What opened it names it for good: its id (``gpudiag-<UTC start>-<GPU>``), its start
and its reason (the first code, on the first GPU) never change while it is open; codes that
join it (a second GPU failing, an XID storm's fatal XID, NVML agreeing) are added to
``codes`` only. An XID storm of application XIDs alone is warnings: no incident.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace

from gpudiag.core.npd import NOT_BROKEN_CODES
from gpudiag.core.records import dataclass
from gpudiag.core.verdict import Verdict

ID_PREFIX = "gpudiag-"


@dataclass(frozen=True)
class Incident:
    """One open (or, with ``ended_wall``, closed) fault episode of the node."""

    id: str
    started_wall: float
    code: str           # the reason: the first fault's code
    gpu: str | None     # the first fault's GPU (None: the node as a whole)
    codes: tuple[str, ...] = ()  # every code seen in it, in order of arrival
    ended_wall: float | None = None

    def record(self) -> dict[str, object]:
        return {"id": self.id, "started_wall": self.started_wall, "code": self.code,
                "gpu": self.gpu, "codes": list(self.codes), "ended_wall": self.ended_wall}

    @classmethod
    def from_record(cls, d: Mapping[str, object]) -> Incident:
        """Read back ``record()``; ValueError on anything else."""
        ident, started, code, gpu, codes = (d.get("id"), d.get("started_wall"), d.get("code"),
                                            d.get("gpu"), d.get("codes"))
        if not isinstance(ident, str) or not ident.startswith(ID_PREFIX) or not isinstance(
                code, str) or isinstance(started, bool) or not isinstance(started, (int, float)):
            raise ValueError("not an incident record")
        ended = d.get("ended_wall")
        return cls(ident, float(started), code, gpu if isinstance(gpu, str) else None,
                   tuple(str(c) for c in codes) if isinstance(codes, list) else (code,),
                   float(ended) if isinstance(ended, (int, float)) and not isinstance(
                       ended, bool) else None)


def incident_id(started_wall: float, gpu: str | None) -> str:
    """``gpudiag-20261205T030455Z-f00d0001``: when, and which GPU (its UUID's first 8 hex
    digits; ``node`` for the node as a whole). A Kubernetes label value (at most 63 of
    ``[A-Za-z0-9._-]``) and short enough for NPD's message."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(started_wall))
    where = gpu[4:12] if gpu and gpu[:4] in ("GPU-", "MIG-") else "node"
    return f"{ID_PREFIX}{stamp}-{''.join(c for c in where if c.isalnum()) or 'node'}"


def broken(verdict: Verdict | None) -> list[tuple[str, str | None]]:
    """The node-health verdict's (code, GPU) faults that make an incident, the root cause
    first; [] when nothing known is broken (None: no verdict yet is nothing known)."""
    if verdict is None:
        return []
    faults = [(b.code, b.device) for b in verdict.blockers if b.code not in NOT_BROKEN_CODES]
    primary = verdict.gpu_validation_blocker
    return sorted(faults, key=lambda f: f[0] != primary)


def advance(current: Incident | None, faults: Sequence[tuple[str, str | None]],
            now_wall: float) -> Incident | None:
    """The open incident after a verdict with ``faults``: opened, joined, kept, or None
    (closed: the caller keeps the closed one for the history)."""
    if not faults:
        return None
    if current is None:
        code, gpu = faults[0]
        return Incident(incident_id(now_wall, gpu), now_wall, code, gpu,
                        tuple(dict.fromkeys(c for c, _ in faults)))
    joined = tuple(dict.fromkeys((*current.codes, *(c for c, _ in faults))))
    return current if joined == current.codes else replace(current, codes=joined)
