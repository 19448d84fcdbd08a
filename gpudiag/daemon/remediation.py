"""The remediation actor: the daemon drains its node on a hardware fault, and resumes it.

It listens to the scheduler's snapshots (``offer``, which only keeps the newest and wakes the
worker) and to ``gpudiag clear`` (``cleared``); everything else happens on its own thread:
the killswitch file is re-read each cycle, scontrol and sinfo run with deadlines
(daemon.slurmctl) and, when they fail, again after a backoff. So a slow or absent Slurm never
holds up the scheduler's loop, /metrics or /v1/preflight. What to do comes from the pure
policy (core.remediation); this module gathers its facts and carries its decision out.

What it did is kept in the state dir (``remediation.json``, written before the next cycle):
a restart neither drains twice nor forgets a drain it owns.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import field, replace
from pathlib import Path

from gpudiag.core.catalog import NIC_DRAINS, drains
from gpudiag.core.fileio import RefusedFile, atomic_write, read_regular
from gpudiag.core.records import dataclass
from gpudiag.core.remediation import (
    KILL_ALL,
    Decision,
    Drain,
    Facts,
    Fault,
    Fleet,
    Memory,
    NodeView,
    Rails,
    Tally,
    cleared,
    decide,
    parse_killswitch,
    released,
    remember,
    resume_due,
)
from gpudiag.core.remediation_config import RemediationConfig
from gpudiag.core.xids import xid_code
from gpudiag.daemon.actuator import Actuator, ActuatorError, NodeInfo
from gpudiag.daemon.actuators import actuator_for
from gpudiag.daemon.cycles import CycleThread
from gpudiag.daemon.snapshot import Snapshot

log = logging.getLogger("gpudiag.daemon.remediation")
STATE_FILE = "remediation.json"
GPU_PROBES = ("host", "nvml", "cuda")  # the checks a fresh pass must have run again
NODE_POLL_S = 5.0  # while gpudiag's drain stands: how often to look whether someone undid it
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
KILLSWITCH_LIMIT = 64 * 1024


def node_name(cfg: RemediationConfig) -> str:
    """The configured node name, else the short host name (what slurmd registers)."""
    return cfg.node_name or socket.gethostname().split(".")[0]


def actuator(cfg: RemediationConfig) -> Actuator:
    """The configured platform's actuator (Slurm: scontrol and sinfo), for this node."""
    return actuator_for(cfg, node_name(cfg))


def check_node_once(cfg: RemediationConfig) -> tuple[bool, str]:
    """``serve --check-config``: (False, why) when Slurm says the node is unknown or cannot
    be asked at all (scontrol absent, failing, timing out): a check of the configuration
    says what would stop remediation (the daemon itself starts and asks again)."""
    slurm = actuator(cfg)
    try:
        info = slurm.show_node()
    except ActuatorError as e:
        if e.kind == "unknown_node":
            return False, (f"node_name {slurm.node!r} is not a node Slurm knows ({e}); set "
                           "node_name to this node's NodeName")
        return False, (f"cannot ask Slurm about node {slurm.node!r} ({e.kind}: {e}); check "
                       "scontrol and slurm_conf in [remediation] and that slurmctld answers "
                       f"(`{cfg.scontrol} ping`)")
    return True, (f"node {slurm.node!r} is {info.view.state} in Slurm (partitions "
                  f"{','.join(info.partitions) or 'none'}), mode {cfg.mode}")


def snapshot_faults(snap: Snapshot, drain_on_nic: bool = False
                    ) -> tuple[tuple[Fault, ...] | None, float | None]:
    """The node-health verdict's draining faults with their evidence times, and the oldest
    start of the GPU probes behind it; (None, None) before there is a verdict.
    ``drain_on_nic`` ([remediation] drain_on_nic): also an expected port down or flapping,
    from the verdict of every enabled backend (the nic backend is in it when enabled)."""
    verdict = snap.ready
    if verdict is None:
        return None, None
    starts = [r.started_wall for k, r in snap.results.items() if k.backend in GPU_PROBES]
    since = min(starts) if starts else None
    nvml = snap.result("nvml")
    probed = nvml.started_wall if nvml is not None else snap.published_wall
    by_index = {f"index {d.index}": d.uuid for d in verdict.devices if d.uuid}
    by_index.update({f"index {i}": g.uuid for i, g in snap.last_seen.items()
                     if f"index {i}" not in by_index and getattr(g, "uuid", None)})
    faults = []
    for b in verdict.blockers:
        if not drains(b.code):
            continue
        uuid = b.device if b.device and b.device[:4] in ("GPU-", "MIG-") else (
            by_index.get(b.device or ""))
        xids = [x.timestamp for x in snap.watcher.recent if xid_code(x.xid) == b.code
                and (x.uuid == uuid if uuid and x.uuid else f"index {x.device_index}"
                     == b.device)]
        faults.append(Fault(b.code, uuid, max(xids) if xids else probed))
    nic = snap.result("nic")
    for b in (snap.full.blockers if drain_on_nic and snap.full is not None else ()):
        if b.code in NIC_DRAINS and nic is not None:  # the port's fault: no GPU of it
            faults.append(Fault(b.code, None, nic.started_wall))
    return tuple(dict.fromkeys(faults)), since


