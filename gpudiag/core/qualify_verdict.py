"""What a GPU's latest qualification adds to the verdicts (docs/qualify.md).

A GPU that computes wrong answers is broken: ``gpu_compute_mismatch`` is a device-layer
blocker naming it. A slow one still computes right: ``gpu_underperforming`` is a warning,
a blocker when the site says so (``qualification.block``). An aborted run measured nothing
and changes nothing; a later passing run of the same GPU replaces the outcome, so clears it.
A run that left the GPU's configuration changed (engine.qualify_inventory) adds the warning
``diagnostic_side_effect``, whatever it measured, until the GPU's next outcome replaces it.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpudiag.core.qualify import COMPUTE_MISMATCH, DIAGNOSTIC_SIDE_EFFECT, UNDERPERFORMING
from gpudiag.core.qualify_score import Qualification
from gpudiag.core.records import dataclass
from gpudiag.core.sdc import MEMORY_TEST_FAILED
from gpudiag.core.verdict import Finding


@dataclass(frozen=True)
class QualificationFindings:
    """Blockers and warnings from the latest qualification of each GPU."""

    blockers: tuple[Finding, ...] = ()
    warnings: tuple[Finding, ...] = ()


def replaces(new: Qualification, old: Qualification | None) -> bool:
    """Whether ``new`` becomes its GPU's latest outcome in place of ``old``: an aborted run
    measured nothing; a finding is overturned only by a run of the same tier (a quick pass
    says nothing of the sdc tier's memory test, nor an sdc pass of the quick tier's speed)."""
    if old is None:
        return True
    if new.result.aborted is not None:
        return False
    return old.code == "none" or old.result.aborted is not None or (
        new.result.tier == old.result.tier)


def qualification_findings(latest: Iterable[Qualification], *, block: bool
                           ) -> QualificationFindings:
    """The findings of each GPU's latest outcome, labelled by UUID as device findings are."""
    blockers: list[Finding] = []
    warnings: list[Finding] = []
    for q in sorted(latest, key=lambda q: q.result.uuid):
        if q.result.side_effects:
            warnings.append(side_effect_finding(q))
        if q.result.aborted is not None or q.code not in (COMPUTE_MISMATCH, MEMORY_TEST_FAILED,
                                                           UNDERPERFORMING):
            continue
        # The site's setting now decides, not the one the run was scored under; a GPU
        # only past a calibrated warn line (core.qualify.CALIBRATION) never blocks.
        warn_only = (any(s.band == "warn" for s in q.scores)
                     and not any(r.below for s in q.scores for r in s.references)
                     and not any(s.band == "fail" for s in q.scores))
        warning = q.code == UNDERPERFORMING and (not block or warn_only)
        where = f"GPU {q.result.index}" if q.result.index is not None else q.result.uuid
        (warnings if warning else blockers).append(Finding.of(
            q.code, f"{where}: qualification ({q.result.tier} tier): {q.message}",
            backend="cuda", device=q.result.uuid, warning=warning))
    return QualificationFindings(tuple(blockers), tuple(warnings))


def side_effect_finding(q: Qualification) -> Finding:
    """``diagnostic_side_effect``: the run left its GPU's configuration changed."""
    where = f"GPU {q.result.index}" if q.result.index is not None else q.result.uuid
    return Finding.of(DIAGNOSTIC_SIDE_EFFECT,
                      f"{where}: the qualification ({q.result.tier} tier) left its "
                      f"configuration changed: {'; '.join(q.result.side_effects)}",
                      backend="cuda", device=q.result.uuid, warning=True)
