"""Remediation's policy, config, Slurm parsing and actor, without a cluster (milliseconds).

tests/test_remediation_slurm.py runs the same rails against a real slurmctld + slurmd.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gpudiag.core.catalog import BLOCKERS, DRAINS, drains
from gpudiag.core.remediation import (
    MAX_REASON_CHARS,
    Decision,
    Facts,
    Fault,
    Fleet,
    Memory,
    NodeView,
    Rails,
    Tally,
    cleared,
    decide,
    own_reason,
    parse_killswitch,
    parse_own,
    released,
    remember,
)
from gpudiag.daemon.config import ConfigError, RemediationConfig, from_mapping
from gpudiag.daemon.remediation import Remediator
from gpudiag.daemon.slurmctl import SlurmControl, SlurmError, parse_fleet, parse_show_node

GPU = "GPU-f00d0000-0000-4000-8000-000000000000"
IDLE = NodeView("IDLE", "")
ROOM = Fleet(nodes=1, recent_own=0)
ACT = Rails(mode="act")


def facts(*faults: Fault, node: NodeView | None = IDLE, fleet: Fleet | None = ROOM,
          now: float = 1000.0, since: float | None = 900.0) -> Facts:
    return Facts(now, tuple(faults), since, node, fleet)


def lost(at: float = 950.0, uuid: str | None = GPU, code: str = "gpu_lost") -> Fault:
    return Fault(code, uuid, at)


# --- the catalog column ---------------------------------------------------------------

@pytest.mark.parametrize("code", sorted(BLOCKERS))
def test_only_hardware_faults_of_a_gpu_or_the_node_drain(code: str) -> None:
    row = BLOCKERS[code]
    assert row.drains == (code in DRAINS) == drains(code)
    if row.drains:
        assert row.layer == "device"
    # Never busy, unproven, software, configuration, visibility or a runtime's backend.
    if row.layer in ("probe", "visibility", "driver", "cuda", "jax", "iree", "requirement",
                     "admission") or code in ("gpu_underperforming",
                                              "gpu_memory_held_without_process"):
        assert not row.drains
        assert decide(facts(lost(code=code)), Memory(), ACT).action == "none"


def test_warnings_and_unknown_codes_never_drain() -> None:
    assert not drains("gpu_xid_application") and not drains("no_such_code")


# --- reasons ---------------------------------------------------------------------------

@pytest.mark.parametrize("code", sorted(DRAINS))
@pytest.mark.parametrize("klass", ["node", "inspect"])
def test_owned_reasons_name_class_code_and_gpu_within_the_length(code: str, klass: str) -> None:
    reason = own_reason(klass, code, GPU)
    assert reason == f"gpudiag:{klass}:{code}:GPU-f00d0000"
    assert len(reason) <= MAX_REASON_CHARS
    assert parse_own(reason) == (klass, code, "GPU-f00d0000")
    assert own_reason(klass, code, None).endswith(":node")


def test_a_long_code_is_cut_to_fit_the_reason() -> None:
    reason = own_reason("inspect", "x" * 100, GPU)
    assert len(reason) == MAX_REASON_CHARS and reason.endswith(":GPU-f00d0000")


# --- decisions -------------------------------------------------------------------------

def test_a_fault_on_an_idle_node_drains_with_an_owned_reason() -> None:
    d = decide(facts(lost()), Memory(), ACT)
    assert (d.action, d.mode, d.outcome, d.reason) == (
        "drain", "act", "ok", "gpudiag:node:gpu_lost:GPU-f00d0000")
    assert d.acts


def test_observe_mode_says_and_counts_but_never_acts() -> None:
    d = decide(facts(lost()), Memory(), Rails(mode="observe"))
    assert (d.action, d.mode, d.outcome, d.acts) == ("drain", "observe", "observed", False)
    after = remember(Memory(), d, facts(lost()))
    assert after.drain is not None and after.drain.observed and after.attempts == {}
    # One would-be action per incident.
    assert decide(facts(lost(960.0)), after, Rails(mode="observe")).outcome == "held"


@pytest.mark.parametrize("switch", ["gpu_lost", "all"])
def test_the_killswitch_turns_a_code_into_observe(switch: str) -> None:
    rails = replace(ACT, killswitch=parse_killswitch(f"# paused\n {switch.upper()} \n\n"))
    d = decide(facts(lost()), Memory(), rails)
    assert (d.mode, d.outcome, d.acts) == ("observe", "killswitch", False)
    other = decide(facts(lost(code="gpu_reset_required")), Memory(), rails)
    assert other.acts == (switch != "all")


def test_the_killswitch_gone_with_the_fault_still_there_acts() -> None:
    rails = replace(ACT, killswitch=frozenset({"gpu_lost"}))
    observed = remember(Memory(), decide(facts(lost()), Memory(), rails), facts(lost()))
    assert decide(facts(lost()), observed, ACT).acts


def test_one_action_per_incident_whatever_else_comes() -> None:
    d = decide(facts(lost()), Memory(), ACT)
    mem = remember(Memory(), d, facts(lost()))
    node = NodeView("IDLE+DRAIN", d.reason)
    storm = [lost(960.0 + i, code=c) for i, c in enumerate(["gpu_lost", "gpu_reset_required",
                                                            "node_reboot_required"] * 5)]
    assert decide(facts(*storm, node=node), mem, ACT).outcome == "held"


@pytest.mark.parametrize("reason", ["ops: PSU swap", "Not responding", "Prolog error"])
def test_an_operators_drain_is_never_touched_nor_stacked_onto(reason: str) -> None:
    d = decide(facts(lost(), node=NodeView("IDLE+DRAIN", reason)), Memory(), ACT)
    assert (d.action, d.outcome, d.acts) == ("drain", "operator", False)


def test_the_slurm_scripts_gpudiag_drain_is_left_alone() -> None:
    d = decide(facts(lost(), node=NodeView("IDLE+DRAIN", "gpudiag: gpu_lost")), Memory(), ACT)
    assert (d.outcome, d.acts) == ("already", False)


def _drained(at: float = 950.0) -> tuple[Memory, str]:
    d = decide(facts(lost(at)), Memory(), ACT)
    return remember(Memory(), d, facts(lost(at), now=at + 1)), d.reason


def test_resume_only_after_a_clear_and_a_fresh_pass() -> None:
    mem, reason = _drained()
    node = NodeView("IDLE+DRAIN", reason)
    # Fault gone from the verdict (the clear released the XID) but no fresh pass yet.
    mem = cleared(mem, GPU, 1000.0)
    assert decide(facts(node=node, since=990.0, now=1001.0), mem, ACT).outcome == "held"
    d = decide(facts(node=node, since=1000.5, now=1002.0), mem, ACT)
    assert (d.action, d.acts) == ("resume", True)
    assert remember(mem, d, facts()).drain is None


def test_the_hold_expiring_releases_the_incident() -> None:
    mem, reason = _drained()
    node = NodeView("IDLE+DRAIN", reason)
    later = released(mem, facts(node=node, now=5000.0, since=4000.0))
    assert later.released_wall == 5000.0
    assert decide(facts(node=node, now=5001.0, since=4000.0), later, ACT).action == "none"
    assert decide(facts(node=node, now=5010.0, since=5005.0), later, ACT).acts


def test_a_resume_is_never_refused_by_the_fleet_guard() -> None:
    mem, reason = _drained()
    mem = cleared(mem, None, 1000.0)
    full = Fleet(nodes=10, recent_own=10)
    d = decide(facts(node=NodeView("IDLE+DRAIN", reason), fleet=full, since=1001.0), mem, ACT)
    assert d.action == "resume" and d.acts


def test_evidence_at_or_before_a_clear_never_drains_again() -> None:
    mem = cleared(Memory(), GPU, 1000.0)
    assert decide(facts(lost(1000.0), now=1100.0), mem, ACT).outcome == "healthy"
    assert decide(facts(lost(999.0), now=1100.0), cleared(Memory(), None, 1000.0),
                  ACT).outcome == "healthy"
    assert decide(facts(lost(1000.1), now=1100.0), mem, ACT).acts  # a new fault does


def test_an_operator_resuming_gpudiags_drain_sets_a_boundary() -> None:
    mem, _reason = _drained()
    d = decide(facts(lost(), node=IDLE, now=1100.0), mem, ACT)
    assert d.outcome == "undone"
    after = remember(mem, d, facts(now=1100.0))
    assert after.drain is None and after.boundary(GPU) == 1100.0
    assert decide(facts(lost(), now=1200.0), after, ACT).outcome == "healthy"


def test_past_the_attempt_cap_the_drain_says_a_person_is_needed_and_is_not_resumed() -> None:
    mem = Memory(attempts={GPU: (100.0, 500.0)})
    d = decide(facts(lost()), mem, ACT)
    assert d.needs_person and d.reason == "gpudiag:inspect:gpu_lost:GPU-f00d0000" and d.acts
    mem = cleared(remember(mem, d, facts(lost())), GPU, 1000.0)
    again = decide(facts(node=NodeView("IDLE+DRAIN", d.reason), since=1001.0), mem, ACT)
    assert (again.action, again.outcome) == ("none", "needs_person")


def test_attempts_outside_the_window_do_not_count() -> None:
    mem = Memory(attempts={GPU: (1.0, 2.0)})
    assert not decide(facts(lost(), now=1e6), mem, ACT).needs_person


@pytest.mark.parametrize(("nodes", "recent", "refused"), [
    (1, 0, False), (1, 1, False), (1, 2, True), (20, 1, False), (20, 2, True),
    (100, 9, False), (100, 10, True), (1000, 99, False), (1000, 100, True)])
def test_the_fleet_guard_refuses_beyond_max_2_nodes_or_10_percent(
        nodes: int, recent: int, refused: bool) -> None:
    d = decide(facts(lost(), fleet=Fleet(nodes, recent)), Memory(), ACT)
    assert (d.outcome == "refused") == refused and d.acts != refused


def test_an_unknown_fleet_refuses_the_drain() -> None:
    assert decide(facts(lost(), fleet=None), Memory(), ACT).outcome == "refused"


def test_memory_survives_its_record() -> None:
    mem, _ = _drained()
    mem = cleared(mem, GPU, 1000.0)
    assert Memory.from_record(json.loads(json.dumps(mem.record()))) == mem


def _resumed(mem: Memory, reason: str, released_at: float) -> Memory:
    d = decide(facts(node=NodeView("IDLE+DRAIN", reason), since=released_at + 1,
                     now=released_at + 2), mem, ACT)
    assert d.action == "resume" and d.acts
    return remember(mem, d, facts(now=released_at + 2))


@pytest.mark.parametrize(("by_person", "field"), [
    (True, "recovered_after_clear"), (False, "recovered_unattended")])
def test_a_resume_counts_who_released_the_incident(by_person: bool, field: str) -> None:
    mem, reason = _drained()
    assert (mem.tally.incidents, mem.tally.needs_person) == (1, 0)
    after = _resumed(cleared(mem, GPU, 1000.0, by_person=by_person), reason, 1000.0)
    assert getattr(after.tally, field) == 1 and after.tally.incidents == 1
    assert after.tally.recovered_after_clear + after.tally.recovered_unattended == 1


def test_a_hold_that_expired_is_a_recovery_with_no_person() -> None:
    mem, reason = _drained()
    expired = released(mem, facts(node=NodeView("IDLE+DRAIN", reason), now=5000.0,
                                  since=4000.0))
    assert not expired.released_by_person
    assert _resumed(expired, reason, 5000.0).tally.recovered_unattended == 1


def test_needs_person_is_counted_per_100_incidents_and_kept_in_the_record() -> None:
    mem = Memory(attempts={GPU: (100.0, 500.0)})
    d = decide(facts(lost()), mem, ACT)
    mem = remember(mem, d, facts(lost()))
    assert (mem.tally.incidents, mem.tally.needs_person) == (1, 1)
    assert mem.tally.needs_person_per_100 == 100.0
    assert Memory.from_record(json.loads(json.dumps(mem.record()))) == mem
    old = {k: v for k, v in mem.record().items() if k not in ("tally", "released_by_person")}
    assert Memory.from_record(old).tally == Tally()  # a file from before the tally


# --- Slurm's texts ---------------------------------------------------------------------

SHOW_NODE = """NodeName=gpu-1 Arch=x86_64 CoresPerSocket=1
   Gres=gpu:2
   State=IDLE+DRAIN ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A
   Partitions=debug,gpu
   Reason=gpudiag:node:gpu_lost:GPU-f00d0000 [root@2026-12-02T03:50:00]
