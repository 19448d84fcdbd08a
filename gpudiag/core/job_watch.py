"""The job watch's rules (issue 53): a hung collective or a straggling GPU, from NVML alone.

Pure: samples in, warnings out; the daemon's part (daemon/job_watch.py) feeds it the
NVML readings of each open run's GPUs, once a second, from a probe child.

- ``job_stalled``: every GPU of one run at or above ``stall_utilization`` with power at or
  below ``stall_power_ratio`` of its enforced limit, and (where the driver shows link
  counters) link throughput flat (varying by at most ``link_flat_kbps``), held for
  ``stall_after_s``. A hung all-reduce spins every GPU at 100% utilization at a fraction of
  its power, and moves no data.
- ``gpu_straggler_suspect``: one GPU of a run (of two or more, all working: utilization at
  least ``busy_utilization``) whose SM clock or power stays at or below
  ``straggler_ratio`` of the run's median for ``straggler_after_s``, with the cause NVML
  shows over that time (thermal, power_cap, pcie, ecc) else ``unknown``.
Both are warnings on the run: never a blocker, never a drain. A reading the driver does not
give is None, and the rule goes on without it (utilization and power are enough).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import field
from typing import Any

from gpudiag.core.records import dataclass
from gpudiag.core.settings import Flag, Number, seconds, setting, share

STALLED = "job_stalled"
STRAGGLER = "gpu_straggler_suspect"
CODES = (STALLED, STRAGGLER)
# Causes of a straggler as NVML shows them, in the order a cause is named when several are.
CAUSES = ("thermal", "power_cap", "pcie", "ecc", "unknown")
_THERMAL = frozenset({"sw_thermal_slowdown", "hw_thermal_slowdown", "hw_slowdown"})
_POWER = frozenset({"sw_power_cap", "hw_power_brake_slowdown"})
MAX_EPISODES = 16  # warnings kept per run: a run that stalls on and off says so bounded
MAX_LAG_S = 5.0  # a gap between samples longer than this restarts every hold (no readings)


@dataclass(frozen=True)
class JobWatchPolicy:
    """``[jobs]``: the job watch's thresholds (docs/daemon.md; calibration: docs/validation)."""

    enabled: bool = setting(True, Flag())
    interval_s: float = setting(1.0, seconds(0.05, 60.0))
    stall_after_s: float = setting(120.0, seconds(maximum=86400.0))
    stall_utilization: float = setting(0.90, share())
    stall_power_ratio: float = setting(0.40, share())
    link_flat_kbps: float = setting(1024.0, Number(0.0, math.inf, "a throughput in kB/s, 0 "
                                                   "or more"))
    straggler_after_s: float = setting(300.0, seconds(maximum=86400.0))
    straggler_ratio: float = setting(0.85, share())
    busy_utilization: float = setting(0.50, share())


@dataclass(frozen=True)
class GpuSample:
    """One GPU's NVML readings at one instant; None where the driver gave none."""

    uuid: str
    utilization_ratio: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    sm_clock_mhz: float | None = None
    throttle_reasons: tuple[str, ...] | None = None
    link_kbps: float | None = None  # PCIe and NVLink, both directions, where counted
    pcie_degraded: bool | None = None  # the link below its width or generation
    ecc_pending: bool | None = None  # a row remap or page retirement pending

    @classmethod
    def from_record(cls, rec: Any) -> GpuSample | None:
        """A sample line's GPU entry (the probe child's JSON); None when malformed."""
        if not isinstance(rec, dict) or not isinstance(rec.get("uuid"), str):
            return None
        reasons = rec.get("throttle_reasons")
        return cls(rec["uuid"], _num(rec.get("utilization_ratio")), _num(rec.get("power_w")),
                   _num(rec.get("power_limit_w")), _num(rec.get("sm_clock_mhz")),
                   tuple(str(r) for r in reasons) if isinstance(reasons, list) else None,
                   _num(rec.get("link_kbps")), _flag(rec.get("pcie_degraded")),
                   _flag(rec.get("ecc_pending")))

    @property
    def power_ratio(self) -> float | None:
        """Power over the enforced limit (None: either unknown, or no limit)."""
        if self.power_w is None or not self.power_limit_w:
            return None
        return self.power_w / self.power_limit_w


def _num(value: object) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    return float(value) if ok else None  # type: ignore[arg-type]


def _flag(value: object) -> bool | None:
    return value if isinstance(value, bool) else None


