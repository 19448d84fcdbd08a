"""One channel from a run to its daemon (issue 49): the unix socket, with the kernel's word.

A run passes its GPU lock descriptors with its begin (SCM_RIGHTS); the daemon asks the kernel,
in its own /proc/self/fdinfo, which locks those very open files hold: no pid is looked up, so
a run is attested across pid namespaces (a daemon under `unshare --pid --fork --mount-proc`,
as a DaemonSet without hostPID; a run in a container of its own). Its end is the same process
by its pidfd's identity; a refused run reports on the socket once. Real processes, real
locks, real pid namespaces (root), the fake 2-GPU host.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpudiag.daemon.httpserver import MAX_PASSED_FDS, PEER_FDS_KEY
from gpudiag.daemon.httpserver import start as start_http
from gpudiag.daemon.runs import (
    BLOCKS_PER_UID_MINUTE,
    Peer,
    RunRefused,
    RunReport,
    RunWindows,
    identity,
    parse_block,
    peer_of,
)
from gpudiag.engine import wire
from gpudiag.engine.locks import locked_through, release, try_lock
from tests.fakes.build import FakeDriver
from tests.support.daemon import Daemon, daemon_toml, metric_samples, wait_for, write_config
from tests.support.run import Rig, run_folder

GPU0 = "GPU-f00d0000-0000-4000-8000-000000000000"
GPU1 = "GPU-f00d0001-0000-4000-8000-000000000001"
UNSHARE_PID = ("unshare", "--pid", "--fork", "--mount-proc", "--kill-child")


def _pid_namespaces() -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a pid namespace")


# --- the kernel's word on passed descriptors -------------------------------------------------

def test_only_a_descriptor_holding_its_gpu_lock_exclusively_attests_that_gpu(
        tmp_path: Path) -> None:
    locks = tmp_path / "locks"
    held = try_lock(locks, GPU0)
    shared = try_lock(locks, GPU1, shared=True)
    assert held is not None and shared is not None
    other = os.open(tmp_path / "other", os.O_CREAT | os.O_RDWR)
    fcntl.flock(other, fcntl.LOCK_EX)
    unlocked = os.open(locks / f"{GPU0}.lock", os.O_RDONLY)  # the same file, no lock of its own
    try:
        assert locked_through(locks, [GPU0, GPU1], [held.fd]) == (GPU0,)
        assert locked_through(locks, [GPU0, GPU1], [shared.fd, other, unlocked]) == ()
        assert locked_through(locks, [GPU0], [os.dup(held.fd)]) == (GPU0,)  # same description
        assert locked_through(locks, [GPU0], [99999]) == ()  # not open at all
    finally:
        for fd in (other, unlocked):
            os.close(fd)
        release([held, shared])
    # Released: the same descriptor number attests nothing any more.
    again = os.open(locks / f"{GPU0}.lock", os.O_RDONLY)
    try:
        assert locked_through(locks, [GPU0], [again]) == ()
    finally:
        os.close(again)


def test_a_begin_with_descriptors_needs_no_pid_and_one_without_a_visible_pid_is_refused(
        tmp_path: Path) -> None:
    locks = tmp_path / "locks"
    lock = try_lock(locks, GPU0)
    assert lock is not None
    runs = RunWindows(locks, lambda: None)
    own = os.pidfd_open(os.getpid())
    try:
        # pid 0: the peer is in a pid namespace this daemon cannot see.
        invisible = Peer(os.getuid(), 0, None, own, identity(own))
        with pytest.raises(RunRefused) as refused:
            runs.begin(invisible, [GPU0], None)
        assert refused.value.code == "gpus_not_locked"
        run = runs.begin(invisible, [GPU0, GPU1], None, [lock.fd])
        assert run.gpus == (GPU0,)
        # The same process ends it (its pidfd's identity), another one cannot.
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        other = os.pidfd_open(child.pid)
        try:
            with pytest.raises(RunRefused) as refused:
                runs.end(Peer(os.getuid(), 0, None, other, identity(other)), run.id,
                         RunReport(0))
            assert refused.value.code == "not_the_run"
        finally:
            os.close(other)
            child.kill()
            child.wait()
    finally:
        release([lock])


def test_a_refusal_counts_once_per_process_and_at_most_the_rate_per_uid() -> None:
    now = [1000.0]
    runs = RunWindows(Path("/nonexistent"), lambda: None, clock=lambda: now[0])
    runs.blocked(Peer(1000, 10, 5.0, None, 111))
    with pytest.raises(RunRefused) as again:
        runs.blocked(Peer(1000, 10, 5.0, None, 111))
    assert again.value.code == "already_blocked"
    for i in range(BLOCKS_PER_UID_MINUTE - 1):
        runs.blocked(Peer(1000, 100 + i, 5.0, None, 1000 + i))
    with pytest.raises(RunRefused) as flood:
        runs.blocked(Peer(1000, 99, 5.0, None, 99))
    assert flood.value.status == 429
    runs.blocked(Peer(1001, 98, 5.0, None, 98))  # another uid has its own allowance
    now[0] += 61
    runs.blocked(Peer(1000, 99, 5.0, None, 99))  # a minute later, again
    with pytest.raises(RunRefused):
        runs.blocked(Peer(1002, 0, None, None, None))  # nothing tells this process apart


@pytest.mark.parametrize(("params", "ok"), [
    ({"code": "gpu_lost", "codes": "gpu_lost,cuda_no_device"}, True),
    ({"code": "made_up_code_9"}, True),  # its word: counted as "other" by the numbers
    ({"code": "GPU lost"}, False),
    ({"code": ""}, False),
    ({"code": "gpu_lost", "codes": ",".join(f"c{i}" for i in range(65))}, False),
])
def test_a_refusal_s_codes_are_code_names_or_a_400(params: dict[str, str], ok: bool) -> None:
    if ok:
        assert parse_block(params)[0] == params["code"]
    else:
        with pytest.raises(RunRefused) as bad:
            parse_block(params)
        assert bad.value.status == 400


def test_peer_of_an_invisible_pid_has_no_start_time_but_its_pidfd_identity() -> None:
    own = os.pidfd_open(os.getpid())
    try:
        peer = peer_of(os.getuid(), 0, own)
        assert peer.started_at is None and peer.pidfd == own
        assert peer.identity is None or peer.identity == os.fstat(own).st_ino
    finally:
        os.close(own)


# --- the transport: descriptors with the request's first bytes --------------------------------

def _echo_fds(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    """A WSGI app answering with the inodes of the descriptors passed to it."""
    inodes = [os.fstat(fd).st_ino for fd in environ.get(PEER_FDS_KEY) or ()]
    start_response("200 OK", [("Content-Type", "application/json")])
    return [json.dumps({"inodes": inodes}).encode()]


@pytest.fixture
def echo(tmp_path: Path) -> Iterator[tuple[str, Any]]:
    sock = str(tmp_path / "echo.sock")
    server, thread = start_http(_echo_fds, "", 0, unix_path=sock, register=False)
    try:
        yield f"unix:{sock}", server
    finally:
        server.shutdown()
        thread.join(5)


def test_descriptors_passed_with_a_request_reach_the_app_and_are_closed_after(
        echo: tuple[str, Any], tmp_path: Path) -> None:
    url, server = echo
    files = [tmp_path / f"f{i}" for i in range(3)]
    fds = [os.open(f, os.O_CREAT | os.O_RDONLY) for f in files]
    env = {"GPUDIAG_DAEMON_USER": str(os.getuid())}
    try:
        status, body, why, _ = wire.request(url, "POST", "/x", {}, env=env, fds=fds)
        assert status == 200, why
        assert json.loads(body)["inodes"] == [f.stat().st_ino for f in files]
        # Too many: the first MAX_PASSED_FDS arrive, the rest are closed by the kernel.
        many = [fds[0]] * (MAX_PASSED_FDS + 10)
        status, body, why, _ = wire.request(url, "POST", "/x", {}, env=env, fds=many)
        assert status == 200 and len(json.loads(body)["inodes"]) == MAX_PASSED_FDS, why
        status, body, _, _ = wire.request(url, "GET", "/x", {}, env=env)
        assert json.loads(body)["inodes"] == []
    finally:
        for fd in fds:
            os.close(fd)
    wait_for(lambda: server._held_fds == 0, 5)
    # None is left open in the server's process (this one): the files have no other opener.
    mine = {os.stat(f"/proc/self/fd/{n}").st_ino for n in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{n}")}
    assert not mine & {f.stat().st_ino for f in files}


def test_descriptors_cannot_be_sent_over_tcp() -> None:
    status, _, why, _ = wire.request("http://127.0.0.1:9", "POST", "/v1/runs/begin", {},
                                     env={}, fds=[0])
    assert status is None and "not a unix socket" in why


# --- real pid namespaces ------------------------------------------------------------------------

def _allocations(daemon: Daemon) -> list[dict[str, str]]:
    return [lab for lab, v in metric_samples(daemon, "gpudiag_gpu_allocation_info") if v == 1]


def _watching(daemon: Daemon) -> tuple[list[list[dict[str, str]]], threading.Event,
                                       threading.Thread]:
    seen: list[list[dict[str, str]]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.append(_allocations(daemon))
            time.sleep(0.1)

    thread = threading.Thread(target=watch)
    thread.start()
    return seen, done, thread


def _daemon(rig: Rig, tmp_path: Path, prefix: tuple[str, ...] = ()) -> tuple[Daemon, Path]:
    sock = tmp_path / "d.sock"
    toml = daemon_toml({"backends.nvml": {"interval_s": 1}})
    daemon = Daemon(rig.env, write_config(tmp_path / "gpudiag.toml", toml), rig.state_dir,
                    extra_args=("--socket", str(sock)), prefix=prefix)
    return daemon, sock


def _jobs(state: Path) -> list[Any]:
    """The job records the daemon's history keeps, newest first."""
    from gpudiag.daemon.store import HistoryStore, default_path

    store = HistoryStore(default_path(state), readonly=True)
    try:
        return list(store.jobs(limit=10))
    finally:
        store.close()


