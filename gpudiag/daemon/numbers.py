"""The numbers nobody publishes: time to detect, catch rate, false blockers, repeat offenders.

``Numbers`` gathers them as the daemon runs (docs/numbers.md says how to read each):
- ``fault(event)``: a blocking XID arrived (its own time: the watcher child's clock when NVML
  delivered the event); it waits for the first verdict that blocks its GPU, and the time
  between them goes into ``gpudiag_fault_to_verdict_seconds``. A GPU that already had a
  finding (a qualification drift, a throttle held, a link narrowed) before its XID counts in
  ``gpudiag_faults_flagged_before_xid_total``;
- ``verdict(snapshot)``: each published snapshot; a GPU (by serial) that goes from no blocker
  to a blocker is an incident, and the time since its previous incident goes into
  ``gpudiag_gpu_incident_interval_seconds``;
- ``cleared(request)``: an applied `gpudiag clear`; with ``--no-repair`` the blockers it
  cleared were false (``gpudiag_false_blockers_total{code}``);
- ``blocked(record)``: a job gpudiag refused (``gpudiag_preflight_blocks_total{code}``);
- ``job(record)``: a job's closeout, its GPUs' energy into ``gpudiag_job_gpu_energy_joules``.
Counters start at 0 with the daemon, as Prometheus counters do; the history keeps the facts.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import field, replace

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from gpudiag.core.attribution import JobRecord
from gpudiag.core.catalog import BLOCKERS
from gpudiag.core.findings import XidEvent
from gpudiag.core.records import dataclass
from gpudiag.core.usage import BlockRecord
from gpudiag.core.verdict import Verdict
from gpudiag.core.xids import xid_entry
from gpudiag.daemon.collectors import StateCollector
from gpudiag.daemon.holds import XID_MESSAGE
from gpudiag.daemon.snapshot import Snapshot

# Buckets: seconds from a fault to its blocking verdict (the watcher wakes the scheduler at
# once: most are under a second), 15 minutes to 30 days between a GPU's incidents (NVSentinel
# ADR-044's range), and joules per GPU per job (700 W for a day is about 6e7 J).
FAULT_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
INCIDENT_BUCKETS_S = (900.0, 3600.0, 4 * 3600.0, 12 * 3600.0, 86400.0, 3 * 86400.0,
                      7 * 86400.0, 14 * 86400.0, 30 * 86400.0)
ENERGY_BUCKETS_J = (1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9)
PENDING_LIMIT_S = 3600.0  # a fault no verdict blocked within an hour is dropped
MAX_PENDING = 1024
# A refused run's code outside the catalog counts as this (label values are catalog codes).
OTHER_CODE = "other"
# The most a GPU can draw (above every board's limit: GB200 1200 W): a job's energy on one GPU
# above this times its attested length (plus the meter's start/stop slack) is not physical.
MAX_GPU_POWER_W = 1500.0
ENERGY_SLACK_S = 5.0


@dataclass(frozen=True)
class Histogram:
    """A fixed-bucket histogram as plain data: ``counts[i]`` observations <= ``bounds[i]``
    (not cumulative), the last one past every bound."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...] = ()
    total: float = 0.0

    def observe(self, value: float) -> Histogram:
        """This histogram with ``value`` counted."""
        counts = list(self.counts or (0,) * (len(self.bounds) + 1))
        i = next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        counts[i] += 1
        return replace(self, counts=tuple(counts), total=self.total + value)

    @property
    def count(self) -> int:
        return sum(self.counts)

    def family(self, name: str, documentation: str) -> HistogramMetricFamily:
        """The histogram as Prometheus renders it (cumulative buckets, +Inf, sum)."""
        counts = self.counts or (0,) * (len(self.bounds) + 1)
        running, buckets = 0, []
        for bound, n in zip((*map(_le, self.bounds), "+Inf"), counts, strict=True):
            running += n
            buckets.append((bound, float(running)))
        family = HistogramMetricFamily(name, documentation)
        family.add_metric([], buckets, sum_value=self.total)
        return family


def _le(bound: float) -> str:
    return f"{bound:g}" if bound < 1e6 else f"{bound:.1e}"


@dataclass(frozen=True)
class NumbersState:
    """What the collector renders: one immutable value per scrape."""

    fault_to_verdict: Histogram = field(default_factory=lambda: Histogram(FAULT_BUCKETS_S))
    faults: int = 0
    flagged_before: int = 0
    preflight_blocks: Mapping[str, int] = field(default_factory=dict)
    false_blockers: Mapping[str, int] = field(default_factory=dict)
    incident_interval: Histogram = field(
        default_factory=lambda: Histogram(INCIDENT_BUCKETS_S))
    job_energy: Histogram = field(default_factory=lambda: Histogram(ENERGY_BUCKETS_J))


