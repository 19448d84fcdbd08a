"""Whose environment is proven (issue 37): fingerprints, runtimes, hybrid answers, proof on change.

The daemon proves JAX and IREE in the environments jobs run in; a job whose environment
differs from every proof the daemon holds gets the daemon's device layer and proves its
backends itself, so a job pinned to the CPU is never told ready from the daemon's own JAX.
Real daemons, real venvs, real JAX (CPU), the fake driver; tests/support/venvs.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.daemon import Daemon, daemon_toml, metric_samples, wait_for, write_config
from tests.support.host import EnvFactory, run_gpudiag, verdict_of
from tests.support.venvs import install_fake_distribution, make_venv

FAKE_PLUGIN_PATH = Path(__file__).resolve().parent / "fakes" / "jax_plugin"


# --- through a real daemon ----------------------------------------------------------------


def _daemon(tmp_path: Path, env: dict[str, str], extra: str = "",
            changes: dict[str, dict[str, Any]] | None = None) -> Daemon:
    toml = daemon_toml({"backends.jax": {"enabled": True, "interval_s": 600},
                        **(changes or {})}) + extra
    daemon = Daemon(env, write_config(tmp_path / "daemon.toml", toml), tmp_path / "state")
    daemon.wait_ready(60)
    return daemon


def _ask(args: list[str], env: dict[str, str], daemon: Daemon | None,
         python: Path | None = None) -> tuple[int, dict[str, Any]]:
    where = ["--daemon-url", daemon.url] if daemon is not None else ["--no-daemon"]
    if python is None:
        return verdict_of([*args, *where, "--format", "json"], env)
    # gpudiag run by the job's own interpreter: that one is the job's.
    done = subprocess.run([str(python), "-m", "gpudiag", *args, *where, "--format", "json"],
                          env={**env, "GPUDIAG_JOB_PYTHON": str(python)}, capture_output=True,
                          text=True, timeout=120, check=False)
    try:
        return done.returncode, json.loads(done.stdout)
    except ValueError:
        raise AssertionError(f"no record: rc={done.returncode} {done.stderr}") from None


def _with_plugin(env: dict[str, str], mode: str) -> dict[str, str]:
    return {**env, "PYTHONPATH": str(FAKE_PLUGIN_PATH), "FAKE_JAX_PLUGIN": mode}


@pytest.fixture
def daemon(tmp_path: Path, gpu_env: EnvFactory) -> Any:
    d = _daemon(tmp_path, gpu_env())
    yield d
    d.stop()


@pytest.mark.parametrize("case", ["jax_platforms_cpu", "jax_platforms_cuda", "plugin_cuinit",
                                  "plugin_pjrt_mismatch"])
def test_a_job_whose_environment_differs_gets_its_own_environments_verdict(
        case: str, daemon: Daemon, gpu_env: EnvFactory) -> None:
    env = {"jax_platforms_cpu": {**gpu_env(), "JAX_PLATFORMS": "cpu"},
           "jax_platforms_cuda": {**gpu_env(), "JAX_PLATFORMS": "cuda"},
           "plugin_cuinit": _with_plugin(gpu_env(), "cuinit"),
           "plugin_pjrt_mismatch": _with_plugin(gpu_env(), "pjrt_mismatch")}[case]
    code_here, here = _ask(["preflight", "--require", "jax"], env, None)
    started = time.monotonic()
    code, asked = _ask(["preflight", "--require", "jax", "--timeout", "60"], env, daemon)
    assert time.monotonic() - started < 60
    assert (code, asked["gpu_validation_blocker"]) == (code_here, here["gpu_validation_blocker"])
    assert asked["gpu_validation_blocker"] != "none"
    assert asked["source"] == "hybrid"
    proof = asked["evidence"]["proof"]["jax"]
    assert proof["where"] == "here" and proof["fingerprint"]


def test_a_job_pinned_to_the_cpu_is_refused_by_gpudiag_run_with_its_own_code(
        daemon: Daemon, gpu_env: EnvFactory, tmp_path: Path) -> None:
    env = {**gpu_env(), "JAX_PLATFORMS": "cpu"}
    done = run_gpudiag(["run", "--require", "jax", "--daemon-url", daemon.url,
                        "--artifacts", str(tmp_path / "runs"), "--", "true"], env)
    assert done.returncode == 125, done.stderr
    closeouts = list((tmp_path / "runs").rglob("closeout.json"))
    assert closeouts, done.stderr
    assert json.loads(closeouts[0].read_text())["gpu_validation_blocker"] == "jax_cpu_fallback"


def test_a_venv_without_jax_asking_the_daemon_hears_jax_not_installed(
        daemon: Daemon, gpu_env: EnvFactory, tmp_path: Path) -> None:
    python = make_venv(tmp_path / "nojax", with_jax=False)
    code, asked = _ask(["preflight", "--require", "jax"], gpu_env(), daemon, python)
    assert code == 1
    assert asked["gpu_validation_blocker"] == "jax_not_installed"
    assert asked["source"] == "hybrid"


def test_the_daemons_own_environment_is_answered_from_its_own_proof(
        daemon: Daemon, gpu_env: EnvFactory) -> None:
    code_here, here = _ask(["preflight", "--require", "jax"], gpu_env(), None)
    code, asked = _ask(["preflight", "--require", "jax"], gpu_env(), daemon)
    assert asked["source"] == "daemon"
    assert asked["evidence"]["proof"]["jax"]["where"] == "daemon"
    assert asked["evidence"]["proof"]["jax"]["runtime"] == "gpudiag"
    assert asked["gpu_validation_blocker"] == here["gpu_validation_blocker"]


def test_a_question_without_fingerprint_never_gets_the_daemons_proof(daemon: Daemon) -> None:
    status, record = daemon.get("/v1/preflight?require=jax")
    assert status == 200
    assert record["ready"] is False
    assert "backend_unproven" in [b["code"] for b in record["blockers"]]
    assert record["evidence"]["proof"]["jax"]["where"] == "prove_here"


def test_a_malformed_fingerprint_is_a_400(daemon: Daemon) -> None:
    for bad in ("jax:xyz", "jax:" + "0" * 15, ",".join(["jax:" + "0" * 16] * 2),
                "a" * 600):
        status, body = daemon.get(f"/v1/preflight?require=jax&fingerprint={bad}")
        assert status == 400, bad
        assert body["error"]["code"] == "bad_fingerprint"


# Counts every child process the console entry starts (fork, spawn): none when the daemon
# answers from a runtime's proof.
_COUNTING_ENTRY = """
import json, os, subprocess, sys
started = []
real_fork, real_init = os.fork, subprocess.Popen.__init__
def fork():
    started.append("fork")
    return real_fork()
