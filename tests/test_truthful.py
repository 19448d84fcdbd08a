"""Verdicts that never lie (issue 23): commands started together, GPUs locked by jobs.

Proven or not ready: ``none`` only when every required backend was proven on the GPUs the
verdict names. Siblings are not users: N gpudiag commands started at the same moment answer
what one alone answers, and never ``devices_busy`` because of each other. What needs no GPU
(a missing JAX plugin) is known even when every GPU is locked by jobs. Through the real CLI on
the fake 8-GPU host, started as Slurm starts jobs: together.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import pytest

from gpudiag.engine.locks import LockInfo, release, try_lock
from tests.fakes.jobs import read_context_log
from tests.support.host import EnvFactory, verdict_of
from tests.support.run import run_folder

UUIDS = [f"GPU-f00d{i:04x}-0000-4000-8000-00000000{i:04x}" for i in range(8)]
FAKE_PLUGIN_PATH = Path(__file__).resolve().parent / "fakes" / "jax_plugin"


def _together(argvs: Sequence[list[str]], env: Mapping[str, str], timeout: float = 300
              ) -> list[tuple[int, dict[str, Any]]]:
    """Start every ``gpudiag ARGV`` at the same moment; (exit code, JSON record) of each."""
    procs = [subprocess.Popen([sys.executable, "-m", "gpudiag", *argv], env=dict(env),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for argv in argvs]
    out: list[tuple[int, dict[str, Any]]] = []
    for argv, proc in zip(argvs, procs, strict=True):
        stdout, stderr = proc.communicate(timeout=timeout)
        try:
            out.append((proc.returncode, json.loads(stdout)))
        except json.JSONDecodeError as e:
            raise AssertionError(f"gpudiag {argv}: rc={proc.returncode}\n{stderr}") from e
    return out


def _answer(rc: int, rec: Mapping[str, Any]) -> tuple[Any, ...]:
    """What must not differ between a lone answer and answers given together."""
    return (rc, rec["gpu_validation_blocker"], rec["ready"],
            tuple(sorted((n, b["status"]) for n, b in rec["backends"].items())))


@contextmanager
def _jobs_hold(lock_dir: Path, uuids: Sequence[str]) -> Iterator[list[LockInfo]]:
    """Hold each GPU's lock as a `gpudiag run` job does (exclusive, purpose job)."""
    held = [lk for u in uuids if (lk := try_lock(lock_dir, u, purpose="job")) is not None]
    assert len(held) == len(uuids), "a GPU lock was taken before the test held it"
    try:
        yield held
    finally:
        release(held)


def _no_lock_left(lock_dir: Path) -> None:
    """Every GPU's lock can be taken exclusively now: no probe left one behind."""
    held = [try_lock(lock_dir, u) for u in UUIDS]
    try:
        assert all(lk is not None for lk in held), "a lock was left behind"
    finally:
        release([lk for lk in held if lk is not None])


@pytest.fixture
def host(gpu_env: EnvFactory, tmp_path: Path) -> dict[str, str]:
    """An idle fake 8-GPU host with a lock folder of its own; JAX without a GPU plugin."""
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=8)
    env["GPUDIAG_LOCK_DIR"] = str(tmp_path / "locks")
    return env


def _with_fake_plugin(env: Mapping[str, str]) -> dict[str, str]:
    """The project's fake JAX CUDA plugin installed (a ``jax_plugins`` module JAX finds)."""
    out = dict(env)
    old = out.get("PYTHONPATH")
    out["PYTHONPATH"] = f"{FAKE_PLUGIN_PATH}{os.pathsep}{old}" if old else str(FAKE_PLUGIN_PATH)
    out["FAKE_JAX_PLUGIN"] = "none"
    return out


def test_eight_jax_preflights_started_together_equal_the_lone_answer(
        host: dict[str, str]) -> None:
    argv = ["preflight", "--require", "jax", "--no-daemon", "--format", "json"]
    lone = _answer(*verdict_of(argv, host))
    assert lone[1] == "jax_gpu_backend_absent", lone
    together = [_answer(rc, rec) for rc, rec in _together([argv] * 8, host)]
    assert together == [lone] * 8
    _no_lock_left(Path(host["GPUDIAG_LOCK_DIR"]))