@dataclass(frozen=True)
class RemediationReport:
    """What /metrics and /v1/health's evidence show; ``version`` moves with every change."""

    version: int
    mode: str
    node: str
    node_checked: bool = False
    drain: Drain | None = None
    refused: bool = False  # the standing incident's drain was refused (the fleet guard)
    actions: Mapping[tuple[str, str, str, str], int] = field(default_factory=dict)
    command_failures: Mapping[tuple[str, str], int] = field(default_factory=dict)
    latency_buckets: tuple[int, ...] = (0,) * len(LATENCY_BUCKETS)
    latency_count: int = 0
    latency_sum_s: float = 0.0
    last_error: str | None = None
    failing_since_wall: float | None = None
    retry_in_s: float | None = None
    killswitch: frozenset[str] = frozenset()
    tally: Tally = field(default_factory=Tally)

    @property
    def needs_person(self) -> bool:
        return self.drain is not None and self.drain.needs_person and not self.drain.observed

    def evidence(self) -> dict[str, object]:
        """The ``remediation`` object of /v1/health's evidence."""
        return {"mode": self.mode, "node": self.node, "node_checked": self.node_checked,
                "drain": self.drain.record() if self.drain else None,
                "needs_person": self.needs_person, "refused": self.refused,
                "incidents": self.tally.record(),
                "killswitch": sorted(self.killswitch),
                "scontrol_healthy": self.last_error is None,
                "last_error": self.last_error, "failing_since_wall": self.failing_since_wall,
                "retry_in_s": self.retry_in_s,
                "command_failures": {f"{c}:{k}": n for (c, k), n in
                                     sorted(self.command_failures.items())}}


