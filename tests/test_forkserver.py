"""The probe fork server: a forked probe child is the spawned one, faster; never a worse one.

Real fork server, real probe children, the fake driver at the library boundary. Each case
names what a forked child must keep from the spawned one (docs/design-notes.md "Probe fork
server"): the verdict, the deadline and group kill, the crash, the exact environment, the
argv a sibling gpudiag recognizes; and what the caller does when the server is gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from gpudiag.core.environment import probe_environment
from gpudiag.core.probe_run import ProbeRun
from gpudiag.engine.forkclient import ForkServer
from gpudiag.engine.isolation import run_probe
from gpudiag.engine.processes import cmdline, is_probe_child
from tests.fakes.build import FakeDriver
from tests.support.daemon import Daemon, daemon_toml, host_env, wait_for, write_config
from tests.support.host import EnvFactory, processes_with_env


@pytest.fixture
def env(gpu_env: EnvFactory) -> dict[str, str]:
    """A healthy fake host's probe environment, marked to find what a case leaves behind."""
    return probe_environment(gpu_env(GPUDIAG_TEST_MARK=uuid.uuid4().hex))


@pytest.fixture
def server(env: dict[str, str]) -> Iterator[ForkServer]:
    """A fork server started with ``env``, stopped after the case."""
    with ForkServer(env) as forker:
        yield forker


def _children_of(pid: int | None) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children() if pid is not None else []
    except psutil.Error:
        return []


