"""The shell recipes of docs/try-without-a-gpu.md, by name, for the tests that run them."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRY_DOC = ROOT / "docs" / "try-without-a-gpu.md"


def doc_blocks() -> dict[str, str]:
    """The doc's shell blocks by the name in the HTML comment before each."""
    text = TRY_DOC.read_text()
    return {m.group(1).removeprefix("recipe: "): m.group(2) for m in re.finditer(
        r"<!-- (setup|recipe: [a-z]+) -->\n```sh\n(.*?)```", text, re.S)}
