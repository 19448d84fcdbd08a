"""Issue 30: help that agrees with itself: one metavar style, --format wherever a record is
printed (with the old --json kept), and errors that name the variable they read."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.support.host import EnvFactory, clean_env, run_gpudiag

COMMANDS = ["probe", "preflight", "health", "serve", "history", "run", "clear", "fleet",
            "npd-relay"]
RECORD_PRINTERS = ["probe", "preflight", "health", "history", "fleet"]


def _help(command: str) -> str:
    proc = run_gpudiag([command, "--help"], {**os.environ, "COLUMNS": "100"})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_names_its_value_in_one_style(command: str) -> None:
    text = _help(command)
    # click's type names (INTEGER RANGE, FLOAT, TEXT for a name) say nothing to a reader.
    assert re.findall(r"--[a-z-]+ (INTEGER|FLOAT|RANGE|BOOLEAN)\b", text) == []
    metavars = re.findall(r"^\s+(?:-\w, )?--[a-z-]+ ([A-Z][A-Z_]*|\[[^\]]+\])", text, re.M)
    assert all(m.startswith("[") or m.isupper() for m in metavars), metavars


@pytest.mark.parametrize("command", RECORD_PRINTERS)
def test_every_command_that_prints_a_record_takes_format(command: str) -> None:
    assert re.search(r"--format \[text\|json", _help(command))


def test_history_json_is_format_json_and_they_must_agree(tmp_path: Path) -> None:
    from gpudiag.daemon.store import HistoryStore, default_path

    HistoryStore(default_path(tmp_path)).close()
    env = clean_env()
    as_json = run_gpudiag(["history", "--json", "--state-dir", str(tmp_path)], env)
    as_format = run_gpudiag(["history", "--format", "json", "--state-dir", str(tmp_path)], env)
    assert as_json.returncode == as_format.returncode == 0, as_json.stderr + as_format.stderr
    assert json.loads(as_json.stdout) == json.loads(as_format.stdout)
    assert set(json.loads(as_json.stdout)) >= {"verdicts", "episodes", "clears"}
    both = run_gpudiag(["history", "--json", "--format", "text", "--state-dir",
                        str(tmp_path)], env)
    assert both.returncode == 2 and "disagree" in both.stderr


def test_fleet_without_a_url_names_the_variable_it_reads() -> None:
    env = clean_env()
    env.pop("GPUDIAG_PROMETHEUS_URL", None)
    proc = run_gpudiag(["fleet"], env)
    assert proc.returncode == 2 and "$GPUDIAG_PROMETHEUS_URL" in proc.stderr, proc.stderr
    assert "--prometheus URL" in proc.stderr


def test_preflight_says_when_to_use_gpus_and_when_min_devices() -> None:
    text = " ".join(_help("preflight").split())
    assert "GPUs a scheduler already gave the job" in text
    assert "N GPUs the job may still choose" in text
    # The Slurm Prolog is such a case: it names the job's GPUs and asks for all of them.
    prolog = (Path(__file__).resolve().parent.parent / "deploy" / "slurm"
              / "gpudiag-prolog.sh").read_text()
    assert "--min-devices" in prolog and "--devices" in prolog and "--gpus" not in prolog


def test_health_require_lists_and_takes_jax_cpu(gpu_env: EnvFactory) -> None:
    assert "jax:cpu" in _help("health")
    proc = run_gpudiag(["health", "--no-daemon", "--require", "jax:cpu", "--format", "kv"],
                       gpu_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gpu_validation_blocker=none" in proc.stdout


def test_one_config_file_name_in_the_unit_the_manifests_the_docs_and_the_help() -> None:
    root = Path(__file__).resolve().parent.parent
    files = [root / "README.md", *(root / "docs").glob("*.md"), *(root / "systemd").iterdir(),
             *(root / "deploy").rglob("*.yaml")]
    named = {m for p in files for m in re.findall(r"/etc/gpudiag/[\w.-]+\.toml", p.read_text())}
    named |= set(re.findall(r"/etc/gpudiag/[\w.-]+\.toml", _help("serve")))
    assert named == {"/etc/gpudiag/gpudiag.toml"}


WORDS = ("job readiness", "node health", "admission", "leaves", "proven")


def test_the_readme_says_what_its_words_mean_before_it_uses_them() -> None:
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text().lower()
    defined_at = text.index("two questions, two commands")
    for word in WORDS:
        assert text.index(word) >= defined_at, f"README uses {word!r} before saying what it is"


def test_the_glossary_defines_every_word_the_docs_lean_on() -> None:
    text = (Path(__file__).resolve().parent.parent / "docs" / "reference.md").read_text()
    glossary = text.split("## Glossary", 1)[1]
    rows = re.findall(r"^\| ([A-Za-z ,]+) \|", glossary, re.M)
    for word in ("verdict", "blocker", "job readiness", "node health", "busy, free", "proven",
                 "leaf", "admission", "held XID".lower()):
        assert word in [r.lower() for r in rows], word
