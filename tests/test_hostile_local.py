"""Issue 24: a second local account (uid 65534 through setpriv) against root's gpudiag.

Folders shared by every user (a 1777 temp folder, the lock folder) are where another user
plants symlinks, FIFOs and code. Each test plants as uid 65534 and runs gpudiag as root,
through the real CLI. Skipped only where the test cannot switch users (not root).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpudiag.engine.locks import lock_holder, try_lock
from gpudiag.engine.locks import release as release_locks
from tests.support.host import EnvFactory, run_gpudiag
from tests.support.run import run_folder

NOBODY = 65534
NO_DAEMON = "http://127.0.0.1:9"
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="needs root and setpriv to act as a second user")


def gpu_uuid(i: int) -> str:
    return f"GPU-f00d{i:04x}-0000-4000-8000-{i:012x}"


def as_nobody(script: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a shell script as uid/gid 65534 with no supplementary groups."""
    proc = subprocess.run(["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY),
                           "--clear-groups", "--", "sh", "-c", script],
                          capture_output=True, text=True, timeout=30)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture
def shared() -> Iterator[Path]:
    """A 1777 folder both users reach (under /tmp, like /tmp itself or /run/gpudiag/locks)."""
    folder = Path(tempfile.mkdtemp(prefix="gpudiag-shared-", dir="/tmp"))
    folder.chmod(0o1777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def host(gpu_env: EnvFactory, shared: Path) -> dict[str, str]:
    """A healthy 4-GPU fake host whose lock folder is the shared 1777 one."""
    locks = shared / "locks"
    locks.mkdir()
    locks.chmod(0o1777)
    return gpu_env(FAKE_NVML_DEVICE_COUNT=4, GPUDIAG_LOCK_DIR=str(locks),
                   GPUDIAG_DAEMON_URL=NO_DAEMON)


def _run(args: list[str], env: dict[str, str], timeout: float = 60
         ) -> subprocess.CompletedProcess[str]:
    return run_gpudiag(["run", *args], env, timeout)


# --- item 2: --artifacts in a folder another user made ----------------------------------


def test_artifacts_in_a_folder_another_user_made_are_refused_and_nothing_planted_runs(
        host: dict[str, str], shared: Path, tmp_path: Path) -> None:
    victim = tmp_path / "root-owned"
    victim.write_text("precious\n")
    marker = shared / "planted-code-ran"
    job = shared / "job1"
    as_nobody(f"mkdir {job} && ln -s {victim} {job}/stdout.log && mkdir {job}/python-hook && "
              f"echo 'open(\"{marker}\", \"w\")' > {job}/python-hook/json.py && "
              f"echo '{{}}' > {job}/plan.json")
    proc = _run(["--artifacts", str(job), "--gpus", "1", "--", sys.executable, "-c",
                 "import json"], host)
    assert proc.returncode == 125, proc.stderr
    assert "belongs to another user" in proc.stderr and "ARGV was not started" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert victim.read_text() == "precious\n"
    assert not marker.exists()


def test_artifacts_in_a_folder_others_can_write_are_refused(host: dict[str, str],
                                                             tmp_path: Path) -> None:
    art = tmp_path / "open"
    art.mkdir()
    art.chmod(0o777)
    proc = _run(["--artifacts", str(art), "--gpus", "1", "--", "true"], host)
    assert proc.returncode == 125 and "writable by others" in proc.stderr, proc.stderr
    assert not (art / "plan.json").exists()


def test_default_run_folders_are_fresh_private_and_unpredictable(host: dict[str, str],
                                                                shared: Path) -> None:
    env = dict(host, GPUDIAG_ARTIFACTS_DIR=str(shared / "runs"))
    for _ in range(2):
        proc = _run(["--gpus", "1", "--", "true"], env)
        assert proc.returncode == 0, proc.stderr
    runs = sorted((shared / "runs").iterdir())
    assert len(runs) == 2
    for run in runs:
        st = run.lstat()
        assert st.st_uid == 0 and (st.st_mode & 0o777) == 0o700, oct(st.st_mode)
        # A stamp and a random part: not the pid, which another user could guess.
        assert re.fullmatch(r"\d{8}T\d{6}Z-[A-Za-z0-9_]{8}", run.name), run.name
        assert (run / "closeout.json").is_file()


# --- item 4: a lock its creator could split ----------------------------------------------


def test_a_lock_file_another_user_created_cannot_be_removed_while_root_holds_it(
        host: dict[str, str], tmp_path: Path) -> None:
    locks = Path(host["GPUDIAG_LOCK_DIR"])
    as_nobody(" && ".join(f"touch {locks}/{gpu_uuid(i)}.lock" for i in range(4)))
    started = tmp_path / "started"
    first = subprocess.Popen(
        [sys.executable, "-m", "gpudiag", "run", "--artifacts", str(tmp_path / "a"),
         "--gpus", "4", "--", "sh", "-c", f"touch {started}; sleep 30"],
        env=host, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not started.exists():
            assert first.poll() is None and time.monotonic() < deadline, first.stderr
            time.sleep(0.1)
        # The creator tries to split the lock: remove the files root's job holds.
        removal = as_nobody(f"rm -f {locks}/*.lock", check=False)
        assert removal.returncode != 0 and "Operation not permitted" in removal.stderr
        for i in range(4):
            assert (locks / f"{gpu_uuid(i)}.lock").stat().st_uid == 0
        second = _run(["--artifacts", str(tmp_path / "b"), "--gpus", "1", "--lock-timeout",
                       "1", "--", "true"], host)
        assert second.returncode == 125, second.stderr
        close = json.loads((run_folder(tmp_path / "b") / "closeout.json").read_text())
        assert close["gpu_validation_blocker"] == "lock_timeout", close
    finally:
        first.terminate()  # `gpudiag run` passes SIGTERM on to its job and waits for it
        first.wait(30)


# --- item 5: planted FIFOs and symlinks in the lock folder -------------------------------


def test_a_planted_fifo_or_symlink_costs_only_its_own_gpu_and_says_so(
        host: dict[str, str], tmp_path: Path) -> None:
    locks = Path(host["GPUDIAG_LOCK_DIR"])
    as_nobody(f"mkfifo {locks}/{gpu_uuid(0)}.lock && ln -s /etc/passwd {locks}/{gpu_uuid(1)}.lock")
    start = time.monotonic()
    proc = _run(["--artifacts", str(tmp_path / "one"), "--gpus", "2", "--", "true"], host)
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - start < 30
    plan = json.loads((run_folder(tmp_path / "one") / "plan.json").read_text())
    assert plan["admission"]["selected"] == [gpu_uuid(2), gpu_uuid(3)]
    passed = {u["uuid"]: u["reason"] for u in plan["admission"]["unusable_locks"]}
    assert set(passed) == {gpu_uuid(0), gpu_uuid(1)}
    assert f"passed over {gpu_uuid(0)}" in proc.stderr and "FIFO" in passed[gpu_uuid(0)]
    # Asking for all four: refused with 125 and a closeout naming the planted files.
    proc = _run(["--artifacts", str(tmp_path / "all"), "--gpus", "4", "--", "true"], host)
    assert proc.returncode == 125, proc.stderr
    close = json.loads((run_folder(tmp_path / "all") / "closeout.json").read_text())
    assert close["gpu_validation_blocker"] == "device_state_unknown"
    assert gpu_uuid(0) in json.dumps(close) or gpu_uuid(0) in proc.stderr


def test_reading_a_planted_lock_holder_never_blocks_follows_or_reads_without_bound(
        shared: Path) -> None:
    locks = shared / "locks"
    locks.mkdir(mode=0o1777)
    locks.chmod(0o1777)
    as_nobody(f"mkfifo {locks}/{gpu_uuid(0)}.lock && ln -s /etc/passwd {locks}/{gpu_uuid(1)}.lock"
              f" && head -c 50000000 /dev/zero > {locks}/{gpu_uuid(2)}.lock")
    start = time.monotonic()
    assert lock_holder(locks, gpu_uuid(0)) is None  # a FIFO: no writer would ever come
    assert lock_holder(locks, gpu_uuid(1)) is None  # a symlink: not followed
    assert lock_holder(locks, gpu_uuid(2)) is None  # 50 MB of zeros: 4 KiB read, no JSON
    assert time.monotonic() - start < 20  # the FIFO would block for ever


def test_a_fifo_renamed_over_a_held_lock_while_waiting_gives_125_and_a_closeout(
        host: dict[str, str], tmp_path: Path) -> None:
    locks = Path(host["GPUDIAG_LOCK_DIR"])
    held = [lk for i in range(4) if (lk := try_lock(locks, gpu_uuid(i))) is not None]
    assert len(held) == 4
    waiting = subprocess.Popen(
        [sys.executable, "-m", "gpudiag", "run", "--artifacts", str(tmp_path / "w"),
         "--gpus", "1", "--lock-timeout", "6", "--", "true"],
        env=host, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(3)  # it now waits for a lock to free
        fifo = locks / ".planted"
        os.mkfifo(fifo)
        os.rename(fifo, locks / f"{gpu_uuid(0)}.lock")
        _, err = waiting.communicate(timeout=40)
    finally:
        waiting.kill()
        release_locks(held)
    assert waiting.returncode == 125, err
    assert "internal error" not in err
    close = json.loads((run_folder(tmp_path / "w") / "closeout.json").read_text())
    assert close["gpu_validation_blocker"] in ("lock_timeout", "device_state_unknown"), close
