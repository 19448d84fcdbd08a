"""The job watch's rules (core/job_watch.py): a hung collective and a straggling GPU."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from gpudiag.core.attribution import Attribution, JobRecord
from gpudiag.core.job_watch import (
    CODES,
    STALLED,
    STRAGGLER,
    GpuSample,
    JobWatchPolicy,
    RunWarning,
    RunWatch,
    run_warnings,
)

A, B = "GPU-aaaaaaaa-0000-0000-0000-000000000000", "GPU-bbbbbbbb-0000-0000-0000-000000000000"
POLICY = JobWatchPolicy(stall_after_s=10.0, straggler_after_s=20.0)


def gpu(uuid: str, util: float | None = 1.0, power: float | None = 80.0, *,
        limit: float | None = 700.0, clock: float | None = 1980.0,
        reasons: tuple[str, ...] | None = (), link: float | None = None) -> GpuSample:
    return GpuSample(uuid, util, power, limit, clock, reasons, link)


def feed(watch: RunWatch, seconds: Iterable[float], *samples: GpuSample) -> RunWatch:
    for ts in seconds:
        watch.observe(1000.0 + ts, {s.uuid: s for s in samples})
    return watch


def codes(watch: RunWatch) -> list[str]:
    return [w.code for w in watch.warnings]


def test_two_gpus_spinning_at_low_power_past_the_window_are_a_stalled_job() -> None:
    watch = feed(RunWatch("r1", (A, B), POLICY), range(12), gpu(A), gpu(B))
    assert codes(watch) == [STALLED] and watch.stalled_now
    numbers = dict(watch.warnings[0].numbers)
    assert numbers["utilization_min_ratio"] == 1.0
    assert numbers["power_max_ratio"] == pytest.approx(80 / 700, abs=1e-3)
    assert numbers["power_max_w"] == 80.0 and numbers["power_limit_w"] == 700.0
    assert watch.warnings[0].held_s == 11.0 and watch.warnings[0].gpu is None


def test_the_same_load_at_working_power_is_nothing() -> None:
    watch = feed(RunWatch("r1", (A, B), POLICY), range(30), gpu(A, power=600), gpu(B, power=600))
    assert codes(watch) == [] and not watch.stalled_now


def test_a_run_that_ends_before_the_window_has_no_warning() -> None:
    watch = feed(RunWatch("r1", (A, B), POLICY), range(9), gpu(A), gpu(B))
    assert codes(watch) == [] and not watch.stalled_now


def test_a_stall_holds_on_utilization_and_power_alone_without_clocks_or_links() -> None:
    bare = {"clock": None, "reasons": None, "link": None}
    watch = feed(RunWatch("r1", (A, B), POLICY), range(12), gpu(A, **bare), gpu(B, **bare))
    assert codes(watch) == [STALLED]
    assert dict(watch.warnings[0].numbers)["link_max_kbps"] is None


def test_link_traffic_that_moves_is_no_stall() -> None:
    watch = RunWatch("r1", (A, B), POLICY)
    for ts in range(30):
        watch.observe(float(ts), {A: gpu(A, link=10_000.0 * (ts % 2)), B: gpu(B, link=0.0)})
    assert codes(watch) == []


def test_a_flat_link_still_stalls() -> None:
    watch = feed(RunWatch("r1", (A, B), POLICY), range(12), gpu(A, link=12.0),
                 gpu(B, link=20.0))
    assert codes(watch) == [STALLED]
    assert dict(watch.warnings[0].numbers)["link_max_kbps"] == 20.0


def test_one_busy_gpu_at_half_its_peers_power_is_a_straggler_of_unknown_cause() -> None:
    watch = feed(RunWatch("r1", (A, B), POLICY), range(22), gpu(A, power=600),
                 gpu(B, power=300))
    assert codes(watch) == [STRAGGLER]
    w = watch.warnings[0]
    numbers = dict(w.numbers)
    assert w.gpu == B and numbers["signal"] == "power" and numbers["cause"] == "unknown"
    assert numbers["ratio_max"] == pytest.approx(300 / 450, abs=1e-3)
    assert watch.stragglers_now() == {B: "unknown"}


@pytest.mark.parametrize(("reasons", "cause"), [
    (("hw_thermal_slowdown",), "thermal"), (("sw_power_cap",), "power_cap"),
    (("hw_power_brake_slowdown", "sw_thermal_slowdown"), "thermal"),
])
def test_a_straggler_names_the_cause_nvml_shows(reasons: tuple[str, ...], cause: str) -> None:
    watch = feed(RunWatch("r1", (A, B), POLICY), range(22), gpu(A, power=600),
                 gpu(B, power=600, clock=1200, reasons=reasons))
    assert codes(watch) == [STRAGGLER]
    numbers = dict(watch.warnings[0].numbers)
    assert numbers["signal"] == "sm_clock" and numbers["cause"] == cause


@pytest.mark.parametrize(("field", "cause"), [("pcie_degraded", "pcie"), ("ecc_pending", "ecc")])
def test_a_straggler_on_a_degraded_link_or_pending_remap_names_it(field: str,
                                                                  cause: str) -> None:
    slow = GpuSample(B, 1.0, 300.0, 700.0, 1980.0, (), None, **{field: True})
    watch = feed(RunWatch("r1", (A, B), POLICY), range(22), gpu(A, power=600), slow)
    assert dict(watch.warnings[0].numbers)["cause"] == cause


def test_idle_gpus_are_never_stragglers() -> None:
    watch = feed(RunWatch("r1", (A, B), POLICY), range(30), gpu(A, util=0.0, power=600),
                 gpu(B, util=0.0, power=60))
    assert codes(watch) == []


def test_a_one_gpu_run_has_no_median_to_straggle_behind() -> None:
    watch = feed(RunWatch("r1", (A,), POLICY), range(30), gpu(A, power=600))
    assert codes(watch) == []


def test_a_gpu_left_unread_restarts_the_hold() -> None:
    watch = RunWatch("r1", (A, B), POLICY)
    feed(watch, range(8), gpu(A), gpu(B))
    feed(watch, [8.0], gpu(A))  # B unread
    feed(watch, range(9, 17), gpu(A), gpu(B))
    assert codes(watch) == []


def test_a_stall_that_recovers_keeps_its_warning_and_is_no_longer_stalled_now() -> None:
    watch = feed(RunWatch("r1", (A, B), POLICY), range(12), gpu(A), gpu(B))
    feed(watch, [12.0], gpu(A, power=600), gpu(B, power=600))
    assert codes(watch) == [STALLED] and not watch.stalled_now


def test_warnings_go_into_the_job_record_and_come_back() -> None:
    watch = feed(RunWatch("r1", (A, B), POLICY), range(12), gpu(A), gpu(B))
    job = JobRecord(1, 2, ("sleep",), None, "h", 0.0, 1.0, 0, (A, B),
                    Attribution("none", "job_succeeded", (), ()), None,
                    warnings=tuple(watch.warnings))
    rec = job.record()
    assert rec["warnings"][0]["code"] == STALLED
    assert JobRecord.from_record(rec).warnings == job.warnings
    assert "warnings" not in JobRecord.from_record({**rec, "warnings": []}).record()


def test_a_malformed_warning_is_left_out_when_read_back() -> None:
    good = RunWarning(STALLED, None, 1.0, 2.0, "m", (("gpus", 2.0),)).record()
    assert [w.code for w in run_warnings([good, {"code": "other"}, "x", {"code": STALLED}])] \
        == [STALLED]
    assert run_warnings("nope") == ()


def test_a_sample_record_with_missing_readings_reads_as_none() -> None:
    s = GpuSample.from_record({"uuid": A, "utilization_ratio": 0.5, "power_w": True})
    assert s is not None and s.power_w is None and s.sm_clock_mhz is None
    assert s.power_ratio is None
    assert GpuSample.from_record({"utilization_ratio": 1}) is None


def test_every_job_watch_code_is_a_cataloged_run_warning_that_never_drains() -> None:
    from gpudiag.core.catalog import BLOCKERS, RUN_WARNINGS, WARNINGS, drains, entry

    assert set(CODES) == set(RUN_WARNINGS)
    for code in CODES:
        assert code not in BLOCKERS and code not in WARNINGS and not drains(code)
        assert entry(code).summary.endswith(".") and entry(code).remediation.endswith(".")


def test_the_jobs_table_sets_every_threshold_and_refuses_nonsense() -> None:
    from gpudiag.daemon.config import ConfigError, from_mapping

    cfg = from_mapping({"jobs": {"stall_after_s": 5, "stall_power_ratio": 0.3,
                                 "straggler_ratio": 0.9, "link_flat_kbps": 0}}).jobs
    assert (cfg.stall_after_s, cfg.stall_power_ratio, cfg.straggler_ratio,
            cfg.link_flat_kbps, cfg.straggler_after_s) == (5.0, 0.3, 0.9, 0.0, 300.0)
    for bad, key in (({"stall_power_ratio": 2}, "jobs.stall_power_ratio"),
                     ({"stall_after_s": -1}, "jobs.stall_after_s"),
                     ({"link_flat_kbps": "x"}, "jobs.link_flat_kbps"),
                     ({"stall_afer_s": 1}, "jobs.stall_afer_s")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            from_mapping({"jobs": bad})


def test_a_reloaded_jobs_table_is_named_as_waiting_for_a_restart() -> None:
    from gpudiag.daemon.config import from_mapping
    from gpudiag.daemon.reload import live_changes, restart_only_changes

    old, new = from_mapping({}), from_mapping({"jobs": {"stall_after_s": 30}})
    assert restart_only_changes(old, new) == ["jobs"] and live_changes(old, new) == []
