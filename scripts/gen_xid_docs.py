"""Write docs/xids.md from the XID catalog (a test checks the file is current)."""

from __future__ import annotations

import sys
from pathlib import Path

from gpudiag.core.xids import BUCKET_CODES, SOURCE_URL, XIDS


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
           "says why no NVML reading proves a reset, so the daemon never clears by itself.",
           "",
           "## Buckets", "", "| NVIDIA bucket | gpudiag code | what to do |", "|---|---|---|"]
    out += [f"| `{bucket}` | {_code(code)} | {action} |"
            for bucket, (code, action) in BUCKET_CODES.items()]
    out += ["", "## Catalog", "",
            "| XID | mnemonic | description | bucket | gpudiag code | what to do |",
            "|---|---|---|---|---|---|"]
    out += [f"| {e.xid} | `{e.mnemonic}` | {e.description} | `{e.bucket}` | {_code(e.code)} "
            f"| {e.action} |" for e in XIDS.values()]
    return "\n".join(out) + "\n"


def _code(code: str | None) -> str:
    return f"`{code}`" if code else "info"


if __name__ == "__main__":
    target = Path(__file__).resolve().parent.parent / "docs" / "xids.md"
    target.write_text(render())
    sys.stdout.write(f"wrote {target}\n")
