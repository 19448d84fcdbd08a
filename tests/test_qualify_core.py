"""Qualification's pure core: the reference table, the memory budget, parsing and scoring."""

from __future__ import annotations

import json
import random

import pytest

from gpudiag.core.catalog import QUALIFICATION, entry
from gpudiag.core.qualify import (
    ABORTED,
    COMPUTE_MISMATCH,
    GIB,
    MEASURES,
    PASSED,
    REFERENCE_TABLE,
    TIERS,
    UNDERPERFORMING,
    ReferenceError,
    expected,
    memory_budget_bytes,
    parse_reference_table,
    reference_for,
    sized_copy_bytes,
)
from gpudiag.core.qualify_score import (
    GpuResult,
    KnownAnswer,
    Measurement,
    ResultError,
    Thresholds,
    parse_result,
    score,
)

H200 = "NVIDIA H200"
HEALTHY_BW = 3.9e12  # bytes/s: about 0.81 of 4.8 TB/s, what a healthy H200 copies


def _result(i: int, bw: float = HEALTHY_BW, *, ok: bool = True, aborted: str | None = None,
            name: str = H200) -> GpuResult:
    return GpuResult(f"GPU-f00d{i:04x}-0000-4000-8000-00000000{i:04x}", name, i, "quick", "cuda",
                     (Measurement("memory_bandwidth", bw, route="cuMemcpyDtoD"),),
                     (KnownAnswer("memory_pattern", ok, "" if ok else "byte 7 read 0x5b"),),
                     aborted)


@pytest.mark.parametrize(("nvml_name", "model"), [
    ("NVIDIA H200", "H200"), ("NVIDIA H100 80GB HBM3", "H100 SXM"),
    ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 NVL", "H100 NVL"), ("NVIDIA A100-SXM4-80GB", "A100 SXM 80GB"),
    ("NVIDIA A100-SXM4-40GB", "A100 40GB"), ("NVIDIA A100 80GB PCIe", "A100 80GB PCIe"),
    ("NVIDIA L40S", "L40S"), ("NVIDIA L4", "L4")])
def test_nvml_names_find_their_reference_row(nvml_name: str, model: str) -> None:
    row = reference_for(nvml_name)
    assert row is not None and row.model == model


@pytest.mark.parametrize("row", REFERENCE_TABLE, ids=lambda r: r.model)
def test_every_reference_row_cites_a_source_and_has_every_measure(row: object) -> None:
    from gpudiag.core.qualify import ReferenceModel

    assert isinstance(row, ReferenceModel)
    assert "data sheet" in row.source
    assert set(row.peaks) == set(MEASURES)
    assert all(expected(row, m) is not None for m in MEASURES)


def test_an_unknown_gpu_has_no_table_reference_but_is_still_scored() -> None:
    q = score(_result(0, name="NVIDIA Future 9000"))
    assert q.code == PASSED and q.reference_model is None
    table = q.scores[0].references[0]
    assert table.value is None and "no row" in table.basis


def test_memory_budget_is_ten_percent_or_4_gib_whichever_is_smaller() -> None:
    assert memory_budget_bytes(143771 * 1024 ** 2) == 4 * GIB
    assert memory_budget_bytes(16 * GIB) == 16 * GIB // 10
    assert memory_budget_bytes(None) == 0
    # both device-to-device buffers fit the budget
    assert 2 * sized_copy_bytes(TIERS["full"], 8 * GIB) <= memory_budget_bytes(8 * GIB)


def test_a_slow_gpu_among_eight_peers_is_underperforming_with_its_figures() -> None:
    results = [_result(i, HEALTHY_BW / 3 if i == 3 else HEALTHY_BW) for i in range(8)]
    verdicts = [score(r, peers=results) for r in results]
    assert [q.code for q in verdicts] == [PASSED] * 3 + [UNDERPERFORMING] + [PASSED] * 4
    slow = verdicts[3]
    assert slow.severity == "warning"
    refs = {r.reference: r for r in slow.scores[0].references}
    assert refs["peers"].below and refs["peers"].ratio == pytest.approx(1 / 3, abs=1e-3)
    assert refs["table"].below  # a third of a healthy H200 is below half of the table too
    assert "memory_bandwidth" in slow.message and "of peers" in slow.message


