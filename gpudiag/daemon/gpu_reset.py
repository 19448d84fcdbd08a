"""The GPU reset rung (issue 52): the daemon resets an idle GPU whose fault a reset repairs.

Off by default (``[gpu_reset] enabled``). It listens to the scheduler's snapshots (``offer``
keeps the newest and wakes its thread; the loop, /metrics and /v1/preflight never wait on a
reset) and, for each GPU the node-health verdict blocks with ``gpu_reset_required``, asks
the pure policy (core.gpu_reset) whether it may reset it now. When it may, on its own thread:

1. lock the GPU and every GPU of its NVLink domain (core.nvlink_domain: read from the
   topology the nvml probe read, the whole node when it could not be read; each faulty GPU's
   domain and how it was found are in the evidence, ``domains``), exclusively, without
   waiting (the lock ``gpudiag run`` jobs and the probes take: none of them starts there
   meanwhile; a lock already taken leaves the GPU alone until the next cycle);
2. look again under the locks, with the configured tool (``--query-compute-apps``): a
   process on any GPU of the domain, or an answer that cannot be read, leaves it alone;
3. note the attempt (``gpu-resets.json`` in the state dir, before the reset, so that a
   crash or a restart never resets twice past the cap);
4. persistence handled: read it (``--query-gpu=persistence_mode``), turn it off for the
   reset (``-pm 0``), reset (``-r -i BUS``), and restore it (``-pm 1``) whatever the reset
   did;
5. release the GPU's held XIDs as the daemon's own clear (recorded in the history, counted as
   a recovery with no person) and re-probe;
6. verify: the first fresh pass (its probes started after the reset, the held XIDs of
   before it released) decides ``recovered`` or ``still_faulty``; none within
   ``verify_timeout_s`` is ``unverified``. The outcome goes to the history (``resets``),
   the log and ``gpudiag_gpu_resets_total{outcome}``.

Only the configured tool is run, never a shell. Tests point it at the fake nvidia-smi
(tests/fakes): no test resets a real GPU.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import field, replace
from pathlib import Path
from typing import Any

from gpudiag.core.fileio import RefusedFile, atomic_write, read_regular
from gpudiag.core.gpu_reset import (
    FAILED,
    LOCKED,
    RECOVERED,
    SEEN_BUSY,
    STILL_FAULTY,
    UNVERIFIED,
    GpuResetConfig,
    ResetGpu,
    ResetPlan,
    plan_reset,
    processes_on,
    reset_faults,
)
from gpudiag.core.nvlink_domain import NvlinkDomain, nvlink_domain
from gpudiag.core.readiness import UNKNOWN
from gpudiag.core.records import dataclass
from gpudiag.daemon.clears import ClearRequest
from gpudiag.daemon.cycles import CycleThread
from gpudiag.daemon.slurmctl import Runner, SlurmError, run_bounded
from gpudiag.daemon.snapshot import Snapshot
from gpudiag.engine.guard import claim_free

log = logging.getLogger("gpudiag.daemon.gpu_reset")
STATE_FILE = "gpu-resets.json"
FRESH_PROBES = ("nvml", "cuda")  # a verifying pass: both ran again after the reset
MAX_WALLS = 16  # attempts kept per GPU (the cap is checked within the window)


class ToolFailed(Exception):
    """The tool failed, timed out or could not be run; the message says which step."""


@dataclass(frozen=True)
class ResetReport:
    """What /metrics and /v1/health's evidence show; ``version`` moves with every change."""

    version: int
    enabled: bool
    resets: Mapping[str, int] = field(default_factory=dict)      # outcome -> count
    left_alone: Mapping[str, int] = field(default_factory=dict)  # reason -> count
    pending: tuple[str, ...] = ()  # GPUs reset, their verifying pass not yet in
    last: Mapping[str, Any] | None = None
    # Each GPU a reset would repair now: its NVLink domain and how it was found.
    domains: Mapping[str, NvlinkDomain] = field(default_factory=dict)

    def evidence(self) -> dict[str, Any]:
        """The ``gpu_reset`` object of /v1/health's evidence."""
        return {"enabled": self.enabled, "resets": dict(sorted(self.resets.items())),
                "left_alone": dict(sorted(self.left_alone.items())),
                "pending": list(self.pending), "last": dict(self.last) if self.last else None,
                "domains": {u: d.evidence() for u, d in sorted(self.domains.items())}}


