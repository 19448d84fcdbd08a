"""The cross-GPU golden of the sdc tier, over whole results (core.sdc.judge_golden decides).

The child hashes the golden program's output and reports it ``pending``; here each pending
golden is judged against the node's other GPUs of the same golden key (this run's, and the
latest result in the history of every GPU not in this run) and the golden stored for the key.
Pure: the engine reads and writes the store.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from gpudiag.core.qualify_score import GpuResult
from gpudiag.core.records import dataclass
from gpudiag.core.sdc import PENDING, judge_golden


@dataclass(frozen=True)
class GoldenUpdate:
    """A golden to store: its key, the hash, and the GPUs that agreed on it."""

    key: str
    output_hash: str
    gpus: tuple[str, ...]


def _golden_of(r: GpuResult) -> tuple[str, str] | None:
    for c in r.checks:
        if c.check == "golden" and c.golden_key and c.output_hash:
            return c.golden_key, c.output_hash
    return None


def resolve_goldens(results: Sequence[GpuResult], past: Sequence[GpuResult],
                    stored: Mapping[str, str]) -> tuple[list[GpuResult], list[GoldenUpdate]]:
    """This run's results with every pending golden judged, and the goldens to store.
    ``past``: history results, oldest first; ``stored``: golden key -> hash."""
    here = {r.uuid for r in results}
    latest: dict[str, GpuResult] = {}
    for r in past:
        if r.uuid not in here and r.aborted is None and _golden_of(r) is not None:
            latest[r.uuid] = r
    by_key: dict[str, dict[str, str]] = {}
    for r in [*results, *latest.values()]:
        found = _golden_of(r) if r.aborted is None else None
        if found is not None:
            by_key.setdefault(found[0], {})[r.uuid] = found[1]
    updates: list[GoldenUpdate] = []
    verdicts: dict[tuple[str, str], tuple[str, str]] = {}
    for key, hashes in sorted(by_key.items()):
        if not any(r.uuid in hashes and _golden_of(r) == (key, hashes[r.uuid])
                   for r in results):
            continue
        decided = judge_golden(hashes, stored.get(key))
        for uuid, j in decided.judgements.items():
            verdicts[(key, uuid)] = (j.status, j.detail)
        if decided.record is not None:
            agree = tuple(sorted(u for u, h in hashes.items() if h == decided.record))
            updates.append(GoldenUpdate(key, decided.record, agree))
    out = []
    for r in results:
        checks = []
        for c in r.checks:
            if c.check == "golden" and c.status == PENDING and c.golden_key:
                status, detail = verdicts.get((c.golden_key, r.uuid), ("unknown", "not judged"))
                c = dataclasses.replace(c, status=status, detail=f"{c.detail}; {detail}")
            checks.append(c)
        out.append(dataclasses.replace(r, checks=tuple(checks)))
    return out, updates
