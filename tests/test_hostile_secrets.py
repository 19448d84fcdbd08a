"""Issue 24 item 6: ten kinds of secret in the environment, none in anything gpudiag writes.

Allow-listed names can carry secrets (NVIDIA_API_KEY, SLURM_JOB_GPUS_TOKEN) and allowed values
can embed credentials (gs://user:PW@..., s3://AKIA:KEY@... in XLA_FLAGS, a PATH entry, the
daemon URL). The test plants them all, then greps every output: the preflight answer and its
--record file, a `gpudiag run`'s artifacts folder, and a real daemon's log, history database,
/metrics and /v1/preflight answer.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from gpudiag.core.redact import redact_environment, redact_record, redact_text
from tests.support.daemon import Daemon, daemon_toml, write_config
from tests.support.host import EnvFactory, run_gpudiag


def _secrets(env: dict[str, str]) -> dict[str, str]:
    """The environment with ten planted secrets; each secret's text contains SECRET-n."""
    return dict(
        env,
        NVIDIA_API_KEY="nvapi-SECRET-1",
        JAX_COMPILATION_CACHE_DIR="gs://user:SECRET-2@bucket/cache",
        XLA_FLAGS="--xla_dump_to=s3://AKIA:SECRET-3@bucket/dump",
        PATH=env["PATH"] + os.pathsep + "https://u:SECRET-4@mirror.example/bin",
        SLURM_JOB_GPUS_TOKEN="SECRET-5",
        CUDA_CACHE_PASSWORD="SECRET-6",
        IREE_CREDENTIALS="SECRET-7",
        TF_CPP_SECRET_THING="SECRET-8",
        LD_LIBRARY_PATH=env["LD_LIBRARY_PATH"] + os.pathsep + "//svc:SECRET-9@share/lib",
        GPUDIAG_DAEMON_URL="http://admin:SECRET-10@127.0.0.1:9",
        AWS_SECRET_ACCESS_KEY="SECRET-11",  # not even allow-listed
    )


def _leaks(text: str) -> list[str]:
    return sorted({f"SECRET-{n}" for n in range(1, 12) if f"SECRET-{n}" in text})


def test_redaction_rules() -> None:
    env = redact_environment({"NVIDIA_API_KEY": "x", "XLA_FLAGS": "--a=s3://K:S@b/c",
                              "PATH": "/bin:https://u:p@h/x", "CUDA_HOME": "/usr/local/cuda"})
    assert env == {"NVIDIA_API_KEY": "***", "XLA_FLAGS": "--a=s3://***@b/c",
                   "PATH": "/bin:https://***@h/x", "CUDA_HOME": "/usr/local/cuda"}
    assert redact_text("git@github.com:org/repo user@host") == "git@github.com:org/repo user@host"
    rec = redact_record({"evidence": {"probe_stderr": {"jax": "dump to s3://AKIA:KEY@b\n" * 24},
                                      "environment": {"SLURM_JOB_GPUS_TOKEN": "t"}}})
    assert "KEY@" not in json.dumps(rec) and rec["evidence"]["environment"] == {
        "SLURM_JOB_GPUS_TOKEN": "***"}


def test_no_planted_secret_reaches_a_record_artifact_or_output(gpu_env: EnvFactory,
                                                             tmp_path: Path) -> None:
    env = _secrets(gpu_env(FAKE_NVML_DEVICE_COUNT=2, GPUDIAG_LOCK_DIR=str(tmp_path / "locks")))
    record = tmp_path / "verdict.json"
    proc = run_gpudiag(["preflight", "--require", "cuda", "--record", str(record)], env)
    assert proc.returncode == 0, proc.stderr
    verdict = json.loads(record.read_text())
    assert verdict["evidence"]["daemon"]["url"] == "http://***@127.0.0.1:9"
    assert verdict["evidence"]["environment"]["NVIDIA_API_KEY"] == "***"
    outputs = {"stdout": proc.stdout, "stderr": proc.stderr, "record": record.read_text()}
    art = tmp_path / "run"
    proc = run_gpudiag(["run", "--artifacts", str(art), "--gpus", "1", "--", "true"], env)
    assert proc.returncode == 0, proc.stderr
    outputs["run stderr"] = proc.stderr
    for path in art.rglob("*"):
        if path.is_file():
            outputs[str(path)] = path.read_text(errors="replace")
    assert len(outputs) > 8
    leaks = {name: _leaks(text) for name, text in outputs.items() if _leaks(text)}
    assert not leaks, leaks


def test_no_planted_secret_reaches_the_daemons_log_history_metrics_or_answers(
        gpu_env: EnvFactory, tmp_path: Path) -> None:
    env = _secrets(gpu_env(FAKE_NVML_DEVICE_COUNT=2, GPUDIAG_LOCK_DIR=str(tmp_path / "locks"),
                           FAKE_NVML_INIT_ERROR=9))  # blocked: blocker episodes get stored
    state = tmp_path / "state"
    daemon = Daemon(env, write_config(tmp_path / "gpudiag.toml", daemon_toml()), state)
    try:
        daemon.wait_ready()
        answers = [daemon.get(p)[1] for p in ("/metrics", "/v1/preflight", "/v1/history",
                                              "/v1/health")]
    finally:
        daemon.stop()
    outputs = {"log": "\n".join(daemon.lines),
               "answers": json.dumps(answers, default=str)}
    for path in state.rglob("*"):
        if path.is_file():
            outputs[str(path)] = path.read_bytes().decode("latin-1")
    assert any("history.sqlite3" in name for name in outputs)
    assert "driver_not_loaded" in outputs["answers"]
    leaks = {name: _leaks(text) for name, text in outputs.items() if _leaks(text)}
    assert not leaks, leaks
