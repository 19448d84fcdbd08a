"""`gpudiag run` artifacts and `--record` on a full disk or a vanished folder: a clear error,
the right exit code, and never a half-written file (a real small tmpfs,
tests/support/host_disk.py)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tests.support.host import EnvFactory, run_gpudiag
from tests.support.host_disk import fill, small_tmpfs
from tests.support.run import NO_DAEMON, gpudiag_run


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


def _no_half_files(folder: Path) -> None:
    """No temporary left over; every JSON artifact present parses in full."""
    files = _files(folder)
    assert not [p for p in files if p.name.endswith(".tmp")], files
    for p in files:
        if p.suffix == ".json":
            json.loads(p.read_text())


def test_run_on_a_full_disk_never_starts_argv_and_says_why(gpu_env: EnvFactory,
                                                           tmp_path: Path) -> None:
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=2, GPUDIAG_LOCK_DIR=str(tmp_path / "locks"),
                  GPUDIAG_DAEMON_URL=NO_DAEMON)
    marker = tmp_path / "argv-ran"
    with small_tmpfs(tmp_path / "disk", "256k") as disk:
        fill(disk)
        proc = gpudiag_run(["--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"], env,
                           disk / "run")
        assert proc.returncode == 125, proc.stderr
        assert "No space left on device (the filesystem is full" in proc.stderr
        assert "ARGV was not started" in proc.stderr and "Traceback" not in proc.stderr
        assert not marker.exists()
        assert _files(disk / "run") == []  # nothing written at all, so nothing half-written


def test_output_that_fills_the_disk_never_blocks_the_job_and_its_exit_code_stands(
        gpu_env: EnvFactory, tmp_path: Path) -> None:
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=2, GPUDIAG_LOCK_DIR=str(tmp_path / "locks"),
                  GPUDIAG_DAEMON_URL=NO_DAEMON)
    # 4 MiB of output into a 1 MiB filesystem: the log fills it while the job still writes.
    code = "import sys; sys.stdout.write('x' * (4 << 20)); sys.stdout.flush(); sys.exit(7)"
    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        t0 = time.monotonic()
        proc = gpudiag_run(["--", sys.executable, "-c", code], env, disk / "run", timeout=120)
        assert time.monotonic() - t0 < 60
        assert proc.returncode == 7, proc.stderr[-2000:]  # the job's own, not gpudiag's
        assert len(proc.stdout) == 4 << 20  # the job's output still reached the terminal
        err = proc.stderr
        assert "artifacts incomplete" in err and "stdout.log: No space left on device" in err
        assert "Traceback" not in err
        _no_half_files(disk / "run")


def test_a_vanished_artifacts_folder_is_said_and_the_exit_code_stands(
        gpu_env: EnvFactory, tmp_path: Path) -> None:
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=2, GPUDIAG_LOCK_DIR=str(tmp_path / "locks"),
                  GPUDIAG_DAEMON_URL=NO_DAEMON)
    run = tmp_path / "run"
    code = f"import shutil, sys; shutil.rmtree({str(run)!r}); sys.exit(5)"
    proc = gpudiag_run(["--", sys.executable, "-c", code], env, run)
    assert proc.returncode == 5, proc.stderr
    # The run's own folder (STAMP-xxxxxxxx under --artifacts) went with it.
    assert f"cannot write {run}/" in proc.stderr
    assert "/result.json: No such file or directory" in proc.stderr
    assert "vanished" in proc.stderr and "Traceback" not in proc.stderr
    assert not run.exists()


def test_record_on_a_full_disk_exits_3_and_leaves_no_file(gpu_env: EnvFactory,
                                                          tmp_path: Path) -> None:
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=2, GPUDIAG_DAEMON_URL=NO_DAEMON)
    with small_tmpfs(tmp_path / "disk", "256k") as disk:
        old = disk / "verdict.json"
        old.write_text('{"old": true}\n')
        fill(disk)
        proc = run_gpudiag(["preflight", "--no-daemon", "--record", str(old)], env)
        assert proc.returncode == 3, proc.stderr
        assert "gpu_validation_blocker=none" in proc.stdout  # the verdict is still shown
        assert f"could not write --record {old}: No space left on device" in proc.stderr
        assert "Traceback" not in proc.stderr
        assert old.read_text() == '{"old": true}\n'  # the old file, whole
        assert [p.name for p in _files(disk)] == ["filler", "verdict.json"]


def test_record_into_a_missing_folder_exits_2_naming_it(gpu_env: EnvFactory,
                                                        tmp_path: Path) -> None:
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=2, GPUDIAG_DAEMON_URL=NO_DAEMON)
    target = tmp_path / "gone" / "v.json"
    proc = run_gpudiag(["preflight", "--no-daemon", "--record", str(target)], env)
    assert proc.returncode == 2  # a usage error, checked before probing (issue 16)
    assert f"mkdir -p {target.parent}" in proc.stderr
    assert f"could not write --record {target}: No such file or directory" in proc.stderr
    assert "Traceback" not in proc.stderr
