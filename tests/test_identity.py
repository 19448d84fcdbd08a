"""Issue 38: facts no other user can forge. A second local user (uid 65534 through setpriv)
writes lock records, names processes like probes, holds shared locks, plants FIFOs and
escape sequences; root's gpudiag decides on what the kernel attests (flock holders from
/proc/locks, uids, pids and their start times), never on what that user wrote.

Every test acts as uid 65534 and runs gpudiag as root, through the real CLI or daemon.
Skipped only where the test cannot switch users (not root).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from gpudiag.core.readiness import BUSY, FREE, GpuOccupancy
from gpudiag.engine.occupancy_view import relook
from tests.fakes.build import write_state_file
from tests.support.host import EnvFactory, clean_env, make_host_dirs, run_gpudiag, verdict_of
from tests.support.run import run_folder

NOBODY = 65534
NO_DAEMON = "http://127.0.0.1:9"
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="needs root and setpriv to act as a second user")


def _marked(lock_dir: Path, occupancy: Mapping[str, GpuOccupancy]) -> dict[str, GpuOccupancy]:
    """The one view's lock answer over ``occupancy`` (engine/occupancy_view.relook)."""
    return dict(relook(occupancy, occupancy, lock_dir=lock_dir).gpus)


def gpu_uuid(i: int) -> str:
    return f"GPU-f00d{i:04x}-0000-4000-8000-{i:012x}"


def nobody_argv(*argv: str) -> list[str]:
    return ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups",
            "--", *argv]


def as_nobody(script: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a shell script as uid/gid 65534 with no supplementary groups."""
    proc = subprocess.run(nobody_argv("sh", "-c", script), capture_output=True, text=True,
                          timeout=30)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def wait_for_file(path: Path, proc: subprocess.Popen[str] | None = None,
                  timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc is None or proc.poll() is None, "the helper ended early"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def stop(proc: subprocess.Popen[str]) -> None:
    """End a helper this test started (its whole session: setpriv's command and children)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, 9)
        except (ProcessLookupError, PermissionError):
            proc.kill()
    proc.wait(10)


@pytest.fixture
def shared() -> Iterator[Path]:
    """A 1777 folder both users reach (under /tmp, like /tmp itself or /run/gpudiag/locks)."""
    folder = Path(tempfile.mkdtemp(prefix="gpudiag-identity-", dir="/tmp"))
    folder.chmod(0o1777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def locks(shared: Path) -> Path:
    folder = shared / "locks"
    folder.mkdir()
    folder.chmod(0o1777)
    return folder


def host(gpu_env: EnvFactory, locks: Path, gpus: int, **knobs: str | int) -> dict[str, str]:
    return gpu_env(FAKE_NVML_DEVICE_COUNT=gpus, GPUDIAG_LOCK_DIR=str(locks),
                   GPUDIAG_DAEMON_URL=NO_DAEMON, **knobs)


# A root job's lock, held as `gpudiag run` holds it (exclusive, purpose job), until killed.
_HOLD_AS_JOB = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from gpudiag.engine.locks import try_lock
    lock = try_lock(Path(sys.argv[1]), sys.argv[2], purpose="job")
    assert lock is not None
    Path(sys.argv[3]).touch()
    time.sleep(60)
""")

# As nobody: make the lock file first and keep a read-write descriptor, then, once root's
# job holds it, rewrite its holder record to say "probe" through that descriptor (the
# file's mode checked at open time only: root's chown and chmod come too late).
_FORGE_RECORD = textwrap.dedent("""
    import json, os, sys, time
    path, started, done = sys.argv[1:4]
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o666)
    os.fchmod(fd, 0o666)
    open(done + ".opened", "w").close()
    while not os.path.exists(started):
        time.sleep(0.05)
    time.sleep(0.3)
    record = json.loads(os.pread(fd, 4096, 0) or b"{}")
    record["purpose"] = "probe"
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode() + b"\\n", 0)
    open(done, "w").close()
    time.sleep(60)
""")


# --- class 1: lock holder records ---------------------------------------------------------


def test_a_forged_probe_record_on_a_root_jobs_lock_leaves_the_gpu_busy(
        gpu_env: EnvFactory, locks: Path, shared: Path) -> None:
    env = host(gpu_env, locks, 1)
    uuid = gpu_uuid(0)
    lock_file = locks / f"{uuid}.lock"
    started, forged = shared / "job-started", shared / "forged"
    forger = subprocess.Popen(nobody_argv(sys.executable, "-c", _FORGE_RECORD, str(lock_file),
                                          str(started), str(forged)),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    job: subprocess.Popen[str] | None = None
    try:
        wait_for_file(Path(str(forged) + ".opened"), forger)
        job = subprocess.Popen([sys.executable, "-c", _HOLD_AS_JOB, str(locks), uuid,
                                str(started)], env=env, start_new_session=True, text=True)
        wait_for_file(forged, forger)
        assert json.loads(lock_file.read_text())["purpose"] == "probe"  # the forgery held
        # The daemon's lock view: the job's GPU is busy, whatever the record says.
        seen = _marked(locks, {uuid: GpuOccupancy(uuid, FREE)})
        assert seen[uuid].state == BUSY, seen
        # Root's inline preflight: the GPU a job holds is busy, not "a sibling probing".
        start = time.monotonic()
        rc, rec = verdict_of(["preflight", "--gpus", "1", "--no-daemon", "--format", "json"],
                             env)
        assert rc == 1 and rec["gpu_validation_blocker"] == "devices_busy", rec["blockers"]
        assert time.monotonic() - start < 15, "it waited for a 'sibling' the record made up"
    finally:
        stop(forger)
        if job is not None:
            stop(job)


_HOLD_AND_LEAVE = textwrap.dedent("""
    import fcntl, json, os, sys, time
    path, ready = sys.argv[1:3]
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "purpose": "job"}).encode(), 0)
    if os.fork() == 0:  # the child keeps the lock, the locker exits
        open(ready, "w").write(str(os.getppid()))
        time.sleep(60)
        os._exit(0)
    time.sleep(0.5)
