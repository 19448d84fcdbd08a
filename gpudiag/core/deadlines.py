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


def daemon_wait_s(timeout_s: float | None) -> float:
    """How long one call waits for the daemon's answer: ``--timeout`` when given (at most
    MAX_DAEMON_WAIT_S), else DEFAULT_DAEMON_WAIT_S; asked once per call, by whichever path."""
    from gpudiag.core.limits import DEFAULT_DAEMON_WAIT_S, MAX_DAEMON_WAIT_S

    return DEFAULT_DAEMON_WAIT_S if timeout_s is None else min(MAX_DAEMON_WAIT_S, timeout_s)


def fallback_timeouts(defaults: dict[str, float], timeout_s: float | None,
                      waited_s: float) -> dict[str, float] | None:
    """The fallback probes' deadlines after a daemon wait of ``waited_s``: None (the probes'
    own) when ``--timeout`` was given or nothing was waited; else each default cut to what is
    left of CALL_BUDGET_S, so that the default whole call fits a Slurm prolog's 60 s."""
    from gpudiag.core.limits import CALL_BUDGET_S, MIN_PROBE_DEADLINE_S

    if timeout_s is not None or waited_s <= 0:
        return None
    left = max(MIN_PROBE_DEADLINE_S, CALL_BUDGET_S - waited_s)
    return {name: min(limit, left) for name, limit in defaults.items()}
