"""The attribution rules, one by one, over typed events (gpudiag.core.attribution)."""

from __future__ import annotations

import pytest

from gpudiag.core.attribution import (
    AFTER_END_S,
    RULES,
    SOFTWARE_CODES,
    Attribution,
    JobEvent,
    JobRecord,
    Rule,
    Source,
    Window,
    attribute,
    history_events,
    xid_event,
)
from gpudiag.core.xids import XIDS, xid_code

GPU = "GPU-f00d0000-0000-4000-8000-000000000000"
OTHER = "GPU-f00d0001-0000-4000-8000-000000000001"
WINDOW = Window(100.0, 110.0, frozenset({GPU}))
COVERED = (Source("run watcher", True),)

# One event that each rule, and only that rule and the ones after it, matches.
EXAMPLES: dict[str, JobEvent] = {
    "hardware_xid": xid_event(105.0, 79, GPU, "watcher"),
    "gpu_fault": JobEvent(105.0, "daemon", GPU, "gpu_lost", None, "GPU 0: NVML 15"),
    "ecc_uncorrectable": JobEvent(105.0, "daemon", GPU, "gpu_ecc_uncorrectable", None,
                                  "GPU 0: row remapping failed"),
    "backend_stopped": JobEvent(105.0, "daemon", None, "cuda_init_failed", None, "cuInit 999"),
    "application_xid": xid_event(105.0, 13, GPU, "watcher"),
}


def test_every_rule_has_an_example() -> None:
    assert [r.name for r in RULES] == list(EXAMPLES)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_each_rule_decides_with_its_event(rule: Rule) -> None:
    event = EXAMPLES[rule.name]
    got = attribute(1, WINDOW, [event], COVERED)
    assert (got.kind, got.rule, got.events) == (rule.kind, rule.name, (event,))


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_an_earlier_rule_wins_over_a_later_one(rule: Rule) -> None:
    later = [EXAMPLES[r.name] for r in RULES[RULES.index(rule):]]
    assert attribute(1, WINDOW, list(reversed(later)), COVERED).rule == rule.name


@pytest.mark.parametrize("xid", sorted(XIDS))
def test_every_catalog_xid_attributes_by_its_nvidia_action(xid: int) -> None:
    got = attribute(1, WINDOW, [xid_event(101.0, xid, GPU, "watcher")], COVERED)
    code = xid_code(xid)
    if code in ("gpu_lost", "gpu_reset_required", "node_reboot_required"):
        assert (got.kind, got.rule) == ("hardware", "hardware_xid")
    elif code == "gpu_xid_application":
        assert (got.kind, got.rule) == ("application", "application_xid")
    else:  # informational: no fault of anyone's
        assert (got.kind, got.rule) == ("application", "exit_without_gpu_event")


@pytest.mark.parametrize(("event", "why"), [
    (xid_event(99.0, 79, GPU, "watcher"), "before the run"),
    (xid_event(110.0 + AFTER_END_S + 0.1, 79, GPU, "watcher"), "after the run"),
    (xid_event(105.0, 79, OTHER, "watcher"), "another GPU"),
    (xid_event(105.0, 79, None, "watcher"), "an XID of no named GPU"),
    (JobEvent(105.0, "daemon", None, "gpu_lost", None, ""), "a GPU fault of no named GPU"),
])
def test_events_outside_the_jobs_window_or_gpus_decide_nothing(event: JobEvent,
                                                               why: str) -> None:
    got = attribute(1, WINDOW, [event], COVERED)
    assert (got.kind, got.events) == ("application", ()), why


def test_a_late_xid_within_the_grace_still_counts() -> None:
    late = xid_event(110.0 + AFTER_END_S / 2, 79, GPU, "daemon")
    assert attribute(1, WINDOW, [late], COVERED).kind == "hardware"


def test_node_wide_software_failures_count_for_every_job() -> None:
    assert all(attribute(1, WINDOW, [JobEvent(101.0, "daemon", None, code)], COVERED).kind
               == "software" for code in SOFTWARE_CODES)


def test_a_hardware_event_counts_even_when_the_job_exited_0() -> None:
    got = attribute(0, WINDOW, [EXAMPLES["hardware_xid"]], COVERED)
    assert (got.kind, got.rule) == ("hardware", "hardware_xid")


def test_a_clean_run_is_none() -> None:
    assert attribute(0, WINDOW, [], COVERED) == Attribution("none", "job_succeeded")


def test_a_failed_run_without_evidence_is_unknown_and_says_what_was_missing() -> None:
    sources = (Source("run watcher", False, "nvmlInit failed: Driver Not Loaded"),)
    got = attribute(1, WINDOW, [], sources)
    assert (got.kind, got.rule) == ("unknown", "evidence_missing")
    assert got.missing == ("run watcher: nvmlInit failed: Driver Not Loaded",)
    assert got.kv() == ("unknown rule=evidence_missing missing=run watcher: nvmlInit failed: "
                        "Driver Not Loaded")
    assert "neither a daemon's history nor a watcher" in attribute(1, WINDOW, [], ()).missing[0]


def test_missing_evidence_does_not_hide_a_hardware_event_another_source_saw() -> None:
    sources = (Source("run watcher", False, "ended during the run"),)
    assert attribute(1, WINDOW, [EXAMPLES["hardware_xid"]], sources).kind == "hardware"


def test_kv_names_the_xid_or_the_code_and_the_gpu() -> None:
    assert (attribute(1, WINDOW, [EXAMPLES["hardware_xid"]], COVERED).kv()
            == f"hardware rule=hardware_xid xid=79 gpu={GPU}")
    assert (attribute(1, WINDOW, [EXAMPLES["backend_stopped"]], COVERED).kv()
            == "software rule=backend_stopped code=cuda_init_failed")


def test_records_read_back() -> None:
    got = attribute(1, WINDOW, [EXAMPLES["hardware_xid"], EXAMPLES["gpu_fault"]], COVERED)
    assert Attribution.from_record(got.record()) == got
    job = JobRecord(10, 11, ("sleep", "3"), "42", "node1", 100.0, 110.0, 1, (GPU,), got,
                    "/runs/1/closeout.json")
    assert JobRecord.from_record(job.record()) == job
    assert job.window == WINDOW
    with pytest.raises(ValueError, match="gpudiag.job/1"):
        JobRecord.from_record({"schema": "other"})
    assert Attribution.from_record({"kind": "cosmic rays"}) is None


def test_history_answers_become_events() -> None:
    history = {
        "xids": [{"ts": 101.0, "xid": 79, "gpu_index": 0, "uuid": GPU}, "junk",
                 {"ts": "x", "xid": 1}],
        "episodes": [{"code": "gpu_ecc_uncorrectable", "device": GPU, "started": 102.0,
                      "message": "m"},
                     {"code": "cuda_init_failed", "device": None, "started": 103.0},
                     {"code": "gpu_lost", "device": "index 3", "started": 104.0}, 7],
    }
    events = history_events(history)
    assert events is not None
    assert [(e.ts, e.gpu, e.code, e.xid) for e in events] == [
        (101.0, GPU, "gpu_lost", 79), (102.0, GPU, "gpu_ecc_uncorrectable", None),
        (103.0, None, "cuda_init_failed", None), (104.0, None, "gpu_lost", None)]
    assert history_events({"verdicts": []}) is None  # an older daemon: no XID timeline