"""


def test_show_node_is_read_once_into_state_reason_and_partitions() -> None:
    info = parse_show_node(SHOW_NODE)
    assert info.view == NodeView("IDLE+DRAIN", "gpudiag:node:gpu_lost:GPU-f00d0000")
    assert info.partitions == ("debug", "gpu") and info.view.drained
    assert parse_show_node("NodeName=x\n   State=IDLE ThreadsPerCore=1\n").view.reason == ""
    with pytest.raises(SlurmError):
        parse_show_node("garbage")


def test_the_fleet_counts_other_nodes_gpudiag_drained_within_the_window() -> None:
    now = time.time()
    recent = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(now - 60))
    old = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(now - 3600))
    text = "\n".join([f"me|{recent}|gpudiag:node:gpu_lost:GPU-1", f"a|{recent}|gpudiag: x",
                      f"b|{old}|gpudiag:node:gpu_lost:GPU-2", f"c|{recent}|ops: PSU",
                      "d|Unknown|none", f"a|{recent}|gpudiag: x"])
    assert parse_fleet(text, node="me", now_wall=now, window_s=600) == Fleet(5, 1)


# --- config ----------------------------------------------------------------------------

def test_remediation_is_off_by_default() -> None:
    assert from_mapping({}).remediation == RemediationConfig()
    assert RemediationConfig().mode == "off"


@pytest.mark.parametrize(("table", "message"), [
    ({"mode": "yes"}, "mode"), ({"scontrol": "scontrol"}, "absolute path"),
    ({"sinfo": "bin/sinfo"}, "absolute path"), ({"node_name": "a b"}, "Slurm node name"),
    ({"node_name": "n1,n2"}, "node_name = 'n1,n2': expected one Slurm node name"),
    ({"node_name": "n[1-4]"}, "no list or host range"),
    ({"fleet_ratio": 2}, "share"), ({"max_attempts_per_gpu": 0}, "number of drains"),
    ({"scheduler": "kubernetes"}, "scheduler"), ({"nodename": "x"}, "unknown key")])
def test_bad_remediation_keys_are_refused_with_the_key_named(table: dict[str, object],
                                                             message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        from_mapping({"remediation": table})


# --- the actor, on a stand-in Slurm -----------------------------------------------------

class StandinSlurm:
    """A runner for SlurmControl that keeps one node's state and records every argv."""

    def __init__(self) -> None:
        self.state, self.reason = "IDLE", ""
        self.calls: list[list[str]] = []
        self.fail: str | None = None

    def __call__(self, argv: Sequence[str], env: dict[str, str], timeout_s: float
                 ) -> tuple[int, str, str]:
        self.calls.append(list(argv[1:]))
        assert env["PATH"] == "/usr/sbin:/usr/bin:/sbin:/bin" and "LD_PRELOAD" not in env
        if self.fail == "timeout":
            raise SlurmError("timeout", f"{argv[0]} did not answer")
        if self.fail:
            return 1, "", "Unable to contact slurm controller\n  connect failure\n"
        if argv[1:3] == ["show", "node"]:
            reason = f"   Reason={self.reason} [root@now]\n" if self.reason else ""
            return 0, f"NodeName=n1\n   State={self.state} X=1\n   Partitions=p\n{reason}", ""
        if argv[1] == "update":
            fields = dict(a.split("=", 1) for a in argv[2:])
            if fields["state"] == "drain":
                self.state, self.reason = "IDLE+DRAIN", fields["reason"]
            else:
                self.state, self.reason = "IDLE", ""
            return 0, "", ""
        return 0, "n1|Unknown|none\n", ""  # sinfo

    def updates(self) -> list[list[str]]:
        return [c for c in self.calls if c[0] == "update"]