@dataclass(frozen=True)
class _Pending:
    uuid: str | None
    index: int | None
    fault_wall: float


# Findings that say nothing about the part's health: not a sign "before the XID" (a GPU's
# settings against its peers' or a diagnostic's change to them are configuration).
NOT_PRECURSORS = frozenset({"gpu_persistence_off", "gpu_fault_outside_selection",
                            "gpu_config_drift", "diagnostic_side_effect"})


def gpu_findings(verdict: Verdict | None, *, blockers_only: bool = False,
                 xids: bool = True) -> dict[str, set[str]]:
    """GPU UUID -> the codes of the verdict's findings on it (``xids`` False: leaving out
    those an XID made, so that a GPU flagged "before its XID" is flagged by something else)."""
    out: dict[str, set[str]] = {}
    if verdict is None:
        return out
    findings = [*verdict.blockers, *(() if blockers_only else verdict.warnings)]
    for f in findings:
        if f.device and (xids or not (XID_MESSAGE.match(f.message)
                                      or f.code in NOT_PRECURSORS)):
            out.setdefault(f.device, set()).add(f.code)
    return out


def _blocking(xid: int) -> bool:
    entry = xid_entry(xid)
    return entry is not None and entry.severity == "blocker"


class Numbers:
    """Thread-safe: the watcher, the scheduler's listeners and the inboxes feed it."""

    def __init__(self, wall: Callable[[], float] = time.time) -> None:
        self._wall = wall
        self._lock = threading.Lock()
        self._state = NumbersState()
        self._pending: list[_Pending] = []
        self._last: Verdict | None = None
        self._last_wall = 0.0
        self._blocked: set[str] | None = None  # serials blocked in the last verdict
        self._incidents: dict[str, float] = {}  # serial -> its last incident's wall time

    def state(self) -> NumbersState:
        """The numbers now (lock-free read of an immutable value)."""
        return self._state

    def seed_incidents(self, times: Mapping[str, Sequence[float]]) -> None:
        """Each serial's last incident from the history, so that a restart keeps intervals."""
        with self._lock:
            for serial, walls in times.items():
                if walls:
                    self._incidents[serial] = max(self._incidents.get(serial, 0.0), max(walls))

    def fault(self, event: XidEvent) -> None:
        """A blocking XID arrived: wait for its verdict; was its GPU flagged before it?"""
        if not _blocking(event.xid):
            return
        fault_wall = event.fault_ts if event.fault_ts is not None else event.timestamp
        with self._lock:
            flagged = gpu_findings(self._last, xids=False)
            before = bool(event.uuid and flagged.get(event.uuid))
            self._state = replace(self._state, faults=self._state.faults + 1,
                                  flagged_before=self._state.flagged_before + int(before))
            self._pending = [*self._pending, _Pending(event.uuid, event.device_index,
                                                      fault_wall)][-MAX_PENDING:]
            if self._last is not None:
                self._resolve(self._last, self._last_wall)

    def verdict(self, snap: Snapshot) -> None:
        """A snapshot was published: resolve faults it blocks, count new incidents."""
        verdict = snap.full
        if verdict is None:
            return
        wall = snap.published_wall
        with self._lock:
            self._last, self._last_wall = verdict, wall
            self._resolve(verdict, wall)
            self._count_incidents(verdict, wall)

    def _resolve(self, verdict: Verdict, wall: float) -> None:
        blocked = gpu_findings(verdict, blockers_only=True)
        indices = {d.index: d.uuid for d in verdict.devices}
        waiting: list[_Pending] = []
        hist = self._state.fault_to_verdict
        for p in self._pending:
            uuid = p.uuid or (indices.get(p.index) if p.index is not None else None)
            if uuid is not None and blocked.get(uuid) and wall >= p.fault_wall - 1.0:
                hist = hist.observe(max(0.0, wall - p.fault_wall))
            elif wall - p.fault_wall <= PENDING_LIMIT_S:
                waiting.append(p)
        self._pending = waiting
        self._state = replace(self._state, fault_to_verdict=hist)

    def _count_incidents(self, verdict: Verdict, wall: float) -> None:
        serial_of = {d.uuid: d.serial for d in verdict.devices if d.uuid and d.serial}
        now = {serial_of[u] for u in gpu_findings(verdict, blockers_only=True)
               if u in serial_of}
        if self._blocked is None:
            # The first verdict after a start: what is blocked now began before (its episode
            # is in the history, the incident already counted).
            self._blocked = now
            return
        hist = self._state.incident_interval
        for serial in sorted(now - self._blocked):
            last = self._incidents.get(serial)
            if last is not None and wall > last:
                hist = hist.observe(wall - last)
            self._incidents[serial] = wall
        self._blocked = now
        self._state = replace(self._state, incident_interval=hist)

    def cleared(self, gpu: str | None, no_repair: bool) -> list[str]:
        """A clear of ``gpu`` (None: all) was applied: the blocker codes it cleared, counted
        as false blockers when the operator said no repair was done."""
        with self._lock:
            on = gpu_findings(self._last, blockers_only=True)
            codes = sorted({c for uuid, found in on.items() if gpu is None or uuid == gpu
                            for c in found})
            if no_repair and codes:
                counts = dict(self._state.false_blockers)
                for code in codes:
                    counts[code] = counts.get(code, 0) + 1
                self._state = replace(self._state, false_blockers=counts)
            return codes

    def blocked(self, record: BlockRecord) -> None:
        """A job gpudiag refused before it started (a code outside the catalog is
        ``other``: a label value is never a string a run chose)."""
        code = record.code if record.code in BLOCKERS else OTHER_CODE
        with self._lock:
            counts = dict(self._state.preflight_blocks)
            counts[code] = counts.get(code, 0) + 1
            self._state = replace(self._state, preflight_blocks=counts)

    def job(self, job: JobRecord) -> None:
        """A job closed out: each of its GPUs' energy into the histogram, when it is a
        physical amount: finite, not negative, at most MAX_GPU_POWER_W times the job's
        attested length, and only for a GPU the job held (``job.gpus``)."""
        held = frozenset(job.gpus)
        ceiling = MAX_GPU_POWER_W * (max(0.0, job.ended - job.started) + ENERGY_SLACK_S)
        with self._lock:
            hist = self._state.job_energy
            for usage in job.gpu_usage:
                energy = usage.energy_joules
                if (energy is not None and usage.uuid in held and math.isfinite(energy)
                        and 0.0 <= energy <= ceiling):
                    hist = hist.observe(energy)
            self._state = replace(self._state, job_energy=hist)


