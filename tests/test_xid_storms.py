"""Issue 52: a storm is one finding. A replay corpus of storm shapes, each delivered by the
fake NVML (FAKE_NVML_XID_STORM) through a real watcher child: thousands of XID 45/13/31/43
across GPUs, interleaved, with and without a fatal XID inside.

For the storm alone: no blocker, at most one held XID per (GPU, XID) and one log line per
GPU, every event counted. A fatal XID written into the fake's state file mid-storm is held,
and blocks the verdict, within 1 s. The drain side against a real slurmctld is in
tests/test_remediation_slurm.py (test_an_xid_storm_drains_nothing_and_a_fatal_xid_inside_it
_drains_at_once).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpudiag.core.classify import NodeFacts, classify
from gpudiag.core.requirement import parse_requirement
from gpudiag.core.verdict import Verdict
from gpudiag.core.xids import xid_code
from gpudiag.daemon.config import XidConfig
from gpudiag.daemon.snapshot import WatcherState
from gpudiag.daemon.watcher import XidWatcher
from tests.fakes.build import FakeDriver, write_state_file
from tests.support.daemon import Runs, host_env, real_runs, wait_for

FATAL_WITHIN_S = 1.0


@dataclass(frozen=True)
class Storm:
    """One storm shape: (GPU, XID, count) entries the fake interleaves, and maybe a fatal
    XID (GPU, XID) that arrives in the middle of it."""

    name: str
    entries: tuple[tuple[int, int, int], ...]
    fatal: tuple[int, int] | None = None

    @property
    def knob(self) -> str:
        return ",".join(f"{gpu}:{xid}*{count}" for gpu, xid, count in self.entries)

    @property
    def total(self) -> int:
        return sum(count for _, _, count in self.entries)


# The corpus: shapes seen in the field (issue 52's anchors), scaled to run in seconds.
CORPUS: tuple[Storm, ...] = (
    # One NVL72 job crash: bursts of XID 45 on every GPU of the node.
    Storm("xid45_burst_every_gpu", tuple((g, 45, 600) for g in range(8))),
    # An application crash: its own XID, then the teardown's 45s, on four GPUs.
    Storm("app_crash_13_31_43_then_45", (
        (0, 13, 300), (0, 45, 900), (1, 31, 300), (1, 45, 900),
        (2, 43, 300), (2, 45, 900), (3, 13, 100), (3, 31, 100), (3, 43, 100))),
    # A long XID 45 run on two GPUs against a few others (the 168,924-to-10 site).
    Storm("xid45_flood_two_gpus", ((4, 45, 2500), (5, 45, 2500), (6, 13, 2), (7, 31, 2))),
    # The same shapes with a fatal XID inside them.
    Storm("xid45_burst_with_79_inside", tuple((g, 45, 600) for g in range(8)), fatal=(6, 79)),
    Storm("app_crash_with_48_inside", (
        (0, 13, 600), (0, 45, 900), (1, 31, 600), (1, 45, 900), (2, 43, 600)), fatal=(1, 48)),
)


@dataclass
class Replayed:
    """What one storm did: the watcher's state, its log lines, the fatal XID's delay."""

    state: WatcherState
    records: list[logging.LogRecord]
    fatal_held_s: float | None
    verdict: Verdict


@pytest.fixture(scope="module")
def healthy_runs(fakes: FakeDriver, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """The host's probe runs on healthy fakes (the verdict's device layer)."""
    return real_runs(host_env(fakes, tmp_path_factory.mktemp("runs")), ("host", "nvml"))


@pytest.fixture(scope="module", params=CORPUS, ids=[s.name for s in CORPUS])
def replayed(request: pytest.FixtureRequest, fakes: FakeDriver, healthy_runs: Runs,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Storm, Replayed]]:
    storm: Storm = request.param
    root = tmp_path_factory.mktemp(storm.name)
    state_file = root / "fake-state"
    write_state_file(state_file, {"FAKE_NVML_XID_STORM": storm.knob})
    env = host_env(fakes, root, FAKE_GPU_STATE_FILE=str(state_file))
    yield storm, _replay(storm, env, state_file, healthy_runs)


def _replay(storm: Storm, env: dict[str, str], state_file: Path, runs: Runs) -> Replayed:
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign,assignment]  # append stands in
    logger = logging.getLogger("gpudiag.daemon.watcher")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    watcher = XidWatcher(XidConfig(heartbeat_s=0.2, telemetry_s=60.0), env)
    total = storm.total + (1 if storm.fatal else 0)
    fatal_held_s: float | None = None
    watcher.start()
    try:
        if storm.fatal is not None:
            gpu, xid = storm.fatal
            # In the middle of the storm: a tenth of it delivered, most still to come.
            wait_for(lambda: _counted(watcher.state()) >= storm.total // 10, 30, interval=0.01)
            written = time.monotonic()
            write_state_file(state_file, {"FAKE_NVML_XID_STORM": storm.knob,
                                          "FAKE_NVML_XIDS": f"{gpu}:{xid}"})
            wait_for(lambda: any(x.xid == xid for x in watcher.state().recent), 10,
                     interval=0.005)
            fatal_held_s = time.monotonic() - written
            assert _counted(watcher.state()) < total, "the storm ended before the fatal XID"
        state = wait_for(lambda: _counted(s := watcher.state()) == total and s, 60,
                         interval=0.05)
    finally:
        watcher.stop()
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    verdict = classify(runs, parse_requirement("cuda"), host="h", checked_at="t",
                       source="daemon", facts=NodeFacts(xids=state.recent))
    return Replayed(state, records, fatal_held_s, verdict)


def _counted(state: WatcherState) -> int:
    return sum(c.count for c in state.xid_counts)


def test_every_xid_of_a_storm_is_counted_and_the_rest_folded(
        replayed: tuple[Storm, Replayed]) -> None:
    storm, r = replayed
    want: Counter[tuple[int, int]] = Counter()
    for gpu, xid, count in storm.entries:
        want[(gpu, xid)] += count
    if storm.fatal is not None:
        want[storm.fatal] += 1
    got = {(c.gpu, c.xid): c for c in r.state.xid_counts}
    assert {k: c.count for k, c in got.items()} == dict(want)
    # One held XID per (GPU, XID) in the window; the others were folded, and said so.
    held = Counter((x.device_index, x.xid) for x in r.state.recent)
    assert set(held.values()) == {1} and set(held) == set(want)
    assert all(c.folded == c.count - 1 for c in got.values())


def test_a_storm_logs_at_most_one_line_per_gpu_besides_its_fatal_xid(
        replayed: tuple[Storm, Replayed]) -> None:
    storm, r = replayed
    said = [rec for rec in r.records if rec.levelno >= logging.WARNING]
    per_gpu = Counter(getattr(rec, "gpu", None) for rec in said
                      if xid_code(getattr(rec, "xid", 0)) not in _BLOCKING)
    assert per_gpu and max(per_gpu.values()) == 1, per_gpu
    fatal = [rec for rec in said if xid_code(getattr(rec, "xid", 0)) in _BLOCKING]
    assert len(fatal) == (1 if storm.fatal else 0)


_BLOCKING = {"gpu_lost", "gpu_reset_required", "node_reboot_required"}


def test_a_storm_alone_blocks_nothing_and_a_fatal_xid_inside_it_blocks_within_1_s(
        replayed: tuple[Storm, Replayed]) -> None:
    storm, r = replayed
    if storm.fatal is None:
        assert r.verdict.blockers == () and r.verdict.ready
        assert {w.code for w in r.verdict.warnings} == {"gpu_xid_application"}
        return
    gpu, xid = storm.fatal
    assert r.fatal_held_s is not None and r.fatal_held_s <= FATAL_WITHIN_S, r.fatal_held_s
    print(f"{storm.name}: XID {xid} held {r.fatal_held_s * 1000:.0f} ms after it was written")
    assert [b.code for b in r.verdict.blockers] == [xid_code(xid)]
    assert f"GPU {gpu}: " in r.verdict.blockers[0].message


def test_xid_45_beside_the_application_xid_of_its_gpu_adds_no_finding(
        replayed: tuple[Storm, Replayed]) -> None:
    storm, r = replayed
    gpus_with_other = {g for g, x, _ in storm.entries if x != 45}
    said = [w.message for w in r.verdict.warnings]
    for gpu in gpus_with_other:
        assert not any(m.startswith(f"GPU {gpu}: application XID 45 ") for m in said), said