@dataclass(frozen=True)
class _Memory:
    """Kept in the state dir: the attempts (the cap) and the resets awaiting their pass."""

    attempts: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    pending: Mapping[str, float] = field(default_factory=dict)  # uuid -> reset wall time

    def record(self) -> dict[str, Any]:
        return {"attempts": {k: list(v) for k, v in self.attempts.items()},
                "pending": dict(self.pending)}

    @classmethod
    def from_record(cls, d: object) -> _Memory:
        if not isinstance(d, dict):
            raise ValueError("not an object")
        attempts, pending = d.get("attempts"), d.get("pending")
        if not isinstance(attempts, dict) or not isinstance(pending, dict):
            raise ValueError("attempts and pending must be objects")
        return cls({str(k): tuple(float(t) for t in v) for k, v in attempts.items()
                    if isinstance(v, list)},
                   {str(k): float(v) for k, v in pending.items()})


class ResetTool:
    """The configured nvidia-smi: the four calls a reset makes, each with a deadline."""

    def __init__(self, path: str, timeout_s: float, env: Mapping[str, str],
                 runner: Runner = run_bounded) -> None:
        self.path, self.timeout_s = path, timeout_s
        self._env = dict(env)
        self._runner = runner

    def _run(self, *args: str) -> str:
        argv = [self.path, *args]
        try:
            code, out, err = self._runner(argv, self._env, self.timeout_s)
        except SlurmError as e:  # run_bounded's: absent or timeout
            raise ToolFailed(f"`{' '.join(argv)}`: {e}") from e
        if code != 0:
            said = "; ".join(line.strip() for line in (out + "\n" + err).splitlines()
                             if line.strip())[:400]
            raise ToolFailed(f"`{' '.join(argv)}` exited {code}: {said or 'no output'}")
        return out

    def processes(self) -> str:
        """Every compute process on the node, ``gpu_uuid, pid`` per line."""
        return self._run("--query-compute-apps=gpu_uuid,pid", "--format=csv,noheader")

    def persistence(self, bus_id: str) -> bool:
        """Whether persistence mode is on for the GPU."""
        out = self._run("-i", bus_id, "--query-gpu=persistence_mode", "--format=csv,noheader")
        return out.strip().lower() == "enabled"

    def set_persistence(self, bus_id: str, on: bool) -> None:
        self._run("-i", bus_id, "-pm", "1" if on else "0")

    def reset(self, bus_id: str) -> None:
        self._run("-r", "-i", bus_id)


def gpus_of(snap: Snapshot) -> dict[str, ResetGpu]:
    """Each GPU of the snapshot's NVML reading as the rung sees it (occupancy from the
    published scope: processes, locks; a GPU not read is UNKNOWN; where its NVLink links
    end, or why that is not known)."""
    result = snap.result("nvml")
    nvml = result.run.nvml if result is not None else None
    scope = snap.scope
    out: dict[str, ResetGpu] = {}
    for d in nvml.devices if nvml is not None else ():
        if not d.uuid:
            continue
        links = d.nvlinks
        state = scope.state(d.uuid) if scope is not None else UNKNOWN
        ends = links.remotes if links is not None else None
        out[d.uuid] = ResetGpu(
            d.uuid, d.pci_bus_id, state,
            nvlink=links is not None and bool(links.active or links.inactive),
            mig=d.mig is not None and bool(d.mig.enabled), ends=ends,
            unread="" if ends is not None else (links.remote_error if links is not None
                                                and links.remote_error else
                                                "where its links end was not read"))
    return out