def actor(tmp_path: Path, slurm: StandinSlurm, **cfg: Any) -> Remediator:
    config = replace(RemediationConfig(mode="act", node_name="n1",
                                       killswitch_file=str(tmp_path / "kill")), **cfg)
    control = SlurmControl(scontrol="/usr/bin/scontrol", sinfo="/usr/bin/sinfo", node="n1",
                           slurm_conf=None, timeout_s=1.0, runner=slurm)
    return Remediator(config, tmp_path, control)


@pytest.fixture
def one_fault(monkeypatch: pytest.MonkeyPatch) -> None:
    import gpudiag.daemon.remediation as mod

    now = time.time()
    monkeypatch.setattr(mod, "snapshot_faults",
                        lambda snap, drain_on_nic=False: ((lost(now - 1),), now - 10))


def test_the_actor_drains_once_and_keeps_it_across_a_restart(tmp_path: Path,
                                                             one_fault: None) -> None:
    slurm = StandinSlurm()
    r = actor(tmp_path, slurm)
    r.offer(object())  # type: ignore[arg-type]
    d = r.cycle()
    assert isinstance(d, Decision) and d.acts
    assert slurm.updates() == [["update", "nodename=n1", "state=drain",
                                "reason=gpudiag:node:gpu_lost:GPU-f00d0000"]]
    assert r.report().actions == {("drain", "act", "gpu_lost", "ok"): 1}
    again = actor(tmp_path, slurm)  # a restart: the state dir remembers the drain
    again.offer(object())  # type: ignore[arg-type]
    again.cycle()
    assert len(slurm.updates()) == 1 and again.report().drain is not None