@pytest.mark.slow
def test_a_daemon_in_its_own_pid_namespace_attests_and_counts_a_host_run(
        fakes: FakeDriver, tmp_path: Path) -> None:
    """The daemon cannot see the run's pid (its peer credentials say pid 0): the run's lock
    descriptors and its pidfd attest it all the same, and it shows while it runs."""
    _pid_namespaces()
    rig = Rig(fakes, tmp_path)
    daemon, sock = _daemon(rig, tmp_path, UNSHARE_PID)
    try:
        daemon.wait_ready(60)
        seen, done, watcher = _watching(daemon)
        try:
            proc, closeout, _ = rig.run("python3", "-c", "import time; time.sleep(2)",
                                           daemon=daemon, url=f"unix:{sock}")
        finally:
            done.set()
            watcher.join()
        assert proc.returncode == 0, proc.stderr
        assert closeout["job_record"]["attested"] == "socket", closeout["job_record"]
        (slot,) = closeout["gpus"]
        held = [s for s in seen if s]
        assert held and all(s[0]["uuid"] == slot["uuid"] for s in held), seen
        # pid 0 to it: the job is named by the daemon's run id, never "pid-0".
        assert held[0][0]["job_id"] == f"run-{closeout['job_record']['run']}", held[0]
        wait_for(lambda: not _allocations(daemon), 10, interval=0.1)
        refused = {lab["reason"]: v for lab, v in
                   metric_samples(daemon, "gpudiag_job_records_refused_total")}
        assert refused["unattested"] == 0, refused
    finally:
        daemon.stop()  # unshare ignores SIGTERM while it waits: killed, with its namespace


