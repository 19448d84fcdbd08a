"""Slurm Prolog and HealthCheckProgram: a stand-in scontrol records every call and keeps a
node's state; `gpudiag preflight` is the real one, on the fake driver."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.build import write_state_file
from tests.test_grafana import start_daemon

ROOT = Path(__file__).resolve().parent.parent
SLURM = ROOT / "deploy" / "slurm"
PROLOG = SLURM / "gpudiag-prolog.sh"
HEALTHCHECK = SLURM / "gpudiag-healthcheck.sh"
NODE = "gpu-node-1"
# Slurm kills a Prolog or health check at 60 s; these must end well inside it.
SLURM_LIMIT_S = 60.0

# A stand-in for scontrol: appends its argv to $SCONTROL_LOG (JSON lines) and keeps one
# node's State/Reason/Gres and the jobs' fields in $SCONTROL_STATE, printing `show node` in
# the layout of Slurm 22.05.
STANDIN = r'''
import json, os, sys, time
state_path, log_path = os.environ["SCONTROL_STATE"], os.environ["SCONTROL_LOG"]
args = sys.argv[1:]
with open(log_path, "a") as fh:
    fh.write(json.dumps(args) + "\n")
with open(state_path) as fh:
    st = json.load(fh)
if args[:2] == ["show", "node"]:
    reason = st["reason"]
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    print(f"NodeName={args[2]} Arch=x86_64 CoresPerSocket=1 \n"
          f"   CPUAlloc=0 CPUEfctv=2 CPUTot=2 CPULoad=0.05\n"
          f"   AvailableFeatures=(null)\n   ActiveFeatures=(null)\n"
          f"   Gres={st['gres']}\n"
          f"   NodeAddr=127.0.0.1 NodeHostName={args[2]} Version=22.05.8\n"
          f"   RealMemory=1 AllocMem=0 FreeMem=1000 Sockets=2 Boards=1\n"
          f"   State={st['state']} ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A\n"
          f"   Partitions=debug \n"
          f"   CfgTRES=cpu=2,mem=1M,billing=2\n   AllocTRES=\n   CapWatts=n/a\n"
          f"   CurrentWatts=0 AveWatts=0\n"
          + (f"   Reason={reason} [root@{stamp}]\n" if reason else ""))
elif args and args[0] == "update":
    fields = dict(a.split("=", 1) for a in args[1:])
    if "NodeName" in fields:
        if fields.get("State") == "DRAIN":
            st["state"], st["reason"] = "IDLE+DRAIN", fields["Reason"]
        elif fields.get("State") == "RESUME":
            st["state"], st["reason"] = "IDLE", ""
    elif "JobId" in fields:
        job = st["jobs"].setdefault(fields.pop("JobId"), {})
        job.update(fields)
    with open(state_path, "w") as fh:
        json.dump(st, fh)
else:
    print(f"scontrol stand-in: unsupported {args}", file=sys.stderr)
    sys.exit(1)
'''


@dataclass
class Outcome:
    """One script run: exit code, scontrol calls, resulting node and job state."""

    returncode: int
    calls: list[list[str]]
    state: dict[str, Any]
    stderr: str
    duration_s: float

    @property
    def updates(self) -> list[list[str]]:
        return [c for c in self.calls if c[:1] == ["update"]]


@dataclass
class SlurmNode:
    """The stand-in scontrol's files and a runner for the two scripts."""

    folder: Path
    make_env: Callable[..., dict[str, str]]

    def set(self, state: str = "IDLE", reason: str = "", gres: str = "gpu:8") -> None:
        (self.folder / "state.json").write_text(json.dumps(
            {"state": state, "reason": reason, "gres": gres, "jobs": {}}))
        (self.folder / "calls.jsonl").write_text("")

    def run(self, script: Path, knobs: Mapping[str, str] | None = None,
            extra: Mapping[str, str] | None = None) -> Outcome:
        env = self.make_env(**dict(knobs or {}))
        env.update({
            "SCONTROL": str(self.folder / "scontrol"),
            "SCONTROL_STATE": str(self.folder / "state.json"),
            "SCONTROL_LOG": str(self.folder / "calls.jsonl"),
            "GPUDIAG": str(Path(sys.executable).with_name("gpudiag")),
            "GPUDIAG_DEFAULTS": "/dev/null",
            # No daemon listens here: preflight falls back to probing inline.
            "GPUDIAG_DAEMON_URL": f"http://127.0.0.1:{closed_port()}",
            "SLURMD_NODENAME": NODE,
        })
        env.update(extra or {})
        (self.folder / "calls.jsonl").write_text("")
        start = time.monotonic()
        proc = subprocess.run([str(script)], env=env, capture_output=True, text=True,
                              timeout=SLURM_LIMIT_S, check=False)
        duration = time.monotonic() - start
        calls = [json.loads(line) for line in
                 (self.folder / "calls.jsonl").read_text().splitlines()]
        state = json.loads((self.folder / "state.json").read_text())
        return Outcome(proc.returncode, calls, state, proc.stderr, duration)


