"""An inline run forks its probe fork server from the caller itself (no exec) when it may.

The CLI's process is single-threaded and has initialized nothing: the server's own
precondition. It becomes the server by a fork, and the probe children are forked from that,
the same children as from an exec'd server (tests/test_forkserver.py). A caller that has a
thread, imported jax/jaxlib/iree/numpy, loaded a driver library, or changed its environment
since it started, gets the exec'd server, as before. docs/design-notes.md "Probe fork server".
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from gpudiag.cli.probing import nvml_runs, parse_backends, probe_requirement
from tests.support.host import EnvFactory, processes_with_env

GPUDIAG = [sys.executable, "-m", "gpudiag"]


def _probe(env: dict[str, str], *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen([*GPUDIAG, "probe", "--backend", "nvml,cuda", "--json", *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _server_and_child(pid: int, backend: str,
                      limit_s: float = 20.0) -> tuple[psutil.Process, psutil.Process]:
    """The fork server below ``pid`` (the CLI's only child) and its ``backend`` probe child."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            for server in psutil.Process(pid).children():
                for child in server.children():
                    if child.cmdline()[3:4] == [backend]:
                        return server, child
        except (psutil.Error, IndexError):
            pass
        time.sleep(0.02)
    raise AssertionError(f"no fork server with a {backend} child below the CLI")


def _forked_from_caller(server: psutil.Process) -> bool:
    # An exec'd server starts with GPUDIAG_PROBE_PARENT_PID in its environment block; a
    # forked one keeps its caller's start block (the kernel shows the block exec gave).
    return "GPUDIAG_PROBE_PARENT_PID" not in server.environ()


def test_a_hung_child_of_the_clis_own_server_is_a_timeout_and_its_group_dies(
        gpu_env: EnvFactory) -> None:
    marker = uuid.uuid4().hex
    proc = _probe(gpu_env(FAKE_CUDA_INIT_HANG=1, GPUDIAG_TEST_MARK=marker), "--timeout", "1")
    server, child = _server_and_child(proc.pid, "cuda")
    assert _forked_from_caller(server)
    assert server.cmdline()[2] == "gpudiag.probes.forkserver"
    argv = child.cmdline()  # longer than the CLI's argv area: it ran on over the environment
    assert argv[:4] == [sys.executable, "-m", "gpudiag.probes", "cuda"]
    assert json.loads(argv[4])["contexts_on"][0].startswith("GPU-")
    assert os.getpgid(child.pid) == child.pid  # its own group, which the deadline kills
    out, err = proc.communicate(timeout=60)
    verdict = json.loads(out)
    assert proc.returncode == 1, err
    assert verdict["gpu_validation_blocker"] == "probe_timeout"
    assert "probe cuda missed its 1 s deadline and was killed" in out
    time.sleep(0.2)
    assert processes_with_env(marker) == []


def test_a_segfaulting_child_of_the_clis_own_server_is_a_crash(gpu_env: EnvFactory) -> None:
    proc = _probe(gpu_env(FAKE_NVML_INIT_CRASH=1))
    out, err = proc.communicate(timeout=60)
    verdict = json.loads(out)
    assert proc.returncode == 1, err
    assert verdict["gpu_validation_blocker"] == "probe_crashed"
    assert "probe nvml was killed by signal 11 (SIGSEGV)" in out


def test_the_cli_probe_verdict_is_the_one_of_spawned_probes(gpu_env: EnvFactory) -> None:
    env = gpu_env()
    forked = json.loads(_probe(env).communicate(timeout=60)[0])
    spawned = json.loads(_probe({**env, "GPUDIAG_PROBE_FORK_SERVER": "0"})
                         .communicate(timeout=60)[0])
    for verdict in (forked, spawned):
        for key in ("checked_at", "age_s"):
            verdict.pop(key, None)
        for run in verdict["backends"].values():
            run.pop("duration_s", None)
            run["detail"].pop("init_duration_s", None)  # a timing too (0.0 or 0.0001 s)
        for device in verdict["devices"]:
            device.pop("last_proven_at", None)
        verdict["evidence"].pop("probe_stderr", None)
    assert forked["gpu_validation_blocker"] == "none"
    assert forked == spawned


@pytest.mark.parametrize(("backends", "reads_nvml"), [
    ("nvml,cuda", True), ("cuda", True), ("nvml", True), ("jax", True), ("host", False),
    ("host,jax:cpu", False), ("iree:local-task", False)])
def test_the_cli_asks_for_nvml_ahead_exactly_when_its_run_reads_nvml(
        backends: str, reads_nvml: bool) -> None:
    # NVML first, for a GPU-touching probe's busy-GPU round (engine/inline.py); a child
    # asked for and never taken would be work thrown away.
    names = parse_backends(backends)
    only = {name.split(":")[0] for name in names}
    assert nvml_runs(probe_requirement(names), only) is reads_nvml


# A caller of the engine's API: prints whether the server was forked from it, and what a
# forked host probe saw of its environment against a spawned one.
CALLER = """
import json, os, sys, threading, time
from gpudiag.core.environment import probe_environment
from gpudiag.engine.forkclient import ForkServer
from gpudiag.engine.isolation import run_probe
how = sys.argv[1]
if how == "thread":
    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
elif how == "numpy":
    import numpy
elif how == "nvml":
    import pynvml
    pynvml.nvmlInit()  # the caller initialized NVML itself: its process is no fresh child
elif how == "environ":
    os.environ["GPUDIAG_CHANGED_SINCE_START"] = "1"
env = probe_environment(os.environ)
with ForkServer(env, probes=["host"], fork_here=True) as server:
    server.start()
    seen = []
    for request in ({**env, "CUDA_VISIBLE_DEVICES": "GPU-f00d0000-0000-0000-0000-000000000003"},
                    env):
        forked = run_probe("host", env=request, timeout_s=30, forker=server)
        spawned = run_probe("host", env=request, timeout_s=30)
        seen.append([forked.host.environment, spawned.host.environment, forked.argv])
    print(json.dumps({"forked_here": server.forked_here, "pid": server.pid, "seen": seen}))
"""


def _caller(env: dict[str, str], how: str) -> dict[str, object]:
    proc = subprocess.run([sys.executable, "-c", CALLER, how], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    answer: dict[str, object] = json.loads(proc.stdout.splitlines()[-1])
    return answer


def test_a_forked_child_sees_exactly_its_requests_environment(gpu_env: EnvFactory) -> None:
    answer = _caller(gpu_env(), "plain")
    assert answer["forked_here"] is True and answer["pid"]
    seen = answer["seen"]
    assert isinstance(seen, list)
    for forked, spawned, _argv in seen:
        assert forked == spawned  # the allow-listed environment, variable for variable
    with_visible, plain = seen
    assert with_visible[0]["CUDA_VISIBLE_DEVICES"] == "GPU-f00d0000-0000-0000-0000-000000000003"
    assert "CUDA_VISIBLE_DEVICES" not in plain[0]
    # Added by the probe environment, though not in the caller's start environment.
    assert plain[0]["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"


def test_a_caller_with_a_thread_gets_an_execd_server(gpu_env: EnvFactory) -> None:
    answer = _caller(gpu_env(), "thread")
    assert answer["forked_here"] is False and answer["pid"]  # exec'd, and it served
    seen = answer["seen"]
    assert isinstance(seen, list) and all(f == s for f, s, _ in seen)


def test_a_caller_that_imported_numpy_gets_an_execd_server(gpu_env: EnvFactory) -> None:
    answer = _caller(gpu_env(), "numpy")
    assert answer["forked_here"] is False and answer["pid"]


def test_a_caller_that_initialized_nvml_itself_gets_an_execd_server(
        gpu_env: EnvFactory) -> None:
    answer = _caller(gpu_env(), "nvml")
    assert answer["forked_here"] is False and answer["pid"]


def test_a_caller_whose_environment_changed_since_its_start_gets_an_execd_server(
        gpu_env: EnvFactory) -> None:
    answer = _caller(gpu_env(), "environ")
    assert answer["forked_here"] is False and answer["pid"]


def test_a_caller_in_another_environment_than_its_own_gets_an_execd_server(
        gpu_env: EnvFactory) -> None:
    # This pytest process asks for probes in a fake host's environment, not its own.
    from gpudiag.core.environment import probe_environment
    from gpudiag.engine.forkclient import ForkServer

    env = probe_environment(gpu_env())
    with ForkServer(env, probes=["nvml"], fork_here=True) as server:
        server.start()
        assert server.pid is not None and not server.forked_here


def test_the_clis_own_server_ends_with_the_cli_when_it_is_killed(gpu_env: EnvFactory) -> None:
    marker = uuid.uuid4().hex
    proc = _probe(gpu_env(FAKE_NVML_INIT_HANG=1, GPUDIAG_TEST_MARK=marker), "--timeout", "30")
    server, _child = _server_and_child(proc.pid, "nvml")
    assert _forked_from_caller(server)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    # The server's control socket ends with the CLI; the child's parent watch ends its group.
    deadline = time.monotonic() + 20
    while processes_with_env(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_with_env(marker) == []


def test_the_exec_switch_keeps_the_execd_server(gpu_env: EnvFactory) -> None:
    # GPUDIAG_PROBE_FORK_SERVER=exec: the path before (benchmarks/probe_overhead.py's column).
    marker = uuid.uuid4().hex
    env = gpu_env(FAKE_NVML_INIT_HANG=1, GPUDIAG_TEST_MARK=marker,
                  GPUDIAG_PROBE_FORK_SERVER="exec")
    proc = _probe(env, "--timeout", "1")
    server, _child = _server_and_child(proc.pid, "nvml")
    assert not _forked_from_caller(server)
    out, _err = proc.communicate(timeout=60)
    assert json.loads(out)["gpu_validation_blocker"] == "probe_timeout"
