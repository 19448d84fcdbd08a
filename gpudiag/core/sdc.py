"""The silent-data-corruption screen (the ``sdc`` tier), the pure part: checks, conditions,
coverage and the cross-GPU golden rule.

A GPU that computes wrong without an error (SDC) passes every init check. The sdc tier runs,
on an idle GPU under its lock and within ``SDC.budget_s`` (10 s):

- ``gemm_repeat``: one seeded GEMM repeated k times on the same inputs, every result compared
  bit for bit with the first (XLA's deterministic ops: zero tolerance);
- ``golden``: a second seeded GEMM whose output is hashed and compared with the node's
  majority and with the golden stored per (GPU model, driver, library versions, program); a
  golden is recorded only once three GPUs agree (``judge_golden``);
- ``memory_address``, ``memory_walking_ones``, ``memory_random``: a short memory test over a
  bounded share of free memory (``memory_test_bytes``): each 8-byte word holds its own
  position; walking ones then walking zeros; a seeded random pattern then its complement.

A check's ``status`` is ``pass``, ``fail`` or ``unknown`` (it could not run at its minimum
size: memory taken, the budget hit, no GEMM route): unknown is never a pass. A failing memory
check is ``gpu_memory_test_failed``, a failing GEMM check ``gpu_compute_mismatch``. Every
check carries the conditions it ran under (clocks, temperature, power limit, throttle mask).
No I/O here: the probe child runs the checks, the engine keeps the goldens.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from gpudiag.core.records import dataclass

GEMM_CHECKS: tuple[str, ...] = ("gemm_repeat", "golden")
MEMORY_CHECKS: tuple[str, ...] = ("memory_address", "memory_walking_ones", "memory_random")
CHECKS: tuple[str, ...] = (*GEMM_CHECKS, *MEMORY_CHECKS)

PASS, FAIL, UNKNOWN = "pass", "fail", "unknown"
# The child cannot judge a golden alone: it reports its hash as pending and the engine
# resolves it against the node's other GPUs and the stored golden (resolve in the engine).
PENDING = "pending"
STATUSES: tuple[str, ...] = (PASS, FAIL, UNKNOWN, PENDING)

COMPUTE_MISMATCH = "gpu_compute_mismatch"
MEMORY_TEST_FAILED = "gpu_memory_test_failed"

# XLA's settings for bit-identical products: deterministic algorithms, and no autotuning
# (autotuning may pick a different algorithm on each GPU, and the golden compares GPUs).
XLA_DETERMINISTIC_FLAGS = ("--xla_gpu_deterministic_ops=true", "--xla_gpu_autotune_level=0")

MIB, GIB = 1024 ** 2, 1024 ** 3
GOLDEN_MIN_AGREE = 3


@dataclass(frozen=True)
class SdcSpec:
    """Sizes and budget of the sdc tier (docs/qualify.md "The sdc tier")."""

    budget_s: float = 10.0             # per GPU, enforced in the child; the engine kills later
    memory_share: float = 0.10         # of the GPU's free memory ...
    memory_max_bytes: int = 1 * GIB    # ... at most this, and within core.qualify's cap
    memory_min_bytes: int = 1 * MIB    # less than this: the memory checks are unknown
    memory_time_share: float = 0.4     # of the budget the memory test may spend
    chunk_bytes: int = 4 * MIB         # one host staging buffer
    gemm_n: int = 4096                 # the repeated GEMM on a GPU (bf16 in, fp32 out)
    cpu_gemm_n: int = 128              # on JAX's CPU devices and the test host route
    gemm_min_n: int = 64               # a smaller product (memory cap) is unknown
    gemm_repeats: int = 16             # k: products compared with the first
    gemm_min_repeats: int = 2          # fewer compared before the budget: unknown
    golden_n: int = 2048
    cpu_golden_n: int = 128
    seed: int = 20261202


SDC = SdcSpec()


def memory_test_bytes(free_bytes: int | None, cap_bytes: int, spec: SdcSpec = SDC) -> int:
    """Bytes the memory test covers: a share of free memory, within the cap, 8-byte words."""
    if free_bytes is None or free_bytes <= 0 or cap_bytes <= 0:
        return 0
    n = min(int(free_bytes * spec.memory_share), cap_bytes, spec.memory_max_bytes)
    return max(0, n) // 8 * 8


def gemm_size(budget_bytes: int, wanted_n: int) -> int:
    """The largest n <= wanted_n whose three fp32 n x n operands fit ``budget_bytes``."""
    n = min(wanted_n, int((max(budget_bytes, 0) / 12) ** 0.5))
    return n // 64 * 64 if n >= 64 else n


@dataclass(frozen=True)
class Conditions:
    """What the GPU ran at when a figure or check was taken: a slow or wrong result under
    throttling reads differently from one at full clocks (None: NVML could not say)."""

    sm_clock_mhz: int | None = None
    memory_clock_mhz: int | None = None
    temperature_c: int | None = None
    power_limit_w: float | None = None
    throttle_mask: int | None = None
    throttle_reasons: tuple[str, ...] = ()
    reason: str | None = None          # why a field is missing

    def record(self) -> dict[str, Any]:
        """The JSON form (a record's ``conditions``)."""
        return {"sm_clock_mhz": self.sm_clock_mhz, "memory_clock_mhz": self.memory_clock_mhz,
                "temperature_c": self.temperature_c, "power_limit_w": self.power_limit_w,
                "throttle_mask": self.throttle_mask,
                "throttle_reasons": list(self.throttle_reasons), "reason": self.reason}


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def parse_conditions(data: Any) -> Conditions | None:
    """Conditions from their JSON form; None when there are none."""
    if not isinstance(data, Mapping):
        return None
    power = data.get("power_limit_w")
    reasons = data.get("throttle_reasons")
    return Conditions(
        _int(data.get("sm_clock_mhz")), _int(data.get("memory_clock_mhz")),
        _int(data.get("temperature_c")),
        float(power) if isinstance(power, (int, float)) and not isinstance(power, bool)
        else None, _int(data.get("throttle_mask")),
        tuple(str(r) for r in reasons) if isinstance(reasons, list) else (),
        data.get("reason") if isinstance(data.get("reason"), str) else None)


@dataclass(frozen=True)
class CheckResult:
    """One sdc check on one GPU: what it covered and, on a failure, where and what."""

    check: str
    status: str                        # pass, fail, unknown (pending: golden, before judging)
    detail: str
    bytes_tested: int = 0
    duration_s: float = 0.0
    where: str | None = None           # element (row, column) or byte offset of the first fault
    expected: str | None = None
    got: str | None = None
    route: str | None = None           # jax, driver (cuMemcpy), test-host (the fakes' GEMM)
    output_hash: str | None = None     # golden: sha256 of the output
    golden_key: str | None = None      # golden: (model, driver, libraries, program)
    conditions: Conditions | None = None
    injected: bool = False             # a test hook injected a fault (never in production)
    bytes_target: int = 0              # what a memory check set out to test (0: not sized)

    @property
    def code(self) -> str | None:
        """The outcome code a failure of this check is."""
        if self.status != FAIL:
            return None
        return MEMORY_TEST_FAILED if self.check in MEMORY_CHECKS else COMPUTE_MISMATCH

    def record(self) -> dict[str, Any]:
        """The JSON form (a record's ``checks[]``)."""
        return {"check": self.check, "status": self.status, "detail": self.detail,
                "bytes_tested": self.bytes_tested, "bytes_target": self.bytes_target,
                "duration_s": self.duration_s,
                "where": self.where, "expected": self.expected, "got": self.got,
                "route": self.route, "output_hash": self.output_hash,
                "golden_key": self.golden_key, "injected": self.injected,
                "conditions": self.conditions.record() if self.conditions else None}


class CheckError(ValueError):
    """A check record that cannot be read (names the field)."""


def _opt_str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def parse_check(data: Any) -> CheckResult:
    """A CheckResult from its JSON form; CheckError names what is wrong."""
    if not isinstance(data, Mapping) or data.get("check") not in CHECKS:
        raise CheckError(f"checks: unknown entry {data!r:.80}")
    if data.get("status") not in STATUSES:
        raise CheckError(f"checks: status {data.get('status')!r} is not one of "
                         f"{', '.join(STATUSES)}")
    duration = data.get("duration_s")
    return CheckResult(
        str(data["check"]), str(data["status"]), str(data.get("detail") or ""),
        _int(data.get("bytes_tested")) or 0,
        float(duration) if isinstance(duration, (int, float)) and not isinstance(
            duration, bool) else 0.0,
        _opt_str(data.get("where")), _opt_str(data.get("expected")), _opt_str(data.get("got")),
        _opt_str(data.get("route")), _opt_str(data.get("output_hash")),
        _opt_str(data.get("golden_key")), parse_conditions(data.get("conditions")),
        data.get("injected") is True, _int(data.get("bytes_target")) or 0)


@dataclass(frozen=True)
class GoldenJudgement:
    """The golden check's status for one GPU, and why."""

    status: str
    detail: str


@dataclass(frozen=True)
class GoldenRound:
    """The golden rule applied to the GPUs of one key: each GPU's judgement and the golden
    to store (None: keep what is stored)."""

    judgements: Mapping[str, GoldenJudgement]
    record: str | None = None


def judge_golden(hashes: Mapping[str, str], stored: str | None,
                 min_agree: int = GOLDEN_MIN_AGREE) -> GoldenRound:
    """Judge each GPU's output hash (``hashes``: uuid -> hash, this node's GPUs of one golden
    key) against the node's majority and the stored golden.

    - A strict majority of at least ``min_agree`` GPUs is the truth: a GPU off it fails, and
      the majority is recorded as the golden when none is stored or it differs (a software
      change the key did not capture: the node agreeing with itself outranks an old hash).
    - Without such a majority the stored golden decides: equal passes, different fails, unless
      another GPU shares the different hash (two agreeing against the stored golden cannot be
      told from a change the key missed: unknown).
    - No majority and nothing stored: unknown for every GPU; nothing is recorded.
    """
    counts = Counter(hashes.values())
    top, n = counts.most_common(1)[0] if counts else ("", 0)
    majority = top if n >= min_agree and n * 2 > len(hashes) else None
    out: dict[str, GoldenJudgement] = {}
    record = None
    if majority is not None:
        if majority != stored:
            record = majority
        basis = (f"{n} of {len(hashes)} GPU(s) of this model agree"
                 + ("" if stored in (None, majority) else
                    "; the stored golden differed and was replaced"))
        for uuid, h in hashes.items():
            out[uuid] = (GoldenJudgement(PASS, f"output hash {h[:16]} matches the node's "
                                               f"majority ({basis})") if h == majority else
                         GoldenJudgement(FAIL, f"output hash {h[:16]} differs from the node's "
                                               f"majority {majority[:16]} ({basis})"))
        return GoldenRound(out, record)
    for uuid, h in hashes.items():
        if stored is None:
            out[uuid] = GoldenJudgement(UNKNOWN, f"no golden stored yet and only {n} of "
                                                 f"{len(hashes)} GPU(s) agree (a golden is "
                                                 f"recorded once {min_agree} agree)")
        elif h == stored:
            out[uuid] = GoldenJudgement(PASS, f"output hash {h[:16]} matches the stored golden")
        elif counts[h] > 1:
            out[uuid] = GoldenJudgement(UNKNOWN, f"output hash {h[:16]} differs from the stored "
                                                 f"golden {stored[:16]}, as {counts[h]} GPU(s) "
                                                 f"agree: fewer than {min_agree}, not judged")
        else:
            out[uuid] = GoldenJudgement(FAIL, f"output hash {h[:16]} differs from the stored "
                                              f"golden {stored[:16]}")
    return GoldenRound(out, None)