def init(self, *a, **k):
    started.append("spawn")
    real_init(self, *a, **k)
os.fork = fork
subprocess.Popen.__init__ = init
sys.argv = ["gpudiag", *json.loads(os.environ.pop("ARGV"))]
from gpudiag.cli.entry import main
rc = main()
open(os.environ.pop("OUT"), "w").write(json.dumps({"rc": rc, "children": started}))
"""


def test_a_job_matching_a_runtime_is_answered_with_no_probe_child(
        tmp_path: Path, gpu_env: EnvFactory) -> None:
    python = make_venv(tmp_path / "train", with_jax=True)
    extra = f'[runtimes.train]\npython = "{python}"\nuser = "root"\nrequire = "jax"\n'
    d = _daemon(tmp_path, gpu_env(), extra)
    try:
        # The runtime's first proof is made on the daemon's schedule (its first round).
        wait_for(lambda: any(labels.get("runtime") == "train" for labels, value in
                             metric_samples(d, "gpudiag_runtime_backend_up")), 90, 0.5)
        out = tmp_path / "out.json"
        argv = ["preflight", "--require", "jax", "--daemon-url", d.url, "--format", "json"]
        env = {**gpu_env(), "ARGV": json.dumps(argv), "OUT": str(out),
               "GPUDIAG_JOB_PYTHON": str(python)}
        done = subprocess.run([str(python), "-c", _COUNTING_ENTRY], env=env, text=True,
                              capture_output=True, timeout=120, check=False)
        record = json.loads(done.stdout)
        assert record["source"] == "daemon", record["evidence"].get("proof")
        assert record["evidence"]["proof"]["jax"]["runtime"] == "train"
        assert json.loads(out.read_text())["children"] == []
    finally:
        d.stop()


def test_two_runtimes_are_proven_side_by_side_and_a_package_installed_proves_again(
        tmp_path: Path, gpu_env: EnvFactory) -> None:
    cpu = make_venv(tmp_path / "cpu", with_jax=True)
    plugged = make_venv(tmp_path / "plugged", with_jax=True)
    extra = (f'[runtimes.cpu]\npython = "{cpu}"\nuser = "root"\nrequire = "jax"\n'
             f'[runtimes.plugged]\npython = "{plugged}"\nuser = "root"\nrequire = "jax"\n'
             f'env = {{ PYTHONPATH = "{FAKE_PLUGIN_PATH}", FAKE_JAX_PLUGIN = "cuinit" }}\n')
    d = _daemon(tmp_path, gpu_env(), extra)
    try:
        def blockers() -> dict[tuple[str, str], float]:
            return {(labels["runtime"], labels["code"]): value for labels, value in
                    metric_samples(d, "gpudiag_runtime_blocker")}

        found = wait_for(lambda: (lambda b: b if b.get(("cpu", "jax_gpu_backend_absent"))
                                  and b.get(("plugged", "jax_backend_init_failed")) else None)(
            blockers()), 120, 0.5)
        assert found[("cpu", "jax_backend_init_failed")] == 0
        assert found[("plugged", "jax_gpu_backend_absent")] == 0
        # Each runtime's failure is its own (issue 48), never the node's.
        node = {labels["code"]: value for labels, value in metric_samples(d, "gpudiag_blocker")}
        assert node["jax_gpu_backend_absent"] == 0 and node["jax_backend_init_failed"] == 0
        ups = {labels["runtime"]: value for labels, value in
               metric_samples(d, "gpudiag_runtime_backend_up")}
        assert ups == {"cpu": 0.0, "plugged": 0.0}

        def runs(runtime: str) -> float:
            return sum(value for labels, value in
                       metric_samples(d, "gpudiag_runtime_probe_runs_total")
                       if labels["runtime"] == runtime and labels["backend"] == "jax")

        before = {name: runs(name) for name in ("cpu", "plugged")}
        install_fake_distribution(cpu, "jax_cuda12_plugin", "0.10.2")
        # The NVML interval is 0.5 s; the new proof itself takes a JAX start.
        wait_for(lambda: runs("cpu") > before["cpu"], 60, 0.25)
        assert runs("plugged") == before["plugged"], "only the changed runtime proves again"
    finally:
        d.stop()


def test_a_default_install_without_extras_publishes_no_blocker(
        tmp_path: Path, gpu_env: EnvFactory) -> None:
    python = make_venv(tmp_path / "plain", with_jax=False)
    config = write_config(tmp_path / "d.toml", daemon_toml({
        "backends.jax": {"enabled": None}, "backends.iree": {"enabled": None}}))
    env = gpu_env()
    proc = subprocess.Popen(
        [str(python), "-m", "gpudiag", "serve", "--listen", "127.0.0.1:0", "--config",
         str(config), "--state-dir", str(tmp_path / "state"), "--log-format", "json"],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True)
    try:
        assert proc.stderr is not None
        url = ""
        for line in proc.stderr:
            try:
                url = json.loads(line).get("url") or ""
            except ValueError:
                continue
            if url:
                break

        def get(path: str) -> str:
            return _get(url + path)[1]

        wait_for(lambda: _get(url + "/readyz")[0] == 200, 90, 0.25)
        metrics = get("/metrics")
        on = [line for line in metrics.splitlines()
              if line.startswith("gpudiag_blocker{") and line.endswith(" 1.0")]
        assert on == [], on
        assert 'gpudiag_warning{code="backend_not_checked",layer="requirement"} 1.0' in metrics
        health = json.loads(get("/v1/health"))
        said = [w for w in health["warnings"] if w["code"] == "backend_not_checked"]
        assert {w["backend"] for w in said} == {"jax", "iree"}
        assert all("[runtimes." in w["message"] for w in said)
    finally:
        proc.terminate()
        proc.wait(10)


def _get(url: str) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return int(r.status), str(r.read().decode())
    except urllib.error.HTTPError as e:
        return int(e.code), str(e.read().decode())


def test_the_probe_archive_runs_a_probe_in_an_interpreter_without_gpudiag(
        tmp_path: Path, gpu_env: EnvFactory) -> None:
    from gpudiag.core.runtime import Runtime
    from gpudiag.engine.isolation import run_probe
    from gpudiag.engine.runtimes import interpreter_argv, probe_archive, runtime_environment

    python = make_venv(tmp_path / "nojax", with_jax=False)
    # gpudiag is not importable there but through the archive: drop the repo from its path.
    pth = next((tmp_path / "nojax" / "lib").glob("python3*/site-packages")) / "gpudiag-tests.pth"
    pth.write_text("".join(f"{line}\n" for line in pth.read_text().splitlines()
                           if "gpudiag-deps" in line))
    runtime = Runtime("nojax", python=str(python))
    archive = probe_archive(tmp_path / "archive")
    env = runtime_environment(runtime, gpu_env())
    assert subprocess.run([str(python), "-c", "import gpudiag"], env=env, cwd=tmp_path,
                          capture_output=True).returncode != 0
    run = run_probe("jax", env=env, timeout_s=60, options={"platform": "cpu"},
                    interpreter=interpreter_argv(runtime, archive))
    assert run.ok, run.error or run.stderr_tail
    assert run.jax is not None and run.jax.installed is False


def test_the_pytest_plugin_of_a_job_pinned_to_the_cpu_skips_with_its_own_code(
        daemon: Daemon, gpu_env: EnvFactory, tmp_path: Path) -> None:
    (tmp_path / "test_model.py").write_text(
        "import pytest\n\n@pytest.mark.gpu(require='jax')\ndef test_on_gpu():\n    pass\n")
    env = {**gpu_env(), "JAX_PLATFORMS": "cpu", "GPUDIAG_DAEMON_URL": daemon.url,
           "GPUDIAG_LOCK_DIR": str(tmp_path / "locks")}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs",
                           "-q", str(tmp_path / "test_model.py")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=240, check=False)
    assert "jax_cpu_fallback" in done.stdout, done.stdout + done.stderr
    assert "1 skipped" in done.stdout, done.stdout


def test_a_runtime_that_hangs_is_a_probe_timeout_of_that_runtime_only(
        tmp_path: Path, gpu_env: EnvFactory) -> None:
    good = make_venv(tmp_path / "good", with_jax=True)
    stuck = tmp_path / "stuck" / "python"
    stuck.parent.mkdir()
    stuck.write_text("#!/bin/sh\nexec sleep 3600\n")  # an interpreter that never answers
    stuck.chmod(0o755)
    extra = (f'[runtimes.good]\npython = "{good}"\nuser = "root"\nrequire = "jax"\n'
             f'[runtimes.stuck]\npython = "{stuck}"\nuser = "root"\nrequire = "jax"\n')
    d = _daemon(tmp_path, gpu_env(), extra, changes={
        "backends.jax": {"enabled": True, "interval_s": 600, "deadline_s": 25}})
    try:
        def blockers() -> dict[tuple[str, str], float]:
            return {(labels["runtime"], labels["code"]): value for labels, value in
                    metric_samples(d, "gpudiag_runtime_blocker")}

        found = wait_for(lambda: (lambda b: b if b.get(("stuck", "probe_timeout")) and
                                  b.get(("good", "jax_gpu_backend_absent")) else None)(
            blockers()), 240, 0.5)
        assert found[("good", "probe_timeout")] == 0
        assert d.get("/healthz")[0] == 200
    finally:
        d.stop()


def test_hybrid_questions_started_at_once_on_a_busy_node_agree_and_leave_the_busy_gpu_alone(
        tmp_path: Path, gpu_env: EnvFactory) -> None:
    """Four jobs pinned to the CPU ask at the same moment while another user's job holds
    GPU 0: each gets its own environment's answer (never the daemon's proof), and no probe,
    the daemon's or theirs, makes a context on the busy GPU."""
    from tests.fakes.jobs import FakeJobs, read_context_log

    log = tmp_path / "contexts.jsonl"
    with FakeJobs(tmp_path / "jobs") as jobs:
        env = gpu_env(FAKE_NVML_DEVICE_COUNT=2, FAKE_GPU_STATE_FILE=str(jobs.state_file),
                      FAKE_CUDA_CONTEXT_LOG=str(log))
        env["GPUDIAG_LOCK_DIR"] = str(tmp_path / "locks")
        busy = f"GPU-f00d{0:04x}-0000-4000-8000-00000000{0:04x}"
        jobs.start(0)
        daemon = _daemon(tmp_path, env)
        try:
            pinned = {**env, "JAX_PLATFORMS": "cpu"}
            argv = [sys.executable, "-m", "gpudiag", "preflight", "--require", "cuda,jax",
                    "--gpus", "1", "--daemon-url", daemon.url, "--format", "json"]
            started = time.monotonic()
            procs = [subprocess.Popen(argv, env=pinned, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True) for _ in range(4)]
            answers = []
            for proc in procs:
                out, err = proc.communicate(timeout=120)
                answers.append((proc.returncode, json.loads(out), err))
            took_s = time.monotonic() - started
        finally:
            daemon.stop()
        events = read_context_log(log)
        assert jobs.contexts_while_busy(events) == []
    assert took_s < 60, took_s
    for rc, record, err in answers:
        assert (rc, record["gpu_validation_blocker"]) == (1, "jax_cpu_fallback"), err
        assert record["source"] == "hybrid"
        assert record["evidence"]["proof"]["jax"]["where"] == "here"
        assert {d["uuid"]: d["occupancy"] for d in record["devices"]}.get(busy) in (None, "busy")
    assert [e for e in events if getattr(e, "uuid", None) == busy
            and getattr(e, "event", None) == "context"] == []
