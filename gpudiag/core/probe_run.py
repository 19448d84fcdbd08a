"""What came back from one probe child, as the caller saw it: the model every layer shares.

Isolation (gpudiag.engine.isolation) makes these; classification, the daemon's snapshot and
admission read them. It lives in core so that pure classification needs no process code.
Building a ProbeRun parses its observation (gpudiag.core.observations) exactly once: readers
use the typed ``parsed`` observation (or ``host``, ``nvml``, ... below), never the raw JSON,
which stays only for evidence and history. A malformed observation turns the run into a
``probe_error`` run naming the field, whoever built it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpudiag.core.observations import (
    CudaObservation,
    HostObservation,
    IreeObservation,
    JaxObservation,
    Malformed,
    NvmlObservation,
    ProbeObservation,
)
from gpudiag.core.registry import parse_observation

STDERR_TAIL_BYTES = 64 * 1024


@dataclass(frozen=True)
class ProbeRun:
    """What came back from one probe child (``observation``: its JSON; ``parsed``: typed)."""

    backend: str
    observation: Mapping[str, Any] | None
    duration_s: float
    exit_code: int | None = None
    signal: int | None = None
    timed_out: bool = False
    stderr_tail: str = ""
    error: str | None = None
    argv: tuple[str, ...] = field(default_factory=tuple)
    # Not run, and why (the daemon's jax/iree round found no free GPU): not a failure.
    skipped: str | None = None
    parsed: ProbeObservation | None = field(init=False, default=None, compare=False,
                                            repr=False)

    def __post_init__(self) -> None:
        if self.observation is None:
            return
        parsed = parse_observation(self.backend, self.observation)
        if isinstance(parsed, Malformed):
            # Frozen: set once, here, before anyone can see the run.
            object.__setattr__(self, "observation", None)
            object.__setattr__(self, "error", f"probe {self.backend} returned a malformed "
                                              f"observation: {parsed.problem}")
            return
        object.__setattr__(self, "parsed", parsed)

    @property
    def ok(self) -> bool:
        return self.observation is not None and self.error is None

    def _typed(self, kind: type[Any]) -> Any:
        return self.parsed if isinstance(self.parsed, kind) else None

    @property
    def host(self) -> HostObservation | None:
        """The typed host observation, whether or not the child exited cleanly."""
        found: HostObservation | None = self._typed(HostObservation)
        return found

    @property
    def nvml(self) -> NvmlObservation | None:
        found: NvmlObservation | None = self._typed(NvmlObservation)
        return found

    @property
    def cuda(self) -> CudaObservation | None:
        found: CudaObservation | None = self._typed(CudaObservation)
        return found

    @property
    def jax(self) -> JaxObservation | None:
        found: JaxObservation | None = self._typed(JaxObservation)
        return found

    @property
    def iree(self) -> IreeObservation | None:
        found: IreeObservation | None = self._typed(IreeObservation)
        return found


def bounded_tail(data: bytes, limit: int = STDERR_TAIL_BYTES) -> str:
    """The last ``limit`` bytes of ``data`` as text (the tail holds the cause)."""
    if len(data) > limit:
        data = data[-limit:]
    return data.decode("utf-8", errors="replace")
