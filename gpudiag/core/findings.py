"""What classification gathers and shares with the backend classifiers (jax, iree).

Kept apart from gpudiag.core.classify so that classify can import the backend classifiers
directly: they need these types, and classify needs them, without a cycle.
"""

from __future__ import annotations

from dataclasses import field

from gpudiag.core.records import dataclass
from gpudiag.core.verdict import Finding


@dataclass(frozen=True)
class XidEvent:
    """One XID the daemon's watcher saw, within its hold time."""

    xid: int
    device_index: int | None
    uuid: str | None
    timestamp: float
    # The fault's own time: the watcher child's clock when NVML delivered the event (the
    # daemon's ``timestamp`` comes a pipe read later). Not part of the event's identity.
    fault_ts: float | None = field(default=None, compare=False)


@dataclass
class Findings:
    """Blockers and warnings gathered while classifying (mutable only inside classify)."""

    blockers: list[Finding] = field(default_factory=list)
    warnings: list[Finding] = field(default_factory=list)

    def block(self, code: str, message: str, *, backend: str | None = None,
              device: str | None = None) -> None:
        f = Finding.of(code, message, backend=backend, device=device)
        if f not in self.blockers:
            self.blockers.append(f)

    def warn(self, code: str, message: str, *, backend: str | None = None,
             device: str | None = None) -> None:
        f = Finding.of(code, message, backend=backend, device=device, warning=True)
        if f not in self.warnings:
            self.warnings.append(f)


@dataclass(frozen=True)
class GpuContext:
    """What the GPU-side analysis learned, for the JAX and IREE classifiers."""

    nvml_ok: bool
    cuda_ok: bool
    gpu_blocked: bool
    # cuDriverGetVersion as NVML or the cuda probe read it (12080 = CUDA 12.8); None: unread.
    cuda_driver_version: int | None = None
