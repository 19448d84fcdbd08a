"""Sizes as people type them (``8GiB``, ``8GB``, ``123``): one parser for every path.

Only ``re`` and ``math``: the daemon-answered CLI fast path checks an answer's memory floor
with it (engine/answercheck.py) without importing the requirement parser.
"""

from __future__ import annotations

import math
import re

_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")
_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
SIZE_FORMS = "plain bytes (8589934592), or a number with B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
MAX_SIZE = 2**63 - 1


def size_bytes(text: str) -> int | None:
    """``8GiB`` -> 8589934592; ``8GB`` -> 8000000000; ``123`` -> 123; None when not
    understood or larger than MAX_SIZE."""
    m = _SIZE_RE.match(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _SIZE_UNITS:
        return None
    value = float(m.group(1)) * _SIZE_UNITS[unit]
    if not math.isfinite(value) or value > MAX_SIZE:
        return None
    return int(value)
