"""Qualification results, typed once from the probe child's JSON, and their scoring.

``parse_result`` reads one GPU's record (the child's JSON, or a history line) into a frozen
``GpuResult``; ``score`` judges it against the reference table, the node's peers and the
GPU's own history (core.qualify has the table and the tiers). Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import field
from typing import Any

from gpudiag.core.probe_run import ProbeRun
from gpudiag.core.qualify import (
    ABORTED,
    COMPUTE_MISMATCH,
    MEASURES,
    PASSED,
    REFERENCE_TABLE,
    SCHEMA,
    UNDERPERFORMING,
    UNITS,
    ReferenceModel,
    band_of,
    expected,
    reference_for,
)
from gpudiag.core.records import dataclass
from gpudiag.core.sdc import (
    FAIL,
    GIB,
    MEMORY_TEST_FAILED,
    MIB,
    PASS,
    UNKNOWN,
    CheckError,
    CheckResult,
    Conditions,
    parse_check,
    parse_conditions,
)
from gpudiag.core.settings import Flag, ratio, setting, share


@dataclass(frozen=True)
class Measurement:
    """One measured figure in base units (``value`` None: not measured, ``reason`` says why)."""

    measure: str
    value: float | None
    reason: str | None = None
    route: str | None = None        # cuMemcpyDtoD, jax, iree, ...
    bytes: int | None = None        # per timed operation
    repeats: int | None = None
    conditions: Conditions | None = None  # clocks, temperature, power limit, throttle mask

    def record(self) -> dict[str, Any]:
        """The JSON form (a record's ``measurements[]``)."""
        return {"measure": self.measure, "value": self.value, "reason": self.reason,
                "route": self.route, "bytes": self.bytes, "repeats": self.repeats,
                "conditions": self.conditions.record() if self.conditions else None}


@dataclass(frozen=True)
class KnownAnswer:
    """One known-answer check: seeded inputs, a result compared with a trusted one."""

    check: str                      # memory_pattern, matmul_fp32, matmul_bf16, ...
    ok: bool
    detail: str


@dataclass(frozen=True)
class GpuResult:
    """What one qualification of one GPU measured (or why it stopped)."""

    uuid: str
    name: str | None
    index: int | None
    tier: str
    platform: str                   # cuda, or cpu (JAX's CPU devices: no GPU here)
    measurements: tuple[Measurement, ...] = ()
    known_answers: tuple[KnownAnswer, ...] = ()
    aborted: str | None = None      # why the run stopped early (another process, deadline)
    started_at: float | None = None  # Unix seconds
    duration_s: float | None = None
    gpu_seconds: float | None = None  # time the GPU was held for measurements
    bytes_used: int | None = None     # the most GPU memory held at once
    checks: tuple[CheckResult, ...] = ()  # the sdc tier's checks (core.sdc)
    versions: Mapping[str, str] = field(default_factory=dict)  # driver and libraries
    budget_s: float | None = None     # the per-GPU budget the run was held to
    # The run stopped for the busy rule (a process appeared, a job waits): not a failure.
    # An abort that is not ``yielded`` (a driver call failed, the child died) is gpudiag
    # failing to measure.
    yielded: bool = False
    # What the run changed on the GPU (``field before -> after``, engine.qualify_inventory):
    # diagnostic_side_effect when any.
    side_effects: tuple[str, ...] = ()

    def value(self, measure: str) -> float | None:
        """The measured value of ``measure``, None when it was not measured."""
        return next((m.value for m in self.measurements if m.measure == measure), None)


@dataclass(frozen=True)
class Thresholds:
    """When a measurement counts as too slow (config ``[qualification]``; docs/qualify.md)."""

    table_ratio: float = setting(0.5, share())    # of what a healthy GPU of the model reaches
    peer_ratio: float = setting(0.8, share())     # of the node's median for the model
    history_ratio: float = setting(0.8, share())  # of this GPU's own recent median
    min_peers: int = 3              # a median of fewer GPUs says little
    history_window: int = 5
    min_history: int = 3
    # A GPU found slow must beat threshold + this to pass again.
    hysteresis: float = setting(0.05, ratio())
    block: bool = setting(False, Flag())  # gpu_underperforming blocks readiness and health


@dataclass(frozen=True)
class ReferenceScore:
    """The measurement against one reference: its value, the ratio and the verdict."""

    reference: str                  # table, peers, history
    value: float | None             # None: no such reference for this GPU (basis says why)
    ratio: float | None
    threshold: float
    below: bool
    basis: str


@dataclass(frozen=True)
class MeasureScore:
    """One measurement and how it compares with each reference."""

    measure: str
    unit: str
    value: float | None
    references: tuple[ReferenceScore, ...]
    band: str | None = None         # ok, warn, fail against a calibration row (core.qualify)

    @property
    def below(self) -> bool:
        return any(r.below for r in self.references)


@dataclass(frozen=True)
class Qualification:
    """The scored outcome for one GPU: the code, its severity and every figure behind it."""

    result: GpuResult
    code: str                       # none, gpu_underperforming, gpu_compute_mismatch,
    severity: str                   # qualification_aborted; ok, warning, blocker, aborted
    message: str
    scores: tuple[MeasureScore, ...] = field(default_factory=tuple)
    reference_model: str | None = None

    def record(self) -> dict[str, Any]:
        """The JSON record (schema gpudiag.qualification/1): one GPU's line in the history."""
        return {"schema": SCHEMA, **result_record(self.result), "code": self.code,
                "severity": self.severity, "message": self.message,
                "reference_model": self.reference_model,
                "coverage": coverage(self.result).record(),
                "scores": [{"measure": s.measure, "unit": s.unit, "value": s.value,
                            "below": s.below, "band": s.band,
                            "references": [vars(r) for r in s.references]}
                           for s in self.scores]}


@dataclass(frozen=True)
class Coverage:
    """What a qualification really covered: every check and measure with its status, the
    bytes of GPU memory tested and the time taken. ``unknown``: it could not run at its
    minimum size, never a pass."""

    checks: Mapping[str, str]      # check or measure -> pass | fail | unknown | measured
    bytes_tested: int
    duration_s: float | None
    # Checks that passed over far less than they set out to test: (check, tested, target).
    short: tuple[tuple[str, int, int], ...] = ()

    @property
    def unknown(self) -> tuple[str, ...]:
        return tuple(c for c, s in self.checks.items() if s == UNKNOWN)

    @property
    def covered(self) -> tuple[str, ...]:
        """What ran and answered: passed, failed or measured (never an unknown)."""
        return tuple(c for c, s in self.checks.items() if s != UNKNOWN)

    @property
    def measured_anything(self) -> bool:
        return bool(self.covered)

    def short_text(self) -> str:
        """The checks far below their target, for a person ("" when none)."""
        return "; ".join(f"{c} covered {_size(t)} of its {_size(n)} target" for c, t, n in
                         self.short)

    def record(self) -> dict[str, Any]:
        return {"checks": dict(self.checks), "bytes_tested": self.bytes_tested,
                "duration_s": self.duration_s, "unknown": list(self.unknown),
                "short": [{"check": c, "bytes_tested": t, "bytes_target": n}
                          for c, t, n in self.short]}


# A check that passed over less than this share of its target is named: a memory test the
# budget cut to 4 MiB of 1 GiB says little about the other 1020 MiB.
SHORT_SHARE = 0.5


def _size(n: int) -> str:
    return f"{n / GIB:.3g} GiB" if n >= GIB else f"{n / MIB:.3g} MiB"


def coverage(r: GpuResult) -> Coverage:
    """The coverage of one result, whatever its tier (an aborted run covers nothing)."""
    checks: dict[str, str] = {}
    tested = 0
    if r.aborted is None:
        for m in r.measurements:
            checks[m.measure] = "measured" if m.value is not None else UNKNOWN
        for k in r.known_answers:
            checks[k.check] = PASS if k.ok else FAIL
            if k.check == "memory_pattern":
                tested += next((m.bytes or 0 for m in r.measurements
                                if m.measure == "memory_bandwidth"), 0)
        for c in r.checks:
            checks[c.check] = c.status
            tested += c.bytes_tested if c.check.startswith("memory_") else 0
    short = tuple((c.check, c.bytes_tested, c.bytes_target) for c in r.checks
                  if r.aborted is None and c.status == PASS and c.bytes_target > 0
                  and c.bytes_tested < SHORT_SHARE * c.bytes_target)
    return Coverage(checks, tested, r.duration_s, short)


def result_record(r: GpuResult) -> dict[str, Any]:
    """The measured part of a record, what ``parse_result`` reads back."""
    return {"uuid": r.uuid, "name": r.name, "index": r.index, "tier": r.tier,
            "platform": r.platform, "aborted": r.aborted, "started_at": r.started_at,
            "duration_s": r.duration_s, "gpu_seconds": r.gpu_seconds, "bytes_used": r.bytes_used,
            "budget_s": r.budget_s, "yielded": r.yielded, "versions": dict(r.versions),
            "measurements": [m.record() for m in r.measurements],
            "known_answers": [vars(k) for k in r.known_answers],
            "checks": [c.record() for c in r.checks],
            **({"side_effects": list(r.side_effects)} if r.side_effects else {})}


OUTCOMES = (PASSED, UNDERPERFORMING, COMPUTE_MISMATCH, MEMORY_TEST_FAILED, ABORTED)


# -- parsing: once, at the boundary ---------------------------------------------------------

class ResultError(ValueError):
    """A result record that cannot be read (names the field)."""


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _opt_int(value: Any) -> int | None:
    n = _num(value)
    return None if n is None else int(n)


def _opt_str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _texts(value: Any) -> tuple[str, ...]:
    return tuple(v for v in value if isinstance(v, str)) if isinstance(value, list) else ()


def parse_result(data: Any) -> GpuResult:
    """A GpuResult from a child's or history's JSON; ResultError names what is wrong."""
    if not isinstance(data, Mapping):
        raise ResultError("a qualification result must be a JSON object")
    uuid, tier, platform = data.get("uuid"), data.get("tier"), data.get("platform")
    if not isinstance(uuid, str) or not uuid:
        raise ResultError("uuid: missing or not a string")
    if not isinstance(tier, str) or not isinstance(platform, str):
        raise ResultError("tier and platform must be strings")
    measurements = []
    for m in data.get("measurements") or ():
        if not isinstance(m, Mapping) or m.get("measure") not in MEASURES:
            raise ResultError(f"measurements: unknown entry {m!r:.80}")
        measurements.append(Measurement(m["measure"], _num(m.get("value")),
                                        _opt_str(m.get("reason")), _opt_str(m.get("route")),
                                        _opt_int(m.get("bytes")), _opt_int(m.get("repeats")),
                                        parse_conditions(m.get("conditions"))))
    answers = []
    for k in data.get("known_answers") or ():
        if not isinstance(k, Mapping) or not isinstance(k.get("ok"), bool):
            raise ResultError(f"known_answers: entry without a boolean ok: {k!r:.80}")
        answers.append(KnownAnswer(str(k.get("check")), k["ok"], str(k.get("detail") or "")))
    try:
        checks = tuple(parse_check(c) for c in data.get("checks") or ())
    except CheckError as e:
        raise ResultError(str(e)) from e
    raw_versions = data.get("versions")
    versions = ({str(k): str(v) for k, v in raw_versions.items() if isinstance(v, str)}
                if isinstance(raw_versions, Mapping) else {})
    return GpuResult(uuid, _opt_str(data.get("name")), _opt_int(data.get("index")), tier,
                     platform, tuple(measurements), tuple(answers),
                     _opt_str(data.get("aborted")), _num(data.get("started_at")),
                     _num(data.get("duration_s")), _num(data.get("gpu_seconds")),
                     _opt_int(data.get("bytes_used")), checks, versions,
                     _num(data.get("budget_s")), data.get("yielded") is True,
                     _texts(data.get("side_effects")))


def parse_qualification(data: Any) -> Qualification:
    """A whole scored Qualification from its record (a history line): no scoring again."""
    result = parse_result(data)
    scores = []
    for s in data.get("scores") or ():
        if not isinstance(s, Mapping) or s.get("measure") not in MEASURES:
            raise ResultError(f"scores: unknown entry {s!r:.80}")
        refs = tuple(ReferenceScore(str(r.get("reference")), _num(r.get("value")),
                                    _num(r.get("ratio")), _num(r.get("threshold")) or 0.0,
                                    r.get("below") is True, str(r.get("basis") or ""))
                     for r in s.get("references") or () if isinstance(r, Mapping))
        scores.append(MeasureScore(s["measure"], UNITS[s["measure"]], _num(s.get("value")),
                                   refs, _opt_str(s.get("band"))))
    code, severity = data.get("code"), data.get("severity")
    if code not in OUTCOMES or not isinstance(
            severity, str):
        raise ResultError(f"code {code!r} or severity {severity!r} is not a qualification's")
    return Qualification(result, code, severity, str(data.get("message") or ""),
                         tuple(scores), _opt_str(data.get("reference_model")))


# -- scoring --------------------------------------------------------------------------------

def _comparable(a: GpuResult, b: GpuResult) -> bool:
    return (a.name == b.name and a.tier == b.tier and a.platform == b.platform
            and b.aborted is None and all(k.ok for k in b.known_answers))


def _ratio_score(reference: str, value: float | None, ref: float | None, threshold: float,
                 basis: str) -> ReferenceScore:
    if value is None or ref is None or ref <= 0:
        return ReferenceScore(reference, ref, None, threshold, False, basis)
    ratio = value / ref
    return ReferenceScore(reference, ref, round(ratio, 4), threshold, ratio < threshold, basis)


def _score_measure(result: GpuResult, measure: str, model: ReferenceModel | None,
                   peers: Sequence[GpuResult], history: Sequence[GpuResult],
                   th: Thresholds, margin: float) -> MeasureScore:
    value = result.value(measure)
    if model is None:
        table = _ratio_score("table", value, None, th.table_ratio + margin,
                             f"no row for {result.name!r} in the reference table")
    else:
        table = _ratio_score("table", value, expected(model, measure), th.table_ratio + margin,
                             f"{model.model}: {model.source}")
    peer_values = [v for p in peers if _comparable(result, p)
                   and (v := p.value(measure)) is not None]
    if value is not None and not any(p.uuid == result.uuid for p in peers):
        peer_values.append(value)
    peer_ref = statistics.median(peer_values) if len(peer_values) >= th.min_peers else None
    peer = _ratio_score("peers", value, peer_ref, th.peer_ratio + margin,
                        f"median of {len(peer_values)} GPU(s) of this model on this node"
                        + ("" if peer_ref is not None else f" (fewer than {th.min_peers})"))
    own = [v for h in history[-th.history_window:] if _comparable(result, h)
           and (v := h.value(measure)) is not None]
    hist_ref = statistics.median(own) if len(own) >= th.min_history else None
    hist = _ratio_score("history", value, hist_ref, th.history_ratio + margin,
                        f"median of this GPU's last {len(own)} result(s)"
                        + ("" if hist_ref is not None else f" (fewer than {th.min_history})"))
    size = next((m.bytes for m in result.measurements if m.measure == measure), None)
    band, _why = band_of(model.model if model else None, measure, value, peer_ref, size)
    return MeasureScore(measure, UNITS[measure], value, (table, peer, hist), band)


def _check_text(c: CheckResult) -> str:
    where = (f" at {c.where}: expected {c.expected}, got {c.got}" if c.where is not None
             else "")
    return f"{c.check}: {c.detail}{where}"


def _band_text(model: ReferenceModel | None, result: GpuResult, s: MeasureScore) -> str:
    peers = next((r.value for r in s.references if r.reference == "peers"), None)
    size = next((m.bytes for m in result.measurements if m.measure == s.measure), None)
    _band, why = band_of(model.model if model else None, s.measure, s.value, peers, size)
    return f"{s.measure} {s.band}: {why}"


def score(result: GpuResult, *, peers: Sequence[GpuResult] = (),
          history: Sequence[GpuResult] = (), previous_code: str | None = None,
          table: Sequence[ReferenceModel] | None = None,
          thresholds: Thresholds = Thresholds()) -> Qualification:
    """Judge one GPU's result. ``peers``: this node's latest results (any GPUs, filtered to
    the model and tier here); ``history``: this GPU's own earlier results, oldest first
    (aborted ones and wrong answers are skipped); ``previous_code``: its last outcome, for
    hysteresis (no flapping near a line)."""
    if result.aborted is not None:
        return Qualification(result, ABORTED, "aborted",
                             f"qualification stopped: {result.aborted}; no verdict changed")
    wrong = [k for k in result.known_answers if not k.ok]
    failed = [c for c in result.checks if c.status == FAIL]
    model = reference_for(result.name, REFERENCE_TABLE if table is None else table)
    margin = thresholds.hysteresis if previous_code == UNDERPERFORMING else 0.0
    scores = tuple(_score_measure(result, m, model, peers, history, thresholds, margin)
                   for m in MEASURES if any(x.measure == m for x in result.measurements))
    model_name = model.model if model else None
    if failed or wrong:
        # A bad memory cell explains a wrong product, not the other way round.
        code = (MEMORY_TEST_FAILED if any(c.code == MEMORY_TEST_FAILED for c in failed)
                else COMPUTE_MISMATCH)
        text = "; ".join([*(_check_text(c) for c in failed),
                          *(f"{k.check}: {k.detail}" for k in wrong)])
        prefix = "memory test failed: " if code == MEMORY_TEST_FAILED else "wrong answer: "
        return Qualification(result, code, "blocker", prefix + text, scores, model_name)
    slow = [(s, r) for s in scores for r in s.references if r.below]
    banded = [s for s in scores if s.band in ("warn", "fail")]
    if slow or banded:
        # A warn line alone never blocks; a threshold or a fail line blocks with block = true.
        severity = ("blocker" if thresholds.block and (slow or any(s.band == "fail"
                                                                   for s in banded))
                    else "warning")
        parts = [f"{s.measure} {s.value:.4g} {s.unit} is {r.ratio:.2f} of {r.reference}"
                 f" ({r.value:.4g}, threshold {r.threshold:.2f})" for s, r in slow
                 if s.value is not None and r.ratio is not None and r.value is not None]
        parts += [_band_text(model, result, s) for s in banded]
        return Qualification(result, UNDERPERFORMING, severity, "; ".join(parts), scores,
                             model_name)
    unknown = [c for c in result.checks if c.status == UNKNOWN]
    passed = [c for c in result.checks if c.status == PASS]
    if not result.checks:
        text = "every measurement within its thresholds"
    elif not unknown:
        text = "every check passed"
    else:
        # Never "every check passed" beside an unknown: it did not run, so it did not pass.
        text = (f"{len(passed)} of {len(result.checks)} checks passed; not covered "
                "(unknown, not a pass): " + "; ".join(f"{c.check} ({c.detail})"
                                                      for c in unknown))
    short = coverage(result).short_text()
    if short:
        text += f"; {short}"
    return Qualification(result, PASSED, "ok", text, scores, model_name)


def child_results(run: ProbeRun, expected: int) -> list[GpuResult] | str:
    """The qualification child's per-GPU results parsed once, or why they cannot be read
    ("" when it gave none: the caller says why from the run's exit and stderr)."""
    observation = run.observation
    found = observation.get("results") if isinstance(observation, Mapping) else None
    if not isinstance(found, list) or len(found) != expected:
        return ""
    try:
        return [parse_result(r) for r in found]
    except ResultError as e:
        return f"the qualification child returned a malformed result: {e}"
