"""The XID catalog: complete, documented, and every XID classified through the real watcher."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TypeAlias

import pytest

from gpudiag.core.catalog import BLOCKERS, WARNINGS
from gpudiag.core.classify import classify
from gpudiag.core.findings import XidEvent
from gpudiag.core.requirement import parse_requirement
from gpudiag.core.verdict import Finding
from gpudiag.core.xids import BUCKET_CODES, XID_CODES, XIDS, xid_code, xid_entry
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
        state = wait_for(lambda: (s := watcher.state()).recent
                         and len(s.recent) == len(stream) and s, 30, interval=0.1)
    finally:
        watcher.stop()
        logger.removeHandler(handler)
    runs = real_runs(env, ("host", "nvml"))
    return state, runs, records


def test_the_watcher_counts_and_logs_an_unknown_xid_once(watched: Watched) -> None:
    state, _, records = watched
    counts = {c.xid: c.count for c in state.xid_counts}
    assert counts[UNKNOWN_XID] == 2 and all(counts[x] == 1 for x in XIDS)
    unknown = [r for r in records if getattr(r, "unknown_xid", False)]
    assert len(unknown) == 1 and "999" in unknown[0].getMessage()


@pytest.mark.parametrize("xid", [*sorted(XIDS), UNKNOWN_XID])
def test_every_catalog_xid_produces_its_code_through_the_watcher(xid: int, watched: Watched
                                                                 ) -> None:
    state, runs, _ = watched
    events = [x for x in state.recent if x.xid == xid]
    assert events and events[0].device_index == 0 and events[0].uuid
    verdict = classify(runs, parse_requirement("cuda"), host="h", checked_at="t",
                       source="daemon", xids=[_fresh(events[0])])
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