@dataclass(frozen=True)
class RunWarning:
    """A job watch warning on a run, with the numbers that made it."""

    code: str
    gpu: str | None  # the GPU (a straggler's); None: the whole run (a stall)
    since: float  # wall time the condition began
    held_s: float  # how long it held (so far, or until it ended)
    message: str
    numbers: tuple[tuple[str, float | str | None], ...] = ()

    def record(self) -> dict[str, Any]:
        """The JSON form (closeout, history, /v1/health, explain)."""
        return {"code": self.code, "gpu": self.gpu, "since": self.since,
                "held_s": round(self.held_s, 3), "message": self.message,
                "numbers": dict(self.numbers)}

    @classmethod
    def from_record(cls, rec: Any) -> RunWarning | None:
        """Parse ``record()``'s form; None when it is not one."""
        if not isinstance(rec, dict) or rec.get("code") not in CODES:
            return None
        since, held = _num(rec.get("since")), _num(rec.get("held_s"))
        gpu, numbers = rec.get("gpu"), rec.get("numbers")
        if since is None or held is None:
            return None
        pairs = tuple((str(k), v if isinstance(v, (str, int, float)) or v is None else str(v))
                      for k, v in (numbers.items() if isinstance(numbers, dict) else ()))
        return cls(str(rec["code"]), gpu if isinstance(gpu, str) else None, since, held,
                   str(rec.get("message") or ""), pairs)


@dataclass
class _Hold:
    """A condition being held: since when, and the extremes seen meanwhile."""

    since: float
    last: float
    low: dict[str, float] = field(default_factory=dict)
    high: dict[str, float] = field(default_factory=dict)
    causes: set[str] = field(default_factory=set)
    said: int | None = None  # index of its warning once it held long enough

    def see(self, key: str, value: float | None) -> None:
        if value is not None:
            self.low[key] = min(self.low.get(key, value), value)
            self.high[key] = max(self.high.get(key, value), value)


