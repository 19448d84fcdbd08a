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


def _blockers_text(*codes: str) -> str:
    verdict = Verdict(requirement=parse_requirement("cuda,jax,iree"),
                      blockers=tuple(Finding.of(c, f"{c} here") for c in codes),
                      warnings=(), devices=(), backends={}, evidence={},
                      preallocation_disabled=True, host="h", checked_at="t")
    out = io.StringIO()
    render_text(verdict, out, color=False, width=120)
    return out.getvalue().split("Blockers (", 1)[1]


def _folded_under(text: str) -> list[str]:
    """The codes listed one per line under "then, because of it"."""
    if "then, because of it" not in text:
        return []
    tail = text.split("then, because of it", 1)[1].splitlines()[1:]
    return [line.split()[0] for line in tail if line.startswith("      ") and line.strip()]


def test_a_busy_gpu_is_never_listed_as_a_consequence_of_a_cuda_fault() -> None:
    text = _blockers_text("cuda_system_not_ready", "jax_backend_init_failed", "devices_busy")
    assert _folded_under(text) == ["jax_backend_init_failed"]
    assert "fix: " in text.split("devices_busy", 1)[1]  # shown in full, on its own


def test_iree_not_installed_is_its_own_finding_under_jax_not_installed() -> None:
    text = _blockers_text("jax_not_installed", "iree_not_installed")
    assert "then, because of it" not in text
    assert text.count("fix: ") == 2


def test_a_driver_fault_folds_the_cuda_and_jax_failures_it_brings() -> None:
    text = _blockers_text("driver_library_missing", "cuda_library_missing", "jax_cpu_fallback",
                          "backend_unproven")
    assert _folded_under(text) == ["cuda_library_missing", "jax_cpu_fallback",
                                   "backend_unproven"]
    assert text.count("fix: ") == 1
