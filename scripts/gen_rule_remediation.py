"""Write the GpudiagNodeBlocked remediation annotation of prometheus/gpudiag.rules.yml from the
blocker catalog (tests/test_prometheus_rules.py checks it is current).

The annotation is a Go template that picks the catalog's remediation by the alert's ``code``
label; it sits between its BEGIN and END comments, at the indentation the rules file gives it.

    .venv/bin/python scripts/gen_rule_remediation.py
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gpudiag.core.catalog import BLOCKERS
from scripts.docblock import replace_block

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "prometheus" / "gpudiag.rules.yml"
BEGIN = "# BEGIN generated remediation"
END = "# END generated remediation"


def remediation_template() -> str:
    """The Go template choosing the catalog's remediation by the alert's code label."""
    lines = []
    for i, entry in enumerate(BLOCKERS.values()):
        keyword = "if" if i == 0 else "else if"
        lines.append(f'{{{{- {keyword} eq $labels.code "{entry.code}" -}}}}')
        lines.append(entry.remediation)
    lines.append("{{- else -}}")
    lines.append("See the gpudiag blocker catalog for {{ $labels.code }}.")
    lines.append("{{- end -}}")
    return "\n".join(lines)


def generated_block(indent: str) -> str:
    """The block from BEGIN to END; its first line takes the indentation already before it."""
    body = "\n".join(indent + "  " + line for line in remediation_template().splitlines())
    return (f"{BEGIN} (scripts/gen_rule_remediation.py rewrites it)\n"
            f"{indent}remediation: |-\n{body}\n{indent}{END}")


def rewrite(text: str) -> str:
    """The rules file with its generated block replaced by the current catalog's."""
    found = re.search(rf"^([ \t]*){re.escape(BEGIN)}", text, re.M)
    indent = found.group(1) if found else ""
    return replace_block(text, BEGIN, END, lambda: generated_block(indent), RULES)


if __name__ == "__main__":
    RULES.write_text(rewrite(RULES.read_text()))
    sys.stdout.write(f"wrote the remediation annotation of {RULES}\n")
