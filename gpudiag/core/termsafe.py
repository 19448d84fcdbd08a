"""Text for a terminal: control characters from data escaped, never sent as they are.

A record's argv, a probe's stderr, a lock or job record another user wrote, a daemon's
answer: any of them can carry ESC sequences (set the title, rewrite the screen, fake a
``ready=true`` line) or bidirectional overrides. Every text output that carries such data
escapes them here first (docs/security.md, "Terminal injection"): ``\\x1b`` becomes the four
characters ``\\x1b``. JSON output needs nothing: json.dumps escapes controls itself.
Only ``re`` is imported: the daemon-answered CLI call uses this for its kv lines.
"""

from __future__ import annotations

import re

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (see gpudiag/__init__)
if TYPE_CHECKING:
    from typing import Any

# C0 controls but tab and newline, DEL, C1 controls (0x9b is a one-byte CSI on some
# terminals), and the bidirectional marks, embeddings, overrides and isolates.
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_UNSAFE_LINE = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escape(m: re.Match[str]) -> str:
    code = ord(m.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def terminal_safe(text: str, *, one_line: bool = False) -> str:
    """``text`` with its control characters written out (``\\x1b``); ``one_line`` escapes
    tab and newline too (a field shown inside one line)."""
    return (_UNSAFE_LINE if one_line else _UNSAFE).sub(_escape, text)


def terminal_safe_record(value: Any, *, one_line: bool = True) -> Any:
    """A JSON-able value with every string (keys too) made terminal-safe."""
    if isinstance(value, str):
        return terminal_safe(value, one_line=one_line)
    if isinstance(value, dict):
        return {terminal_safe_record(k, one_line=True): terminal_safe_record(
            v, one_line=one_line) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [terminal_safe_record(v, one_line=one_line) for v in value]
    return value