""")


def test_a_refusal_never_names_a_dead_locker_as_the_holder(
        gpu_env: EnvFactory, locks: Path, shared: Path, tmp_path: Path) -> None:
    env = host(gpu_env, locks, 1)
    uuid = gpu_uuid(0)
    ready = shared / "ready"
    holder = subprocess.Popen(nobody_argv(sys.executable, "-c", _HOLD_AND_LEAVE,
                                          str(locks / f"{uuid}.lock"), str(ready)),
                              stdout=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        wait_for_file(ready)
        time.sleep(0.2)
        dead = int(ready.read_text())
        holder.wait(10)  # the locker has exited; its child holds the lock
        assert not psutil.pid_exists(dead) or psutil.Process(dead).status() == "zombie"
        proc = run_gpudiag(["run", "--artifacts", str(tmp_path / "run"), "--gpus", "1",
                            "--lock-timeout", "1", "--", "true"], env)
        assert proc.returncode == 125, proc.stderr
        close = json.loads((run_folder(tmp_path / "run") / "closeout.json").read_text())
        assert close["gpu_validation_blocker"] in ("lock_timeout", "devices_busy"), close
        text = json.dumps(close) + proc.stderr
        assert f'"pid": {dead},' not in text and f"pid {dead} " not in text, text
    finally:
        stop(holder)


_HOLDERS_SEEN = (
    "import json, sys; from pathlib import Path; from gpudiag.engine.locks import holders; "
    "print(json.dumps([[h.pid, h.probing] for h in holders(Path(sys.argv[1]), sys.argv[2]) "
    "or ()]))")


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux)")
def test_a_holder_another_user_namespace_cannot_follow_is_still_the_kernels_locker(
        tmp_path: Path) -> None:
    """A reader in a user namespace of its own (a daemon under `unshare --user`, a container
    without CAP_SYS_PTRACE) lists another process's descriptors but cannot follow them: the
    holder is still the kernel's locker, a sibling probe when it holds the probe mark, never
    "an heir of an exited locker" (the fault matrix met it: its inline preflight's probe lock
    read as another user's shared lock, devices_busy)."""
    from gpudiag.engine.locks import release, try_lock

    locks, uuid = tmp_path / "locks", gpu_uuid(0)
    lock = try_lock(locks, uuid, purpose="probe", shared=True)
    assert lock is not None
    try:
        seen = subprocess.run(["unshare", "--user", "--map-root-user", sys.executable, "-c",
                               _HOLDERS_SEEN, str(locks), uuid],
                              capture_output=True, text=True, timeout=60)
    finally:
        release([lock])
    assert seen.returncode == 0, seen.stderr
    assert json.loads(seen.stdout) == [[os.getpid(), True]]


# --- class 2: sibling probes recognised by argv --------------------------------------------


def test_another_users_process_named_like_a_probe_is_a_user_of_the_gpu(
        gpu_env: EnvFactory, locks: Path, tmp_path: Path) -> None:
    # argv: python3 -c CODE -m gpudiag.probes cuda (what a probe child's argv reads)
    impostor = subprocess.Popen(nobody_argv(sys.executable, "-c", "import time; "
                                            "time.sleep(60)", "-m", "gpudiag.probes", "cuda"),
                                start_new_session=True, text=True)
    try:
        contexts = tmp_path / "contexts.jsonl"
        env = host(gpu_env, locks, 2, FAKE_NVML_PROCESSES=f"0:{impostor.pid}:300",
                   FAKE_CUDA_CONTEXT_LOG=str(contexts))
        rc, rec = verdict_of(["preflight", "--gpus", "2", "--no-daemon", "--format", "json"],
                             env)
        assert rc == 1 and rec["gpu_validation_blocker"] == "devices_busy", rec["blockers"]
        gpu0 = [d for d in rec["devices"] if d["uuid"] == gpu_uuid(0)]
        assert gpu0 and gpu0[0]["occupancy"] == "busy"
        from tests.fakes.jobs import read_context_log

        touched = {e.uuid for e in read_context_log(contexts)} if contexts.exists() else set()
        assert gpu_uuid(0) not in touched, "a CUDA context was made beside another user"
    finally:
        stop(impostor)


# --- class 5: waiting on a shared lock ------------------------------------------------------


def _cpu_s(proc: psutil.Process) -> float:
    """CPU seconds of ``proc`` and of its children, ended (reaped) and alive."""
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system + (t.children_user + t.children_system if p is proc
                                      else 0.0)
    return total


def test_a_job_waiting_for_a_gpu_under_another_users_shared_lock_sleeps_and_names_it(
        gpu_env: EnvFactory, locks: Path, tmp_path: Path) -> None:
    env = host(gpu_env, locks, 1)
    lock_file = locks / f"{gpu_uuid(0)}.lock"
    holder = subprocess.Popen(nobody_argv("flock", "-s", str(lock_file), "sleep", "60"),
                              start_new_session=True, text=True)
    job: subprocess.Popen[str] | None = None
    try:
        deadline = time.monotonic() + 10
        while str(holder.pid) not in Path("/proc/locks").read_text():
            assert time.monotonic() < deadline, "flock -s never held the lock"
            time.sleep(0.05)
        # The daemon's lock view does not publish it free.
        seen = _marked(locks, {gpu_uuid(0): GpuOccupancy(gpu_uuid(0), FREE)})
        assert seen[gpu_uuid(0)].state == BUSY, seen
        job = subprocess.Popen([sys.executable, "-m", "gpudiag", "run", "--artifacts",
                                str(tmp_path / "run"), "--gpus", "1", "--lock-timeout", "20",
                                "--", "true"], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        ps = psutil.Process(job.pid)
        # Past the preflight (its children reaped): the job waits, holding the waiting mark.
        deadline = time.monotonic() + 30
        while not ((locks / f"{gpu_uuid(0)}.waiting").exists()
                   and _holds(job.pid, locks / f"{gpu_uuid(0)}.waiting")):
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()
            time.sleep(0.1)
        time.sleep(0.5)
        cpu0, t0 = _cpu_s(ps), time.monotonic()
        time.sleep(10.0)
        cpu1, t1 = _cpu_s(ps), time.monotonic()
        share = (cpu1 - cpu0) / (t1 - t0)
        print(f"waiting: {share:.1%} of a core")
        assert share <= 0.05, f"the wait burns {share:.0%} of a core"
        _, err = job.communicate(timeout=60)
        assert job.returncode == 125, err
        close = json.loads((run_folder(tmp_path / "run") / "closeout.json").read_text())
        assert close["gpu_validation_blocker"] == "lock_timeout", close
        assert f"pid {holder.pid} (uid {NOBODY}, shared" in json.dumps(close) + err, err
    finally:
        stop(holder)
        if job is not None and job.poll() is None:
            job.kill()
            job.wait(10)


# --- class 6: the client believes any daemon answer -----------------------------------------

# As nobody: squat a loopback port (the daemon is down) and answer every GET with the same
# JSON record, whatever was asked.
_FAKE_DAEMON = textwrap.dedent("""
    import http.server, sys
    body = open(sys.argv[1], "rb").read()
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a):
            pass
    server = http.server.HTTPServer(("127.0.0.1", 0), H)
    open(sys.argv[2] + ".tmp", "w").write(str(server.server_address[1]))
    import os; os.rename(sys.argv[2] + ".tmp", sys.argv[2])
    server.serve_forever()
""")


def _forged_answers(record: dict[str, object]) -> dict[str, dict[str, object]]:
    """Answers that do not hold, from a real ready record (gpus=1, require cuda)."""
    not_ready = dict(record, ready=False)  # ready false, no blocker, blocker "none"
    other_question = json.loads(json.dumps(record))
    other_question["requirement"]["gpus"] = None  # an answer for no --gpus
    other_require = json.loads(json.dumps(record))
    other_require["requirement"]["backends"] = ["nvml"]
    ready_with_blocker = dict(record, blockers=[
        {"code": "gpu_lost", "layer": "device", "backend": None, "device": None,
         "message": "lost", "remediation": "reset"}])
    return {"not_ready_without_blocker": not_ready, "another_gpus": other_question,
            "another_requirement": other_require, "ready_with_a_blocker": ready_with_blocker}


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_a_daemon_answer_that_does_not_hold_is_said_and_answered_here(
        gpu_env: EnvFactory, locks: Path, shared: Path, fmt: str) -> None:
    env = host(gpu_env, locks, 2)
    rc, real = verdict_of(["preflight", "--gpus", "1", "--no-daemon", "--format", "json"], env)
    assert rc == 0 and real["ready"] is True, real["blockers"]
    for name, forged in _forged_answers(real).items():
        answer, port_file = shared / f"{name}.json", shared / f"{name}.port"
        answer.write_text(json.dumps(dict(forged, source="daemon")))
        answer.chmod(0o644)
        server = subprocess.Popen(nobody_argv(sys.executable, "-c", _FAKE_DAEMON, str(answer),
                                              str(port_file)), start_new_session=True,
                                  text=True)
        try:
            wait_for_file(port_file, server)
            url = f"http://127.0.0.1:{port_file.read_text()}"
            proc = run_gpudiag(["preflight", "--gpus", "1", "--format", fmt, "--daemon-url",
                                url], env)
            said = [line for line in proc.stderr.splitlines() if "does not hold" in line]
            assert len(said) == 1, (name, proc.stderr)
            assert proc.returncode == 0, (name, proc.stdout, proc.stderr)  # answered here
            if fmt == "json":
                rec = json.loads(proc.stdout)
                assert rec["source"] == "inline" and rec["ready"] is True, name
            else:
                assert "gpu_validation_blocker=none" in proc.stdout, (name, proc.stdout)
        finally:
            stop(server)


# --- class 7: inputs that hang or exhaust ----------------------------------------------------


def test_a_fifo_or_dev_zero_as_config_or_closeout_is_refused_in_one_line(
        shared: Path) -> None:
    run_dir = shared / "run"
    as_nobody(f"mkfifo {shared}/config.toml && ln -s /dev/zero {shared}/zero.toml && "
              f"mkdir {run_dir} && ln -s /dev/zero {run_dir}/closeout.json && "
              f"mkdir {shared}/run2 && mkfifo {shared}/run2/closeout.json")
    env = {"PATH": "/usr/bin:/bin"}
    cases = [["serve", "--config", str(shared / "config.toml"), "--check-config"],
             ["serve", "--config", str(shared / "zero.toml"), "--check-config"],
             ["explain", "--run", str(run_dir), "--state-dir", str(shared)],
             ["explain", "--run", str(shared / "run2"), "--state-dir", str(shared)]]
    for argv in cases:
        start = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "gpudiag", *argv], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        peak = 0
        while proc.poll() is None and time.monotonic() - start < 20:
            try:
                peak = max(peak, psutil.Process(proc.pid).memory_info().rss)
            except psutil.Error:
                pass
            time.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
        out, err = proc.communicate(timeout=10)
        assert proc.returncode == 2, (argv, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, (argv, err)
        assert peak < 300 << 20, (argv, peak)


def test_a_sighup_with_the_config_swapped_for_a_fifo_keeps_the_daemon_and_its_sigterm(
        fakes: object, tmp_path: Path, shared: Path) -> None:
    from tests.support.daemon import Daemon, daemon_toml, host_env, write_config

    env = host_env(fakes, tmp_path / "host", gpus=1, FAKE_NVML_DEVICE_COUNT=1,  # type: ignore[arg-type]
                   GPUDIAG_LOCK_DIR=str(shared / "locks"))
    config = write_config(shared / "gpudiag.toml", daemon_toml())
    daemon = Daemon(env, config, tmp_path / "state")
    try:
        daemon.wait_ready()
        config.unlink()
        as_nobody(f"mkfifo -m 0666 {config}")
        daemon.proc.send_signal(1)  # SIGHUP: re-read the config
        deadline = time.monotonic() + 10
        while not any("not a regular file" in line for line in daemon.lines):
            assert time.monotonic() < deadline, "\n".join(daemon.lines[-10:])
            time.sleep(0.1)
        assert daemon.get("/healthz")[0] == 200
    finally:
        start = time.monotonic()
        daemon.stop()
        assert time.monotonic() - start < 8, "SIGTERM was not heard"


# --- class 8: terminal injection -------------------------------------------------------------


def test_escape_sequences_in_a_run_another_user_wrote_never_reach_the_terminal(
        gpu_env: EnvFactory, locks: Path, shared: Path, tmp_path: Path) -> None:
    env = host(gpu_env, locks, 1)
    real = tmp_path / "real"
    proc = run_gpudiag(["run", "--artifacts", str(real), "--gpus", "1", "--", "false"], env)
    assert proc.returncode == 1, proc.stderr
    planted = shared / "planted"
    shutil.copytree(run_folder(real), planted)
    evil = "\x1b]0;pwned\x07\x1b[2J\x1b[31mready=true\u202e"
    result = json.loads((planted / "result.json").read_text())
    result["argv"] = ["false", evil]
    (planted / "result.json").write_text(json.dumps(result))
    close = json.loads((planted / "closeout.json").read_text())
    close["attribution"]["missing"] = [evil]
    (planted / "closeout.json").write_text(json.dumps(close))
    subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(planted)], check=True)
    for fmt in ("text", "kv"):
        out = run_gpudiag(["explain", "--run", str(planted), "--state-dir", str(tmp_path),
                           "--format", fmt], {"PATH": "/usr/bin:/bin"})
        assert out.returncode == 0, out.stderr
        assert "\x1b" not in out.stdout and "\x07" not in out.stdout, repr(out.stdout)
        assert "\u202e" not in out.stdout and "\\x1b" in out.stdout, repr(out.stdout)


