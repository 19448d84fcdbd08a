"""Remediation policy: from facts (faults, the node as Slurm shows it, the fleet, what gpudiag
did before) to one decision: drain, resume or nothing, and why. Pure: no I/O, no clock.

The rails (docs/operations.md "Remediation"), in the order they are checked:
- only codes the catalog marks ``drains`` (hardware faults of a GPU or the node) act;
- evidence dated at or before the GPU's recovery boundary (a ``gpudiag clear``, or an
  operator resuming gpudiag's drain) never acts again;
- one action per node per incident: while gpudiag's drain stands, more faults change nothing;
- a drain whose reason is not gpudiag's is never touched, nor stacked onto;
- the killswitch turns named codes (or all) into observe; observe only says and counts;
- past ``max_attempts`` drains of one GPU in the window, the drain says a person is needed
  (class ``inspect``) and is never resumed by gpudiag;
- the fleet guard refuses a drain when gpudiag already drained max(min_nodes, ratio x nodes)
  of the partition within its window; a resume is never refused.

The reason gpudiag writes is ``gpudiag:<class>:<code>:<GPU UUID prefix>``, e.g.
``gpudiag:node:gpu_lost:GPU-f00d0000``: who drained, why, and which GPU.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import field, replace

from gpudiag.core.catalog import drains
from gpudiag.core.records import dataclass

MODES = ("off", "observe", "act")
OWN_PREFIX = "gpudiag:"
# Slurm keeps a reason of any length, but `sinfo -R` shows 20 characters by default and
# sites copy reasons into tickets: gpudiag's stay short (docs/operations.md).
MAX_REASON_CHARS = 64
UUID_PREFIX_CHARS = 12  # "GPU-" and 8 hex digits: unique on a node, short in `sinfo -R`
CLASS_NODE = "node"        # a hardware fault of a GPU or the node: gpudiag resumes it
CLASS_INSPECT = "inspect"  # the attempt cap was met: a person resumes it after inspection
KILL_ALL = "all"
_OWN = re.compile(r"gpudiag:(node|inspect):([a-z0-9_]+):([A-Za-z0-9-]+)")


@dataclass(frozen=True)
class Fault:
    """One blocker that drains (catalog ``drains``), with when its evidence was seen."""

    code: str
    uuid: str | None  # the GPU; None: the node as a whole
    evidence_wall: float


@dataclass(frozen=True)
class NodeView:
    """The node as ``scontrol show node`` shows it."""

    state: str   # e.g. IDLE, IDLE+DRAIN, MIXED+DRAIN
    reason: str  # "" when none, without Slurm's "[user@time]" stamp

    @property
    def drained(self) -> bool:
        return any(w in self.state for w in ("DRAIN", "DOWN", "FAIL"))


@dataclass(frozen=True)
class Fleet:
    """The partition as ``sinfo`` shows it: its nodes, and the others gpudiag drained lately."""

    nodes: int
    recent_own: int


@dataclass(frozen=True)
class Rails:
    """The limits a decision obeys (``[remediation]`` and the killswitch file)."""

    mode: str = "observe"
    killswitch: frozenset[str] = frozenset()  # codes, or {"all"}
    fleet_min_nodes: int = 2
    fleet_ratio: float = 0.10
    max_attempts: int = 2
    attempt_window_s: float = 7 * 86400.0

    def mode_for(self, code: str) -> str:
        """act, or observe when the mode or the killswitch says so."""
        if self.mode == "act" and (KILL_ALL in self.killswitch or code in self.killswitch):
            return "observe"
        return self.mode

    def fleet_limit(self, nodes: int) -> int:
        """How many of the partition's nodes gpudiag may have drained within the window."""
        return max(self.fleet_min_nodes, math.floor(self.fleet_ratio * nodes))


@dataclass(frozen=True)
class Drain:
    """A drain gpudiag made (or, ``observed``, would have made): the incident it answers."""

    reason: str
    code: str
    uuid: str | None
    drained_wall: float
    evidence_wall: float
    needs_person: bool = False
    observed: bool = False  # observe mode or the killswitch: nothing was drained

    def record(self) -> dict[str, object]:
        return {"reason": self.reason, "code": self.code, "uuid": self.uuid,
                "drained_wall": self.drained_wall, "evidence_wall": self.evidence_wall,
                "needs_person": self.needs_person, "observed": self.observed}

    @classmethod
    def from_record(cls, d: Mapping[str, object]) -> Drain:
        uuid = d.get("uuid")
        return cls(reason=str(d["reason"]), code=str(d["code"]),
                   uuid=uuid if isinstance(uuid, str) else None,
                   drained_wall=_float(d["drained_wall"]),
                   evidence_wall=_float(d["evidence_wall"]),
                   needs_person=d.get("needs_person") is True, observed=d.get("observed") is True)