class NumbersCollector(StateCollector[NumbersState]):
    """Renders ``Numbers``; every family is present from the first scrape."""

    def render(self, state: NumbersState) -> Iterable[Metric]:
        """The histograms and counters of docs/numbers.md."""
        yield state.fault_to_verdict.family(
            "gpudiag_fault_to_verdict_seconds",
            "Seconds from a blocking fault's own time (the NVML XID event) to the first "
            "verdict that blocked its GPU.")
        yield CounterMetricFamily(
            "gpudiag_faults", "Blocking XIDs seen (the denominator of flagged-before).",
            value=float(state.faults))
        yield CounterMetricFamily(
            "gpudiag_faults_flagged_before_xid",
            "Blocking XIDs whose GPU already had a finding (a qualification drift, a held "
            "throttle, a narrowed link) before the XID.", value=float(state.flagged_before))
        blocks = CounterMetricFamily(
            "gpudiag_preflight_blocks", "Jobs gpudiag refused before they started, by the code "
            "(and its layer: device is a hardware fault caught before the job).",
            labels=["code", "layer"])
        for code, n in sorted(state.preflight_blocks.items()):
            row = BLOCKERS.get(code)
            blocks.add_metric([code, row.layer if row is not None else OTHER_CODE], float(n))
        yield blocks
        yield _by_code("gpudiag_false_blockers",
                       "Blockers cleared by `gpudiag clear --no-repair`: nothing was "
                       "repaired, so the blocker was false.", state.false_blockers)
        yield state.incident_interval.family(
            "gpudiag_gpu_incident_interval_seconds",
            "Seconds between a GPU's incidents (by serial): a blocker appearing on a GPU that "
            "had none.")
        yield state.job_energy.family(
            "gpudiag_job_gpu_energy_joules",
            "Energy one GPU used during one job (NVML's total energy counter, start to end).")


def _by_code(name: str, documentation: str, counts: Mapping[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation, labels=["code"])
    for code, n in sorted(counts.items()):
        family.add_metric([code], float(n))
    return family
