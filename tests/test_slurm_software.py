"""The Slurm scripts never drain for software (issue 48).

``jax``/``iree`` in GPUDIAG_PROLOG_REQUIRE and GPUDIAG_HEALTH_REQUIRE mean the node's
configured runtimes (the Prolog runs before the job's environment exists); none configured
means not checked. A runtime's software code may refuse a job (the Prolog cancels it and
exits 0: a failing Prolog drains the node); only device-layer codes drain. The stand-in
scontrol/scancel around the real scripts, the real `gpudiag`, and a real daemon with real
runtimes (venvs with the suite's CPU-only JAX) on the fake driver. The real cluster's case is
in tests/test_slurm.py.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes.build import FakeDriver
from tests.support import slurm
from tests.support.daemon import Daemon, daemon_toml, metric_samples, wait_for, write_config
from tests.support.slurm import HEALTHCHECK, PROLOG, Outcome, RealSlurm, SlurmNode, job_field
from tests.support.venvs import make_venv

node = slurm.node
BOTH = {"GPUDIAG_PROLOG_REQUIRE": "cuda,jax", "GPUDIAG_HEALTH_REQUIRE": "cuda,jax"}


def _job(gpus: str = "0") -> dict[str, str]:
    return {"SLURM_JOB_ID": "4242", "SLURM_JOB_GPUS": gpus, "CUDA_VISIBLE_DEVICES": gpus}


def _drains(out: Outcome) -> list[list[str]]:
    return [c for c in out.updates if "State=DRAIN" in c]


def _cancels(out: Outcome) -> list[list[str]]:
    return [c for c in out.calls if c[:1] == ["scancel"]]


@pytest.mark.parametrize("script", [PROLOG, HEALTHCHECK], ids=["prolog", "healthcheck"])
def test_jax_without_a_configured_runtime_is_not_checked_and_never_drains(
        node: SlurmNode, script: Path) -> None:
    # No daemon answers (only the daemon knows the node's runtimes), and the scripts' own
    # PATH has no JAX at all: neither is the job's environment.
    out = node.run(script, extra={**BOTH, **_job()})
    assert out.returncode == 0, out.stderr
    assert _drains(out) == [] and _cancels(out) == [], out.calls
    assert out.state["state"] == "IDLE"
    if script == PROLOG:
        comment = out.state["jobs"]["4242"]["AdminComment"]
        assert comment.startswith("gpudiag: none ready=true"), comment
        assert comment.endswith("runtimes=jax=not_checked"), comment


def test_a_device_fault_still_drains_with_jax_required(node: SlurmNode) -> None:
    out = node.run(HEALTHCHECK, {"FAKE_CUDA_INIT_ERROR": "999"}, extra=BOTH)
    assert out.state["reason"] == "gpudiag: cuda_init_failed", out.stderr


@pytest.fixture(scope="module")
def runtimes_daemon(tmp_path_factory: pytest.TempPathFactory,
                    fakes: FakeDriver) -> Iterator[Daemon]:
    """A daemon with two runtimes: ``pinned`` (CPU-pinned, promising GPU JAX: it fails with
    jax_cpu_fallback) and ``cpujobs`` (promising CPU jobs: ok)."""
    from tests.support.host import clean_env, make_host_dirs

    root = tmp_path_factory.mktemp("rt")
    dev, proc = make_host_dirs(root / "host")
    env = fakes.env(base={**clean_env(), "GPUDIAG_DEVICE_DIR": str(dev),
                          "GPUDIAG_DRIVER_PROC_DIR": str(proc)})
    python = make_venv(root / "venv", with_jax=True)
    toml = daemon_toml({"backends.jax": {"enabled": True, "interval_s": 600}}) + (
        f'[runtimes.pinned]\npython = "{python}"\nuser = "root"\n'
        'env = { JAX_PLATFORMS = "cpu" }\n'
        f'[runtimes.cpujobs]\npython = "{python}"\nuser = "root"\nrequire = "jax:cpu"\n'
        'env = { JAX_PLATFORMS = "cpu" }\n')
    d = Daemon(env, write_config(root / "d.toml", toml), root / "state")
    try:
        d.wait_ready(60)
        wait_for(lambda: len([1 for labels, _ in metric_samples(
            d, "gpudiag_runtime_backend_up") if labels["runtime"] in ("pinned", "cpujobs")])
            == 2 and any(v for labels, v in metric_samples(d, "gpudiag_runtime_blocker")
                         if labels["runtime"] == "pinned"), 120, 0.5)
        yield d
    finally:
        d.stop()


def test_a_runtime_that_serves_jax_lets_the_job_run(node: SlurmNode,
                                                    runtimes_daemon: Daemon) -> None:
    # cpujobs serves jax (on the CPU, as it promises) while pinned fails: the node serves it.
    out = node.run(PROLOG, extra={**BOTH, **_job(), "GPUDIAG_DAEMON_URL": runtimes_daemon.url})
    assert out.returncode == 0, out.stderr
    comment = out.state["jobs"]["4242"]["AdminComment"]
    assert comment.startswith("gpudiag: none ready=true"), comment
    assert "source=daemon" in comment and comment.endswith("runtimes=jax=ok"), comment
    assert _drains(out) == [] and _cancels(out) == []


@pytest.fixture(scope="module")
def failing_daemon(tmp_path_factory: pytest.TempPathFactory,
                   fakes: FakeDriver) -> Iterator[Daemon]:
    """A daemon whose one runtime (CPU-pinned, promising GPU JAX) fails."""
    from tests.support.host import clean_env, make_host_dirs

    root = tmp_path_factory.mktemp("fail")
    dev, proc = make_host_dirs(root / "host")
    env = fakes.env(base={**clean_env(), "GPUDIAG_DEVICE_DIR": str(dev),
                          "GPUDIAG_DRIVER_PROC_DIR": str(proc)})
    python = make_venv(root / "venv", with_jax=True)
    toml = daemon_toml({"backends.jax": {"enabled": True, "interval_s": 600}}) + (
        f'[runtimes.pinned]\npython = "{python}"\nuser = "root"\n'
        'env = { JAX_PLATFORMS = "cpu" }\n')
    d = Daemon(env, write_config(root / "d.toml", toml), root / "state")
    try:
        d.wait_ready(60)
        wait_for(lambda: any(v for labels, v in metric_samples(d, "gpudiag_runtime_blocker")
                             if labels["runtime"] == "pinned"), 120, 0.5)
        yield d
    finally:
        d.stop()


def test_a_failing_runtime_cancels_the_job_in_the_prolog_and_never_drains(
        node: SlurmNode, failing_daemon: Daemon) -> None:
    out = node.run(PROLOG, extra={**BOTH, **_job(), "GPUDIAG_DAEMON_URL": failing_daemon.url})
    assert out.returncode == 0, "a failing Prolog would drain the node"
    assert _drains(out) == [] and out.state["state"] == "IDLE", out.calls
    assert _cancels(out) == [["scancel", "4242"]], out.calls
    comment = out.state["jobs"]["4242"]["AdminComment"]
    assert comment.startswith("gpudiag: jax_cpu_fallback ready=false"), comment
    assert "software=yes" in comment and "runtimes=jax=runtime:pinned:jax_cpu_fallback" in comment
    # GPUDIAG_ON_SOFTWARE=allow lets it run (recorded all the same).
    allowed = node.run(PROLOG, extra={**BOTH, **_job(), "GPUDIAG_ON_SOFTWARE": "allow",
                                      "GPUDIAG_DAEMON_URL": failing_daemon.url})
    assert _cancels(allowed) == [] and _drains(allowed) == []


def test_a_failing_runtime_never_drains_in_the_health_check(
        node: SlurmNode, failing_daemon: Daemon) -> None:
    out = node.run(HEALTHCHECK, extra={**BOTH, "GPUDIAG_DAEMON_URL": failing_daemon.url})
    assert out.returncode == 0, out.stderr
    assert _drains(out) == [] and out.state["state"] == "IDLE", out.calls
    assert "a runtime fails (software: not drained): jax=runtime:pinned:jax_cpu_fallback" \
        in out.stderr, out.stderr
    # A drain the scripts made before for a software code is undone: software is no fault.
    node.set(state="IDLE+DRAIN", reason="gpudiag: jax_gpu_backend_absent")
    again = node.run(HEALTHCHECK, extra={**BOTH, "GPUDIAG_DAEMON_URL": failing_daemon.url})
    assert again.state["reason"] == "" and again.state["state"] == "IDLE", again.calls


real_slurm = slurm.real_slurm


@pytest.mark.slow
def test_real_slurm_a_failing_runtime_cancels_the_job_and_never_drains(
        real_slurm: RealSlurm, failing_daemon: Daemon) -> None:
    """The real Prolog on the real cluster, asking a daemon whose one runtime fails: the
    job is cancelled with the runtime's code in its record; the node stays in service."""
    s = real_slurm
    s.set_gpus()
    s.wait("an idle node", lambda: s.node_field("State") == "IDLE")
    defaults = s.folder / "defaults"
    before = defaults.read_text()
    # Later lines of the sourced defaults file win.
    defaults.write_text(before + f"GPUDIAG_DAEMON_URL={failing_daemon.url}\n"
                        "GPUDIAG_PROLOG_REQUIRE=cuda,jax\n")
    job = ""
    try:
        job = subprocess.run(["sbatch", "--parsable", "--gres=gpu:1", "-o", "/dev/null",
                              "--wrap", "true"], env=s.env, capture_output=True, text=True,
                             cwd=s.folder, timeout=30, check=True).stdout.strip().split(";")[0]
        s.wait("the job to be cancelled",
               lambda: job_field(s, job, "JobState") == "CANCELLED", 120)
        comment = job_field(s, job, "AdminComment")
        assert comment.startswith("gpudiag: jax_cpu_fallback ready=false"), comment
        assert "runtimes=jax=runtime:pinned:jax_cpu_fallback" in comment, comment
        assert s.reason() == "" and "DRAIN" not in s.node_field("State")
    finally:
        defaults.write_text(before)
        if job:
            subprocess.run(["scancel", job], env=s.env, timeout=30, check=False)
