"""What came back from one probe child, as the caller saw it: the model every layer shares.

Isolation (gpudiag.engine.isolation) makes these; classification, the daemon's snapshot and
admission read them. It lives in core so that pure classification needs no process code.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpudiag.core.limits import PROBES

STDERR_TAIL_BYTES = 64 * 1024
# "devices" is the nvml probe's per-device sub-observation.
KNOWN_PROBES = (*PROBES, "devices")


@dataclass(frozen=True)
class ProbeRun:
    """What came back from one probe child."""

    backend: str
    observation: Mapping[str, Any] | None
    duration_s: float
    exit_code: int | None = None
    signal: int | None = None
    timed_out: bool = False
    stderr_tail: str = ""
    error: str | None = None
    argv: tuple[str, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return self.observation is not None and self.error is None


def bounded_tail(data: bytes, limit: int = STDERR_TAIL_BYTES) -> str:
    """The last ``limit`` bytes of ``data`` as text (the tail holds the cause)."""
    if len(data) > limit:
        data = data[-limit:]
    return data.decode("utf-8", errors="replace")
