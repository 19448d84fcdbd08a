"""The XID catalog: complete, documented, and every XID classified through the real watcher."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TypeAlias

import pytest

from gpudiag.core.catalog import BLOCKERS, WARNINGS
from gpudiag.core.classify import NodeFacts, classify
from gpudiag.core.findings import XidEvent
from gpudiag.core.requirement import parse_requirement
from gpudiag.core.verdict import Finding
from gpudiag.core.xids import (
    BUCKET_CODES,
    DEFAULT_PROMOTIONS,
    PROMOTED_CODE,
    XID_CODES,
    XIDS,
    Promotion,
    XidRules,
    judge_xids,
    xid_code,
    xid_entry,
)
from gpudiag.daemon.config import XidConfig
from gpudiag.daemon.snapshot import WatcherState
from gpudiag.daemon.watcher import XidWatcher
from scripts.gen_xid_docs import render
from tests.fakes.build import FakeDriver
from tests.support.daemon import Runs, host_env, real_runs, wait_for

UNKNOWN_XID = 999  # not in NVIDIA's catalog: counted and held, never classified


def test_the_table_covers_every_xid_of_nvidias_catalog() -> None:
    # The published catalog numbers its XIDs 1..172 without a gap.
    assert sorted(XIDS) == list(range(1, 173))
    assert xid_entry(UNKNOWN_XID) is None and xid_code(UNKNOWN_XID) is None


@pytest.mark.parametrize("xid", sorted(XIDS))
def test_every_xid_maps_to_a_catalog_code_or_is_informational(xid: int) -> None:
    e = XIDS[xid]
    assert e.xid == xid and e.mnemonic and e.description and e.action.endswith(".")
    assert e.bucket in BUCKET_CODES
    assert e.code is None or (e.code in XID_CODES and e.code in {*BLOCKERS, *WARNINGS})
    assert e.severity == ("info" if e.code is None else
                          "warning" if e.code in WARNINGS else "blocker")


@pytest.mark.parametrize(("xids", "code"), [
    ((79,), "gpu_lost"),
    ((48, 62, 64, 74, 95, 119, 120), "gpu_reset_required"),
    ((13, 31, 43, 45), "gpu_xid_application"),
])
def test_the_xids_gpudiag_classified_before_keep_their_code(xids: tuple[int, ...],
                                                             code: str) -> None:
    assert {xid_code(x) for x in xids} == {code}


def test_docs_xids_match_the_table() -> None:
    docs = Path(__file__).resolve().parent.parent / "docs" / "xids.md"
    assert docs.read_text() == render(), "run: .venv/bin/python scripts/gen_xid_docs.py"


# -- every catalog XID through one real watcher child on the fake NVML --------------------------
# The watched fixture: the watcher's state, the host's probe runs, the watcher's log records.
Watched: TypeAlias = tuple[WatcherState, Runs, list[logging.LogRecord]]


@pytest.fixture(scope="module")
def watched(fakes: FakeDriver, tmp_path_factory: pytest.TempPathFactory) -> Watched:
    """One watcher child delivering every catalog XID (and an unknown one, twice) on GPU 0."""
    root = tmp_path_factory.mktemp("xids")
    stream = [*XIDS, UNKNOWN_XID, UNKNOWN_XID]
    env = host_env(fakes, root, gpus=1, FAKE_NVML_DEVICE_COUNT=1,
                   FAKE_NVML_XIDS=",".join(f"0:{x}" for x in stream))
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign,assignment]  # append stands in
    logger = logging.getLogger("gpudiag.daemon.watcher")
    logger.addHandler(handler)
    watcher = XidWatcher(XidConfig(heartbeat_s=0.2, telemetry_s=5.0, hold_s=3600.0), env)
    watcher.start()
    try:
        # The second 999 folds into the first's storm window: counted, not held twice.
        state = wait_for(lambda: (s := watcher.state()).recent
                         and sum(c.count for c in s.xid_counts) == len(stream) and s, 30,
                         interval=0.1)
    finally:
        watcher.stop()
        logger.removeHandler(handler)
    runs = real_runs(env, ("host", "nvml"))
    return state, runs, records


def test_the_watcher_counts_and_logs_an_unknown_xid_once(watched: Watched) -> None:
    state, _, records = watched
    counts = {c.xid: c.count for c in state.xid_counts}
    assert counts[UNKNOWN_XID] == 2 and all(counts[x] == 1 for x in XIDS)
    assert [x.xid for x in state.recent].count(UNKNOWN_XID) == 1
    unknown = [r for r in records if getattr(r, "unknown_xid", False)]
    assert len(unknown) == 1 and "999" in unknown[0].getMessage()


@pytest.mark.parametrize("xid", [*sorted(XIDS), UNKNOWN_XID])
def test_every_catalog_xid_produces_its_code_through_the_watcher(xid: int, watched: Watched
                                                                 ) -> None:
    state, runs, _ = watched
    events = [x for x in state.recent if x.xid == xid]
    assert events and events[0].device_index == 0 and events[0].uuid
    verdict = classify(runs, parse_requirement("cuda"), host="h", checked_at="t",
                       source="daemon", facts=NodeFacts(xids=[_fresh(events[0])]))
    def about(findings: Iterable[Finding]) -> list[str]:
        return [f.code for f in findings if f"XID {xid} " in f.message]

    code = xid_code(xid)
    if code is None:
        assert about(verdict.blockers) == about(verdict.warnings) == [] and verdict.ready
    elif code in WARNINGS:
        assert about(verdict.warnings) == [code] and about(verdict.blockers) == []
    else:
        assert about(verdict.blockers) == [code] and about(verdict.warnings) == []
        assert verdict.record()["gpu_validation_blocker"] == code


def _fresh(event: XidEvent) -> XidEvent:
    return XidEvent(event.xid, event.device_index, event.uuid, time.time())


# -- semantics: solo, pairs that cancel, promotion by count ------------------------------------
UUID_A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
UUID_B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"


def _x(xid: int, ts: float, uuid: str = UUID_A, index: int = 0) -> XidEvent:
    return XidEvent(xid, index, uuid, ts)


def test_xid_45_alone_is_the_application_warning() -> None:
    assert [(j.event.xid, j.code) for j in judge_xids([_x(45, 1.0)])] == [
        (45, "gpu_xid_application")]


@pytest.mark.parametrize("other", [13, 31, 79, 48])
def test_xid_45_beside_another_xid_on_its_gpu_follows_that_one(other: int) -> None:
    judged = judge_xids([_x(other, 1.0), _x(45, 2.0), _x(45, 3.0)])
    assert [j.event.xid for j in judged] == [other]


def test_xid_45_beside_another_xid_on_another_gpu_stays_its_own_warning() -> None:
    judged = judge_xids([_x(79, 1.0, UUID_B, 1), _x(45, 2.0)])
    assert sorted((j.event.xid, j.code) for j in judged) == [
        (45, "gpu_xid_application"), (79, "gpu_lost")]


def test_xid_45_beside_an_informational_xid_stays_its_own_warning() -> None:
    assert [j.event.xid for j in judge_xids([_x(63, 1.0), _x(45, 2.0)])] == [45]


@pytest.mark.parametrize("xid", [x for x, e in XIDS.items() if e.cancels is not None])
def test_a_cancelling_xid_ends_its_pair_on_the_same_gpu_only(xid: int) -> None:
    ended = XIDS[xid].cancels
    assert ended is not None
    events = [_x(ended, 1.0), _x(ended, 1.0, UUID_B, 1), _x(xid, 2.0)]
    left = [e for e in events if e.xid == ended and e.uuid == UUID_B]
    assert judge_xids(events) == judge_xids(left)
    # The other order ends nothing: the earlier XID of the pair is what it ends.
    assert judge_xids([_x(xid, 1.0), _x(ended, 2.0)]) == judge_xids([_x(ended, 2.0)])


def test_163_then_162_leaves_no_held_power_smoothing_event() -> None:
    assert XIDS[162].cancels == 163 and judge_xids([_x(163, 1.0), _x(162, 2.0)]) == []


@pytest.mark.parametrize("xid", sorted(DEFAULT_PROMOTIONS))
def test_an_application_xid_is_a_warning_first_and_blocks_at_its_count(xid: int) -> None:
    rule = DEFAULT_PROMOTIONS[xid]
    assert XIDS[xid].code == "gpu_xid_application" and XIDS[xid].solo
    below = [_x(xid, float(t)) for t in range(rule.count - 1)]
    assert [j.code for j in judge_xids(below)] == ["gpu_xid_application"]
    at = [*below, _x(xid, float(rule.count))]
    (judged,) = judge_xids(at)
    assert judged.code == PROMOTED_CODE and judged.promoted == rule
    assert judged.occurrences == rule.count


def test_promotion_counts_within_its_window_only() -> None:
    rules = XidRules({13: Promotion(3, 100.0)})
    spread = [_x(13, 0.0), _x(13, 150.0), _x(13, 300.0)]
    assert [j.code for j in judge_xids(spread, rules)] == ["gpu_xid_application"]
    close = [_x(13, 0.0), _x(13, 50.0), _x(13, 99.0)]
    assert [j.code for j in judge_xids(close, rules)] == [PROMOTED_CODE]


def test_promotion_counts_per_gpu() -> None:
    rules = XidRules({31: Promotion(2)})
    events = [_x(31, 0.0), _x(31, 1.0, UUID_B, 1)]
    assert {j.code for j in judge_xids(events, rules)} == {"gpu_xid_application"}


def test_xid_45_is_never_promoted_however_often_it_comes() -> None:
    assert 45 not in DEFAULT_PROMOTIONS
    assert {j.code for j in judge_xids([_x(45, float(t)) for t in range(10_000)])} == {
        "gpu_xid_application"}


def test_a_promoted_xid_blocks_its_gpu_in_the_verdict(watched: Watched) -> None:
    state, runs, _ = watched
    (first,) = [x for x in state.recent if x.xid == 13]
    now = time.time()
    events = [XidEvent(13, first.device_index, first.uuid, now - k) for k in range(5)]
    verdict = classify(runs, parse_requirement("cuda"), host="h", checked_at="t",
                       source="daemon", facts=NodeFacts(xids=events))
    assert verdict.gpu_validation_blocker == PROMOTED_CODE
    (b,) = [b for b in verdict.blockers if "XID 13 " in b.message]
    assert "seen 5 times" in b.message and "promoted from a warning at 5" in b.message
    quiet = classify(runs, parse_requirement("cuda"), host="h", checked_at="t",
                     source="daemon",
                     facts=NodeFacts(xids=events, xid_rules=XidRules({})))
    assert [w.code for w in quiet.warnings if "XID 13 " in w.message] == [
        "gpu_xid_application"]
