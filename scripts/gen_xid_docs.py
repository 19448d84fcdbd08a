"""Write docs/xids.md from the XID catalog (a test checks the file is current)."""

from __future__ import annotations

import sys
from pathlib import Path

from gpudiag.core.xids import (
    BUCKET_CODES,
    PROMOTED_CODE,
    PROMOTION_WINDOW_S,
    SOURCE_URL,
    XIDS,
    XidEntry,
)


def render() -> str:
    """The XID catalog as Markdown: how buckets map to codes, then one row per XID."""
    out = ["# XIDs", "",
           "Generated from `gpudiag/core/xids.py` by `scripts/gen_xid_docs.py`; do not edit.", "",
           f"Source: NVIDIA's XID catalog for Ampere and newer GPUs, <{SOURCE_URL}>, its "
           "\"Resolution Bucket (Immediate Action)\" column. The daemon's XID watcher "
           "classifies every XID it sees by this table while the XID is held "
           "(`xid.hold_s`): `gpu_lost`, `gpu_reset_required` and `node_reboot_required` "
           "block the GPU, `gpu_xid_application` is a warning, `info` XIDs are counted in "
           "`gpudiag_gpu_xid_errors_total` only. An XID missing from this table is counted "
           "the same way and logged once (\"not in NVIDIA's XID catalog\"). "
           "`gpudiag clear --gpu UUID` releases a held XID after a repair; docs/daemon.md "
           "says why no NVML reading proves a reset, so the daemon never clears by itself, "
           "with one exception: an XID a reboot heals, after a reboot (below).",
           "",
           "## How XIDs become findings", "",
           "The watcher holds each XID on its GPU; the held XIDs become findings together, by "
           "the catalog's `semantics` column (`gpudiag/core/xids.py`, `judge_xids`):", "",
           "- **One per GPU and XID.** However often an XID is held on a GPU, it makes one "
           "finding there.",
           "- **Not solo** (`follows another XID`): the XID reports the consequence of "
           "another one (NVIDIA: XID 45 \"follow the other XID\"). On a GPU that holds "
           "another XID with a code it adds nothing of its own; alone it is the "
           "application warning.",
           "- **Pairs that cancel** (`ends XID N`): a later XID of the pair ends the earlier "
           "one on the same GPU (163 power smoothing disengaged, then 162 re-engaged).",
           "- **Promotion by count** (`promoted at N`): an application-class XID is a warning "
           f"first; held N times on one GPU within {PROMOTION_WINDOW_S:g} s it blocks the GPU "
           f"as `{PROMOTED_CODE}` (an application fault that keeps coming back on one GPU, "
           "across jobs, points at the GPU). A storm counts once (below). `[xid.promote]` "
           "in the daemon config sets each XID's count and window (`13 = {count = 3, "
           "window_s = 1800}`; `count = 0` turns it off; only application-class XIDs that "
           "stand alone can be promoted).", "",
           "- **A reboot heals it** (`a reboot heals it`): the XID's action is a node reboot. "
           "Held from an earlier boot (the kernel's boot id, recorded in the history at each "
           "start), it is released without `gpudiag clear` once a fresh pass in this boot "
           "(host, nvml, cuda, and the quick qualification tier where qualification is on) "
           "finds no fault on its GPU; in the same boot it stays held across restarts "
           "(docs/operations.md \"Reboot-class faults heal\").", "",
           "## Storms", "",
           "A storm is one finding. The first XID of a (GPU, XID) opens a window of "
           "`xid.storm_window_s` (300 s): it is held, logged once, kept in the history and "
           "wakes the daemon's loop. Every later one in the window is folded: counted in "
           "`gpudiag_gpu_xid_errors_total` and `gpudiag_xid_storm_folded_total` (both per "
           "`gpu, uuid, xid`), but no finding, log line, history row or wake-up of its own; the "
           "counters reach `/metrics` with the next snapshot. A storm that lasts longer "
           "opens a new window (one more log line and held XID, which extends the hold). A "
           "different XID is never folded into another's window: a fatal XID inside a storm "
           "of XID 45 blocks at once. `gpudiag clear` closes the cleared GPU's windows. "
           "The history's XID timeline (`/v1/history`, `gpudiag explain`, a run's failure "
           "attribution, which looks 60 s back from a run's start) has each window's first "
           "XID: a run that starts later inside an open window of the same GPU and XID does "
           "not see that XID as its own. "
           "Figures: docs/benchmarks.md \"XID storms\".", "",
           "## Buckets", "", "| NVIDIA bucket | gpudiag code | what to do |", "|---|---|---|"]
    out += [f"| `{bucket}` | {_code(code)} | {action} |"
            for bucket, (code, action) in BUCKET_CODES.items()]
    out += ["", "## Catalog", "",
            "| XID | mnemonic | description | bucket | gpudiag code | semantics | what to do |",
            "|---|---|---|---|---|---|---|"]
    out += [f"| {e.xid} | `{e.mnemonic}` | {e.description} | `{e.bucket}` | {_code(e.code)} "
            f"| {_semantics(e)} | {e.action} |" for e in XIDS.values()]
    return "\n".join(out) + "\n"


def _semantics(e: XidEntry) -> str:
    said = ([] if e.solo else ["follows another XID"]) + (
        [f"ends XID {e.cancels}"] if e.cancels is not None else []) + (
        [f"promoted at {e.promote_after}"] if e.promote_after is not None else []) + (
        ["a reboot heals it"] if e.reboot_heals else [])
    return ", ".join(said) or "solo"


def _code(code: str | None) -> str:
    return f"`{code}`" if code else "info"


if __name__ == "__main__":
    target = Path(__file__).resolve().parent.parent / "docs" / "xids.md"
    target.write_text(render())
    sys.stdout.write(f"wrote {target}\n")
