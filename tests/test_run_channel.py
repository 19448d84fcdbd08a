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
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gpudiag.daemon.httpserver import MAX_PASSED_FDS, PEER_FDS_KEY
from gpudiag.daemon.httpserver import start as start_http
from gpudiag.daemon.runs import (
    BLOCKS_PER_UID_MINUTE,
    LET_GO_GRACE_S,
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
from tests.support.run import Rig, job_record, run_folder

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


# --- a run the daemon cannot see, across a daemon restart (issue 49's leftover) ---------------

def _invisible_run(locks: Path, kept: Path
                   ) -> tuple[RunWindows, str, subprocess.Popen[bytes], Any]:
    """A run begun with pid 0 (another pid namespace) on GPU0's lock by a child process;
    (the windows, its id, that process, its lock)."""
    lock = try_lock(locks, GPU0)
    assert lock is not None
    runs = RunWindows(locks, lambda: None, kept=kept)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    fd = os.pidfd_open(proc.pid)
    run = runs.begin(Peer(os.getuid(), 0, None, fd, identity(fd)), [GPU0], "42", [lock.fd])
    return runs, run.id, proc, lock


def _peer(proc: subprocess.Popen[bytes]) -> Peer:
    """The process as a peer of another pid namespace (pid 0), its pidfd taken now."""
    fd = os.pidfd_open(proc.pid)
    return Peer(os.getuid(), 0, None, fd, identity(fd))


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait()


def _record_of(run_id: str | None, pid: int = 4242) -> Any:
    return replace(job_record(pid, [], exit_code=0, started=time.time() - 5), run=run_id)


def test_a_run_seen_by_no_pid_is_opened_again_after_a_restart_while_its_lock_is_held(
        tmp_path: Path) -> None:
    locks, kept = tmp_path / "locks", tmp_path / "open-runs.json"
    _, run_id, proc, lock = _invisible_run(locks, kept)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (entry,) = json.loads(kept.read_text())["runs"]
        assert entry["pid"] == 0 and entry["seen_by"] == "locks" and entry["identity"]
        assert list(entry["locks"]) == [GPU0]
        # The daemon restarts: the kernel says the very lock file is held; no pid is asked.
        now = [time.time()]
        again = RunWindows(locks, lambda: None, kept=kept, clock=lambda: now[0])
        assert again.restore() == 1
        (back,) = again.open_runs()
        assert (back.id, back.gpus, back.peer.pid, back.slurm_job_id) == (
            run_id, (GPU0,), 0, "42")
        again.poll()
        assert [r.id for r in again.open_runs()] == [run_id]  # still held: still open
        # Only the process that began it ends it (its pidfd's identity, kept across).
        with pytest.raises(RunRefused) as refused:
            again.end(_peer(other), run_id, RunReport(0))
        assert refused.value.code == "not_the_run"
        # `gpudiag run` lets its locks go (and proves them free) before its end arrives:
        # the run stays open for that end.
        release([lock])
        again.poll()
        assert [r.id for r in again.open_runs()] == [run_id]
        ran, job = again.end(_peer(proc), run_id, RunReport(0))
        assert ran.id == run_id and job.gpus == (GPU0,)
    finally:
        release([lock])
        _stop(proc)
        _stop(other)
    # No end came: LET_GO_GRACE_S after its locks went, it leaves the open runs unrecorded.
    now[0] += LET_GO_GRACE_S - 0.1
    again.poll()
    assert [r.id for r in again.open_runs()] == [run_id]
    now[0] += 0.1
    again.poll()
    assert again.open_runs() == ()


def test_a_run_whose_lock_went_while_the_daemon_was_down_is_closed_and_its_record_matched(
        tmp_path: Path) -> None:
    locks, kept = tmp_path / "locks", tmp_path / "open-runs.json"
    _, run_id, proc, lock = _invisible_run(locks, kept)
    _stop(proc)
    release([lock])  # the run ended while no daemon ran
    again = RunWindows(locks, lambda: None, kept=kept)
    assert again.restore() == 0
    assert json.loads(kept.read_text())["runs"] == []
    # Its inbox record names its run id: matched to that run whatever pid it names, and
    # only when the kernel says the run's own uid wrote it.
    assert again.match(_record_of(run_id), 65534)[0] == "foreign"
    how, job, matched = again.match(_record_of(run_id), os.getuid())
    assert (how, matched) == ("socket", run_id) and job is not None
    assert job.pid == 0 and job.gpus == (GPU0,)
    again.close_matched(run_id, job.ended)
    assert again.match(_record_of(run_id), os.getuid())[0] == "duplicate"
    # A run id the daemon never gave attests nothing.
    assert again.match(_record_of("0123456789abcdef"), 65534)[0] == "unattested"


def test_a_lock_file_replaced_while_the_daemon_was_down_reopens_no_run(tmp_path: Path) -> None:
    """Another file of the same name, held by someone else, is not the run's lock."""
    locks, kept = tmp_path / "locks", tmp_path / "open-runs.json"
    _, _, proc, lock = _invisible_run(locks, kept)
    _stop(proc)
    release([lock])
    (locks / f"{GPU0}.lock").unlink()
    other = try_lock(locks, GPU0)
    assert other is not None
    try:
        again = RunWindows(locks, lambda: None, kept=kept)
        assert again.restore() == 0 and again.open_runs() == ()
    finally:
        release([other])


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


# --- a run the daemon cannot see, across a real daemon restart ----------------------------------

def _waiting_run(rig: Rig, sock: Path, name: str) -> tuple[subprocess.Popen[str], Path, Path]:
    """A host `gpudiag run` on the daemon's socket, its job waiting for a go file; (the
    process, its artifacts folder, the go file), once its job started."""
    started, go, artifacts = rig.root / f"{name}-started", rig.root / f"{name}-go", \
        rig.root / name
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpudiag", "run", "--gpus", "1", "--artifacts", str(artifacts),
         "--daemon-url", f"unix:{sock}", "--", "sh", "-c",
         f"touch {started}; while [ ! -e {go} ]; do sleep 0.1; done"],
        env=rig.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: started.exists() or proc.poll() is not None, 60)
    assert proc.poll() is None, proc.communicate()
    return proc, artifacts, go


