"""Write docs/blockers.md from the catalog (a test checks the file is current)."""

from __future__ import annotations

import sys
from pathlib import Path

from gpudiag.core.catalog import BLOCKERS, LAYER_ORDER, QUALIFICATION, WARNINGS


def render() -> str:
    """The catalog as Markdown, one table per layer, then the warnings."""
    out = ["# Blocker and warning codes", "",
           "Generated from `gpudiag/core/catalog.py` by `scripts/gen_blocker_docs.py`; "
           "do not edit.",
           "The primary `gpu_validation_blocker` is the blocker of the lowest layer, in this "
           "order: " + " < ".join(f"`{layer}`" for layer in LAYER_ORDER) + ".", ""]
    for layer in LAYER_ORDER:
        rows = [e for e in BLOCKERS.values() if e.layer == layer]
        out += [f"## {layer}", "", "| code | meaning | remediation |", "|---|---|---|"]
        out += [f"| `{e.code}` | {e.summary} | {e.remediation} |" for e in rows]
        out.append("")
    out += ["## Warnings (never set gpu_validation_blocker)", "",
            "| code | layer | meaning | what to do |", "|---|---|---|---|"]
    out += [f"| `{e.code}` | {e.layer} | {e.summary} | {e.remediation} |"
            for e in WARNINGS.values()]
    out += ["", "## Qualification outcomes (gpudiag qualify; docs/qualify.md)", "",
            "| code | layer | meaning | what to do |", "|---|---|---|---|"]
    out += [f"| `{e.code}` | {e.layer} | {e.summary} | {e.remediation} |"
            for e in QUALIFICATION.values()]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    target = Path(__file__).resolve().parent.parent / "docs" / "blockers.md"
    target.write_text(render())
    sys.stdout.write(f"wrote {target}\n")
