"""Text rendering and the JAX probe's own safety on a shared card."""

from __future__ import annotations

import io
import json
import subprocess
import sys

from gpudiag.cli.render import render_text
from gpudiag.core.requirement import parse_requirement
from gpudiag.core.verdict import Finding, Verdict
from tests.support.host import clean_env


def test_text_keeps_brackets_that_look_like_markup() -> None:
    verdict = Verdict(requirement=parse_requirement("jax"),
                      blockers=(Finding.of("jax_gpu_backend_absent", "platforms: [cpu]"),),
                      warnings=(), devices=(), backends={}, evidence={},
                      preallocation_disabled=True, host="h", checked_at="t")
    out = io.StringIO()
    render_text(verdict, out, color=False)
    text = out.getvalue()
    assert "jax[cuda12]" in text
    assert "[cpu]" in text
    assert text.rstrip().endswith("gpu_validation_blocker=jax_gpu_backend_absent")


def test_jax_probe_reports_leaked_preallocation_but_never_uses_it() -> None:
    env = clean_env()
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true"
    proc = subprocess.run([sys.executable, "-m", "gpudiag.probes", "jax",
                           json.dumps({"platform": "cpu"})], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    obs = json.loads(proc.stdout.splitlines()[-1])
    assert obs["preallocation_disabled"] is False  # what the job would get
    assert obs["xla_env"]["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
    assert obs["probe_forced_preallocation_off"] is True  # what the probe itself used
    assert obs["compute"]["ok"] is True