def _run_shown(daemon: Daemon) -> str:
    """The one run the allocation series names (pid 0 to the daemon: by its run id)."""
    (alloc,) = wait_for(lambda: _allocations(daemon), 20)
    job_id: str = alloc["job_id"]
    assert job_id.startswith("run-"), alloc
    return job_id.removeprefix("run-")


def _open_in_health(daemon: Daemon) -> list[str]:
    status, health = daemon.get("/v1/health")
    assert status in (200, 503), health
    return [r["run"] for r in health["evidence"]["runs"]["open"]]


@pytest.mark.slow
def test_a_run_the_daemon_cannot_see_is_shown_across_a_daemon_restart_and_closed_after(
        fakes: FakeDriver, tmp_path: Path) -> None:
    """The daemon (its own pid namespace) sees the run as pid 0: restarted mid-run, it opens
    the run again from its lock file, still held, and the run's end reaches it."""
    _pid_namespaces()
    rig = Rig(fakes, tmp_path)
    daemon, sock = _daemon(rig, tmp_path, UNSHARE_PID)
    proc: subprocess.Popen[str] | None = None
    try:
        daemon.wait_ready(60)
        proc, artifacts, go = _waiting_run(rig, sock, "across")
        run_id = _run_shown(daemon)
        (kept,) = json.loads((rig.state_dir / "open-runs.json").read_text())["runs"]
        assert (kept["id"], kept["pid"], kept["seen_by"]) == (run_id, 0, "locks"), kept
        daemon.stop()
        daemon, _ = _daemon(rig, tmp_path, UNSHARE_PID)
        daemon.wait_ready(60)
        assert any("still running: open again" in line for line in daemon.lines)
        assert _run_shown(daemon) == run_id
        assert run_id in wait_for(lambda: _open_in_health(daemon) or None, 20)
        go.touch()
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        closeout = json.loads((run_folder(artifacts) / "closeout.json").read_text())
        assert closeout["job_record"]["attested"] == "socket", closeout["job_record"]
        assert closeout["job_record"]["run"] == run_id
        wait_for(lambda: not _allocations(daemon), 10, interval=0.1)
        (job,) = wait_for(lambda: _jobs(rig.state_dir), 10)
        assert (job.attested, job.run_id) == ("socket", run_id), job
        assert json.loads((rig.state_dir / "open-runs.json").read_text())["runs"] == []
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.communicate()
        daemon.stop()


@pytest.mark.slow
def test_a_run_that_ended_while_the_daemon_was_down_is_closed_and_its_inbox_record_matched(
        fakes: FakeDriver, tmp_path: Path) -> None:
    """Its end reaches no daemon: its inbox record names its run id and closes that run at
    the restart, pid 0 or not; another user's copy of that record closes nothing."""
    _pid_namespaces()
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv(1) to act as a second user")
    rig = Rig(fakes, tmp_path)
    daemon, sock = _daemon(rig, tmp_path, UNSHARE_PID)
    proc: subprocess.Popen[str] | None = None
    try:
        daemon.wait_ready(60)
        proc, artifacts, go = _waiting_run(rig, sock, "down")
        run_id = _run_shown(daemon)
        daemon.stop()
        go.touch()  # the run ends (its lock with it) while no daemon runs
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        said = json.loads((run_folder(artifacts) / "closeout.json").read_text())["job_record"]
        assert said["run"] == run_id and said["path"], said
        record = Path(said["path"]).read_text()
        assert json.loads(record)["run"] == run_id
        # uid 65534 drops a copy naming the same run into the (sticky, 1733) inbox: written
        # by that user (setpriv) where it may write, moved in with its owner kept (pytest's
        # folders are closed to other users).
        spool = Path(tempfile.mkdtemp(prefix="gpudiag-forge-"))
        try:
            spool.chmod(0o777)
            planted = subprocess.run(
                ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
                 sys.executable, "-I", "-c",
                 "import sys; open(sys.argv[1], 'w').write(sys.argv[2])",
                 str(spool / "forged.json"), record], capture_output=True, text=True,
                timeout=30)
            assert planted.returncode == 0, planted.stderr
            forged = rig.state_dir / "job-closeouts" / "0-forged.json"
            shutil.move(spool / "forged.json", forged)
            assert forged.stat().st_uid == 65534
        finally:
            shutil.rmtree(spool, ignore_errors=True)
        daemon, _ = _daemon(rig, tmp_path, UNSHARE_PID)
        daemon.wait_ready(60)
        assert any("ended while the daemon was down" in line for line in daemon.lines)
        (job,) = wait_for(lambda: _jobs(rig.state_dir), 20)
        assert (job.attested, job.run_id, job.uid) == ("socket", run_id, 0), job
        refused = wait_for(lambda: {lab["reason"]: v for lab, v in metric_samples(
            daemon, "gpudiag_job_records_refused_total")} if not list(
            (rig.state_dir / "job-closeouts").iterdir()) else None, 20)
        assert (refused["foreign"], refused["unattested"]) == (1, 0), refused
        assert not _allocations(daemon)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.communicate()
        daemon.stop()