class Remediator:
    """Drains and resumes this node through Slurm, on its own thread (module docstring)."""

    def __init__(self, cfg: RemediationConfig, state_dir: Path, slurm: Actuator | None = None,
                 *, wall: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.slurm = slurm or actuator(cfg)  # the platform's calls (daemon/actuator.py)
        self._path = state_dir / STATE_FILE
        self._wall, self._mono = wall, monotonic
        self._lock = threading.Lock()  # guards _latest, _clears and _report; never held on I/O
        self._worker = CycleThread("remediation", self.cycle, lambda: self.cfg.tick_s)
        self._latest: Snapshot | None = None
        self._clears: list[tuple[str | None, float, bool]] = []
        self._memory = self._load()
        self._report = RemediationReport(1, cfg.mode, self.slurm.node, drain=self._memory.drain,
                                         tally=self._memory.tally)
        self._partitions: tuple[str, ...] = tuple(
            p for p in (cfg.partition or "").split(",") if p)
        self._said: set[tuple[str, str, str | None]] = set()  # once per incident and outcome
        self._failures = 0
        self._retry_at = 0.0
        self._node_read_at = -1e9
        self._waiting = False  # an incident refused or left alone: looked at again in a while

    # -- the daemon's side ---------------------------------------------------------------
    def check_node(self) -> NodeInfo:
        """``scontrol show node`` for the configured node (SlurmError when it fails)."""
        info = self.slurm.show_node()
        self._partitions = self._partitions or info.partitions
        self._set(node_checked=True)
        return info

    def offer(self, snap: Snapshot) -> None:
        """The scheduler's listener: keep the newest snapshot, wake the worker; never blocks."""
        with self._lock:
            self._latest = snap
        self._worker.wake()

    def cleared(self, uuid: str | None, wall: float, *, by_person: bool = True) -> None:
        """A ``gpudiag clear`` of ``uuid`` (None: all) was applied at ``wall`` (``by_person``
        False: the daemon released a reboot-class hold itself)."""
        with self._lock:
            self._clears.append((uuid, wall, by_person))
        self._worker.wake()

    def report(self) -> RemediationReport:
        with self._lock:
            return self._report

    def start(self) -> None:
        self._worker.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        self._worker.stop(timeout_s)

    def cycle(self) -> Decision | None:
        """One look at the facts and at most one action (public for tests)."""
        with self._lock:
            snap, clears, self._clears = self._latest, self._clears, []
        memory = self._memory
        for uuid, wall, by_person in clears:
            memory = cleared(memory, uuid, wall, by_person=by_person)
        rails = self._rails()
        now = self._wall()
        faults, since = (snapshot_faults(snap, self.cfg.drain_on_nic) if snap is not None
                         else (None, None))
        facts = Facts(now, faults, since, node=None)
        memory = released(memory, facts)
        self._keep(memory)
        if self._mono() < self._retry_at:
            return None  # backing off after a failed scontrol/sinfo
        first = decide(facts, memory, rails)
        if first.outcome in ("waiting", "healthy"):
            self._said.clear()
            self._waiting = False
            self._set(refused=False)
            return first
        if first.outcome == "held" and first.mode == "observe":
            return first
        # Slurm is asked at once for a new incident or a resume that may be due; otherwise
        # (gpudiag's drain stands, or a refused or left-alone incident) every NODE_POLL_S.
        standing = memory.drain is not None and not memory.drain.observed
        due = not self._waiting and (resume_due(facts, memory) if standing else True)
        if not due and self._mono() - self._node_read_at < NODE_POLL_S:
            return first
        try:
            info = self._read_node()
            facts = replace(facts, node=info.view)
            decision = decide(facts, memory, rails)
            if decision.action == "drain" and decision.outcome == "refused":
                facts = replace(facts, fleet=self._read_fleet(now))
                decision = decide(facts, memory, rails)
            if decision.acts:
                self._act(decision)
        except ActuatorError as e:
            self._failed(e, first, self._pending(facts, memory, rails))
            return None
        self._succeeded()
        self._settle(decision, memory, facts)
        return decision

    def _read_node(self) -> NodeInfo:
        info = self.check_node()
        self._node_read_at = self._mono()
        return info

    def _read_fleet(self, now: float) -> Fleet:
        return self.slurm.fleet(self._partitions, now_wall=now, window_s=self.cfg.fleet_window_s)

    def _act(self, decision: Decision) -> None:
        if decision.action == "drain":
            self.slurm.drain(decision.reason)
        else:
            self.slurm.resume()

    def _settle(self, decision: Decision, memory: Memory, facts: Facts) -> None:
        """Count, log and remember what the decision did."""
        kept = remember(memory, decision, replace(facts, now_wall=self._wall()))
        self._keep(kept)
        outcome = decision.outcome
        # Looked at again only every NODE_POLL_S: an incident refused or left alone, or a
        # resume of gpudiag's drain that observe or the killswitch holds back.
        self._waiting = outcome in ("refused", "operator", "already") or (
            decision.action == "resume" and outcome in ("observed", "killswitch")
            and kept.drain is not None)
        if outcome in ("held", "node_unknown", "healthy", "waiting"):
            return
        key = (outcome, decision.code, decision.fault.uuid if decision.fault else None)
        if decision.action == "none" and outcome == "needs_person":
            if key not in self._said:
                self._said.add(key)
                log.warning("remediation: %s", decision.why, extra=self._extra(decision))
            return
        if self._waiting and key in self._said:
            return  # said once per incident; tried again every cycle
        self._said.add(key)
        action = "drain" if outcome == "undone" else decision.action
        self._count(action, decision.mode, decision.code, outcome)
        if decision.acts and decision.action == "drain" and decision.fault is not None:
            self._observe_latency(self._wall() - decision.fault.evidence_wall)
        self._set(refused=outcome == "refused")
        level = logging.INFO if outcome in ("observed", "killswitch") else logging.WARNING
        log.log(level, "remediation: %s", decision.why, extra=self._extra(decision))

    def _extra(self, d: Decision) -> dict[str, object]:
        return {"remediation_action": d.action, "remediation_mode": d.mode, "code": d.code,
                "outcome": d.outcome, "reason": d.reason or None, "node": self.slurm.node,
                "uuid": d.fault.uuid if d.fault else None}

    def _rails(self) -> Rails:
        cfg = self.cfg
        kill = self._killswitch()
        if kill != self._report.killswitch:
            self._set(killswitch=kill)
        return Rails(mode=cfg.mode, killswitch=kill, fleet_min_nodes=cfg.fleet_min_nodes,
                     fleet_ratio=cfg.fleet_ratio, max_attempts=cfg.max_attempts_per_gpu,
                     attempt_window_s=cfg.attempt_window_s)

    def _killswitch(self) -> frozenset[str]:
        """The killswitch file, re-read every cycle; one that cannot be read means all."""
        try:
            raw, _st = read_regular(Path(self.cfg.killswitch_file), KILLSWITCH_LIMIT)
        except RefusedFile as e:
            if isinstance(e.__cause__, FileNotFoundError):
                return frozenset()  # no killswitch: the mode decides
            if self._report.killswitch != frozenset({KILL_ALL}):
                log.warning("remediation killswitch %s unreadable (%s): every code observes",
                            self.cfg.killswitch_file, e)
            return frozenset({KILL_ALL})
        return parse_killswitch(raw.decode("utf-8", errors="replace"))

    # -- faults of its own ---------------------------------------------------------------
    @staticmethod
    def _pending(facts: Facts, memory: Memory, rails: Rails) -> str:
        """What a new incident comes to once Slurm answers, on a node it shows idle and
        undrained and a fleet guard that allows it ("": no new incident): said while
        scontrol fails."""
        if memory.drain is not None or not facts.faults:
            return ""
        would = decide(replace(facts, node=NodeView("IDLE", ""), fleet=Fleet(1, 0)), memory,
                       rails)
        return would.why if would.action in ("drain", "resume") else ""

    def _failed(self, e: ActuatorError, decision: Decision, pending: str = "") -> None:
        self._failures += 1
        delay = min(self.cfg.retry_max_s, 0.5 * 2 ** (self._failures - 1))
        self._retry_at = self._mono() + delay
        command = "sinfo" if "sinfo" in str(e) else "scontrol"
        with self._lock:
            r = self._report
            failures = dict(r.command_failures)
            failures[(command, e.kind)] = failures.get((command, e.kind), 0) + 1
            since = r.failing_since_wall or self._wall()
        self._set(command_failures=failures, last_error=f"{e.kind}: {e}",
                  failing_since_wall=since, retry_in_s=delay)
        if decision.action in ("drain", "resume") or pending or self._failures == 1:
            # What it would do once Slurm answers, so that an observe week reads right.
            log.warning("remediation: %s failed (%s: %s); retrying in %.1f s%s", command,
                        e.kind, e, delay,
                        f"; once Slurm answers: {pending}" if pending else "",
                        extra={"error": str(e), "kind": e.kind, "retry_in_s": delay})

    def _succeeded(self) -> None:
        if self._failures or self._report.last_error is not None:
            log.info("remediation: Slurm answers again after %d failure(s)", self._failures)
            self._failures = 0
            self._set(last_error=None, failing_since_wall=None, retry_in_s=None)

    # -- bookkeeping ---------------------------------------------------------------------
    def _count(self, action: str, mode: str, code: str, outcome: str) -> None:
        with self._lock:
            actions = dict(self._report.actions)
        key = (action, mode, code, outcome)
        actions[key] = actions.get(key, 0) + 1
        self._set(actions=actions)

    def _observe_latency(self, seconds: float) -> None:
        r = self.report()
        buckets = tuple(n + (1 if seconds <= le else 0)
                        for n, le in zip(r.latency_buckets, LATENCY_BUCKETS, strict=True))
        self._set(latency_buckets=buckets, latency_count=r.latency_count + 1,
                  latency_sum_s=r.latency_sum_s + max(0.0, seconds))

    def _set(self, **changes: object) -> None:
        with self._lock:
            r = self._report
            new = replace(r, **changes)  # type: ignore[arg-type]
            if new != r:  # a new version only for a change: /v1/health's answers are cached
                self._report = replace(new, version=r.version + 1)

    def _keep(self, memory: Memory) -> None:
        """Remember, in memory and in the state dir, before anything else happens."""
        if memory == self._memory:
            return
        self._memory = memory
        if memory.drain != self._report.drain or memory.tally != self._report.tally:
            self._set(drain=memory.drain, tally=memory.tally)
        try:
            atomic_write(self._path, json.dumps(memory.record()), 0o600)
        except OSError as e:
            log.error("remediation: cannot keep its state in %s (%s): a restart would not "
                      "know this node's drain", self._path, e)

    def _load(self) -> Memory:
        try:
            raw, _st = read_regular(self._path, 1 << 20)
            return Memory.from_record(json.loads(raw))
        except RefusedFile as e:
            if isinstance(e.__cause__, FileNotFoundError):
                return Memory()  # a first start
            error: Exception = e
        except (ValueError, KeyError, TypeError) as e:
            error = e
        log.error("remediation: %s unreadable (%s): starting with no memory of drains; "
                  "a drain gpudiag made before is left alone (resume it by hand)",
                  self._path, error)
        return Memory()