def test_eight_cuda_preflights_for_one_gpu_together_are_all_ready_on_a_named_gpu(
        host: dict[str, str]) -> None:
    argv = ["preflight", "--require", "cuda", "--gpus", "1", "--no-daemon", "--format", "json"]
    for rc, rec in _together([argv] * 8, host):
        assert rc == 0 and rec["gpu_validation_blocker"] == "none", rec["blockers"]
        selected = [d for d in rec["devices"] if d.get("selected")]
        assert len(selected) == 1 and selected[0]["uuid"] in UUIDS
        assert selected[0]["last_proven_at"] == rec["checked_at"], "named but not proven"
    _no_lock_left(Path(host["GPUDIAG_LOCK_DIR"]))


def test_sixteen_mixed_commands_together_never_say_devices_busy(host: dict[str, str]) -> None:
    kinds = [["preflight", "--require", "cuda"], ["preflight", "--require", "cuda", "--gpus", "2"],
             ["health", "--require", "cuda"], ["preflight", "--require", "cuda,jax", "--gpus", "1"]]
    argvs = [[*kinds[i % len(kinds)], "--no-daemon", "--format", "json"] for i in range(16)]
    for rc, rec in _together(argvs, host):
        codes = [b["code"] for b in rec["blockers"]]
        said = [f"{b['code']}: {b['message']}" for b in rec["blockers"]]
        assert "devices_busy" not in codes and "backend_unproven" not in codes, said
        if "jax" not in rec["requirement"]["backends"]:
            assert rc == 0, codes
    _no_lock_left(Path(host["GPUDIAG_LOCK_DIR"]))


def test_with_every_gpu_locked_by_jobs_a_missing_jax_plugin_is_still_known(
        host: dict[str, str]) -> None:
    with _jobs_hold(Path(host["GPUDIAG_LOCK_DIR"]), UUIDS):
        rc, rec = verdict_of(["health", "--require", "jax", "--no-daemon", "--format", "json"],
                             host)
    assert rc == 1
    assert rec["gpu_validation_blocker"] == "jax_gpu_backend_absent"
    assert rec["backends"]["jax"]["detail"]["installation_only"] is True


def test_with_every_gpu_locked_by_jobs_a_healthy_jax_is_unproven_never_ready(
        host: dict[str, str], tmp_path: Path) -> None:
    env = _with_fake_plugin(host)
    contexts = tmp_path / "contexts.jsonl"
    env["FAKE_CUDA_CONTEXT_LOG"] = str(contexts)
    with _jobs_hold(Path(host["GPUDIAG_LOCK_DIR"]), UUIDS):
        rc, health = verdict_of(["health", "--require", "jax", "--no-daemon", "--format",
                                 "json"], env)
        job_rc, job = verdict_of(["preflight", "--require", "jax", "--gpus", "1",
                                  "--no-daemon", "--format", "json"], env)
    # Node health: nothing known broken, jax unproven; it is not "none" and not a fault.
    assert rc == 1 and health["ready"] is False
    assert health["gpu_validation_blocker"] == "backend_unproven", health["blockers"]
    jax = health["backends"]["jax"]
    assert jax["status"] == "unproven"
    assert "8 locked by a gpudiag run job" in jax["detail"]["reason"]
    assert "nothing known is broken" in health["blockers"][0]["message"]
    # Job readiness: not ready; every GPU is held by a job.
    assert job_rc == 1 and job["gpu_validation_blocker"] == "devices_busy"
    assert "backend_unproven" in [b["code"] for b in job["blockers"]]
    # A job's lock keeps every probe off its GPU, even before the job has a process there
    # (the same log does record contexts once the locks are gone: the control below).
    assert read_context_log(contexts, event="context") == []
    verdict_of(["preflight", "--require", "cuda", "--no-daemon", "--format", "json"], env)
    assert read_context_log(contexts, event="context"), "the context log records nothing"


