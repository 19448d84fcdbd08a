"""Write docs/reference.md's backend table from the backend registry (a test checks it is current).

``--print`` writes the generated block to stdout instead of rewriting the file.
"""

from __future__ import annotations

import sys
from pathlib import Path

from gpudiag.core import registry

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gpudiag.core.backend import BackendSpec
from scripts.docblock import replace_block

DOC = Path(__file__).resolve().parent.parent / "docs" / "reference.md"
BEGIN = "<!-- backends: generated from gpudiag/core/registry.py by scripts/gen_backend_docs.py -->"
END = "<!-- /backends -->"


def _platforms(spec: BackendSpec) -> str:
    if not spec.requirable:
        return "(not requirable)"
    if spec.platforms is None:
        return f"`{spec.name}`"
    word = spec.platform_word.split()[-1].upper()
    return f"`{spec.name}`, `{spec.name}:{word}` ({', '.join(spec.platforms)})"


def render() -> str:
    """The generated block: one row per registered backend, in run and report order."""
    out = [BEGIN, "| backend | what it proves | `--require` | blocker layer | interval | "
           "deadline | probe child |", "|---|---|---|---|---|---|---|"]
    out += [f"| `{s.name}` | {s.summary} | {_platforms(s)} | `{s.layer}` | {s.interval_s:g} s "
            f"| {s.timeout_s:g} s | `python -m gpudiag.probes {s.name}` ({s.probe_module}) |"
            for s in registry.specs()]
    out.append(END)
    return "\n".join(out)


def rewrite(text: str) -> str:
    """``text`` (docs/reference.md) with its generated backend block replaced."""
    return replace_block(text, BEGIN, END, render, DOC)


if __name__ == "__main__":
    if sys.argv[1:] == ["--print"]:
        sys.stdout.write(render() + "\n")
    else:
        DOC.write_text(rewrite(DOC.read_text()))
        sys.stdout.write(f"wrote the backend table of {DOC}\n")
