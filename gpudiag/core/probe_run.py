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
from dataclasses import field
from typing import Any, Generic, TypeVar

from gpudiag.core.observations import (
    CudaObservation,
    HostObservation,
    IreeObservation,
    JaxObservation,
    Malformed,
    NvmlObservation,
    ProbeObservation,
)
from gpudiag.core.records import dataclass
from gpudiag.core.registry import parse_observation

STDERR_TAIL_BYTES = 64 * 1024
_Kind = TypeVar("_Kind")


class _Typed(Generic[_Kind]):
    """A read-only attribute of a ProbeRun: its parsed observation if it is of this kind."""

    def __init__(self, kind: type[_Kind]) -> None:
        self.kind = kind

    def __get__(self, run: ProbeRun, owner: type[ProbeRun] | None = None) -> _Kind | None:
        parsed = run.parsed
        return parsed if isinstance(parsed, self.kind) else None


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

    # The typed observation by kind, whether or not the child exited cleanly; None when the
    # run holds another kind or nothing.
    host = _Typed(HostObservation)
    nvml = _Typed(NvmlObservation)
    cuda = _Typed(CudaObservation)
    jax = _Typed(JaxObservation)
    iree = _Typed(IreeObservation)


def bounded_tail(data: bytes, limit: int = STDERR_TAIL_BYTES) -> str:
    """The last ``limit`` bytes of ``data`` as text (the tail holds the cause)."""
    if len(data) > limit:
        data = data[-limit:]
    return data.decode("utf-8", errors="replace")