def _maps_libcuda(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return "libcuda" in f.read()
    except OSError:
        return False


def _in_background(backend: str, env: dict[str, str], timeout_s: float,
                   server: ForkServer) -> tuple[threading.Thread, list[ProbeRun]]:
    runs: list[ProbeRun] = []
    worker = threading.Thread(target=lambda: runs.append(
        run_probe(backend, env=env, timeout_s=timeout_s, forker=server)))
    worker.start()
    return worker, runs


def _wait_for(predicate: object, limit_s: float = 20.0) -> None:
    deadline = time.monotonic() + limit_s
    while not predicate() and time.monotonic() < deadline:  # type: ignore[operator]
        time.sleep(0.05)


def test_a_forked_probe_observes_what_a_spawned_one_does(env: dict[str, str],
                                                         server: ForkServer) -> None:
    for backend in ("nvml", "cuda", "host"):
        forked = run_probe(backend, env=env, timeout_s=30, forker=server)
        spawned = run_probe(backend, env=env, timeout_s=30)
        assert forked.ok and spawned.ok, (forked.error, spawned.error)
        assert forked.argv == spawned.argv
        assert forked.exit_code == spawned.exit_code == 0
        assert sorted(forked.observation or {}) == sorted(spawned.observation or {})
    # They were forked: the server runs, and its children ended (it reaped them).
    assert server.pid is not None and _children_of(server.pid) == []


def test_a_forked_child_gets_exactly_the_requests_environment(env: dict[str, str],
                                                              server: ForkServer) -> None:
    seen = []
    for visible in ("1", "GPU-f00d0000-0000-0000-0000-000000000003"):
        run = run_probe("host", env={**env, "CUDA_VISIBLE_DEVICES": visible}, timeout_s=30,
                        forker=server)
        assert run.host is not None, run.error
        seen.append(run.host.environment.get("CUDA_VISIBLE_DEVICES"))
    plain = run_probe("host", env=env, timeout_s=30, forker=server)
    assert plain.host is not None
    assert seen == ["1", "GPU-f00d0000-0000-0000-0000-000000000003"]
    assert "CUDA_VISIBLE_DEVICES" not in plain.host.environment


def test_a_request_whose_loader_environment_differs_is_spawned(env: dict[str, str],
                                                               server: ForkServer) -> None:
    # The dynamic loader reads LD_LIBRARY_PATH once, at exec: a child forked from a server
    # started with the fakes would still find them. Spawned, it finds no NVML library.
    without = {**env, "LD_LIBRARY_PATH": "/nonexistent"}
    assert server.serves(env) and not server.serves(without)
    run = run_probe("nvml", env=without, timeout_s=30, forker=server)
    assert run.nvml is not None and not run.nvml.ok
    assert run.nvml.error is not None and run.nvml.error.code == 12  # LIB_NOT_FOUND


def test_a_forked_cuda_child_shows_the_probe_argv_a_sibling_recognizes(
        gpu_env: EnvFactory) -> None:
    env = probe_environment(gpu_env(FAKE_CUDA_INIT_HANG=1))
    with ForkServer(env) as server:
        worker, runs = _in_background("cuda", env, 20.0, server)
        # Once it touches the driver (NVML could list it only then), its argv is the probe's.
        _wait_for(lambda: any(_maps_libcuda(k.pid) for k in _children_of(server.pid)))
        kids = _children_of(server.pid)
        assert kids and _maps_libcuda(kids[0].pid), "no forked child reached libcuda"
        argv = cmdline(kids[0].pid)
        assert argv[:4] == [sys.executable, "-m", "gpudiag.probes", "cuda"]
        assert is_probe_child(argv)
        assert cmdline(server.pid or 0)[2] == "gpudiag.probes.forkserver"
        assert not is_probe_child(cmdline(server.pid or 0))
        # What ps shows: the argv, not the 16 KiB room the server keeps for its children's.
        for pid in (server.pid or 0, kids[0].pid):
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
            assert len(raw) < 2048 and b"  " not in raw, raw[:200]
        assert cmdline(server.pid or 0)[3:] == ["*"]
        os.killpg(kids[0].pid, signal.SIGKILL)
        worker.join(30)
    assert runs and runs[0].signal == signal.SIGKILL


def test_a_hung_forked_child_is_a_timeout_and_its_group_dies(gpu_env: EnvFactory) -> None:
    marker = uuid.uuid4().hex
    env = probe_environment(gpu_env(FAKE_NVML_INIT_HANG=1, GPUDIAG_TEST_MARK=marker))
    with ForkServer(env) as server:
        assert run_probe("host", env=env, timeout_s=30, forker=server).ok  # server is up
        started = time.monotonic()
        run = run_probe("nvml", env=env, timeout_s=1.5, forker=server)
        took = time.monotonic() - started
        assert run.timed_out and run.signal == signal.SIGKILL
        assert run.error == "probe nvml missed its 1.5 s deadline and was killed"
        assert took < 5, f"the timeout took {took:.1f} s"
        assert _children_of(server.pid) == []
    time.sleep(0.2)
    assert processes_with_env(marker) == []


def test_a_segfaulting_forked_child_is_a_crash(gpu_env: EnvFactory) -> None:
    env = probe_environment(gpu_env(FAKE_NVML_INIT_CRASH=1))
    with ForkServer(env) as server:
        forked = run_probe("nvml", env=env, timeout_s=30, forker=server)
        assert server.pid is not None  # one child's crash is not the server's
    spawned = run_probe("nvml", env=env, timeout_s=30)
    assert forked.signal == spawned.signal == signal.SIGSEGV
    assert forked.error == spawned.error == "probe nvml was killed by signal 11 (SIGSEGV)"
    assert "Fatal Python error" in forked.stderr_tail  # faulthandler, as in a spawned child


def test_a_child_asked_for_ahead_is_the_one_its_run_takes(env: dict[str, str],
                                                          server: ForkServer) -> None:
    server.start()
    assert server.ask_ahead("nvml", None, env)  # the server forks it as soon as it can
    run = run_probe("nvml", env=env, timeout_s=30, forker=server)
    spawned = run_probe("nvml", env=env, timeout_s=30)
    assert run.ok and spawned.ok, (run.error, spawned.error)
    assert run.argv == spawned.argv
    assert sorted(run.observation or {}) == sorted(spawned.observation or {})
    assert _children_of(server.pid) == []  # taken: no second child, none left


def test_a_child_asked_for_ahead_is_taken_only_by_the_same_request(
        env: dict[str, str], server: ForkServer) -> None:
    server.start()
    assert server.ask_ahead("host", None, env)
    visible = "GPU-f00d0000-0000-0000-0000-000000000003"
    run = run_probe("host", env={**env, "CUDA_VISIBLE_DEVICES": visible}, timeout_s=30,
                    forker=server)
    assert run.host is not None, run.error
    assert run.host.environment.get("CUDA_VISIBLE_DEVICES") == visible  # its own child
    plain = run_probe("host", env=env, timeout_s=30, forker=server)
    assert plain.host is not None, plain.error
    assert "CUDA_VISIBLE_DEVICES" not in plain.host.environment


def test_a_hung_child_asked_for_ahead_misses_the_deadline_counted_from_the_ask(
        gpu_env: EnvFactory) -> None:
    marker = uuid.uuid4().hex
    env = probe_environment(gpu_env(FAKE_NVML_INIT_HANG=1, GPUDIAG_TEST_MARK=marker))
    with ForkServer(env) as server:
        server.start()
        assert server.ask_ahead("nvml", None, env)
        time.sleep(1.0)
        started = time.monotonic()
        run = run_probe("nvml", env=env, timeout_s=1.5, forker=server)
        took = time.monotonic() - started
        assert run.timed_out and run.signal == signal.SIGKILL
        assert run.error == "probe nvml missed its 1.5 s deadline and was killed"
        assert took < 1.4, f"the deadline counted from the run, not the ask ({took:.1f} s)"
        assert run.duration_s >= 1.5
    time.sleep(0.2)
    assert processes_with_env(marker) == []


def test_an_unclaimed_child_asked_for_ahead_ends_with_the_server(gpu_env: EnvFactory) -> None:
    marker = uuid.uuid4().hex
    env = probe_environment(gpu_env(FAKE_NVML_INIT_HANG=1, GPUDIAG_TEST_MARK=marker))
    server = ForkServer(env)
    server.start()
    assert server.ask_ahead("nvml", None, env)
    _wait_for(lambda: processes_with_env(marker, cmdline_has="gpudiag.probes nvml") != [])
    assert processes_with_env(marker, cmdline_has="gpudiag.probes nvml") != []
    killed = server.close()
    assert killed >= 1, killed  # killed, as a run's children are at its end
    time.sleep(0.2)
    assert processes_with_env(marker) == []


def test_nothing_is_asked_for_ahead_where_probes_are_spawned(env: dict[str, str]) -> None:
    off = {**env, "GPUDIAG_PROBE_FORK_SERVER": "0"}
    with ForkServer(off) as server:
        assert not server.ask_ahead("nvml", None, off)
        assert server.pid is None


def test_a_dead_fork_server_means_spawned_probes(env: dict[str, str],
                                                 server: ForkServer) -> None:
    assert run_probe("nvml", env=env, timeout_s=30, forker=server).ok
    pid = server.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    _wait_for(lambda: server.pid is None)
    run = run_probe("nvml", env=env, timeout_s=30, forker=server)
    assert run.ok and run.error is None
    assert server.pid is None  # not started again at once: spawned meanwhile


def test_a_pynvml_shadowed_while_the_server_runs_reaches_the_next_probe(
        gpu_env: EnvFactory, tmp_path: Path) -> None:
    # The server imported the real pynvml; a broken one put on the path later is what a
    # fresh child imports, so the next probe must see it (spawned), not the server's copy.
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    base = probe_environment(gpu_env(GPUDIAG_TEST_MARK=uuid.uuid4().hex))
    env = {**base, "PYTHONPATH": os.pathsep.join(
        [str(shadow), *filter(None, [base.get("PYTHONPATH")])])}
    with ForkServer(env) as server:
        assert run_probe("nvml", env=env, timeout_s=30, forker=server).ok
        first = server.pid
        assert first is not None
        (shadow / "pynvml.py").write_text("raise RuntimeError('a broken pynvml install')\n")
        broken = run_probe("nvml", env=env, timeout_s=30, forker=server)
        assert not broken.ok and "a broken pynvml install" in broken.stderr_tail + str(
            broken.observation), (broken.error, broken.observation)
        # The stale server ends once its children did; the caller spawns meanwhile.
        _wait_for(lambda: server.pid is None)
        assert server.pid is None
        (shadow / "pynvml.py").unlink()
        assert run_probe("nvml", env=env, timeout_s=30, forker=server).ok


def test_a_fork_server_dying_under_a_running_probe_never_hangs_the_caller(
        gpu_env: EnvFactory) -> None:
    marker = uuid.uuid4().hex
    env = probe_environment(gpu_env(FAKE_NVML_INIT_HANG=1, GPUDIAG_TEST_MARK=marker))
    with ForkServer(env) as server:
        started = time.monotonic()
        worker, runs = _in_background("nvml", env, 3.0, server)
        _wait_for(lambda: _children_of(server.pid))
        assert _children_of(server.pid), "no forked child appeared"
        os.kill(server.pid or 0, signal.SIGKILL)
        worker.join(30)
        took = time.monotonic() - started
    # The forked child ended with its server; the probe was spawned again and timed out on
    # its own deadline, as a spawned probe of a hung driver does.
    assert runs and runs[0].timed_out, runs
    assert took < 15, f"the caller waited {took:.1f} s"
    time.sleep(0.2)
    assert processes_with_env(marker) == []


def test_the_fork_server_is_single_threaded_after_its_imports() -> None:
    code = ("from gpudiag.probes.forkserver import preimport, threads; import sys; "
            "preimport(); print(threads(), sorted(m for m in ('jax', 'iree', 'numpy') "
            "if m in sys.modules), 'pynvml' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split(maxsplit=1)
    assert out == ["1", "[] True\n"]


KILL_FORKED = """
import os, threading, time
from gpudiag.engine.forkclient import ForkServer
from gpudiag.engine.isolation import run_probe
from gpudiag.engine.processes import descendants, kill_child_groups
env = dict(os.environ)
server = ForkServer(env)
threading.Thread(target=run_probe, args=("nvml",), daemon=True,
                 kwargs={"env": env, "timeout_s": 120, "forker": server}).start()
deadline = time.monotonic() + 30
while len(descendants()) < 2 and time.monotonic() < deadline:
    time.sleep(0.05)
print(len(descendants()), kill_child_groups())
"""


def test_the_daemons_exit_kill_reaches_forked_children(gpu_env: EnvFactory) -> None:
    # gpudiag serve calls kill_child_groups on the way out: the fork server's children lead
    # groups of their own below it, and go too.
    marker = uuid.uuid4().hex
    env = probe_environment(gpu_env(FAKE_NVML_INIT_HANG=1, GPUDIAG_TEST_MARK=marker))
    proc = subprocess.run([sys.executable, "-c", KILL_FORKED], env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["2", "2"]  # the server and its child; both groups killed
    _wait_for(lambda: not processes_with_env(marker), 5.0)
    assert processes_with_env(marker) == []


def test_the_daemon_forks_its_probes_from_one_server_and_takes_it_down(
        fakes: FakeDriver, tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    env = host_env(fakes, tmp_path / "host", gpus=2, FAKE_NVML_DEVICE_COUNT=2,
                   GPUDIAG_TEST_MARK=marker)
    daemon = Daemon(env, write_config(tmp_path / "gpudiag.toml", daemon_toml()),
                    tmp_path / "state")
    try:
        daemon.wait_ready()

        def servers() -> list[int]:
            return [k.pid for k in _children_of(daemon.proc.pid)
                    if cmdline(k.pid)[2:3] == ["gpudiag.probes.forkserver"]]

        wait_for(lambda: len(servers()) == 1, 20)
        server = servers()[0]
        status, health = daemon.get("/v1/health")
        assert status == 200 and health["gpu_validation_blocker"] == "none", health
        # Rounds go on (nvml every 0.5 s): the same server forks them all.
        wait_for(lambda: psutil.Process(server).cpu_times().children_user > 0
                 or psutil.Process(server).cpu_times().children_system > 0, 20)
        assert servers() == [server]
    finally:
        assert daemon.stop() == 0
    _wait_for(lambda: not processes_with_env(marker), 10.0)
    assert processes_with_env(marker) == []