def test_siblings_exclusive_probe_lock_is_waited_for_not_called_busy(
        host: dict[str, str]) -> None:
    """A sibling's probe holding a GPU exclusively (exclusive compute mode) is waited for."""
    lock_dir = Path(host["GPUDIAG_LOCK_DIR"])
    lock = try_lock(lock_dir, UUIDS[0], purpose="probe")
    assert lock is not None
    proc = subprocess.Popen([sys.executable, "-m", "gpudiag", "preflight", "--require", "cuda",
                             "--no-daemon", "--format", "json"], env=host,
                            stdout=subprocess.PIPE, text=True)
    try:
        import time

        time.sleep(3.0)  # the preflight reaches the lock and waits for the sibling
        assert proc.poll() is None, "the preflight did not wait for the sibling probe"
    finally:
        release([lock])
    stdout, _ = proc.communicate(timeout=120)
    rec = json.loads(stdout)
    assert proc.returncode == 0, rec["blockers"]
    proven = {d["uuid"] for d in rec["devices"] if d["last_proven_at"] == rec["checked_at"]}
    assert UUIDS[0] in proven


def _run_after_jobs_release(env: dict[str, str], art: Path, require: str,
                            argv: list[str]) -> tuple[int, dict[str, Any]]:
    """`gpudiag run --gpus 1` started while jobs hold every GPU; the jobs end once it says
    it waits for them (a fixed sleep let a slow start find the GPUs free already)."""
    lock_dir = Path(env["GPUDIAG_LOCK_DIR"])
    said: list[str] = []
    waiting = threading.Event()

    def read(stream: IO[str]) -> None:
        for line in stream:
            said.append(line)
            if "waiting up to" in line:
                waiting.set()

    with _jobs_hold(lock_dir, UUIDS):
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpudiag", "run", "--gpus", "1", "--require", require,
             "--no-daemon", "--lock-timeout", "60", "--artifacts", str(art), "--", *argv],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        assert proc.stderr is not None
        reader = threading.Thread(target=read, args=(proc.stderr,), daemon=True)
        reader.start()
        assert waiting.wait(60), f"the run never waited for the jobs:\n{''.join(said)}"
    proc.wait(timeout=180)
    reader.join(10)
    stderr = "".join(said)
    closeout = json.loads((run_folder(art) / "closeout.json").read_text())
    assert isinstance(closeout, dict), stderr
    return proc.returncode, closeout


def test_admission_proves_a_backend_it_could_not_prove_before_it_runs_the_job(
        host: dict[str, str], tmp_path: Path) -> None:
    """Unproven at preflight (every GPU locked) is no pass: once a GPU is admitted, JAX is
    proven on it under the lock, and a JAX that cannot come up there refuses the job."""
    marker = tmp_path / "ran"
    rc, closeout = _run_after_jobs_release(
        _with_fake_plugin(host), tmp_path / "a", "jax",
        [sys.executable, "-c", f"open({str(marker)!r}, 'w')"])
    assert rc == 125, closeout
    assert not marker.exists(), "the job ran on a backend that was never proven"
    assert closeout["gpu_validation_blocker"].startswith("jax_"), closeout
    assert closeout["evidence"]["proof"]["under_lock"] is True
    assert closeout["evidence"]["proof"]["backends"]["jax"] == "blocked"


def test_admission_proves_cuda_on_the_gpu_it_locked(host: dict[str, str],
                                                     tmp_path: Path) -> None:
    rc, closeout = _run_after_jobs_release(host, tmp_path / "a", "cuda", ["true"])
    assert rc == 0, closeout
    assert closeout["gpu_validation_blocker"] == "none"
    verdict = json.loads((run_folder(tmp_path / "a") / "verdict.json").read_text())
    proof = verdict["evidence"]["proof"]
    assert proof["under_lock"] is True and proof["backends"]["cuda"] == "ok"