@pytest.mark.parametrize("fail", ["exit", "timeout"])
def test_scontrol_failing_is_counted_and_backed_off(tmp_path: Path, one_fault: None,
                                                    fail: str) -> None:
    slurm = StandinSlurm()
    slurm.fail = fail
    r = actor(tmp_path, slurm)
    r.offer(object())  # type: ignore[arg-type]
    assert r.cycle() is None
    assert r.cycle() is None  # backing off: Slurm is not asked again at once
    assert len(slurm.calls) == 1
    report = r.report()
    assert report.last_error and sum(report.command_failures.values()) == 1
    assert report.evidence()["scontrol_healthy"] is False


def test_scontrol_s_many_line_error_is_one_log_line_saying_what_would_be_done(
        tmp_path: Path, one_fault: None, caplog: pytest.LogCaptureFixture) -> None:
    slurm = StandinSlurm()
    slurm.fail = "exit"
    r = actor(tmp_path, slurm, mode="observe")
    r.offer(object())  # type: ignore[arg-type]
    with caplog.at_level("WARNING", logger="gpudiag.daemon.remediation"):
        assert r.cycle() is None
    (record,) = [rec for rec in caplog.records if "failed" in rec.getMessage()]
    text = record.getMessage()
    assert "\n" not in text and "Unable to contact slurm controller; connect failure" in text
    assert "once Slurm answers: would drain" in text and "gpu_lost" in text, text