class RunWatch:
    """One run's holds and warnings, fed one sample of its GPUs at a time."""

    def __init__(self, run_id: str, gpus: Sequence[str], policy: JobWatchPolicy) -> None:
        self.run_id, self.gpus, self.policy = run_id, tuple(gpus), policy
        self.samples = 0
        self.last: dict[str, GpuSample] = {}
        self._stall: _Hold | None = None
        self._lag: dict[str, _Hold] = {}
        self.warnings: list[RunWarning] = []

    @property
    def stalled_now(self) -> bool:
        """Whether the run is stalled at its latest sample (the metric)."""
        hold = self._stall
        return hold is not None and hold.said is not None

    def stragglers_now(self) -> dict[str, str]:
        """The GPUs lagging past the straggler time now, with their cause."""
        return {g: _cause(h.causes) for g, h in self._lag.items() if h.said is not None}

    def observe(self, ts: float, samples: Mapping[str, GpuSample]) -> None:
        """Take one instant's readings (of every watched GPU; this run's are picked)."""
        mine = [samples[g] for g in self.gpus if g in samples]
        if len(mine) < len(self.gpus):
            self._stall, self._lag = None, {}  # a GPU unread: nothing holds across it
            return
        self.samples += 1
        self.last = {s.uuid: s for s in mine}
        self._watch_stall(ts, mine)
        self._watch_lag(ts, mine)

    # -- job_stalled -----------------------------------------------------------------------
    def _watch_stall(self, ts: float, mine: list[GpuSample]) -> None:
        p = self.policy
        ratios = [s.power_ratio for s in mine]
        spinning = all(s.utilization_ratio is not None
                       and s.utilization_ratio >= p.stall_utilization for s in mine) and all(
            r is not None and r <= p.stall_power_ratio for r in ratios)
        hold = self._stall
        if not spinning:
            self._stall = None
            return
        if hold is None or ts - hold.last > MAX_LAG_S or self._links_moved(hold, mine):
            hold = self._stall = _Hold(ts, ts)
        hold.last = ts
        for s in mine:
            hold.see("utilization_min_ratio", s.utilization_ratio)
            hold.see("power_max_ratio", s.power_ratio)
            hold.see("power_w", s.power_w)
            hold.see("power_limit_w", s.power_limit_w)
            hold.see(f"link_kbps:{s.uuid}", s.link_kbps)
        held = ts - hold.since
        if held < p.stall_after_s:
            return
        util = hold.low["utilization_min_ratio"]
        power = hold.high["power_max_ratio"]
        links = [hold.high[k] for k in hold.high if k.startswith("link_kbps:")]
        numbers: tuple[tuple[str, float | str | None], ...] = (
            ("gpus", float(len(mine))), ("utilization_min_ratio", round(util, 3)),
            ("power_max_ratio", round(power, 3)), ("power_max_w", hold.high.get("power_w")),
            ("power_limit_w", hold.low.get("power_limit_w")),
            ("link_max_kbps", max(links) if links else None),
            ("stall_after_s", p.stall_after_s))
        message = (f"every GPU of run {self.run_id} ({len(mine)}) at >= {util:.0%} "
                   f"utilization with power <= {power:.0%} of its limit for {held:.0f} s"
                   + (f", links flat (<= {max(links):.0f} KB/s)" if links else
                      " (link throughput not shown by the driver)")
                   + ": a hung collective (NCCL all-reduce) spins like this")
        self._say(hold, RunWarning(STALLED, None, hold.since, held, message, numbers))

    def _links_moved(self, hold: _Hold, mine: list[GpuSample]) -> bool:
        """Whether a GPU's link throughput moved past the flat band since the hold began."""
        flat = self.policy.link_flat_kbps
        for s in mine:
            key = f"link_kbps:{s.uuid}"
            if s.link_kbps is None or key not in hold.low:
                continue
            if max(hold.high[key], s.link_kbps) - min(hold.low[key], s.link_kbps) > flat:
                return True
        return False

    # -- gpu_straggler_suspect -------------------------------------------------------------
    def _watch_lag(self, ts: float, mine: list[GpuSample]) -> None:
        p = self.policy
        busy = len(mine) >= 2 and all(s.utilization_ratio is not None
                                      and s.utilization_ratio >= p.busy_utilization
                                      for s in mine)
        if not busy:
            self._lag = {}
            return
        powers = [s.power_w for s in mine]
        clocks = [s.sm_clock_mhz for s in mine]
        med_power = statistics.median(powers) if None not in powers else None  # type: ignore[type-var]
        med_clock = statistics.median(clocks) if None not in clocks else None  # type: ignore[type-var]
        for s in mine:
            signal = self._lagging(s, med_power, med_clock)
            hold = self._lag.get(s.uuid)
            if signal is None:
                self._lag.pop(s.uuid, None)
                continue
            if hold is None or ts - hold.last > MAX_LAG_S:
                hold = self._lag[s.uuid] = _Hold(ts, ts)
            hold.last = ts
            hold.see("power_w", s.power_w)
            hold.see("median_power_w", med_power)
            hold.see("sm_clock_mhz", s.sm_clock_mhz)
            hold.see("median_sm_clock_mhz", med_clock)
            hold.causes |= _causes_of(s)
            held = ts - hold.since
            if held >= p.straggler_after_s:
                self._say(hold, self._straggler(s, hold, signal, held))

    def _lagging(self, s: GpuSample, med_power: float | None, med_clock: float | None
                 ) -> str | None:
        """Which reading lags the run's median (``sm_clock`` first), or None."""
        r = self.policy.straggler_ratio
        if med_clock and s.sm_clock_mhz is not None and s.sm_clock_mhz <= r * med_clock:
            return "sm_clock"
        if med_power and s.power_w is not None and s.power_w <= r * med_power:
            return "power"
        return None

    def _straggler(self, s: GpuSample, hold: _Hold, signal: str, held: float) -> RunWarning:
        cause = _cause(hold.causes)
        key, med = (("sm_clock_mhz", "median_sm_clock_mhz") if signal == "sm_clock"
                    else ("power_w", "median_power_w"))
        mine, median = hold.high.get(key), hold.low.get(med)
        ratio = round(mine / median, 3) if mine is not None and median else None
        numbers: tuple[tuple[str, float | str | None], ...] = (
            ("signal", signal), ("cause", cause), ("ratio_max", ratio),
            (f"{key}_max", mine), (f"{med}_min", median),
            ("straggler_ratio", self.policy.straggler_ratio),
            ("straggler_after_s", self.policy.straggler_after_s))
        what = "SM clock" if signal == "sm_clock" else "power"
        message = (f"GPU {s.uuid} of run {self.run_id}: its {what} at most "
                   f"{ratio if ratio is not None else '?'} of the run's median for "
                   f"{held:.0f} s while every GPU works (cause: {cause})")
        return RunWarning(STRAGGLER, s.uuid, hold.since, held, message, numbers)

    def _say(self, hold: _Hold, warning: RunWarning) -> None:
        """Record (or update, as it goes on holding) the hold's warning."""
        if hold.said is not None:
            self.warnings[hold.said] = warning
        elif len(self.warnings) < MAX_EPISODES:
            hold.said = len(self.warnings)
            self.warnings.append(warning)

    def evidence(self) -> dict[str, Any]:
        """The run's part of /v1/health's runs evidence."""
        return {"run": self.run_id, "gpus": list(self.gpus), "samples": self.samples,
                "job_stalled": self.stalled_now,
                "stragglers": sorted(self.stragglers_now()),
                "warnings": [w.record() for w in self.warnings],
                "latest": {u: {"utilization_ratio": s.utilization_ratio,
                               "power_w": s.power_w, "power_limit_w": s.power_limit_w,
                               "sm_clock_mhz": s.sm_clock_mhz, "link_kbps": s.link_kbps}
                           for u, s in self.last.items()}}


def _causes_of(s: GpuSample) -> set[str]:
    reasons = set(s.throttle_reasons or ())
    found = set()
    if reasons & _THERMAL:
        found.add("thermal")
    if reasons & _POWER:
        found.add("power_cap")
    if s.pcie_degraded:
        found.add("pcie")
    if s.ecc_pending:
        found.add("ecc")
    return found


def _cause(causes: set[str]) -> str:
    """The first of CAUSES seen over the hold (``unknown`` when NVML showed none)."""
    return next((c for c in CAUSES if c in causes), "unknown")


def run_warnings(value: object) -> tuple[RunWarning, ...]:
    """A record's ``warnings`` list, read back (what is not a warning is left out)."""
    if not isinstance(value, list):
        return ()
    found = (RunWarning.from_record(v) for v in value[:MAX_EPISODES])
    return tuple(w for w in found if w is not None)