@pytest.mark.slow
def test_a_run_in_its_own_pid_namespace_is_attested_by_the_host_daemon(
        fakes: FakeDriver, tmp_path: Path) -> None:
    _pid_namespaces()
    rig = Rig(fakes, tmp_path)
    daemon, sock = _daemon(rig, tmp_path)
    try:
        daemon.wait_ready(60)
        artifacts = tmp_path / "ns-run"
        env = {**rig.env, "GPUDIAG_DAEMON_URL": f"unix:{sock}",
               "GPUDIAG_DAEMON_USER": str(os.getuid())}
        # A shell as the namespace's pid 1, as a container's init: the run's detached
        # watcher and meter are reparented to it, not to the run (which waits for its
        # descendants); the namespace ends with it.
        run = [sys.executable, "-m", "gpudiag", "run", "--gpus", "1", "--artifacts",
               str(artifacts), "--", "sh", "-c", "echo $$; sleep 1"]
        proc = subprocess.run(
            [*UNSHARE_PID, "sh", "-c", '"$@"; exit $?', "init", *run],
            env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        closeout = json.loads((run_folder(artifacts) / "closeout.json").read_text())
        assert closeout["job_record"]["attested"] == "socket", closeout["job_record"]
        # The run was pid 1 of its namespace, its job's shell a low pid there; the daemon
        # keeps the run's pid as its own namespace names it.
        assert int(proc.stdout.split()[0]) < 100, proc.stdout
        (job,) = wait_for(lambda: _jobs(rig.state_dir), 10)
        assert job.attested == "socket" and job.pid is not None and job.pid > 1, job
    finally:
        assert daemon.stop() == 0


@pytest.mark.slow
def test_a_refused_run_reports_on_the_socket_once_and_drops_no_file(
        fakes: FakeDriver, tmp_path: Path) -> None:
    rig = Rig(fakes, tmp_path)
    rig.knobs["FAKE_NVML_DEVICE_ERRORS"] = "0:15,1:15"
    from tests.fakes.build import write_state_file

    write_state_file(rig.state_file, rig.knobs)
    daemon, sock = _daemon(rig, tmp_path)
    try:
        daemon.wait_ready(60)
        proc, closeout, _ = rig.run("true", daemon=daemon, url=f"unix:{sock}")
        assert proc.returncode == 125 and closeout["gpu_validation_blocker"] == "gpu_lost"
        counted = wait_for(lambda: [v for lab, v in metric_samples(
            daemon, "gpudiag_preflight_blocks_total") if lab["code"] == "gpu_lost"], 15)
        assert counted == [1.0]
        assert not list((rig.state_dir / "job-closeouts").iterdir())
    finally:
        assert daemon.stop() == 0


def test_a_begin_over_a_socket_pair_from_a_process_without_locks_attests_nothing(
        tmp_path: Path) -> None:
    """Descriptors of files that are not the daemon's lock files, or not locked, open no run."""
    locks = tmp_path / "locks"
    runs = RunWindows(locks, lambda: None)
    a, b = socket.socketpair(socket.AF_UNIX)
    try:
        fake = os.open(tmp_path / f"{GPU0}.lock", os.O_CREAT | os.O_RDWR)
        fcntl.flock(fake, fcntl.LOCK_EX)  # a lock file of the same name, in another folder
        socket.send_fds(a, [b"x"], [fake])
        _, fds, _, _ = socket.recv_fds(b, 1, 4)
        peer = peer_of(os.getuid(), os.getpid(), os.pidfd_open(os.getpid()))
        with pytest.raises(RunRefused) as refused:
            runs.begin(peer, [GPU0], None, fds)
        assert refused.value.code == "gpus_not_locked"
        for fd in (fake, *fds):
            os.close(fd)
    finally:
        a.close()
        b.close()