def test_an_unreadable_killswitch_fails_safe_into_observe(tmp_path: Path,
                                                          one_fault: None) -> None:
    (tmp_path / "kill").mkdir()  # not a regular file
    slurm = StandinSlurm()
    r = actor(tmp_path, slurm)
    r.offer(object())  # type: ignore[arg-type]
    d = r.cycle()
    assert d is not None and d.outcome == "killswitch" and slurm.updates() == []


def test_an_executable_others_can_write_is_refused(tmp_path: Path) -> None:
    from gpudiag.daemon.slurmctl import check_executable

    exe = tmp_path / "scontrol"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert check_executable(str(exe)) is None
    exe.chmod(0o775)
    assert "writable by its group" in (check_executable(str(exe)) or "")
    exe.chmod(0o644)
    assert "not an executable" in (check_executable(str(exe)) or "")
    assert check_executable(str(tmp_path / "none")) is not None


def test_a_clear_that_did_not_repair_is_taken_back_by_newer_evidence() -> None:
    mem, reason = _drained()
    mem = cleared(mem, GPU, 1000.0)
    node = NodeView("IDLE+DRAIN", reason)
    still = released(mem, facts(lost(1005.0), node=node, now=1006.0, since=1001.0))
    assert still.released_wall is None
    assert decide(facts(node=node, now=1010.0, since=1008.0), still, ACT).outcome == "held"