# --- class 9: shared defaults -----------------------------------------------------------------


@pytest.mark.parametrize("plant", ["mkdir -m 0755 {dest}", "mkdir -m 0777 {dest}",
                                   "mkdir -m 0700 {dest}.real && ln -s {dest}.real {dest}"])
def test_the_fake_host_refuses_a_dest_another_user_made_or_may_write(
        shared: Path, plant: str) -> None:
    dest = shared / "gpudiag-try"
    as_nobody(plant.format(dest=dest))
    proc = subprocess.run([sys.executable, "-m", "tests.fakes", str(dest), "--gpus", "1"],
                          capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 2, proc.stderr
    assert "refused" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (dest / "driver").exists() and not (Path(f"{dest}.real") / "driver").exists()


def test_the_fake_host_builds_in_a_folder_of_ones_own(shared: Path) -> None:
    dest = shared / "mine"
    proc = subprocess.run([sys.executable, "-m", "tests.fakes", str(dest), "--gpus", "1"],
                          capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 0, proc.stderr
    assert (dest.stat().st_mode & 0o777) == 0o700 and (dest / "env.sh").is_file()


SLURM = Path(__file__).resolve().parent.parent / "deploy" / "slurm"


@pytest.mark.parametrize("script", ["gpudiag-prolog.sh", "gpudiag-healthcheck.sh",
                                    "gpudiag-epilog.sh"])
def test_slurm_scripts_run_nothing_another_user_named_in_their_environment(
        shared: Path, script: str) -> None:
    marker = shared / "ran-as-root"
    bin_dir = shared / "bin"
    evil = "#!/bin/sh\\ntouch " + str(marker) + "\\nexit 0\\n"
    as_nobody(f"mkdir {bin_dir} && for n in gpudiag scontrol nvidia-smi logger timeout; do "
              f"printf '{evil}' > {bin_dir}/$n && chmod 755 {bin_dir}/$n; done && "
              f"printf 'GPUDIAG={bin_dir}/gpudiag\\nSCONTROL={bin_dir}/scontrol\\n' > "
              f"{shared}/defaults && chmod 644 {shared}/defaults")
    env = {"GPUDIAG": f"{bin_dir}/gpudiag", "SCONTROL": f"{bin_dir}/scontrol",
           "GPUDIAG_DEFAULTS": f"{shared}/defaults", "PATH": str(bin_dir),
           "GPUDIAG_DAEMON_URL": "http://127.0.0.1:9", "SLURMD_NODENAME": "node1",
           "SLURM_JOB_ID": "42", "SLURM_JOB_GPUS": "0", "GPUDIAG_TIMEOUT_S": "5"}
    proc = subprocess.run([str(SLURM / script)], env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert not marker.exists(), (proc.returncode, proc.stderr)
    assert f"not sourcing {shared}/defaults" in proc.stderr, proc.stderr


def test_the_security_doc_names_only_tests_that_exist() -> None:
    import re

    doc = (Path(__file__).resolve().parent.parent / "docs" / "security.md").read_text()
    section = doc[doc.index("## Issue 38"):doc.index("## Crash safety")]
    named = set(re.findall(r"`(test_\w+)", section))
    # This module's tests, the daemon's qualification tests that class 4 names and the run
    # channel's (issue 49) that class 3 names.
    modules = (Path(__file__), Path(__file__).with_name("test_qualify_daemon.py"),
               Path(__file__).with_name("test_run_channel.py"))
    defined = {name for m in modules
               for name in re.findall(r"^def (test_\w+)", m.read_text(), re.M)}
    assert len(named) >= 10 and named <= defined, named - defined


# --- class 4 (part): qualification yields to a waiting job -----------------------------------


def _holds(pid: int, path: Path) -> bool:
    st = path.stat()
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino} "
    return any(f" {pid} {key}" in line for line in Path("/proc/locks").read_text().splitlines())


def test_a_job_waiting_for_a_gpu_under_qualification_gets_it_within_seconds(
        gpu_env: EnvFactory, locks: Path, tmp_path: Path) -> None:
    env = host(gpu_env, locks, 1)
    qual = subprocess.Popen([sys.executable, "-m", "gpudiag", "qualify", "--tier", "full",
                             "--no-history", "--format", "json"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lock_file = locks / f"{gpu_uuid(0)}.lock"
        deadline = time.monotonic() + 60
        while not (lock_file.exists() and _holds(qual.pid, lock_file)):
            assert qual.poll() is None and time.monotonic() < deadline, qual.communicate()
            time.sleep(0.1)
        time.sleep(1.0)  # measuring now
        start = time.monotonic()
        run = run_gpudiag(["run", "--artifacts", str(tmp_path / "run"), "--gpus", "1",
                           "--lock-timeout", "30", "--", "true"], env)
        took = time.monotonic() - start
        assert run.returncode == 0, run.stderr
        assert took < 20, f"the job waited {took:.1f} s for a qualification"
        out, err = qual.communicate(timeout=60)
        assert "a job is waiting for the GPU" in out + err, (out, err)
    finally:
        if qual.poll() is None:
            qual.kill()
            qual.wait(10)


# As nobody: hold a GPU's lock and its qualification mark (shared), argv ending as the
# daemon's does, until killed.
_POSE_AS_QUALIFICATION = textwrap.dedent("""
    import fcntl, os, sys, time
    lock, mark, ready = sys.argv[1:4]
    for path in (mark, lock):
        fd = os.open(path, os.O_CREAT | os.O_RDONLY, 0o644)
        fcntl.flock(fd, fcntl.LOCK_SH)
    open(ready, "w").close()
    time.sleep(60)
""")


def test_another_users_qualification_mark_is_never_named_a_qualification(
        gpu_env: EnvFactory, locks: Path, shared: Path, tmp_path: Path) -> None:
    env = host(gpu_env, locks, 1)
    ready = shared / "posing"
    poser = subprocess.Popen(nobody_argv(
        sys.executable, "-c", _POSE_AS_QUALIFICATION, str(locks / f"{gpu_uuid(0)}.lock"),
        str(locks / f"{gpu_uuid(0)}.qualifying"), str(ready), "-m", "gpudiag", "serve"),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for_file(ready, poser)
        proc = run_gpudiag(["run", "--artifacts", str(tmp_path / "run"), "--gpus", "1",
                            "--lock-timeout", "0", "--", "true"], env)
        assert proc.returncode == 125, proc.stderr
        refusal = next(ln for ln in proc.stderr.splitlines() if "refused:" in ln)
        assert f"pid {poser.pid} (uid {NOBODY}, shared)" in refusal, refusal
        assert "qualification" not in refusal and "daemon" not in refusal, refusal
        close = json.loads((run_folder(tmp_path / "run") / "closeout.json").read_text())
        (held,) = close["evidence"]["held_by_others"]
        assert not held["holder"]["qualifying"] and not held["holder"]["daemon"], held
    finally:
        stop(poser)


# --- class 3 (part): job records another user wrote ------------------------------------------

GPU0 = gpu_uuid(0)


def _planted_job(job: str, started: float, ended: float) -> str:
    """A job record claiming Slurm job ``job`` with a hardware XID inside its window."""
    from gpudiag.core.attribution import JobRecord, Source, Window, attribute, xid_event

    window = Window(started, ended, frozenset({GPU0}))
    got = attribute(1, window, [xid_event(started + 5, 79, GPU0, "watcher")],
                    [Source("run watcher", True)])
    return json.dumps(JobRecord(10, 11, ("train",), job, "node1", started, ended, 1, (GPU0,),
                                got, None).record())


def test_the_epilog_never_drains_on_another_users_record_for_the_job(
        shared: Path, tmp_path: Path) -> None:
    from gpudiag.core.attribution import JOB_INBOX
    from gpudiag.core.findings import XidEvent
    from gpudiag.daemon.closeouts import JobInbox, record_job
    from gpudiag.daemon.store import HistoryStore, default_path

    state = shared / "state"
    state.mkdir()
    store = HistoryStore(default_path(state))
    store.record_xids([XidEvent(79, 0, GPU0, 105.0)])  # a past XID, repaired since
    inbox = JobInbox(state, record=lambda job, uid, *how: record_job(store, job, uid, *how))
    inbox.prepare()
    # uid 65534 claims job 77 (uid 1000's) with the XID's window, and a job of its own
    # that ends tomorrow.
    (shared / "a.json").write_text(_planted_job("77", 100.0, 110.0))
    (shared / "b.json").write_text(_planted_job("78", time.time(), time.time() + 86400))
    as_nobody(f"cp {shared}/a.json {state}/{JOB_INBOX}/1-77.json && "
              f"cp {shared}/b.json {state}/{JOB_INBOX}/2-78.json")
    taken = inbox.poll()  # what the daemon's loop does
    assert taken == []  # no attested run behind either; one of them future-dated too
    refused = inbox.refused.counts()
    assert (refused["unattested"], refused["future_dated"]) == (1, 1), refused
    assert not list((state / JOB_INBOX).iterdir())
    store.close()
    scontrol, calls = tmp_path / "scontrol", tmp_path / "calls"
    scontrol.write_text(f"#!/bin/sh\necho \"$*\" >> {calls}\n")
    scontrol.chmod(0o755)
    defaults = tmp_path / "defaults"
    defaults.write_text(f"GPUDIAG={Path(sys.executable).with_name('gpudiag')}\n"
                        f"SCONTROL={scontrol}\nGPUDIAG_STATE_DIR={state}\n")
    env = {"GPUDIAG_DEFAULTS": str(defaults), "SLURMD_NODENAME": "node1",
           "SLURM_JOB_ID": "77", "SLURM_JOB_GPUS": "0", "SLURM_JOB_UID": "1000"}
    proc = subprocess.run([str(SLURM / "gpudiag-epilog.sh")], env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    drains = [c for c in (calls.read_text().splitlines() if calls.exists() else [])
              if "State=DRAIN" in c]
    assert drains == [], (drains, proc.stderr)
    # The job owner's own explain finds no record of theirs; root's view still lists it.
    mine = run_gpudiag(["explain", "--slurm-job", "77", "--job-uid", "1000", "--state-dir",
                        str(state), "--format", "kv"], {"PATH": "/usr/bin:/bin"})
    assert mine.returncode == 1, mine.stdout + mine.stderr


# --- class 3: attested run windows ---------------------------------------------------------

GPU1 = gpu_uuid(1)


@dataclass
class NodeRig:
    """A 2-GPU fake node both users can use: the fake driver, device nodes, the fakes' state
    file and the GPU locks under ``shared``; root's daemon on a unix socket there."""

    shared: Path
    env: dict[str, str]
    state: Path
    state_file: Path
    sock: Path
    python: str
    daemon: Any = None

    def xids(self, spec: str) -> None:
        write_state_file(self.state_file, {"FAKE_NVML_DEVICE_COUNT": 2, "FAKE_NVML_XIDS": spec})
        self.state_file.chmod(0o644)

    def nobody_env(self, **more: str) -> dict[str, str]:
        """The job's environment: the host's, no state dir of the daemon's, no home."""
        env = {k: v for k, v in self.env.items() if k != "GPUDIAG_STATE_DIR"}
        return {**env, "HOME": "/nonexistent", "GPUDIAG_DAEMON_USER": "0",
                "GPUDIAG_DAEMON_URL": f"unix:{self.sock}", **more}

    def plant(self, name: str, record: dict[str, object]) -> None:
        """uid 65534 drops ``record`` into the daemon's inbox."""
        staged = self.shared / f"{name}.staged"
        staged.write_text(json.dumps(record))
        staged.chmod(0o644)
        as_nobody(f"cp {staged} {self.state}/job-closeouts/{name}")


def nobody_python(shared: Path) -> str:
    """A Python uid 65534 can run with this checkout's gpudiag and dependencies: this one,
    or (when its interpreter sits where that user cannot reach, e.g. under /root) a venv in
    ``shared`` over the same Python minor version that reads this venv's packages."""
    if as_nobody(f"{sys.executable} -c 'import subprocess, sys; "
                 "subprocess.run([sys.executable, \"-c\", \"pass\"], check=True)'",
                 check=False).returncode == 0:
        return sys.executable
    base = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
    venv = shared / "py"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(base)
    lib = venv / "lib" / base.name
    lib.mkdir(parents=True)
    site = next(p for p in map(Path, sys.path) if p.name == "site-packages" and p.is_dir())
    (lib / "site-packages").symlink_to(site)
    (venv / "pyvenv.cfg").write_text(f"home = {base.parent}\n"
                                      "include-system-site-packages = false\n")
    subprocess.run(["chmod", "-R", "a+rX", str(venv)], check=True)
    return str(venv / "bin" / "python")


@pytest.fixture
def node(fakes: Any, shared: Path, tmp_path: Path) -> Iterator[NodeRig]:
    from tests.support.daemon import Daemon, daemon_toml, write_config

    driver = shared / "driver"
    shutil.copytree(fakes.root, driver)
    dev, proc = make_host_dirs(shared / "host", gpus=2)
    state_file, state, sock_dir = shared / "gpu-state", shared / "state", shared / "sock"
    sock_dir.mkdir()
    state.mkdir()
    for folder in (driver, shared / "host", sock_dir, state):
        subprocess.run(["chmod", "-R", "a+rX", str(folder)], check=True)
    env = type(fakes)(driver, driver / fakes.lib_dir.name, driver / fakes.bin_dir.name).env(
        base=clean_env(), FAKE_GPU_STATE_FILE=str(state_file), GPUDIAG_DEVICE_DIR=str(dev),
        GPUDIAG_DRIVER_PROC_DIR=str(proc), GPUDIAG_LOCK_DIR=str(shared / "locks"),
        GPUDIAG_STATE_DIR=str(state), FAKE_NVML_DEVICE_COUNT=2)
    (shared / "locks").mkdir()
    (shared / "locks").chmod(0o1777)
    rig = NodeRig(shared, env, state, state_file, sock_dir / "gpudiag.sock",
                  nobody_python(shared))
    rig.xids("")
    config = write_config(tmp_path / "gpudiag.toml", daemon_toml(
        {"backends.cuda": {"interval_s": 1}}))
    rig.daemon = Daemon(env, config, state, extra_args=("--socket", str(rig.sock)))
    try:
        rig.daemon.wait_ready()
        yield rig
    finally:
        rig.daemon.stop()


def _history_xids(rig: NodeRig) -> list[dict[str, Any]]:
    status, data = rig.daemon.get("/v1/history?limit=100")
    return list(data["xids"]) if status == 200 else []


def _refused(rig: NodeRig) -> dict[str, float]:
    from tests.support.daemon import metric_samples

    return {lab["reason"]: v for lab, v in
            metric_samples(rig.daemon, "gpudiag_job_records_refused_total")}


def _epilog(rig: NodeRig, tmp_path: Path, job: str, uid: int) -> list[str]:
    """The Slurm Epilog of ``job`` (owner ``uid``) on this node: the drains it asked for."""
    scontrol, calls = tmp_path / f"scontrol-{job}", tmp_path / f"calls-{job}"
    scontrol.write_text(f"#!/bin/sh\necho \"$*\" >> {calls}\n")
    scontrol.chmod(0o755)
    defaults = tmp_path / f"defaults-{job}"
    defaults.write_text(f"GPUDIAG={Path(sys.executable).with_name('gpudiag')}\n"
                        f"SCONTROL={scontrol}\nGPUDIAG_STATE_DIR={rig.state}\n")
    env = {"GPUDIAG_DEFAULTS": str(defaults), "SLURMD_NODENAME": "node1", "SLURM_JOB_ID": job,
           "SLURM_JOB_GPUS": "0", "SLURM_JOB_UID": str(uid)}
    proc = subprocess.run([str(SLURM / "gpudiag-epilog.sh")], env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    return [c for c in (calls.read_text().splitlines() if calls.exists() else [])
            if "State=DRAIN" in c]


def test_the_epilog_trusts_only_a_window_the_daemon_attested_over_its_socket(
        node: NodeRig, tmp_path: Path) -> None:
    from tests.support.daemon import wait_for

    rig = node
    # A past XID on GPU 1: uid 65534 then claims a job 78 of its own whose window held it.
    rig.xids("1:79")
    past = wait_for(lambda: _history_xids(rig), 20)[0]["ts"]
    rig.plant("1-78.json", json.loads(_planted_job("78", past - 5, past + 5).replace(
        GPU0, GPU1)))
    # uid 65534's real job 77: `gpudiag run` asks the daemon on its socket; an XID comes
    # on its GPU (GPU 0: GPU 1 is held) while the job runs.
    started = rig.shared / "job-started"
    job = subprocess.Popen(nobody_argv(
        rig.python, "-m", "gpudiag", "run", "--gpus", "1", "--artifacts",
        str(rig.shared / "runs"), "--", "sh", "-c", f"touch {started}; sleep 3"),
        env=rig.nobody_env(SLURM_JOB_ID="77"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True)
    try:
        while not started.exists():
            assert job.poll() is None, job.communicate()
            time.sleep(0.05)
        time.sleep(0.5)
        rig.xids("1:79,0:79")
        _, err = job.communicate(timeout=60)
    finally:
        stop(job)
    assert job.returncode == 0, err
    closeout = json.loads((run_folder(rig.shared / "runs") / "closeout.json").read_text())
    assert closeout["verdict_source"] == "daemon", closeout
    assert closeout["attribution"]["kind"] == "hardware", closeout["attribution"]
    assert closeout["job_record"]["attested"] == "socket", closeout["job_record"]
    # Then a newer record of job 77 that says nothing happened, as uid 65534 wrote it.
    rig.plant("9-77.json", json.loads(_planted_job("77", time.time() - 2, time.time() - 1)))
    wait_for(lambda: not list((rig.state / "job-closeouts").glob("*.json")), 20)
    assert _refused(rig)["unattested"] == 2, _refused(rig)
    # The job's own attested window decides: its XID drains the node; the planted record
    # neither hides it nor makes job 78 a hardware failure.
    assert _epilog(rig, tmp_path, "77", NOBODY) == [
        "update NodeName=node1 State=DRAIN Reason=gpudiag: gpu_lost during job 77"]
    assert _epilog(rig, tmp_path, "78", NOBODY) == []
    kv = run_gpudiag(["explain", "--slurm-job", "77", "--job-uid", str(NOBODY), "--state-dir",
                      str(rig.state), "--format", "kv"], {"PATH": "/usr/bin:/bin"})
    assert "attested=socket" in kv.stdout and "owner_uid=65534" in kv.stdout, kv.stdout


# As uid 65534: lock GPU argv[3] as `gpudiag run` does, announce a run to the daemon, touch
# argv[2] + ".begun" with the run id, then end it once argv[2] + ".end" appears (its body:
# the exit code to claim); the answers land in argv[2] + ".json".
_ANNOUNCER = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    from gpudiag.engine.announce import begin_run, end_run
    from gpudiag.engine.locks import try_lock
    url, out, uuid, locks = sys.argv[1:5]
    lock = try_lock(Path(locks), uuid, purpose="job")
    run, why = begin_run(url, [uuid], "77", os.environ)
    Path(out + ".begun").write_text(json.dumps({"run": run, "why": why}))
    while not os.path.exists(out + ".end"):
        time.sleep(0.05)
    answer, why = end_run(url, run, 1, os.getpid(), b"{}", os.environ)
    Path(out + ".json").write_text(json.dumps({"answer": answer, "why": why}))
""")


def _announce(rig: NodeRig, name: str, *, locks: Path | None = None
              ) -> tuple[subprocess.Popen[str], Path]:
    out = rig.shared / name
    proc = subprocess.Popen(nobody_argv(rig.python, "-c", _ANNOUNCER, f"unix:{rig.sock}",
                                        str(out), GPU0, str(locks or rig.shared / "locks")),
                            env=rig.nobody_env(), start_new_session=True, text=True,
                            stderr=subprocess.PIPE)
    wait_for_file(Path(f"{out}.begun"), proc)
    return proc, out


def test_only_the_process_that_began_a_run_ends_it_and_only_on_gpus_it_holds(
        node: NodeRig, tmp_path: Path) -> None:
    from gpudiag.engine.announce import end_run

    rig = node
    private = rig.shared / "private-locks"
    private.mkdir()
    private.chmod(0o1777)
    # GPU locks the daemon does not look at (another folder): nothing attests the GPUs.
    elsewhere, out = _announce(rig, "elsewhere", locks=private)
    try:
        begun = json.loads(Path(f"{out}.begun").read_text())
        assert begun["run"] is None and "gpus_not_locked" in begun["why"], begun
    finally:
        stop(elsewhere)
    job, out = _announce(rig, "job")
    try:
        run = json.loads(Path(f"{out}.begun").read_text())["run"]
        assert run, Path(f"{out}.begun").read_text()
        # Root (another uid) and a second uid-65534 process cannot end it for the run.
        answer, why = end_run(f"unix:{rig.sock}", run, 0, 1, b"{}",
                              {"GPUDIAG_DAEMON_USER": "0"})
        assert answer is None and "not_the_run" in why, why
        impostor = subprocess.run(nobody_argv(rig.python, "-c", (
            "import os, sys; from gpudiag.engine.announce import end_run; "
            f"print(end_run('unix:{rig.sock}', '{run}', 0, 1, b'{{}}', os.environ)[1])")),
            env=rig.nobody_env(), capture_output=True, text=True, timeout=60)
        assert "not_the_run" in impostor.stdout, impostor.stdout + impostor.stderr
        Path(f"{out}.end").touch()
        wait_for_file(Path(f"{out}.json"), job)
    finally:
        stop(job)
    ended = json.loads(Path(f"{out}.json").read_text())
    assert ended["answer"]["recorded"] is True, ended
    assert ended["answer"]["gpus"] == [GPU0], ended
    # Over TCP nobody can be attested: the daemon cannot see who asks.
    status, data = _post(rig.daemon.url + f"/v1/runs/begin?gpus={GPU0}")
    assert status == 403 and data["error"]["code"] == "not_attested", data


def _post(url: str) -> tuple[int, Any]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="POST"),
                                    timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


_FLOOD = textwrap.dedent("""
    import os, sys
    folder, record, n = sys.argv[1], open(sys.argv[2]).read(), int(sys.argv[3])
    for i in range(n):
        # Whole files only (written aside, then renamed in): a record the daemon met half
        # written would count as malformed, not as what it is.
        with open(f"{folder}/{i:06d}-{i}.tmp", "w") as fh:
            fh.write(record.replace('"pid": 10,', f'"pid": {100000 + i},'))
        os.rename(f"{folder}/{i:06d}-{i}.tmp", f"{folder}/{i:06d}-{i}.json")
""")


def test_a_non_root_job_shows_in_the_allocations_while_it_runs_and_its_refusal_counts(
        node: NodeRig) -> None:
    """uid 65534's `gpudiag run` speaks to root's daemon on its socket alone: its GPU is in
    `gpudiag_gpu_allocation_info` (user nobody) while it runs, and once the GPUs are lost its
    refused run is counted in `gpudiag_preflight_blocks_total` without a file anywhere."""
    from tests.support.daemon import metric_samples, wait_for

    rig = node
    started = rig.shared / "alloc-started"
    job = subprocess.Popen(nobody_argv(
        rig.python, "-m", "gpudiag", "run", "--gpus", "1", "--artifacts",
        str(rig.shared / "alloc-runs"), "--", "sh", "-c", f"touch {started}; sleep 2"),
        env=rig.nobody_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        wait_for_file(started, job, timeout=60)
        (alloc,) = wait_for(lambda: [lab for lab, v in metric_samples(
            rig.daemon, "gpudiag_gpu_allocation_info") if v == 1], 10, interval=0.1)
        _, err = job.communicate(timeout=60)
    finally:
        stop(job)
    assert job.returncode == 0, err
    closeout = json.loads((run_folder(rig.shared / "alloc-runs") / "closeout.json").read_text())
    assert alloc["uuid"] == closeout["gpus"][0]["uuid"] and alloc["user"] == "nobody", alloc
    assert closeout["job_record"]["attested"] == "socket", closeout["job_record"]
    wait_for(lambda: not metric_samples(rig.daemon, "gpudiag_gpu_allocation_info"), 10)
    write_state_file(rig.state_file, {"FAKE_NVML_DEVICE_COUNT": 2,
                                      "FAKE_NVML_DEVICE_ERRORS": "0:15,1:15"})
    rig.state_file.chmod(0o644)
    wait_for(lambda: rig.daemon.get("/v1/preflight?require=cuda")[1].get(
        "gpu_validation_blocker") == "gpu_lost", 20, interval=0.2)
    refused = subprocess.run(nobody_argv(
        rig.python, "-m", "gpudiag", "run", "--gpus", "1", "--artifacts",
        str(rig.shared / "alloc-runs"), "--", "true"), env=rig.nobody_env(),
        capture_output=True, text=True, timeout=60)
    assert refused.returncode == 125, refused.stderr
    blocks = wait_for(lambda: {lab["code"]: v for lab, v in metric_samples(
        rig.daemon, "gpudiag_preflight_blocks_total")}, 10, interval=0.1)
    assert blocks == {"gpu_lost": 1.0}, blocks
    assert not list((rig.state / "job-closeouts").iterdir())
    assert _refused(rig)["foreign"] == 0, _refused(rig)


def test_a_flood_of_planted_records_neither_stalls_the_daemon_nor_grows_its_history(
        node: NodeRig) -> None:
    from gpudiag.daemon.store import HistoryStore, default_path

    rig = node
    staged = rig.shared / "flood.staged"
    staged.write_text(_planted_job("77", time.time() - 20, time.time() - 10))
    staged.chmod(0o644)
    inbox = rig.state / "job-closeouts"
    flood = subprocess.run(nobody_argv(rig.python, "-c", _FLOOD, str(inbox), str(staged),
                                       "3000"), capture_output=True, text=True, timeout=120)
    assert flood.returncode == 0, flood.stderr
    worst, start = 0.0, time.monotonic()
    while any(inbox.iterdir()):
        assert time.monotonic() - start < 120, "the inbox was not taken in"
        t0 = time.monotonic()
        assert rig.daemon.get("/healthz", timeout=30)[0] == 200
        worst = max(worst, time.monotonic() - t0)
        time.sleep(0.05)
    took = time.monotonic() - start
    print(f"3000 planted records refused in {took:.1f} s; slowest /healthz {worst * 1000:.0f} ms")
    assert worst < 5.0, f"/healthz took {worst:.1f} s while the inbox was taken in"
    assert _refused(rig)["unattested"] == 3000, _refused(rig)
    store = HistoryStore(default_path(rig.state), readonly=True)
    try:
        assert store.jobs(limit=10) == []
    finally:
        store.close()



def test_block_records_planted_by_another_user_change_no_metric(node: NodeRig) -> None:
    """50 `gpudiag.block/1` records of uid 65534 (one with an invented code) are refused as
    foreign: `gpudiag_preflight_blocks_total` stays empty, and /metrics does not grow."""
    from tests.support.daemon import metric_samples, wait_for

    rig = node
    staged = rig.shared / "block.staged"
    staged.write_text(json.dumps({"schema": "gpudiag.block/1", "pid": 10, "code": "gpu_lost",
                                  "codes": ["gpu_lost"], "ts": time.time(),
                                  "slurm_job_id": None}))
    staged.chmod(0o644)
    inbox = rig.state / "job-closeouts"
    flood = subprocess.run(nobody_argv(rig.python, "-c", _FLOOD, str(inbox), str(staged), "50"),
                           capture_output=True, text=True, timeout=120)
    assert flood.returncode == 0, flood.stderr
    wait_for(lambda: not any(inbox.iterdir()), 60, interval=0.2)
    wait_for(lambda: _refused(rig).get("foreign") == 50, 10, interval=0.2)
    assert metric_samples(rig.daemon, "gpudiag_preflight_blocks_total") == []


# As uid 65534: lock GPU argv[2] and run argv[3] attested runs back to back on it, each
# ending with a 3 KB argv (what the daemon keeps of a run's own word).
_RUN_LOOP = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    from gpudiag.engine.announce import begin_run, end_run
    from gpudiag.engine.locks import try_lock
    url, uuid, n, locks = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    lock = try_lock(Path(locks), uuid, purpose="job")
    body = json.dumps({"argv": ["x" * 1000] * 3}).encode()
    for i in range(n):
        run, why = begin_run(url, [uuid], str(i), os.environ)
        assert run, why
        answer, why = end_run(url, run, 1, os.getpid(), body, os.environ)
        assert answer, why
""")


def test_attested_runs_by_the_hundred_keep_the_history_bound_and_its_verdicts(
        node: NodeRig, tmp_path: Path) -> None:
    from gpudiag.daemon.store import HistoryStore, default_path

    rig = node
    status, before = rig.daemon.get("/v1/history?limit=1000")
    assert status == 200 and before["verdicts"], before
    limit = 1 << 20
    # Another daemon on the same node state, with a 1 MiB history bound.
    rig.daemon.stop()
    from tests.support.daemon import Daemon, daemon_toml, write_config

    config = write_config(tmp_path / "small.toml", daemon_toml(
        {"history": {"max_bytes": limit}}))
    rig.daemon = Daemon(rig.env, config, rig.state, extra_args=("--socket", str(rig.sock)))
    rig.daemon.wait_ready()
    start = time.monotonic()
    loop = subprocess.run(nobody_argv(rig.python, "-c", _RUN_LOOP, f"unix:{rig.sock}", GPU0,
                                      "400", str(rig.shared / "locks")),
                          env=rig.nobody_env(), capture_output=True, text=True, timeout=300)
    took = time.monotonic() - start
    assert loop.returncode == 0, loop.stderr
    store = HistoryStore(default_path(rig.state), readonly=True)
    try:
        size, jobs = store.size_bytes(), store.jobs(limit=1000)
        ids = {v.id for v in store.verdicts(limit=1000)}
    finally:
        store.close()
    print(f"400 attested runs in {took:.1f} s: history {size / 1024:.0f} KiB (bound "
          f"{limit // 1024} KiB), {len(jobs)} jobs kept")
    assert size <= limit and 0 < len(jobs) < 400
    assert {v["id"] for v in before["verdicts"]} <= ids  # no verdict change was dropped
    assert all(j.attested == "socket" and j.uid == NOBODY for j in jobs)


def _restart(rig: NodeRig, tmp_path: Path) -> None:
    """Stop the node's daemon and start it again on the same state, socket and config."""
    from tests.support.daemon import Daemon

    rig.daemon.stop()
    rig.daemon = Daemon(rig.env, tmp_path / "gpudiag.toml", rig.state,
                        extra_args=("--socket", str(rig.sock)))
    rig.daemon.wait_ready()


def _nobody_job(rig: NodeRig, slurm_job: str, started: Path, go: Path, **env: str
                ) -> subprocess.Popen[str]:
    """uid 65534's `gpudiag run` on the daemon's socket, its job waiting for ``go``."""
    return subprocess.Popen(nobody_argv(
        rig.python, "-m", "gpudiag", "run", "--gpus", "1", "--artifacts",
        str(rig.shared / f"runs-{slurm_job}"), "--", "sh", "-c",
        f"touch {started}; while [ ! -e {go} ]; do sleep 0.1; done"),
        env=rig.nobody_env(SLURM_JOB_ID=slurm_job, **env), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True)


def test_a_run_attested_before_a_daemon_restart_is_still_attested_after_it(
        node: NodeRig, tmp_path: Path) -> None:
    from tests.support.daemon import wait_for

    rig = node
    started, go = rig.shared / "job-started", rig.shared / "job-go"
    job = _nobody_job(rig, "79", started, go)
    try:
        wait_for(lambda: started.exists() or job.poll() is not None, 60)
        assert job.poll() is None, job.communicate()
        kept = json.loads((rig.state / "open-runs.json").read_text())
        assert [r["uid"] for r in kept["runs"]] == [NOBODY], kept
        # The daemon restarts while the job runs; the kernel still says the run's process
        # holds its GPU's lock, so the new daemon opens the run again.
        _restart(rig, tmp_path)
        assert any("still running: open again" in line for line in rig.daemon.lines)
        go.touch()
        _, err = job.communicate(timeout=60)
    finally:
        stop(job)
    assert job.returncode == 0, err
    closeout = json.loads((run_folder(rig.shared / "runs-79") / "closeout.json").read_text())
    assert closeout["job_record"]["attested"] == "socket", closeout["job_record"]
    assert json.loads((rig.state / "open-runs.json").read_text())["runs"] == []
    kv = run_gpudiag(["explain", "--slurm-job", "79", "--job-uid", str(NOBODY), "--state-dir",
                      str(rig.state), "--format", "kv"], {"PATH": "/usr/bin:/bin"})
    assert "attested=socket" in kv.stdout, kv.stdout


def test_a_run_that_ended_while_the_daemon_was_away_is_not_opened_again(
        node: NodeRig, tmp_path: Path) -> None:
    from tests.support.daemon import wait_for

    rig = node
    started, go = rig.shared / "job-started", rig.shared / "job-go"
    job = _nobody_job(rig, "80", started, go)
    try:
        wait_for(lambda: started.exists() or job.poll() is not None, 60)
        rig.daemon.stop()
        # The job ends (its locks with it) while no daemon runs: its end cannot be said.
        go.touch()
        job.communicate(timeout=60)
    finally:
        stop(job)
    _restart(rig, tmp_path)
    assert json.loads((rig.state / "open-runs.json").read_text())["runs"] == []
    assert not any("open again" in line for line in rig.daemon.lines)


def test_an_xid_on_the_gpu_of_a_mig_run_is_in_its_attested_window(
        node: NodeRig, tmp_path: Path) -> None:
    """A MIG run locks its instance; the XID names the physical GPU: the daemon's attested
    window covers both, so the run is a hardware failure and its Epilog drains."""
    from tests.support.daemon import wait_for

    rig = node
    mig = "MIG-f00d0000-0000-4000-8000-000000000000"  # GPU 0's first instance
    knobs: dict[str, str | int] = {"FAKE_NVML_DEVICE_COUNT": 2, "FAKE_NVML_MIG": "0:2"}
    write_state_file(rig.state_file, {**knobs, "FAKE_NVML_XIDS": ""})
    rig.state_file.chmod(0o644)
    time.sleep(2.0)  # a few of the daemon's NVML rounds (every 0.5 s here) see the instances
    started, go = rig.shared / "job-started", rig.shared / "job-go"
    job = _nobody_job(rig, "81", started, go, CUDA_VISIBLE_DEVICES=mig)
    try:
        wait_for(lambda: started.exists() or job.poll() is not None, 60)
        assert job.poll() is None, job.communicate()
        write_state_file(rig.state_file, {**knobs, "FAKE_NVML_XIDS": "0:79"})
        rig.state_file.chmod(0o644)
        wait_for(lambda: _history_xids(rig), 20)
        go.touch()
        _, err = job.communicate(timeout=60)
    finally:
        stop(job)
    closeout = json.loads((run_folder(rig.shared / "runs-81") / "closeout.json").read_text())
    assert closeout["job_record"]["attested"] == "socket", (closeout["job_record"], err)
    kv = run_gpudiag(["explain", "--slurm-job", "81", "--job-uid", str(NOBODY), "--state-dir",
                      str(rig.state), "--format", "kv"], {"PATH": "/usr/bin:/bin"})
    assert "attested=socket" in kv.stdout and "attribution=hardware" in kv.stdout, kv.stdout
    assert _epilog(rig, tmp_path, "81", NOBODY) != []
