"""The requirement parsers' error and the deadline parser: the part of
``gpudiag.core.requirement`` that imports nothing heavy.

The console entry's fast path reads ``--timeout`` with these without importing the backend
registry and its dataclasses (docs/benchmarks.md, "CLI start"); ``gpudiag.core.requirement``
re-exports both, so every caller keeps one parser and one error type.
"""

from __future__ import annotations

import math


class RequirementError(ValueError):
    """A requirement, size, device list or deadline that cannot be understood."""


def parse_timeout(text: str | float, *, name: str = "timeout") -> float:
    """A deadline in seconds: a positive finite number up to one day."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise RequirementError(
            f"{name} {text!r} is not a number of seconds; accepted: e.g. 30 or 2.5") from None
    if not math.isfinite(value) or value <= 0 or value > 86400:
        raise RequirementError(f"{name} {text!r} must be more than 0 and at most 86400 seconds")
    return value
