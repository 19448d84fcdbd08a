"""``gpudiag run`` end to end: the real CLI in a child, real children, real JAX on the CPU.

The driver boundary is the fake libnvidia-ml/libcuda; docker is a stand-in script that
records its argv (no Docker engine runs here).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from gpudiag.core.child import env_sha256
from gpudiag.engine.processes import ended
from tests.fakes.build import FakeDriver
from tests.support.daemon import Daemon, daemon_toml, host_env, write_config
from tests.support.host import EnvFactory, run_gpudiag
from tests.support.run import NO_DAEMON, gpudiag_run, run_folder

PRINT_ENV = ("import json, os; from gpudiag.core.child import env_sha256; "
             "print(json.dumps({'env': dict(os.environ), 'sha256': env_sha256(os.environ)}))")


def gpu_uuid(i: int) -> str:
    return f"GPU-f00d{i:04x}-0000-4000-8000-00000000{i:04x}"


def kv(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition("=")
        out[key] = value
    return out


def load(path: Path) -> Any:
    return json.loads(path.read_text())


@pytest.fixture
def host(gpu_env: EnvFactory, tmp_path: Path) -> dict[str, str]:
    """A healthy 4-GPU fake host whose locks live in this test's folder."""
    return gpu_env(FAKE_NVML_DEVICE_COUNT=4, GPUDIAG_LOCK_DIR=str(tmp_path / "locks"),
                   GPUDIAG_DAEMON_URL=NO_DAEMON)