def test_the_metrics_render_every_family_and_pass_promtool(tmp_path: Path,
                                                           one_fault: None) -> None:
    import shutil
    import subprocess

    from prometheus_client import CollectorRegistry, generate_latest

    from gpudiag.daemon.remediation_exporter import RemediationCollector

    slurm = StandinSlurm()
    r = actor(tmp_path, slurm)
    r.offer(object())  # type: ignore[arg-type]
    r.cycle()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RemediationCollector(r.report))
    text = generate_latest(registry).decode()
    assert ('gpudiag_remediation_actions_total{action="drain",code="gpu_lost",mode="act",'
            'outcome="ok"} 1.0') in text
    assert "gpudiag_remediation_latency_seconds_count 1.0" in text
    assert "gpudiag_remediation_drained 1.0" in text
    assert 'gpudiag_remediation_mode{mode="act"} 1.0' in text
    promtool = shutil.which("promtool")
    if promtool is not None:
        proc = subprocess.run([promtool, "check", "metrics"], input=text, text=True,
                              capture_output=True, timeout=30, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(("rails", "outcome"), [
    (Rails(mode="observe"), "observed"),
    (Rails(mode="act", killswitch=frozenset({"gpu_lost"})), "killswitch")])
def test_observe_and_the_killswitch_hold_a_resume_of_gpudiags_drain_back(
        rails: Rails, outcome: str) -> None:
    mem, reason = _drained()
    mem = cleared(mem, GPU, 1000.0)
    f = facts(node=NodeView("IDLE+DRAIN", reason), since=1001.0, now=1002.0)
    d = decide(f, mem, rails)
    assert (d.action, d.outcome, d.acts) == ("resume", outcome, False)
    assert remember(mem, d, f).drain == mem.drain  # still gpudiag's, resumed later


def test_check_config_with_a_slurm_that_cannot_be_reached_exits_2_naming_it(
        tmp_path: Path) -> None:
    import subprocess
    import sys

    scontrol = tmp_path / "scontrol"
    scontrol.write_text("#!/bin/sh\n"
                        "echo 'slurm_load_node error: Unable to contact slurm controller' >&2\n"
                        "echo '  (connect failure)' >&2\n"
                        "echo 'scontrol: error: Connection refused' >&2\n"
                        "echo 'scontrol: error: cannot reach slurmctld' >&2\nexit 1\n")
    scontrol.chmod(0o755)
    config = tmp_path / "gpudiag.toml"
    config.write_text(f'[remediation]\nmode = "observe"\nscontrol = "{scontrol}"\n'
                      f'sinfo = "{scontrol}"\nnode_name = "n1"\n')
    proc = subprocess.run([sys.executable, "-m", "gpudiag", "serve", "--config", str(config),
                           "--check-config"], capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (said,) = [line for line in proc.stdout.splitlines() if line.startswith("# remediation:")]
    assert "cannot ask Slurm about node 'n1'" in said
    assert "Unable to contact slurm controller; (connect failure); scontrol: error" in said
