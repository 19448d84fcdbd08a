"""Click options more than one command shares: one object each, one help text."""

from __future__ import annotations

import click

from gpudiag.core import registry


def _require_help() -> str:
    """``--require``'s help, from the backend registry (so it cannot drift from the parser)."""
    parts: list[str] = []
    for spec in registry.specs():
        if not spec.requirable:
            continue
        parts.append(spec.name)
        other = [p for p in spec.platforms or () if p not in ("gpu", "cuda")]
        word = spec.platform_word.split()[-1].upper()
        if len(other) == 1:
            parts.append(f"{spec.name}:{other[0]}")
        elif other:
            parts.append(f"{spec.name}:{word} ({', '.join(other)})")
    return ("What the job needs, comma-separated: " + ", ".join(parts)
            + ". Without a platform a backend runs on the NVIDIA GPU.")


# The one --require of probe-answering commands (preflight, health, run).
require = click.option("--require", "require_text", default="cuda", show_default=True,
                       metavar="LIST", help=_require_help())
