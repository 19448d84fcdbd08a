"""ASCII-only integer parsing for text from outside (HTTP, config, environment, files).

``str.isdigit()`` is true for Unicode digits ("²", "¹", "٣") and ``int()`` accepts some of
them and raises on others: a check and a conversion that disagree. Everything that turns
outside text into an integer goes through here: digits 0-9 only, so the check and the value
always agree and nothing past the check can raise.
"""

from __future__ import annotations

import re

_ASCII_DIGITS = re.compile(r"[0-9]{1,30}")


def ascii_int(text: str, *, strip: bool = True) -> int | None:
    """``"42"`` -> 42; None for anything but ASCII digits (signs, Unicode digits, empty)."""
    candidate = text.strip(" \t") if strip else text
    if not _ASCII_DIGITS.fullmatch(candidate):
        return None
    return int(candidate)
