"""Issue 30: after a repair, every text that says "reset" or "reboot" also says how to tell the
daemon (`gpudiag clear`), so a repaired GPU is not blocked for xid.hold_s more."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpudiag.core.catalog import BLOCKERS
from gpudiag.core.xids import BUCKET_CODES, LOST, REBOOT, RESET, XID_CODES, XIDS

ROOT = Path(__file__).resolve().parent.parent
HELD = (LOST, RESET, REBOOT)  # the codes a held XID blocks with


@pytest.mark.parametrize("code", [c for c in BLOCKERS if c in XID_CODES and c in HELD])
def test_a_held_xid_codes_remediation_ends_with_gpudiag_clear(code: str) -> None:
    remediation = BLOCKERS[code].remediation
    assert "gpudiag clear" in remediation, remediation
    assert remediation in (ROOT / "docs" / "blockers.md").read_text()
    assert remediation in (ROOT / "prometheus" / "gpudiag.rules.yml").read_text()
    assert remediation in (ROOT / "docs" / "faults.md").read_text()


@pytest.mark.parametrize("xid", [x for x, e in XIDS.items() if e.code in HELD])
def test_every_blocking_xids_action_says_to_clear_after_the_repair(xid: int) -> None:
    assert "gpudiag clear --gpu N" in XIDS[xid].action


def test_every_blocking_bucket_says_to_clear_and_the_others_do_not() -> None:
    for bucket, (code, action) in BUCKET_CODES.items():
        assert ("gpudiag clear" in action) == (code in HELD), bucket
    assert (ROOT / "docs" / "xids.md").read_text().count("gpudiag clear --gpu N") >= len(
        [e for e in XIDS.values() if e.code in HELD])


def test_operations_says_what_to_do_after_a_repair() -> None:
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text.split("## After a repair", 1)[1].split("\n## ", 1)[0]
    assert "gpudiag clear --gpu 3" in section and "GpudiagCriticalXid" in section