def closed_port() -> int:
    """A loopback port nobody listens on (bound then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def node(tmp_path: Path, gpu_env: Callable[..., dict[str, str]]) -> SlurmNode:
    folder = tmp_path / "slurm"
    folder.mkdir()
    standin = folder / "scontrol"
    standin.write_text(f"#!{sys.executable}\n{STANDIN}")
    standin.chmod(0o755)
    n = SlurmNode(folder, gpu_env)
    n.set()
    return n


def drain_calls(out: Outcome) -> list[list[str]]:
    return [c for c in out.updates if "State=DRAIN" in c]


def resume_calls(out: Outcome) -> list[list[str]]:
    return [c for c in out.updates if "State=RESUME" in c]


# --- HealthCheckProgram -------------------------------------------------------------------

def test_healthcheck_drains_a_blocked_node_with_the_code(node: SlurmNode) -> None:
    out = node.run(HEALTHCHECK, {"FAKE_CUDA_INIT_ERROR": "999"})
    assert out.returncode == 0, out.stderr
    assert drain_calls(out) == [["update", f"NodeName={NODE}", "State=DRAIN",
                                 "Reason=gpudiag: cuda_init_failed"]]
    assert out.state["state"] == "IDLE+DRAIN"
    assert out.duration_s < SLURM_LIMIT_S / 2


def test_healthcheck_blocked_then_recovered_undrains_its_own_drain(node: SlurmNode) -> None:
    blocked = node.run(HEALTHCHECK, {"FAKE_NVML_DEVICE_ERRORS": "3:15"})
    assert blocked.state["reason"] == "gpudiag: gpu_lost"
    # Still blocked the same way: no second drain call (no reason timestamp churn).
    again = node.run(HEALTHCHECK, {"FAKE_NVML_DEVICE_ERRORS": "3:15"})
    assert drain_calls(again) == [], (again.calls, again.stderr)
    recovered = node.run(HEALTHCHECK)
    assert recovered.returncode == 0, recovered.stderr
    assert resume_calls(recovered) == [["update", f"NodeName={NODE}", "State=RESUME"]]
    assert recovered.state == {**recovered.state, "state": "IDLE", "reason": ""}


def test_healthcheck_updates_its_own_drain_when_the_code_changes(node: SlurmNode) -> None:
    node.set(state="IDLE+DRAIN", reason="gpudiag: cuda_init_failed")
    out = node.run(HEALTHCHECK, {"FAKE_NVML_DEVICE_ERRORS": "0:15"})
    assert out.state["reason"] == "gpudiag: gpu_lost"


@pytest.mark.parametrize("knobs", [{}, {"FAKE_CUDA_INIT_ERROR": "999"}],
                         ids=["ready", "blocked"])
def test_healthcheck_leaves_another_reasons_drain_alone(node: SlurmNode,
                                                        knobs: dict[str, str]) -> None:
    node.set(state="IDLE+DRAIN", reason="replacing PSU (ops ticket 4711)")
    out = node.run(HEALTHCHECK, knobs)
    assert out.returncode == 0, out.stderr
    assert out.updates == []
    assert out.state["reason"] == "replacing PSU (ops ticket 4711)"
    assert out.state["state"] == "IDLE+DRAIN"


def test_healthcheck_changes_nothing_when_gpudiag_itself_fails(node: SlurmNode) -> None:
    node.set(state="IDLE+DRAIN", reason="gpudiag: cuda_init_failed")
    # A bad requirement is a usage error (exit 2): unknown, not recovered.
    out = node.run(HEALTHCHECK, extra={"GPUDIAG_HEALTH_REQUIRE": "nonsense"})
    assert out.returncode == 0
    assert out.updates == []
    assert "preflight exit 2" in out.stderr


def test_healthcheck_skips_nodes_without_gpu_gres(node: SlurmNode) -> None:
    node.set(gres="(null)")
    out = node.run(HEALTHCHECK, {"FAKE_CUDA_INIT_ERROR": "999"})
    assert out.calls == [["show", "node", NODE]]


def test_healthcheck_on_a_hung_driver_drains_within_the_slurm_limit(node: SlurmNode) -> None:
    out = node.run(HEALTHCHECK, {"FAKE_CUDA_INIT_HANG": "1"},
                   extra={"GPUDIAG_PROBE_TIMEOUT_S": "2"})
    assert out.state["reason"] == "gpudiag: probe_timeout"
    assert out.duration_s < SLURM_LIMIT_S / 2


# --- Prolog -------------------------------------------------------------------------------

def job_env(gpus: str, job: str = "4242") -> dict[str, str]:
    # What slurmd gives a Prolog of a --gres=gpu job (CUDA_VISIBLE_DEVICES too, which the
    # Prolog must not let narrow the node-wide indices a second time).
    return {"SLURM_JOB_ID": job, "SLURM_JOB_GPUS": gpus, "CUDA_VISIBLE_DEVICES": gpus}


def test_prolog_admits_a_ready_job_and_records_the_verdict(node: SlurmNode) -> None:
    out = node.run(PROLOG, extra=job_env("2,5"))
    assert out.returncode == 0, out.stderr
    comment = out.state["jobs"]["4242"]["AdminComment"]
    assert comment.startswith("gpudiag: none ready=true gpus=2,5 checked_at=")
    assert "source=inline" in comment
    assert drain_calls(out) == []


def test_prolog_refuses_a_job_whose_gpu_is_blocked(node: SlurmNode) -> None:
    out = node.run(PROLOG, {"FAKE_NVML_DEVICE_ERRORS": "5:15"}, extra=job_env("2,5"))
    assert out.returncode == 1
    comment = out.state["jobs"]["4242"]["AdminComment"]
    assert comment.startswith("gpudiag: gpu_lost ready=false gpus=2,5")
    assert "blockers=gpu_lost" in comment
    # Drained with gpudiag's own reason (Slurm keeps it instead of "Prolog error").
    assert out.state["reason"] == "gpudiag: gpu_lost"
    assert out.duration_s < SLURM_LIMIT_S / 2


def test_prolog_admits_a_job_on_the_node_s_healthy_gpus(node: SlurmNode) -> None:
    out = node.run(PROLOG, {"FAKE_NVML_DEVICE_ERRORS": "5:15"}, extra=job_env("1"))
    assert out.returncode == 0, out.stderr
    assert out.state["jobs"]["4242"]["AdminComment"].startswith("gpudiag: none")


def test_prolog_does_nothing_for_a_job_without_gpus(node: SlurmNode) -> None:
    out = node.run(PROLOG, {"FAKE_CUDA_INIT_ERROR": "999"},
                   extra={"SLURM_JOB_ID": "7", "SLURM_JOB_GPUS": ""})
    assert out.returncode == 0
    assert out.calls == []


@pytest.mark.parametrize(("policy", "expected_rc"), [("allow", 0), ("refuse", 1)])
def test_prolog_on_a_gpudiag_failure_follows_the_policy(node: SlurmNode, policy: str,
                                                        expected_rc: int) -> None:
    out = node.run(PROLOG, extra={**job_env("0"), "GPUDIAG_PROLOG_REQUIRE": "nonsense",
                                  "GPUDIAG_ON_ERROR": policy})
    assert out.returncode == expected_rc
    assert out.state["jobs"]["4242"]["AdminComment"] == "gpudiag: unknown preflight_exit=2"
    assert drain_calls(out) == []


def test_prolog_drain_is_undrained_by_the_healthcheck_once_fixed(node: SlurmNode) -> None:
    refused = node.run(PROLOG, {"FAKE_CUDA_INIT_ERROR": "999"}, extra=job_env("0"))
    assert refused.returncode == 1
    assert refused.state["reason"] == "gpudiag: cuda_init_failed"
    fixed = node.run(HEALTHCHECK)
    assert resume_calls(fixed) == [["update", f"NodeName={NODE}", "State=RESUME"]]


def test_scripts_need_no_environment_beyond_what_slurm_gives(node: SlurmNode) -> None:
    """slurmd starts them without PATH: they must set their own."""
    out = node.run(HEALTHCHECK, {"FAKE_CUDA_INIT_ERROR": "999"}, extra={"PATH": ""})
    assert out.state["reason"] == "gpudiag: cuda_init_failed", out.stderr
    assert os.access(PROLOG, os.X_OK) and os.access(HEALTHCHECK, os.X_OK)


# --- with the daemon running --------------------------------------------------------------

def test_scripts_ask_the_running_daemon_and_follow_its_state(
        node: SlurmNode, tmp_path: Path) -> None:
    """A real `gpudiag serve` on the fakes; the GPU state changes while it runs."""
    state_file = tmp_path / "gpu-state"
    write_state_file(state_file, {})
    daemon = start_daemon(tmp_path / "daemon", node.make_env(FAKE_GPU_STATE_FILE=str(state_file)))
    url = {"GPUDIAG_DAEMON_URL": f"http://{daemon.instance}"}
    try:
        admitted = wait_for(lambda: node.run(PROLOG, extra={**job_env("0,1"), **url}),
                            lambda o: "source=daemon" in str(o.state["jobs"]))
        assert admitted.returncode == 0, admitted.stderr
        assert admitted.state["jobs"]["4242"]["AdminComment"].startswith("gpudiag: none")

        write_state_file(state_file, {"FAKE_NVML_DEVICE_ERRORS": "0:15"})
        drained = wait_for(lambda: node.run(HEALTHCHECK, extra=url),
                           lambda o: o.state["reason"] == "gpudiag: gpu_lost")
        assert drained.state["state"] == "IDLE+DRAIN"

        write_state_file(state_file, {})
        resumed = wait_for(lambda: node.run(HEALTHCHECK, extra=url),
                           lambda o: o.state["reason"] == "")
        assert resume_calls(resumed) == [["update", f"NodeName={NODE}", "State=RESUME"]]
    finally:
        daemon.proc.terminate()
        daemon.proc.wait(15)


def wait_for(action: Callable[[], Outcome], done: Callable[[Outcome], bool],
             timeout_s: float = 30.0) -> Outcome:
    """Run ``action`` until ``done`` holds for its outcome (the daemon re-probes every 1 s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = action()
        if done(out) or time.monotonic() > deadline:
            assert done(out), (out.calls, out.state, out.stderr)
            return out
        time.sleep(0.5)
