"""One generated block in a Markdown file: replaced between its BEGIN and END markers.

The docs generators (scripts/gen_alert_docs.py, scripts/gen_backend_docs.py) keep hand-written
prose around a table they own; this is the one implementation of swapping that table.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path


def replace_block(text: str, begin: str, end: str, render: Callable[[], str],
                  doc: Path) -> str:
    """``text`` with the block from ``begin`` to ``end`` replaced by ``render()``."""
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise ValueError(f"{doc}: no '{begin}' ... '{end}' block")
    return pattern.sub(lambda _: render(), text)