def test_a_python_child_sees_exactly_the_admitted_gpu_and_the_closeout_says_ready(
        host: dict[str, str], tmp_path: Path) -> None:
    env = dict(host, SECRET_TOKEN="hunter2-not-for-records")
    art = tmp_path / "art"
    proc = gpudiag_run(["--gpus", "1", "--", sys.executable, "-c", PRINT_ENV], env, art)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    child = seen["env"]
    close = kv(run_folder(art) / "closeout.txt")
    uuid = close["gpus.0.uuid"]
    assert uuid == gpu_uuid(0)
    assert child["CUDA_VISIBLE_DEVICES"] == child["NVIDIA_VISIBLE_DEVICES"] == uuid
    assert child["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert child["XLA_PYTHON_CLIENT_ALLOCATOR"] == "platform"
    assert child["XLA_PYTHON_CLIENT_USE_CUDA_HOST_ALLOCATOR"] == "false"
    assert "JAX_PLATFORMS" not in child  # --require cuda: JAX is not part of the job
    assert close["gpu_execution_route"] == "gpudiag-run"
    assert close["gpu_validation_blocker"] == "none" and close["ready"] == "true"
    assert close["exit_code"] == "0" and close["status"] == "exited"
    assert close["preallocation_disabled"] == "yes" and close["preallocation_source"] == "child"
    assert close["gpus.count"] == "1" and close["gpus.0.name"] == "NVIDIA H200"
    assert int(close["gpus.0.memory_total_bytes"]) == 143771 * 2**20
    for name in ("plan", "environment", "result", "stdout", "stderr", "closeout_json"):
        assert Path(close[f"artifacts.{name}"]).is_file(), name
    # The output was streamed and stored, with its hash.
    assert (run_folder(art) / "stdout.log").read_text() == proc.stdout
    result = load(run_folder(art) / "result.json")
    assert result["outputs"]["stdout"]["sha256"] == hashlib.sha256(
        (run_folder(art) / "stdout.log").read_bytes()).hexdigest()
    assert result["locks"]["free_after_release"] == {uuid: True}
    # environment.json: every name and the hash of the whole, the same the child computed.
    envrec = load(run_folder(art) / "environment.json")
    assert envrec["sha256"] == seen["sha256"] == env_sha256(child)
    assert "SECRET_TOKEN" in envrec["keys"]
    assert envrec["set_by_gpudiag"]["CUDA_VISIBLE_DEVICES"] == uuid
    plan = load(run_folder(art) / "plan.json")
    assert plan["argv"] == [sys.executable, "-c", PRINT_ENV]
    assert plan["admission"]["selected"] == [uuid]
    assert plan["admission"]["locks"][0]["uuid"] == uuid
    assert plan["admission"]["first_observation"]["leaves"]
    assert plan["admission"]["locked_observation"]["leaves"]
    assert len(plan["fingerprint"]) == 64 and plan["environment"]["set"]["NVIDIA_VISIBLE_DEVICES"]
    for artifact in run_folder(art).glob("*.json"):  # stdout.log is the child's own output
        assert "hunter2" not in artifact.read_text(), artifact.name


def test_a_blocked_host_never_starts_argv(gpu_env: EnvFactory, tmp_path: Path) -> None:
    env = gpu_env(FAKE_NVML_INIT_ERROR=9, GPUDIAG_LOCK_DIR=str(tmp_path / "locks"))
    marker = tmp_path / "marker"
    art = tmp_path / "art"
    proc = gpudiag_run(["--", "touch", str(marker)], env, art)
    assert proc.returncode == 125, proc.stderr
    assert not marker.exists()
    assert "driver_not_loaded" in proc.stderr
    close = kv(run_folder(art) / "closeout.txt")
    assert close["gpu_validation_blocker"] == "driver_not_loaded"
    assert close["launched"] == "false" and close["exit_code"] == "125"
    assert close["blockers.0.layer"] == "driver" and "nvmlInit" in close["blockers.0.message"]
    assert close["preallocation_disabled"] == "no"
    evidence = load(run_folder(art) / "closeout.json")["evidence"]
    assert evidence["driver"] is not None and "environment" in evidence
    assert load(run_folder(art) / "verdict.json")["gpu_validation_blocker"] == "driver_not_loaded"
    run = run_folder(art)
    assert not (run / "plan.json").exists() and not (run / "stdout.log").exists()


def test_jax_on_a_host_without_a_jax_gpu_backend_is_refused_not_run_on_the_cpu(
        host: dict[str, str], tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    proc = gpudiag_run(["--require", "jax", "--", "touch", str(marker)], host, tmp_path / "a")
    assert proc.returncode == 125, proc.stderr
    assert not marker.exists()
    close = kv(run_folder(tmp_path / "a") / "closeout.txt")
    assert close["gpu_validation_blocker"] == "jax_gpu_backend_absent"


@pytest.mark.parametrize(("code", "expected"), [
    ("pass", 0),
    ("raise SystemExit(7)", 7),
    ("import os, signal; os.kill(os.getpid(), signal.SIGUSR1)", 128 + signal.SIGUSR1),
])
def test_exit_code_is_the_childs_own_or_128_plus_its_signal(host: dict[str, str],
                                                             tmp_path: Path, code: str,
                                                             expected: int) -> None:
    proc = gpudiag_run(["--", sys.executable, "-c", code], host, tmp_path / "a")
    assert proc.returncode == expected, proc.stderr
    close = kv(run_folder(tmp_path / "a") / "closeout.txt")
    assert close["exit_code"] == str(expected)
    if expected > 128:
        assert close["exit_signal"] == str(signal.SIGUSR1) and close["status"] == "signaled"


def test_argv_that_cannot_start_exits_127_and_closes_out(host: dict[str, str],
                                                          tmp_path: Path) -> None:
    proc = gpudiag_run(["--", str(tmp_path / "no-such-program")], host, tmp_path / "a")
    assert proc.returncode == 127
    close = kv(run_folder(tmp_path / "a") / "closeout.txt")
    assert close["status"] == "launch_failed" and "no-such-program" in close["error"]


@pytest.mark.parametrize("args", [["--gpus", "many"], ["--min-free-memory", "8XB"],
                                  ["--timeout", "-1"], ["--require", "cuda,tpu"]])
def test_bad_flags_exit_125_with_a_clear_message(host: dict[str, str], tmp_path: Path,
                                                 args: list[str]) -> None:
    marker = tmp_path / "marker"
    proc = gpudiag_run([*args, "--", "touch", str(marker)], host, tmp_path / "a")
    assert proc.returncode == 125
    assert "Traceback" not in proc.stderr and args[1] in proc.stderr
    assert not marker.exists()


INTERVAL = textwrap.dedent("""
    import os, sys, time
    log, starts = sys.argv[1], sys.argv[1] + ".starts"
    start = time.time()
    with open(starts, "a") as fh:
        fh.write("x\\n")
    mine = sum(1 for _ in open(starts))
    # A barrier per wave of 4: every admitted job stays until its wave is complete, so the
    # peak is exactly the number of GPUs however slowly the jobs start (bounded wait).
    wave_full = 4 * ((mine - 1) // 4 + 1)
    deadline = time.time() + 30
    while sum(1 for _ in open(starts)) < wave_full and time.time() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)
    with open(log, "a") as fh:
        fh.write(f"{os.environ['CUDA_VISIBLE_DEVICES']} {start} {time.time()}\\n")
""")


def test_eight_jobs_on_four_gpus_run_four_at_a_time_never_two_on_one_gpu(
        host: dict[str, str], tmp_path: Path) -> None:
    log = tmp_path / "intervals"
    procs = [subprocess.Popen(
        [sys.executable, "-m", "gpudiag", "run", "--gpus", "1", "--lock-timeout", "120",
         "--artifacts", str(tmp_path / f"a{i}"), "--", sys.executable, "-c", INTERVAL,
         str(log)], env=host, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(8)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    rows = [line.split() for line in log.read_text().splitlines()]
    intervals = [(u, float(a), float(b)) for u, a, b in rows]
    assert len(intervals) == 8
    assert {u for u, _, _ in intervals} <= {gpu_uuid(i) for i in range(4)}
    overlaps = [(x, y) for i, x in enumerate(intervals) for y in intervals[i + 1:]
                if x[0] == y[0] and x[1] < y[2] and y[1] < x[2]]
    assert overlaps == [], f"two jobs on one GPU at once: {overlaps}"
    # The most jobs running at one moment: never more than the 4 GPUs, and all 4 in use.
    peak = max(sum(1 for _, a, b in intervals if a <= t < b) for _, t, _ in intervals)
    assert peak == 4, intervals


GRANDCHILD = textwrap.dedent("""
    import os, subprocess, sys, time
    folder = sys.argv[1]
    if len(sys.argv) > 2:  # the grandchild: drops every inherited fd, outlives its parent
        os.closerange(3, 4096)
        time.sleep(1.5)
        with open(os.path.join(folder, "grandchild_end"), "w") as fh:
            fh.write(str(time.time()))
        sys.exit(0)
    g = subprocess.Popen([sys.executable, os.path.abspath(__file__), folder, "x"],
                         start_new_session=True)
    with open(os.path.join(folder, "grandchild_pid"), "w") as fh:
        fh.write(str(g.pid))
    open(os.path.join(folder, "child_exited"), "w").close()
""")


def _locked(path: str) -> bool:
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_a_gpu_stays_locked_until_the_last_grandchild_ends(host: dict[str, str],
                                                           tmp_path: Path) -> None:
    (tmp_path / "gc.py").write_text(GRANDCHILD)
    art = tmp_path / "a"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpudiag", "run", "--artifacts", str(art), "--",
         sys.executable, str(tmp_path / "gc.py"), str(tmp_path)], env=host,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (tmp_path / "child_exited").exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    lock_path = load(run_folder(art) / "plan.json")["admission"]["locks"][0]["path"]
    time.sleep(0.3)  # the child has exited by now; its orphaned grandchild still runs
    assert not (tmp_path / "grandchild_end").exists()
    assert _locked(lock_path), "the GPU was released while a grandchild still ran"
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert not _locked(lock_path)
    ended = float((tmp_path / "grandchild_end").read_text())
    result = load(run_folder(art) / "result.json")
    gc_pid = int((tmp_path / "grandchild_pid").read_text())
    tracked = {d["pid"]: d for d in result["descendants"]}
    assert gc_pid in tracked and tracked[gc_pid]["reaped"], result["descendants"]
    assert result["subreaper"] is True
    from datetime import datetime
    released = datetime.fromisoformat(result["locks"]["released_at"].replace("Z", "+00:00"))
    assert released.timestamp() >= ended


TREE = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    pids = open(sys.argv[1], "a")
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    for code in (stubborn, "import time; time.sleep(60)"):
        p = subprocess.Popen([sys.executable, "-c", code], start_new_session=code == stubborn)
        pids.write(f"{p.pid}\\n")
    pids.write(f"{os.getpid()}\\n")
    pids.close()
    time.sleep(60)
""")


def test_timeout_ends_the_whole_tree(host: dict[str, str], tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    t0 = time.monotonic()
    proc = gpudiag_run(["--timeout", "1.5", "--kill-grace", "0.5", "--", sys.executable, "-c",
                        TREE, str(pid_file)], host, tmp_path / "a")
    took = time.monotonic() - t0
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert "timed out" in proc.stderr and took < 30
    pids = [int(p) for p in pid_file.read_text().split()]
    assert len(pids) == 3
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    close = kv(run_folder(tmp_path / "a") / "closeout.txt")
    assert close["timed_out"] == "true" and close["status"] == "timed_out"
    result = load(run_folder(tmp_path / "a") / "result.json")
    assert result["kill"]["term_sent"] and result["kill"]["kill_sent"]  # one ignored TERM
    assert set(pids) <= {d["pid"] for d in result["descendants"]}


def test_sigterm_is_forwarded_to_the_child(host: dict[str, str], tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    code = ("import signal, sys, time, pathlib; "
            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(42)); "
            f"pathlib.Path({str(ready)!r}).touch(); time.sleep(30)")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpudiag", "run", "--artifacts", str(tmp_path / "a"), "--",
         sys.executable, "-c", code], env=host, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 42, err
    forwarded = load(run_folder(tmp_path / "a") / "result.json")["forwarded_signals"]
    assert [f["signal"] for f in forwarded] == [signal.SIGTERM]


def test_a_jax_child_on_the_cpu_closes_out_preallocation_disabled_as_seen_inside(
        bare_env: dict[str, str], tmp_path: Path) -> None:
    code = "import jax, jax.numpy as jnp; print(jax.default_backend(), float(jnp.ones(4).sum()))"
    art = tmp_path / "a"
    proc = gpudiag_run(["--require", "jax:cpu", "--", sys.executable, "-c", code], bare_env,
                       art, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "cpu 4.0"
    close = kv(run_folder(art) / "closeout.txt")
    assert close["preallocation_disabled"] == "yes" and close["preallocation_source"] == "child"
    assert close["gpu_validation_blocker"] == "none" and close["gpus.count"] == "0"
    reports = load(run_folder(art) / "closeout.json")["evidence"]["child_reports"]
    assert len(reports) == 1
    assert reports[0]["startup"] is True and reports[0]["at_report"] is True
    assert reports[0]["jax"]["default_backend"] == "cpu"
    assert reports[0]["environment_matches_plan"] is True


def test_a_child_that_turns_preallocation_back_on_is_caught(bare_env: dict[str, str],
                                                            tmp_path: Path) -> None:
    code = ("import os; os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'] = 'true'; "
            "import jax; jax.numpy.ones(2).block_until_ready()")
    art = tmp_path / "a"
    proc = gpudiag_run(["--require", "jax:cpu", "--", sys.executable, "-c", code], bare_env,
                       art, timeout=120)
    assert proc.returncode == 0, proc.stderr
    close = kv(run_folder(art) / "closeout.txt")
    assert close["preallocation_disabled"] == "no" and close["preallocation_source"] == "child"


DOCKER = textwrap.dedent("""\
    #!{python}
    import json, os, sys
    with open(os.environ["FAKE_DOCKER_LOG"], "a") as fh:
        fh.write(json.dumps(sys.argv[1:]) + "\\n")
    if sys.argv[1] == "info":
        print(os.environ.get("FAKE_DOCKER_DEVICES", "null"))
        sys.exit(0)
    sys.exit(int(os.environ.get("FAKE_DOCKER_EXIT", "0")))
""")


@pytest.mark.parametrize("cdi", [True, False])
def test_image_runs_one_docker_run_with_cdi_or_gpus_all_and_the_exact_env(
        host: dict[str, str], tmp_path: Path, cdi: bool) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    docker = bindir / "docker"
    docker.write_text(DOCKER.format(python=sys.executable))
    docker.chmod(0o755)
    log = tmp_path / "docker.log"
    devices = [{"Source": "cdi", "ID": f"nvidia.com/gpu={gpu_uuid(i)}"} for i in range(4)]
    env = dict(host, PATH=f"{bindir}{os.pathsep}{host['PATH']}", FAKE_DOCKER_LOG=str(log),
               FAKE_DOCKER_EXIT="3", FAKE_DOCKER_DEVICES=json.dumps(devices) if cdi else "null")
    art = tmp_path / "a"
    proc = gpudiag_run(["--image", "img:1", "--", "python", "train.py"], env, art)
    assert proc.returncode == 3, proc.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    runs = [c for c in calls if c[0] == "run"]
    assert len(runs) == 1
    argv = runs[0]
    assert argv[-3:] == ["img:1", "python", "train.py"]
    uuid = gpu_uuid(0)
    if cdi:
        assert ["--device", f"nvidia.com/gpu={uuid}"] == argv[argv.index("--device"):][:2]
        assert "--gpus" not in argv
    else:
        assert argv[argv.index("--gpus") + 1] == "all" and "--device" not in argv
    envs = [argv[i + 1] for i, a in enumerate(argv) if a == "-e"]
    assert f"CUDA_VISIBLE_DEVICES={uuid}" in envs and f"NVIDIA_VISIBLE_DEVICES={uuid}" in envs
    assert "XLA_PYTHON_CLIENT_PREALLOCATE=false" in envs
    assert "XLA_PYTHON_CLIENT_ALLOCATOR=platform" in envs
    assert "XLA_PYTHON_CLIENT_USE_CUDA_HOST_ALLOCATOR=false" in envs
    close = kv(run_folder(art) / "closeout.txt")
    assert close["container_image"] == "img:1"
    assert close["gpu_injection"] == ("cdi" if cdi else "gpus-all")
    assert load(run_folder(art) / "plan.json")["docker"]["argv"] == ["docker", *argv]


def test_the_verdict_comes_from_a_running_daemon_and_admission_still_observes(
        fakes: FakeDriver, tmp_path: Path) -> None:
    env = host_env(fakes, tmp_path / "host", gpus=2, FAKE_NVML_DEVICE_COUNT=2,
                   GPUDIAG_LOCK_DIR=str(tmp_path / "locks"))
    cfg = write_config(tmp_path / "gpudiag.toml", daemon_toml())
    daemon = Daemon(env, cfg, tmp_path / "state")
    try:
        daemon.wait_ready()
        env["GPUDIAG_DAEMON_URL"] = daemon.url
        art = tmp_path / "a"
        proc = run_gpudiag(["run", "--artifacts", str(art), "--", sys.executable, "-c",
                            "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"], env)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == gpu_uuid(0)
        close = kv(run_folder(art) / "closeout.txt")
        assert close["verdict_source"] == "daemon" and close["gpu_validation_blocker"] == "none"
        # The daemon's verdict says the host is fine; occupancy is still observed here, now.
        plan = load(run_folder(art) / "plan.json")
        assert plan["admission"]["first_observation"]["leaves"]
        assert plan["admission"]["locked_observation"]["leaves"]
    finally:
        daemon.stop()


def test_a_non_python_child_is_verified_from_the_plan_environment(host: dict[str, str],
                                                                   tmp_path: Path) -> None:
    proc = gpudiag_run(["--", "sh", "-c", 'echo "$XLA_PYTHON_CLIENT_PREALLOCATE"; exit 5'],
                       host, tmp_path / "a")
    assert proc.returncode == 5 and proc.stdout == "false\n"
    close = kv(run_folder(tmp_path / "a") / "closeout.txt")
    assert close["preallocation_disabled"] == "yes" and close["preallocation_source"] == "plan"


def test_sigkill_of_gpudiag_itself_leaves_the_gpu_locked_while_argv_lives(
        host: dict[str, str], tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    code = ("import os, pathlib, time; "
            f"pathlib.Path({str(ready)!r}).write_text(str(os.getpid())); time.sleep(2)")
    art = tmp_path / "a"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpudiag", "run", "--artifacts", str(art), "--",
         sys.executable, "-c", code], env=host, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not (ready.exists() and ready.read_text()):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    child = int(ready.read_text())
    lock_path = load(run_folder(art) / "plan.json")["admission"]["locks"][0]["path"]
    proc.kill()
    proc.wait()
    try:
        # The child inherited the lock file: the kernel keeps the flock while it lives.
        assert _locked(lock_path)
        deadline = time.monotonic() + 20
        while _locked(lock_path):
            assert time.monotonic() < deadline, "the lock outlived the child"
            time.sleep(0.05)
        assert ended(child)  # gone, or a zombie nobody reaped yet (its files are closed)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


def test_docker_without_cdi_listing_falls_back_to_gpus_all_once(tmp_path: Path) -> None:
    from gpudiag.runner.containers import discovered_devices, docker_run_argv, plan_docker

    missing = str(tmp_path / "no-docker")
    ids, why = discovered_devices(missing)
    assert ids == () and why is not None and "no-docker" in why
    plan = plan_docker("img", ["run.sh"], [gpu_uuid(1)], {"CUDA_VISIBLE_DEVICES": gpu_uuid(1)},
                       docker=missing)
    assert plan.injection == "gpus-all" and plan.info_error
    assert plan.argv.count("--gpus") == 1 and "--device" not in plan.argv
    # CDI only when every admitted UUID is listed: never a mix of both ways.
    partial = docker_run_argv("img", ["x"], [gpu_uuid(0), gpu_uuid(1)], {},
                              discovered=[f"nvidia.com/gpu={gpu_uuid(0)}"])
    assert partial.injection == "gpus-all" and "--device" not in partial.argv
    none = plan_docker("img", ["x"], [], {"CUDA_VISIBLE_DEVICES": ""}, docker=missing)
    assert none.injection == "none" and "--gpus" not in none.argv and none.info_error is None


def test_the_child_hook_chains_to_the_sitecustomize_it_shadows(host: dict[str, str],
                                                                tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    marker = tmp_path / "their-hook-ran"
    (theirs / "sitecustomize.py").write_text(
        f"import pathlib; pathlib.Path({str(marker)!r}).write_text('yes')\n")
    env = dict(host, PYTHONPATH=str(theirs))
    art = tmp_path / "a"
    proc = gpudiag_run(["--", sys.executable, "-c", "import sys; print(sys.path[1:3])"], env,
                       art)
    assert proc.returncode == 0, proc.stderr
    assert marker.read_text() == "yes"  # the job's own sitecustomize still ran
    # The hook first, the job's PYTHONPATH kept after it.
    assert proc.stdout.strip() == repr([str(run_folder(art) / "python-hook"), str(theirs)])
    assert kv(run_folder(art) / "closeout.txt")["preallocation_source"] == "child"


def test_two_runs_with_one_artifacts_folder_get_two_fresh_private_run_folders(
        host: dict[str, str], tmp_path: Path) -> None:
    art = tmp_path / "art"
    for word in ("first", "second"):
        proc = gpudiag_run(["--gpus", "0", "--require", "nvml", "--", "echo", word], host, art)
        assert proc.returncode == 0, proc.stderr
    runs = sorted(p for p in art.iterdir() if p.is_dir())
    assert len(runs) == 2 and all(oct(p.stat().st_mode & 0o777) == "0o700" for p in runs)
    assert all(re.fullmatch(r"\d{8}T\d{6}Z-[A-Za-z0-9_]{8}", p.name) for p in runs)
    # Neither run replaced the other's output.
    assert sorted((p / "stdout.log").read_text() for p in runs) == ["first\n", "second\n"]
    assert {kv(p / "closeout.txt")["status"] for p in runs} == {"exited"}


@pytest.mark.parametrize("how", [["--xla-allocator", "keep"], "GPUDIAG_XLA_ALLOCATOR"])
def test_xla_allocator_keep_leaves_the_job_s_allocator_and_the_closeout_records_it(
        host: dict[str, str], tmp_path: Path, how: list[str] | str) -> None:
    env = dict(host, XLA_PYTHON_CLIENT_ALLOCATOR="cuda_async")
    env.pop("XLA_PYTHON_CLIENT_USE_CUDA_HOST_ALLOCATOR", None)
    flags = how if isinstance(how, list) else []
    if isinstance(how, str):
        env[how] = "keep"
    art = tmp_path / "art"
    proc = gpudiag_run([*flags, "--gpus", "1", "--", sys.executable, "-c", PRINT_ENV], env, art)
    assert proc.returncode == 0, proc.stderr
    child = json.loads(proc.stdout.strip().splitlines()[-1])["env"]
    assert child["XLA_PYTHON_CLIENT_ALLOCATOR"] == "cuda_async"
    assert "XLA_PYTHON_CLIENT_USE_CUDA_HOST_ALLOCATOR" not in child
    assert child["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"  # preallocation stays off
    close = kv(run_folder(art) / "closeout.txt")
    assert close["xla_allocator"] == "cuda_async" and close["preallocation_disabled"] == "yes"
    assert load(run_folder(art) / "closeout.json")["xla_allocator"] == "cuda_async"


def test_the_default_allocator_is_platform_and_recorded(host: dict[str, str],
                                                        tmp_path: Path) -> None:
    env = dict(host, XLA_PYTHON_CLIENT_ALLOCATOR="bfc")
    proc = gpudiag_run(["--gpus", "1", "--", sys.executable, "-c", PRINT_ENV], env,
                       tmp_path / "art")
    assert proc.returncode == 0, proc.stderr
    assert kv(run_folder(tmp_path / "art") / "closeout.txt")["xla_allocator"] == "platform"


def test_a_bad_xla_allocator_is_refused_before_anything_runs(host: dict[str, str],
                                                             tmp_path: Path) -> None:
    proc = gpudiag_run(["--xla-allocator", "fast", "--", "true"], host, tmp_path / "art")
    assert proc.returncode == 125 and "fast" in proc.stderr
