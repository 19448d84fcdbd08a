"""The bounds of POST /v1/qualify: one request per GPU, a GPU-seconds cap, a bounded queue.

Issue 38, class 4: a ``tier=full`` request held a GPU longer than a job's lock timeout and the
queue took any number of requests. Now (docs/qualify.md, "On demand"):

- a request names GPUs the daemon knows (resolved once, when it is queued, to full UUIDs);
- its budget, the tier's deadline per GPU times its GPUs, is at most ``max_request_gpu_s``;
- a GPU that already has a qualification queued or running (asked for, or the schedule's)
  takes no second one: the refusal names the one it has;
- at most ``max_queued`` requests wait at once.

Pure rules over the queue the qualifier holds (daemon/qualify_schedule.py); the HTTP status of each
refusal is the app's (daemon/app.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpudiag.core.gpunames import GpuNameError, NamedGpu, resolve
from gpudiag.core.qualify import TIERS
from gpudiag.core.records import dataclass
from gpudiag.daemon.snapshot import Snapshot

# Refusal codes (docs/reference.md, "HTTP API of the daemon").
UNKNOWN_GPU = "unknown_gpu"
NO_GPUS = "no_gpus"
OVER_BUDGET = "over_budget"
ALREADY_QUEUED = "qualification_pending"
QUEUE_FULL = "queue_full"


@dataclass(frozen=True)
class QualifyRequest:
    """One qualification to run: asked for (POST /v1/qualify) or due on the schedule."""

    gpus: tuple[str, ...] | None  # as asked: indices or full UUIDs; None: every GPU
    tier: str
    uuids: tuple[str, ...] = ()  # the GPUs it covers, resolved when it was queued
    indices: tuple[int, ...] = ()  # their NVML indices, for messages
    requested_at: float = 0.0  # wall clock, epoch seconds
    scheduled: bool = False  # the daemon's own schedule, not a request
    started_at: float | None = None  # when it began to run (wall clock)

    @property
    def budget_gpu_s(self) -> float:
        """The most GPU time it may take: the tier's deadline per GPU, times its GPUs."""
        return TIERS[self.tier].deadline_s * len(self.uuids)

    def describe(self, now: float, running: bool) -> str:
        """``the full-tier request for GPU 0 (GPU-...), running for 3.2 s``."""
        what = "the scheduled" if self.scheduled else "the requested"
        gpus = ", ".join(f"{i} ({u})" for i, u in zip(self.indices, self.uuids, strict=True))
        since = self.started_at if running and self.started_at is not None else (
            self.requested_at)
        state = "running for" if running else "queued"
        when = f"{max(0.0, now - since):.1f} s" + ("" if running else " ago")
        return f"{what} {self.tier}-tier qualification of GPU {gpus}, {state} {when}"

    def record(self) -> dict[str, Any]:
        return {"gpus": list(self.gpus or ()), "tier": self.tier, "uuids": list(self.uuids),
                "budget_gpu_s": self.budget_gpu_s, "requested_at": self.requested_at}


class RequestRefused(Exception):
    """A request the bounds refuse: ``code`` one of this module's, ``message`` says why."""

    def __init__(self, code: str, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


def known_gpus(snapshot: Snapshot) -> list[NamedGpu]:
    """The GPUs a request may name: the physical GPUs of the latest NVML reading."""
    result = snapshot.result("nvml")
    nvml = result.run.nvml if result is not None else None
    return [NamedGpu(d.index, d.uuid, d.pci_bus_id) for d in (nvml.devices if nvml else ())
            if d.uuid and d.uuid.startswith("GPU-")]


def resolve_request(gpus: Sequence[str] | None, tier: str, known: Sequence[NamedGpu],
                    now: float) -> QualifyRequest:
    """The request for ``gpus`` (None: every GPU the daemon knows), its GPUs resolved."""
    if not known:
        raise RequestRefused(NO_GPUS, "no GPU is known yet (the daemon has not read NVML, or "
                             "NVML shows none): retry once GET /readyz answers 200",
                             retry_after_s=5.0)
    if gpus:
        try:
            picked = {resolve(g, known) for g in gpus}
        except GpuNameError as e:
            raise RequestRefused(UNKNOWN_GPU, f"gpus: {e}") from None
    else:
        picked = set(known)
    chosen = sorted(picked, key=lambda g: g.index)
    return QualifyRequest(tuple(gpus) if gpus else None, tier, tuple(g.uuid for g in chosen),
                          tuple(g.index for g in chosen), now)


def check(req: QualifyRequest, queued: Sequence[QualifyRequest],
          running: QualifyRequest | None, *, max_gpu_s: float, max_queued: int,
          now: float) -> None:
    """RequestRefused when ``req`` may not join the queue; the order is the docs' order."""
    if req.budget_gpu_s > max_gpu_s:
        per = TIERS[req.tier].deadline_s
        raise RequestRefused(OVER_BUDGET, (
            f"tier={req.tier} on {len(req.uuids)} GPU(s) may take {req.budget_gpu_s:g} "
            f"GPU-seconds ({per:g} s per GPU); the cap per request is {max_gpu_s:g} "
            f"(qualification.max_request_gpu_s): name at most {int(max_gpu_s // per)} GPU(s) "
            "with gpus=, or ask for a shorter tier"))
    holders: Mapping[str, tuple[QualifyRequest, bool]] = {
        **{u: (q, False) for q in queued for u in q.uuids},
        **({u: (running, True) for u in running.uuids} if running is not None else {})}
    taken = [(i, u) for i, u in zip(req.indices, req.uuids, strict=True) if u in holders]
    if taken:
        index, uuid = taken[0]
        other, is_running = holders[uuid]
        raise RequestRefused(ALREADY_QUEUED, (
            f"GPU {index} ({uuid}) already has a qualification: "
            f"{other.describe(now, is_running)}; "
            "one qualification per GPU may be queued or running: ask again once it ends (its "
            "outcome: gpudiag_gpu_qualification_outcome in /metrics)"),
            retry_after_s=_left_s(other, now, is_running))
    if len(queued) >= max_queued:
        raise RequestRefused(QUEUE_FULL, (
            f"{len(queued)} qualification request(s) are queued already, the most there may "
            f"be (qualification.max_queued = {max_queued}): ask again once one has run"),
            retry_after_s=_left_s(running, now, True) if running is not None else 5.0)


def _left_s(req: QualifyRequest, now: float, running: bool) -> float:
    """At most how long until ``req`` is done: its budget, less what ran of it."""
    began = req.started_at if req.started_at is not None else now
    spent = max(0.0, now - began) if running else 0.0
    return max(1.0, req.budget_gpu_s - spent)