def _float(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{value!r} is not a time")
    return float(value)


@dataclass(frozen=True)
class Tally:
    """Incidents this node's remediation handled, kept across restarts (and reboots)."""

    incidents: int = 0             # drains gpudiag made (act)
    needs_person: int = 0          # of them, past the attempt cap (class inspect)
    recovered_unattended: int = 0  # resumed by gpudiag with no person's `gpudiag clear`
    recovered_after_clear: int = 0  # resumed by gpudiag after a person's `gpudiag clear`

    @property
    def needs_person_per_100(self) -> float:
        """needs_person per 100 incidents (0 before the first)."""
        return 100.0 * self.needs_person / self.incidents if self.incidents else 0.0

    def record(self) -> dict[str, int]:
        return {"incidents": self.incidents, "needs_person": self.needs_person,
                "recovered_unattended": self.recovered_unattended,
                "recovered_after_clear": self.recovered_after_clear}

    @classmethod
    def from_record(cls, d: object) -> Tally:
        """Read back ``record()``; a file from before tallies (or a damaged one) is zeros."""
        if not isinstance(d, dict):
            return cls()
        def n(key: str) -> int:
            v = d.get(key)
            return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0
        return cls(n("incidents"), n("needs_person"), n("recovered_unattended"),
                   n("recovered_after_clear"))


@dataclass(frozen=True)
class Memory:
    """What gpudiag keeps across cycles and restarts (the state dir's remediation.json)."""

    drain: Drain | None = None
    # GPU UUID ("*": every GPU) -> wall time of its recovery boundary.
    verified: Mapping[str, float] = field(default_factory=dict)
    # GPU UUID ("*": node faults) -> wall times of gpudiag's drains for it (the attempt cap).
    attempts: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    # When the standing drain's incident was released (a clear, or its faults gone).
    released_wall: float | None = None
    # Whether a person released it (`gpudiag clear`), or nobody did (the hold expired, or a
    # reboot and a clean fresh pass healed it).
    released_by_person: bool = False
    tally: Tally = field(default_factory=Tally)

    def boundary(self, uuid: str | None) -> float:
        """Evidence at or before this wall time never acts again for ``uuid``."""
        own = self.verified.get(uuid, -math.inf) if uuid is not None else -math.inf
        return max(own, self.verified.get("*", -math.inf))

    def record(self) -> dict[str, object]:
        return {"drain": self.drain.record() if self.drain else None,
                "verified": dict(self.verified),
                "attempts": {k: list(v) for k, v in self.attempts.items()},
                "released_wall": self.released_wall,
                "released_by_person": self.released_by_person,
                "tally": self.tally.record()}

    @classmethod
    def from_record(cls, d: Mapping[str, object]) -> Memory:
        """Read back ``record()``; ValueError on anything else."""
        drain, verified, attempts = d.get("drain"), d.get("verified"), d.get("attempts")
        released = d.get("released_wall")
        if not isinstance(verified, dict) or not isinstance(attempts, dict):
            raise ValueError("verified and attempts must be objects")
        return cls(
            drain=Drain.from_record(drain) if isinstance(drain, dict) else None,
            verified={str(k): _float(v) for k, v in verified.items()},
            attempts={str(k): tuple(_float(t) for t in v) for k, v in attempts.items()
                      if isinstance(v, list)},
            released_wall=None if released is None else _float(released),
            released_by_person=d.get("released_by_person") is True,
            tally=Tally.from_record(d.get("tally")))


@dataclass(frozen=True)
class Facts:
    """What one cycle knows. ``faults`` None: no node-health verdict yet (nothing acts)."""

    now_wall: float
    faults: tuple[Fault, ...] | None
    # The oldest start of the GPU probes behind this verdict: a pass counts as fresh only
    # when every one of them started after the release.
    probes_since_wall: float | None
    node: NodeView | None  # None: scontrol could not be asked
    fleet: Fleet | None = None  # None: not asked, or sinfo failed


@dataclass(frozen=True)
class Decision:
    """What to do now. ``action`` drain|resume|none; ``outcome`` names why for the metric."""

    action: str
    mode: str
    code: str
    outcome: str
    why: str
    reason: str = ""  # the Slurm reason of a drain
    fault: Fault | None = None
    needs_person: bool = False

    @property
    def acts(self) -> bool:
        """Whether scontrol is to be called."""
        return self.action in ("drain", "resume") and self.mode == "act" and self.outcome == "ok"


def own_reason(klass: str, code: str, uuid: str | None) -> str:
    """``gpudiag:<class>:<code>:<GPU UUID prefix or node>``, at most MAX_REASON_CHARS."""
    where = uuid[:UUID_PREFIX_CHARS] if uuid else "node"
    room = MAX_REASON_CHARS - len(f"{OWN_PREFIX}{klass}::{where}")
    return f"{OWN_PREFIX}{klass}:{code[:room]}:{where}"


def parse_own(reason: str) -> tuple[str, str, str] | None:
    """(class, code, where) of a reason in gpudiag's daemon format, else None."""
    m = _OWN.fullmatch(reason.strip())
    return (m.group(1), m.group(2), m.group(3)) if m else None


def is_gpudiag_reason(reason: str) -> bool:
    """Any reason gpudiag's tooling writes (the daemon's, and the Slurm scripts'
    ``gpudiag: CODE``): never an operator's."""
    return reason.startswith(OWN_PREFIX)


def live_faults(faults: tuple[Fault, ...], memory: Memory) -> list[Fault]:
    """The faults that may act: a draining code, evidence newer than its recovery boundary;
    oldest first (the incident's first fault names it)."""
    # A NIC fault is among ``faults`` only where [remediation] drain_on_nic is on: the daemon
    # gathers them (daemon.remediation.snapshot_faults), so here it may drain.
    out = [f for f in faults if drains(f.code, drain_on_nic=True)
           and f.evidence_wall > memory.boundary(f.uuid)]
    return sorted(out, key=lambda f: (f.evidence_wall, f.code, f.uuid or ""))


def attempts_of(memory: Memory, uuid: str | None, now_wall: float, window_s: float) -> int:
    """gpudiag's drains for this GPU within the attempt window."""
    return sum(1 for t in memory.attempts.get(uuid or "*", ()) if now_wall - t <= window_s)


def _none(outcome: str, why: str, code: str = "", mode: str = "act") -> Decision:
    return Decision("none", mode, code, outcome, why)


def decide(facts: Facts, memory: Memory, rails: Rails) -> Decision:
    """The one decision for this cycle (rails in the module docstring's order)."""
    if facts.faults is None:
        return _none("waiting", "no node-health verdict yet")
    live = live_faults(facts.faults, memory)
    drain = memory.drain
    if drain is not None and drain.observed:
        if live and rails.mode_for(drain.code) == "act":
            drain = None  # observe or the killswitch ended with the fault still there: act
        else:
            return _standing_observed(facts, memory, live)
    if drain is not None:
        return _standing(facts, memory, rails, drain, live)
    if not live:
        return _none("healthy", "no fault that drains")
    return _new_incident(facts, memory, rails, live[0])


def _standing_observed(facts: Facts, memory: Memory, live: list[Fault]) -> Decision:
    drain = memory.drain
    assert drain is not None
    if live or not _fresh_pass(facts, memory):
        return _none("held", "an observed incident stands", drain.code, "observe")
    return Decision("resume", "observe", drain.code, "observed",
                    f"would resume: {drain.reason} was cleared and the checks pass again")


def _standing(facts: Facts, memory: Memory, rails: Rails, drain: Drain, live: list[Fault]
              ) -> Decision:
    node = facts.node
    if node is None:
        return _none("node_unknown", "scontrol could not be asked", drain.code)
    if node.reason != drain.reason or not node.drained:
        return _none("undone", f"gpudiag's drain ({drain.reason}) was resumed or changed by "
                     f"someone else (now {node.state!r}, reason {node.reason!r}): forgotten, "
                     "its evidence never drains again", drain.code)
    if live or not _fresh_pass(facts, memory):
        return _none("held", f"one action per incident: {drain.reason} stands", drain.code)
    if drain.needs_person:
        return _none("needs_person", f"{drain.reason}: gpudiag's attempts for this GPU are "
                     "used up; a person resumes it after inspection", drain.code)
    mode = rails.mode_for(drain.code)
    if mode != "act":  # observe, or the killswitch: gpudiag's drain stays as it is
        return Decision("resume", mode, drain.code,
                        "killswitch" if rails.mode == "act" else "observed",
                        f"would resume: {drain.reason} was cleared and the checks pass again")
    return Decision("resume", "act", drain.code, "ok",
                    f"resuming: {drain.reason} was cleared and the checks pass again")


def _fresh_pass(facts: Facts, memory: Memory) -> bool:
    released = memory.released_wall
    return (released is not None and facts.probes_since_wall is not None
            and facts.probes_since_wall > released)


def _new_incident(facts: Facts, memory: Memory, rails: Rails, fault: Fault) -> Decision:
    mode = rails.mode_for(fault.code)
    node = facts.node
    if node is None:
        return _none("node_unknown", "scontrol could not be asked", fault.code, mode)
    if node.drained and node.reason and not is_gpudiag_reason(node.reason):
        return Decision("drain", mode, fault.code, "operator",
                        f"left alone: already drained by someone else ({node.reason!r})",
                        fault=fault)
    if node.drained and is_gpudiag_reason(node.reason):
        return Decision("drain", mode, fault.code, "already",
                        f"left alone: already drained by gpudiag ({node.reason!r})", fault=fault)
    used = attempts_of(memory, fault.uuid, facts.now_wall, rails.attempt_window_s)
    person = used >= rails.max_attempts
    reason = own_reason(CLASS_INSPECT if person else CLASS_NODE, fault.code, fault.uuid)
    fleet = facts.fleet
    if fleet is None:
        return Decision("drain", mode, fault.code, "refused",
                        "refused: the fleet guard could not count the partition (sinfo)",
                        reason, fault, person)
    limit = rails.fleet_limit(fleet.nodes)
    if fleet.recent_own >= limit:
        return Decision("drain", mode, fault.code, "refused",
                        f"refused by the fleet guard: gpudiag drained {fleet.recent_own} of "
                        f"{fleet.nodes} node(s) lately, limit {limit}", reason, fault, person)
    outcome = "ok" if mode == "act" else ("killswitch" if rails.mode == "act" else "observed")
    verb = "draining" if mode == "act" else "would drain"
    said = f"{verb}: {reason}" + (f" (attempt {used + 1}, past the cap of "
                                  f"{rails.max_attempts}: a person is needed)" if person else "")
    return Decision("drain", mode, fault.code, outcome, said, reason, fault, person)


def remember(memory: Memory, decision: Decision, facts: Facts) -> Memory:
    """The memory after ``decision`` was carried out (or, observe, would have been)."""
    now = facts.now_wall
    if decision.outcome == "undone":
        return replace(memory, drain=None, released_wall=None,
                       verified={**memory.verified, "*": now})
    if decision.action == "drain" and decision.outcome in ("ok", "observed", "killswitch"):
        fault = decision.fault
        assert fault is not None
        drain = Drain(decision.reason, fault.code, fault.uuid, now, fault.evidence_wall,
                      decision.needs_person, observed=decision.mode != "act")
        attempts = dict(memory.attempts)
        tally = memory.tally
        if decision.mode == "act":
            key = fault.uuid or "*"
            attempts[key] = (*attempts.get(key, ()), now)[-16:]
            tally = replace(tally, incidents=tally.incidents + 1,
                            needs_person=tally.needs_person + int(decision.needs_person))
        return replace(memory, drain=drain, attempts=attempts, released_wall=None,
                       released_by_person=False, tally=tally)
    if decision.action == "resume" and (decision.outcome == "ok" or (
            memory.drain is not None and memory.drain.observed)):
        tally = memory.tally
        if decision.outcome == "ok":
            tally = (replace(tally, recovered_after_clear=tally.recovered_after_clear + 1)
                     if memory.released_by_person else
                     replace(tally, recovered_unattended=tally.recovered_unattended + 1))
        return replace(memory, drain=None, released_wall=None, released_by_person=False,
                       tally=tally)
    return memory


def released(memory: Memory, facts: Facts) -> Memory:
    """A standing incident whose faults are gone (the hold expired) counts as released now;
    the resume still waits for a fresh pass after this moment. Evidence newer than the
    release (a clear that did not repair it) takes the release back."""
    if memory.drain is None or facts.faults is None:
        return memory
    live = live_faults(facts.faults, memory)
    if memory.released_wall is not None:
        if any(f.evidence_wall > memory.released_wall for f in live):
            return replace(memory, released_wall=None)
        return memory
    return memory if live else replace(memory, released_wall=facts.now_wall,
                                       released_by_person=False)


def resume_due(facts: Facts, memory: Memory) -> bool:
    """Whether a standing incident may resume now (released, no live fault, a fresh pass):
    only then does the actor ask Slurm at once rather than on its slow poll."""
    return (memory.drain is not None and facts.faults is not None
            and not live_faults(facts.faults, memory) and _fresh_pass(facts, memory))


def cleared(memory: Memory, uuid: str | None, wall: float, *, by_person: bool = True
            ) -> Memory:
    """``gpudiag clear`` of ``uuid`` (None: all) at ``wall``: the recovery boundary moves, and
    a standing incident on that GPU is released (``by_person`` False: the daemon's own
    release after a reboot, daemon/reboots.py)."""
    verified = {**memory.verified, uuid or "*": max(wall, memory.verified.get(uuid or "*",
                                                                            -math.inf))}
    drain = memory.drain
    hit = drain is not None and (uuid is None or drain.uuid in (None, uuid))
    return replace(memory, verified=verified,
                   released_wall=wall if hit else memory.released_wall,
                   released_by_person=by_person if hit else memory.released_by_person)


def parse_killswitch(text: str) -> frozenset[str]:
    """The killswitch file: one code per line (or ``all``), ``#`` comments, blank lines."""
    codes = set()
    for line in text.splitlines():
        word = line.split("#", 1)[0].strip()
        if word:
            codes.add(word.lower())
    return frozenset(codes)
