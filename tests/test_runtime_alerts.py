"""Runtimes are the node's promise, reported as theirs (issue 48).

A runtime's findings are ``gpudiag_runtime_blocker{runtime,...}``, a runtime section in
/v1/health (``evidence.runtimes``) and the warning alert GpudiagRuntimeFailing; the node's
own verdict (``gpudiag_blocker``, GpudiagNodeBlocked) stays for the node's own faults. Real
daemons on the fake driver, real venvs with the suite's CPU-only JAX, and the real promtool
over the daemon's own /metrics.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support.daemon import Daemon, daemon_toml, metric_samples, wait_for, write_config
from tests.support.host import EnvFactory
from tests.support.prometheus import PROMTOOL, RULES
from tests.support.venvs import make_venv


def _daemon(tmp_path: Path, env: dict[str, str], extra: str) -> Daemon:
    toml = daemon_toml({"backends.jax": {"enabled": True, "interval_s": 600}}) + extra
    return Daemon.ready(env, write_config(tmp_path / "daemon.toml", toml), tmp_path / "state",
                        timeout=120)


def _runtime_blockers(d: Daemon) -> dict[tuple[str, str], float]:
    return {(labels["runtime"], labels["code"]): value
            for labels, value in metric_samples(d, "gpudiag_runtime_blocker")}


@pytest.fixture
def pinned(tmp_path: Path, gpu_env: EnvFactory) -> Any:
    """A daemon with two runtimes pinned to the CPU: ``pinned`` promises GPU JAX (its
    default), ``cpujobs`` promises CPU jobs (``require = "jax:cpu"``)."""
    python = make_venv(tmp_path / "venv", with_jax=True)
    extra = (f'[runtimes.pinned]\npython = "{python}"\nuser = "root"\n'
             'env = { JAX_PLATFORMS = "cpu" }\n'
             f'[runtimes.cpujobs]\npython = "{python}"\nuser = "root"\nrequire = "jax:cpu"\n'
             'env = { JAX_PLATFORMS = "cpu" }\n')
    d = _daemon(tmp_path, gpu_env(), extra)
    try:
        wait_for(lambda: _runtime_blockers(d).get(("pinned", "jax_cpu_fallback")), 120, 0.5)
        wait_for(lambda: dict((labels["runtime"], v) for labels, v in metric_samples(
            d, "gpudiag_runtime_backend_up")).get("cpujobs"), 120, 0.5)
        yield d
    finally:
        d.stop()


def test_a_runtime_pinned_to_the_cpu_is_its_own_blocker_never_the_nodes(pinned: Daemon) -> None:
    node = {labels["code"]: value for labels, value in metric_samples(pinned, "gpudiag_blocker")}
    assert node["jax_cpu_fallback"] == 0
    assert [code for code, value in node.items() if value] == []
    found = _runtime_blockers(pinned)
    assert found[("pinned", "jax_cpu_fallback")] == 1
    assert [k for k, v in found.items() if v and k[0] == "cpujobs"] == []
    # The series are bounded: the probe, jax and iree codes per runtime, no device code.
    assert ("pinned", "gpu_lost") not in found
    assert len({code for _, code in found}) <= 20


def test_health_has_a_runtime_section_and_the_node_reads_healthy(pinned: Daemon) -> None:
    status, record = pinned.get("/v1/health")
    assert status == 200
    assert record["gpu_validation_blocker"] == "none", record["blockers"]
    section = record["evidence"]["runtimes"]
    assert section["pinned"]["state"] == "blocked"
    assert section["pinned"]["blocker"] == "jax_cpu_fallback"
    assert section["pinned"]["blockers"][0]["backend"] == "jax"
    assert section["cpujobs"] == {**section["cpujobs"], "state": "ok", "ready": True,
                                  "blocker": "none", "require": ["jax:cpu"],
                                  "backends": {"jax": "ok"}, "refused": None}
    assert "gpudiag" not in section, "the daemon's own environment serves nobody here"


def test_the_daemon_log_names_the_runtime(pinned: Daemon) -> None:
    said = [json.loads(line).get("msg") or json.loads(line).get("message") or ""
            for line in pinned.lines if line.startswith("{")]
    text = "\n".join(said)
    assert "probe jax@pinned: child ok" in text, text
    assert "runtime pinned: verdict changed: jax_cpu_fallback" in text, text
    assert "verdict changed: jax_cpu_fallback" not in text.replace(
        "runtime pinned: verdict changed: jax_cpu_fallback", ""), text
    assert "proving again: \n" not in text + "\n" and not text.endswith("proving again: ")


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")
def test_the_rules_over_that_daemons_metrics_page_nobody_and_warn_of_the_runtime(
        pinned: Daemon, tmp_path: Path) -> None:
    series = [(name, labels, value) for name in ("gpudiag_blocker", "gpudiag_runtime_blocker",
                                                   "gpudiag_runtime_refused")
              for labels, value in metric_samples(pinned, name)]
    inputs = [{"series": name + "{" + ",".join(
        f'{k}="{v}"' for k, v in {"job": "gpudiag", "instance": "n:9477", **labels}.items())
        + "}", "values": f"{value:g}x40"} for name, labels, value in series]
    test = {"rule_files": [str(RULES)], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": inputs,
        "alert_rule_test": [
            {"eval_time": "30m", "alertname": "GpudiagNodeBlocked", "exp_alerts": []},
            {"eval_time": "30m", "alertname": "GpudiagRuntimeRefused", "exp_alerts": []},
            {"eval_time": "30m", "alertname": "GpudiagRuntimeFailing", "exp_alerts": [{
                "exp_labels": {"severity": "warning", "job": "gpudiag", "instance": "n:9477",
                               "runtime": "pinned"},
                "exp_annotations": {
                    "summary": "n:9477: runtime pinned cannot serve its jobs",
                    "description": (
                        "The job environment pinned on n:9477 fails its own backend proof "
                        "for 15 minutes (`gpudiag_runtime_blocker{runtime=\"pinned\"}` names "
                        "the code; GET /v1/health, evidence.runtimes, has the evidence). Fix "
                        "that environment (its packages, its env, its require); the node's "
                        "GPUs are not at fault.")}}]}]}]}
    path = tmp_path / "rules.test.yml"
    path.write_text(json.dumps(test))  # JSON is YAML
    assert PROMTOOL is not None
    done = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_terminal_shows_the_runtimes_apart_from_the_nodes_blockers(pinned: Daemon) -> None:
    import io

    from gpudiag.cli.render import render_text
    from gpudiag.core.verdict import Verdict

    _, record = pinned.get("/v1/health")
    out = io.StringIO()
    render_text(Verdict.from_record(record), out, color=False, width=200)
    text = out.getvalue()
    assert "Runtimes (the job environments this node serves" in text, text
    lines = {line.split()[0]: line for line in text.splitlines() if line.startswith("  ")}
    assert "blocked" in lines["pinned"] and "jax_cpu_fallback" in lines["pinned"], text
    assert "ok" in lines["cpujobs"].split() and "jax ok" in lines["cpujobs"], text
    assert text.rstrip().endswith("gpu_validation_blocker=none"), text