class GpuResetter:
    """Resets idle GPUs whose fault a reset repairs, on its own thread (module docstring)."""

    def __init__(self, cfg: GpuResetConfig, state_dir: Path, lock_dir: Path, *,
                 submit: Callable[[ClearRequest], None],
                 record: Callable[[str, str, str, float], None],
                 env: Mapping[str, str], runner: Runner = run_bounded,
                 wall: Callable[[], float] = time.time,
                 incident: Callable[[Snapshot], str | None] | None = None) -> None:
        """``submit`` applies the daemon's own clear of a reset GPU; ``record(gpu, outcome,
        detail, reset_wall)`` keeps an outcome in the history; ``env`` is what the tool
        sees (the daemon's environment); ``incident`` names the node's open incident as of a
        snapshot (daemon/incidents.py), said with each reset so that it can be followed."""
        self.cfg = cfg
        self.tool = ResetTool(cfg.nvidia_smi, cfg.command_timeout_s, env, runner)
        self._path = state_dir / STATE_FILE
        self._lock_dir = lock_dir
        self._submit, self._record = submit, record
        self._wall = wall
        self._incident = incident
        self._lock = threading.Lock()  # guards _latest and _report; never held on I/O
        self._worker = CycleThread("gpu-reset", self.cycle, lambda: self.cfg.tick_s)
        self._latest: Snapshot | None = None
        self._memory = self._load()
        self._report = ResetReport(1, cfg.enabled, pending=tuple(self._memory.pending))
        self._said: set[tuple[str, str]] = set()  # (uuid, reason): once per GPU incident

    # -- the daemon's side ---------------------------------------------------------------
    def offer(self, snap: Snapshot) -> None:
        """The scheduler's listener: keep the newest snapshot, wake the worker; never blocks."""
        with self._lock:
            self._latest = snap
        self._worker.wake()

    def report(self) -> ResetReport:
        with self._lock:
            return self._report

    def evidence(self) -> tuple[int, dict[str, Any]]:
        """/v1/health's ``gpu_reset`` evidence, with its version."""
        r = self.report()
        return r.version, r.evidence()

    def start(self) -> None:
        self._worker.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        self._worker.stop(timeout_s)

    # -- one cycle -----------------------------------------------------------------------
    def cycle(self) -> ResetPlan | None:
        """Verify what was reset, then reset at most one GPU (public for tests); the plan
        acted on, or None."""
        with self._lock:
            snap = self._latest
        if snap is None or snap.ready is None or not self.cfg.enabled:
            return None
        self._verify(snap)
        faulty = reset_faults([(b.code, b.device) for b in snap.ready.blockers])
        self._said = {(u, r) for u, r in self._said if u in faulty}
        gpus = gpus_of(snap)
        self._set(domains={u: nvlink_domain(u, gpus) for u in faulty})
        now = self._wall()
        for uuid in faulty:
            if uuid in self._memory.pending:
                continue
            plan = plan_reset(uuid, gpus, self._memory.attempts.get(uuid, ()), now, self.cfg)
            if not plan.reset:
                self._left_alone(uuid, plan.reason, plan.why)
                continue
            self._reset(plan, snap)
            return plan
        return None

    def _verify(self, snap: Snapshot) -> None:
        verdict = snap.ready
        assert verdict is not None
        for uuid, at in list(self._memory.pending.items()):
            held = any(x.uuid == uuid and x.timestamp <= at for x in snap.watcher.recent)
            results = [snap.result(name) for name in FRESH_PROBES]
            fresh = not held and all(r is None or r.started_wall > at for r in results) and any(
                r is not None for r in results)
            if fresh:
                codes = sorted({b.code for b in verdict.blockers if b.device == uuid})
                if codes:
                    self._finish(uuid, at, STILL_FAULTY, "the fresh pass after the reset still "
                                 f"finds {', '.join(codes)}")
                else:
                    self._finish(uuid, at, RECOVERED, "the fresh pass after the reset finds "
                                 "no fault")
            elif self._wall() - at > self.cfg.verify_timeout_s:
                self._finish(uuid, at, UNVERIFIED, f"no fresh pass within "
                             f"{self.cfg.verify_timeout_s:g} s of the reset")

    def _reset(self, plan: ResetPlan, snap: Snapshot) -> None:
        """Lock the domain, look again, reset under the locks (module docstring)."""
        scope = snap.scope
        occupancy = scope.occupancy if scope is not None else {}
        claim = claim_free(occupancy, plan.domain, lock_dir=self._lock_dir,
                           exclusive=plan.domain, purpose="reset")
        with claim:
            if set(claim.claimed) != set(plan.domain):
                left = ", ".join(f"{u} ({why})" for u, why in sorted(claim.left_alone.items()))
                self._left_alone(plan.uuid, LOCKED, f"GPU {plan.uuid}: its NVLink domain could "
                                 f"not be locked ({left}); tried again next cycle", count=False)
                return
            try:
                seen = processes_on(self.tool.processes(), plan.domain)
            except ToolFailed as e:
                seen = [str(e)]
            if seen:
                self._left_alone(plan.uuid, SEEN_BUSY, f"GPU {plan.uuid}: under the locks the "
                                 f"tool shows work on its NVLink domain ({'; '.join(seen)[:300]})")
                return
            at = self._wall()
            ident = self._incident(snap) if self._incident is not None else None
            within = f" (incident {ident})" if ident else ""
            walls = (*self._memory.attempts.get(plan.uuid, ()), at)[-MAX_WALLS:]
            self._keep(replace(self._memory, attempts={**self._memory.attempts,
                                                       plan.uuid: walls}))
            how = plan.nvlink.why if plan.nvlink is not None else "not looked at"
            log.warning("resetting GPU %s (%s)%s: gpu_reset_required, the GPU and its NVLink "
                        "domain (%s) idle and locked", plan.uuid, plan.bus_id, within, how,
                        extra={"uuid": plan.uuid, "pci_bus_id": plan.bus_id,
                               "domain": list(plan.domain), "incident": ident,
                               "domain_basis": plan.nvlink.basis if plan.nvlink else None})
            try:
                self._run_reset(plan.bus_id)
            except ToolFailed as e:
                self._finish(plan.uuid, at, FAILED, f"{e}{within}")
                return
        self._keep(replace(self._memory, pending={**self._memory.pending, plan.uuid: at}))
        self._set(pending=tuple(self._memory.pending))
        self._submit(ClearRequest(gpu=plan.uuid, reason=f"reset by gpudiag (nvidia-smi -r -i "
                                  f"{plan.bus_id}): gpu_reset_required on an idle GPU{within}",
                                  uid=os.getuid(), requested_wall=at, automatic=True))

    def _run_reset(self, bus_id: str) -> None:
        """Persistence off, reset, persistence restored (whatever the reset did)."""
        persistent = self.tool.persistence(bus_id)
        if persistent:
            self.tool.set_persistence(bus_id, False)
        try:
            self.tool.reset(bus_id)
        finally:
            if persistent:
                try:
                    self.tool.set_persistence(bus_id, True)
                except ToolFailed as e:
                    log.error("GPU %s: persistence mode could not be turned on again after the "
                              "reset (%s); turn it on by hand (nvidia-smi -i %s -pm 1)",
                              bus_id, e, bus_id, extra={"pci_bus_id": bus_id})

    # -- bookkeeping ---------------------------------------------------------------------
    def _finish(self, uuid: str, at: float, outcome: str, detail: str) -> None:
        pending = {k: v for k, v in self._memory.pending.items() if k != uuid}
        self._keep(replace(self._memory, pending=pending))
        level = logging.INFO if outcome == RECOVERED else logging.WARNING
        log.log(level, "GPU reset of %s: %s (%s)", uuid, outcome, detail,
                extra={"uuid": uuid, "outcome": outcome, "reset_wall": at})
        with contextlib.suppress(Exception):  # the history may be unwritable: said there
            self._record(uuid, outcome, detail, at)
        r = self.report()
        resets = dict(r.resets)
        resets[outcome] = resets.get(outcome, 0) + 1
        self._set(resets=resets, pending=tuple(pending),
                  last={"gpu": uuid, "outcome": outcome, "detail": detail, "reset_wall": at})

    def _left_alone(self, uuid: str, reason: str, why: str, *, count: bool = True) -> None:
        """Said and counted once per GPU incident and reason."""
        if (uuid, reason) in self._said:
            return
        self._said.add((uuid, reason))
        log.warning("GPU reset of %s: left alone: %s", uuid, why,
                    extra={"uuid": uuid, "reason": reason})
        if count:
            r = self.report()
            left = dict(r.left_alone)
            left[reason] = left.get(reason, 0) + 1
            self._set(left_alone=left)

    def _set(self, **changes: object) -> None:
        with self._lock:
            r = self._report
            new = replace(r, **changes)  # type: ignore[arg-type]
            if new != r:
                self._report = replace(new, version=r.version + 1)

    def _keep(self, memory: _Memory) -> None:
        """Remember, in memory and in the state dir, before anything else happens."""
        self._memory = memory
        try:
            atomic_write(self._path, json.dumps(memory.record()), 0o600)
        except OSError as e:
            log.error("GPU reset: cannot keep its state in %s (%s): a restart would not know "
                      "this node's resets", self._path, e)

    def _load(self) -> _Memory:
        try:
            raw, _st = read_regular(self._path, 1 << 20)
            return _Memory.from_record(json.loads(raw))
        except RefusedFile as e:
            if isinstance(e.__cause__, FileNotFoundError):
                return _Memory()
            error: Exception = e
        except (ValueError, TypeError) as e:
            error = e
        log.error("GPU reset: %s unreadable (%s): starting with no memory of resets",
                  self._path, error)
        return _Memory()


