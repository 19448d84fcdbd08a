"""The sdc tier's rules without a child: the golden rule, coverage, calibration bands, and
detection of every single-bit fault by the child's own memory and GEMM code (in process)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpudiag.core.qualify import CALIBRATION, band_of
from gpudiag.core.qualify_golden import resolve_goldens
from gpudiag.core.qualify_score import (
    GpuResult,
    KnownAnswer,
    Measurement,
    Thresholds,
    coverage,
    parse_qualification,
    parse_result,
    score,
)
from gpudiag.core.qualify_verdict import qualification_findings, replaces
from gpudiag.core.sdc import (
    FAIL,
    PASS,
    PENDING,
    SDC,
    UNKNOWN,
    CheckResult,
    Conditions,
    judge_golden,
    memory_test_bytes,
)
from gpudiag.probes import qualify_sdc

H200 = "NVIDIA H200"
MIB = 1024 ** 2


def uuid(i: int) -> str:
    return f"GPU-f00d{i:04x}-0000-4000-8000-00000000{i:04x}"


# -- the golden rule ---------------------------------------------------------------------------

@pytest.mark.parametrize(("hashes", "stored", "want", "record"), [
    # 7 agree, 1 differs: the one is blocked; the majority becomes the golden.
    ("aaaaaaab", None, "PPPPPPPF", "a"),
    # Every GPU agrees on a new hash (a library upgrade under a new key): all pass, recorded.
    ("bbbbbbbb", None, "PPPPPPPP", "b"),
    # Two GPUs: fewer than three agree, nothing stored: unknown, nothing recorded.
    ("aa", None, "UU", None),
    ("ab", None, "UU", None),
    # One GPU alone against the stored golden.
    ("a", "a", "P", None),
    ("b", "a", "F", None),
    # Two agreeing against the stored golden: a change the key missed cannot be ruled out.
    ("bb", "a", "UU", None),
    ("ab", "a", "PF", None),
    # The node's majority outranks an older stored golden of the same key.
    ("bbbb", "a", "PPPP", "b"),
    ("bbba", "a", "PPPF", "b"),
    # Half and half is no majority: the stored golden decides for each.
    ("aabb", "a", "PPUU", None),
])
def test_the_golden_rule(hashes: str, stored: str | None, want: str, record: str | None
                         ) -> None:
    decided = judge_golden({uuid(i): h for i, h in enumerate(hashes)}, stored)
    short = {PASS: "P", FAIL: "F", UNKNOWN: "U"}
    assert "".join(short[decided.judgements[uuid(i)].status] for i in range(len(hashes))) == want
    assert decided.record == record


def _golden_result(i: int, h: str, key: str = "k", *, aborted: str | None = None,
                   status: str = PENDING) -> GpuResult:
    c = CheckResult("golden", status, "hashed", output_hash=h, golden_key=key)
    return GpuResult(uuid(i), H200, i, "sdc", "cuda", checks=(c,), aborted=aborted)


def test_goldens_resolve_against_history_peers_one_gpu_at_a_time() -> None:
    # The daemon qualifies one GPU at a time: the others' latest hashes are in the history.
    past = [_golden_result(i, "a", status=PASS) for i in range(1, 4)]
    (judged,), updates = resolve_goldens([_golden_result(0, "x")], past, {})
    assert judged.checks[0].status == FAIL and "majority" in judged.checks[0].detail
    assert [(u.key, u.output_hash, len(u.gpus)) for u in updates] == [("k", "a", 3)]
    # An aborted history line is no vote; another key is another program.
    past = [_golden_result(1, "a", status=PASS), _golden_result(2, "a", aborted="job"),
            _golden_result(3, "a", key="other", status=PASS)]
    (judged,), updates = resolve_goldens([_golden_result(0, "a")], past, {})
    assert judged.checks[0].status == UNKNOWN and updates == []


# -- coverage and records ---------------------------------------------------------------------

def test_coverage_is_in_every_record_and_unknown_is_never_a_pass() -> None:
    quick = GpuResult(uuid(0), H200, 0, "quick", "cuda",
                      (Measurement("memory_bandwidth", 1e12, bytes=64 * MIB),
                       Measurement("matmul_bf16", None, reason="no JAX")),
                      (KnownAnswer("memory_pattern", True, "ok"),), duration_s=1.5)
    rec = score(quick).record()
    assert rec["coverage"] == {"checks": {"memory_bandwidth": "measured",
                                          "matmul_bf16": "unknown", "memory_pattern": "pass"},
                               "bytes_tested": 64 * MIB, "duration_s": 1.5,
                               "unknown": ["matmul_bf16"], "short": []}
    sdc = GpuResult(uuid(1), H200, 1, "sdc", "cuda", checks=(
        CheckResult("gemm_repeat", UNKNOWN, "budget"),
        CheckResult("memory_address", PASS, "ok", bytes_tested=8 * MIB)), duration_s=3.0)
    q = score(sdc)
    assert q.code == "none" and "not covered (unknown, not a pass): gemm_repeat" in q.message
    assert coverage(sdc).unknown == ("gemm_repeat",) and coverage(sdc).bytes_tested == 8 * MIB
    aborted = GpuResult(uuid(2), H200, 2, "sdc", "cuda", aborted="process 7 appeared")
    assert score(aborted).record()["coverage"]["checks"] == {}


def test_never_every_check_passed_beside_an_unknown_and_a_short_pass_is_named() -> None:
    sdc = GpuResult(uuid(1), H200, 1, "sdc", "cuda", checks=(
        CheckResult("gemm_repeat", PASS, "ok"), CheckResult("golden", UNKNOWN, "no majority"),
        CheckResult("memory_address", PASS, "ok", bytes_tested=1024 * MIB,
                    bytes_target=1024 * MIB),
        CheckResult("memory_random", PASS, "ok", bytes_tested=4 * MIB,
                    bytes_target=1024 * MIB)))
    q = score(sdc)
    assert q.code == "none" and "every check passed" not in q.message
    assert q.message.startswith("3 of 4 checks passed; not covered")
    assert "memory_random covered 4 MiB of its 1 GiB target" in q.message
    assert q.record()["coverage"]["short"] == [
        {"check": "memory_random", "bytes_tested": 4 * MIB, "bytes_target": 1024 * MIB}]
    whole = GpuResult(uuid(1), H200, 1, "sdc", "cuda", checks=(
        CheckResult("gemm_repeat", PASS, "ok"),
        CheckResult("memory_random", PASS, "ok", bytes_tested=600 * MIB,
                    bytes_target=1024 * MIB)))
    assert score(whole).message == "every check passed"


def test_an_sdc_record_reads_back_with_checks_conditions_and_versions() -> None:
    cond = Conditions(1980, 3201, 41, 700.0, 0x4, ("sw_power_cap",))
    r = GpuResult(uuid(0), H200, 0, "sdc", "cuda",
                  (Measurement("memory_bandwidth", 1.0, conditions=cond),), checks=(
                      CheckResult("memory_random", FAIL, "wrong word", 8 * MIB, 0.2,
                                  "byte offset 8 (word 1)", "0x1", "0x3", "driver",
                                  conditions=cond),
                      CheckResult("golden", PASS, "ok", output_hash="ab", golden_key="k")),
                  versions={"driver": "570.124.06", "jax": "0.10.2"}, budget_s=10.0)
    q = score(r)
    assert q.code == "gpu_memory_test_failed" and q.severity == "blocker"
    assert "byte offset 8 (word 1): expected 0x1, got 0x3" in q.message
    text = json.dumps(q.record())
    assert parse_result(json.loads(text)) == r
    assert parse_qualification(json.loads(text)).code == "gpu_memory_test_failed"


def test_a_memory_failure_is_a_blocker_on_that_gpu_and_only_an_sdc_run_clears_it() -> None:
    bad = score(GpuResult(uuid(3), H200, 3, "sdc", "cuda", checks=(
        CheckResult("memory_address", FAIL, "wrong"),)))
    found = qualification_findings([bad], block=False)
    assert [(f.code, f.layer, f.device) for f in found.blockers] == [
        ("gpu_memory_test_failed", "device", uuid(3))]
    quick_pass = score(GpuResult(uuid(3), H200, 3, "quick", "cuda"))
    sdc_pass = score(GpuResult(uuid(3), H200, 3, "sdc", "cuda", checks=(
        CheckResult("memory_address", PASS, "ok"),)))
    assert not replaces(quick_pass, bad) and replaces(sdc_pass, bad)
    assert replaces(bad, quick_pass)


@pytest.mark.parametrize(("free", "cap", "want"), [
    (80 * MIB, 8 * MIB, 8 * MIB), (140 * 1024 * MIB, 4096 * MIB, 1024 * MIB),
    (5 * MIB, 4096 * MIB, 512 * 1024), (None, 8 * MIB, 0), (10 * MIB, 0, 0)])
def test_the_memory_test_covers_a_bounded_share_of_free_memory(
        free: int | None, cap: int, want: int) -> None:
    assert memory_test_bytes(free, cap) == want


# -- H200 calibration ---------------------------------------------------------------------------

@pytest.mark.parametrize(("measure", "value", "median", "size", "band"), [
    ("memory_bandwidth", 4.2e12, 4.2e12, 512 * MIB, "ok"),
    ("memory_bandwidth", 3.7e12, 4.2e12, 512 * MIB, "warn"),   # 0.88 of peers, < 4.0 TB/s
    ("memory_bandwidth", 3.3e12, 4.2e12, 512 * MIB, "fail"),   # 0.79 of peers, < 3.6 TB/s
    ("memory_bandwidth", 3.5e12, None, 512 * MIB, "fail"),     # absolute: whole node slow
    ("memory_bandwidth", 3.5e12, None, 64 * MIB, "ok"),        # too small for the line
    ("matmul_bf16", 700e12, 780e12, 8192 * 8192 * 8, "warn"),  # 0.90 of peers
    ("matmul_bf16", 480e12, None, 8192 * 8192 * 8, "fail"),    # < 0.5 x 989 TFLOPS
    ("host_to_device_bandwidth", 45e9, None, 512 * MIB, "warn"),
    ("device_to_host_bandwidth", 39e9, None, 512 * MIB, "fail"),
])
def test_h200_lines_are_absolute_and_peer_relative(measure: str, value: float,
                                                   median: float | None, size: int,
                                                   band: str) -> None:
    got, why = band_of("H200", measure, value, median, size)
    assert got == band, why
    assert band_of("H100 SXM", measure, value, median, size)[0] is None
    assert "H200" in CALIBRATION and measure in CALIBRATION["H200"]


def test_a_warn_line_warns_and_a_fail_line_blocks_only_with_block() -> None:
    def result(i: int, bw: float) -> GpuResult:
        return GpuResult(uuid(i), H200, i, "full", "cuda",
                         (Measurement("memory_bandwidth", bw, bytes=512 * MIB),))

    peers = [result(i, 4.2e12) for i in range(1, 8)]
    warn = score(result(0, 3.85e12), peers=[result(0, 3.85e12), *peers])
    assert warn.code == "gpu_underperforming" and warn.scores[0].band == "warn"
    assert "memory_bandwidth warn" in warn.message
    assert qualification_findings([warn], block=True).warnings  # a warn line never blocks
    fail = score(result(0, 3.4e12), peers=[result(0, 3.4e12), *peers],
                 thresholds=Thresholds(block=True))
    assert fail.scores[0].band == "fail" and fail.severity == "blocker"
    assert qualification_findings([fail], block=True).blockers
    assert qualification_findings([fail], block=False).warnings


# -- every single-bit fault is detected, in process ----------------------------------------------

class BadCell:
    """A region of host memory standing for device memory, with one bad cell."""

    def __init__(self, n_bytes: int, offset: int, bit: int, mode: str) -> None:
        import numpy as np

        self.mem = np.zeros(n_bytes // 8, dtype=np.uint64)
        # A negative offset: no bad cell at all.
        self.offset, self.bit, self.mode = (offset % n_bytes if offset >= 0 else -n_bytes,
                                            bit, mode)

    def write(self, offset: int, words: Any) -> None:
        self.mem[offset // 8: offset // 8 + words.size] = words

    def read(self, offset: int, count: int) -> Any:
        out = self.mem[offset // 8: offset // 8 + count].copy()
        raw = out.view("u1")
        at = self.offset - offset
        if 0 <= at < raw.size:
            m, v = 1 << self.bit, int(raw[at])
            raw[at] = (v & (0xFF ^ m) if self.mode == "stuck0" else
                       v | m if self.mode == "stuck1" else v ^ m)
        return out


@settings(max_examples=40, deadline=None)
@given(offset=st.integers(0, MIB - 1), bit=st.integers(0, 7),
       mode=st.sampled_from(["flip", "stuck0", "stuck1"]))
def test_every_single_bit_memory_fault_is_detected(offset: int, bit: int, mode: str) -> None:
    n = MIB  # the memory test's minimum size
    port = BadCell(n, offset, bit, mode)
    far = qualify_sdc.Budget(float("inf"))
    checks = qualify_sdc.memory_checks(port, n, lambda: None, far, dict, "test")
    failed = [c for c in checks if c["status"] == FAIL]
    assert failed, checks
    assert f"byte offset {offset // 8 * 8} (word {offset // 8})" in failed[0]["where"]
    assert f"bit(s) {offset % 8 * 8 + bit} of the word" in failed[0]["where"]
    if mode == "flip":
        assert len(failed) == 3  # a flipped bit is wrong in every pattern


def test_a_clean_region_passes_every_memory_check() -> None:
    port = BadCell(3 * MIB, -1, 0, "flip")
    checks = qualify_sdc.memory_checks(port, 3 * MIB, lambda: None,
                                       qualify_sdc.Budget(float("inf")), dict, "test")
    assert [c["status"] for c in checks] == [PASS] * 3
    assert all(c["bytes_tested"] == 3 * MIB for c in checks)


@settings(max_examples=40, deadline=None)
@given(iteration=st.integers(1, SDC.gemm_repeats), element=st.integers(0, 64 * 64 - 1),
       bit=st.integers(0, 31))
def test_every_single_bit_gemm_fault_is_detected(iteration: int, element: int, bit: int,
                                                  ) -> None:
    env = {qualify_sdc.FAULT_ENV: f"0:gemm_repeat:{iteration}:{element}:{bit}"}
    faults = qualify_sdc.injected_faults(0, env)
    route = qualify_sdc.HostGemm()
    _program, product = route.program(SDC.seed, 64)
    first = product()
    flipped = qualify_sdc._flip(route, product(), faults[0])
    count, flat = route.equal_bits(first, flipped)
    assert (count, flat) == (1, element)