def test_block_turns_underperforming_into_a_blocker() -> None:
    results = [_result(i, HEALTHY_BW / 3 if i == 3 else HEALTHY_BW) for i in range(8)]
    q = score(results[3], peers=results, thresholds=Thresholds(block=True))
    assert (q.code, q.severity) == (UNDERPERFORMING, "blocker")


def test_a_wrong_answer_is_a_mismatch_whatever_the_speed() -> None:
    q = score(_result(0, HEALTHY_BW * 1.1, ok=False))
    assert (q.code, q.severity) == (COMPUTE_MISMATCH, "blocker")
    assert "memory_pattern" in q.message


def test_an_aborted_run_changes_nothing() -> None:
    q = score(_result(0, aborted="process 4242 appeared on the GPU"))
    assert (q.code, q.severity) == (ABORTED, "aborted") and q.scores == ()


def test_own_history_catches_a_gpu_that_slowed_down_alone() -> None:
    history = [_result(0, HEALTHY_BW) for _ in range(5)]
    q = score(_result(0, HEALTHY_BW * 0.7), history=history)
    refs = {r.reference: r for r in q.scores[0].references}
    assert q.code == UNDERPERFORMING and refs["history"].below
    assert not refs["table"].below and refs["peers"].value is None  # one GPU: no peer median


def test_hysteresis_keeps_a_slow_gpu_slow_just_above_the_line() -> None:
    # A model without a calibration row (the H200's warns below 0.90 of its peers).
    h100 = "NVIDIA H100 80GB HBM3"
    peers = [_result(i, name=h100) for i in range(1, 8)]
    near = _result(0, HEALTHY_BW * 0.82, name=h100)
    assert score(near, peers=peers).code == PASSED
    assert score(near, peers=peers, previous_code=UNDERPERFORMING).code == UNDERPERFORMING


def test_ten_runs_on_an_unchanged_node_give_the_same_verdict() -> None:
    rng = random.Random(7)
    outcomes = set()
    for _ in range(10):
        # run-to-run noise of a few percent, as best-of-N timings show on one GPU
        results = [_result(i, (HEALTHY_BW / 3 if i == 3 else HEALTHY_BW) * rng.uniform(0.97, 1.03))
                   for i in range(8)]
        outcomes.add(tuple(score(r, peers=results).code for r in results))
    assert len(outcomes) == 1


def test_a_record_reads_back_to_the_same_result() -> None:
    q = score(_result(2), peers=[_result(i) for i in range(8)])
    text = json.dumps(q.record())
    assert parse_result(json.loads(text)) == q.result
    assert json.loads(text)["schema"] == "gpudiag.qualification/1"


@pytest.mark.parametrize("bad", [[], {"uuid": 3}, {"uuid": "GPU-x", "tier": "quick"},
                                 {"uuid": "GPU-x", "tier": "quick", "platform": "cuda",
                                  "measurements": [{"measure": "warp_speed"}]}])
def test_a_malformed_result_names_its_problem(bad: object) -> None:
    with pytest.raises(ResultError):
        parse_result(bad)


def test_a_site_reference_table_is_checked_and_used() -> None:
    table = parse_reference_table({"models": [{
        "model": "cpu", "names": ["cpu"], "source": "measured on this host",
        "peaks": {"matmul_fp32": 1e9}, "healthy_share": {"matmul_fp32": 1.0}}]})
    r = GpuResult("CPU-0", "cpu", 0, "quick", "cpu", (Measurement("matmul_fp32", 4e8),))
    q = score(r, table=table)
    assert q.code == UNDERPERFORMING and q.reference_model == "cpu"
    for bad, why in [({}, "models"), ({"models": [{"names": ["x"], "source": "s",
                                                   "peaks": {"nope": 1}}]}, "unknown measure"),
                     ({"models": [{"names": ["x"], "peaks": {}}]}, "source")]:
        with pytest.raises(ReferenceError, match=why):
            parse_reference_table(bad)


@pytest.mark.parametrize("code", list(QUALIFICATION))
def test_qualification_codes_are_in_the_catalog(code: str) -> None:
    assert entry(code).remediation and entry(code).layer == "device"
