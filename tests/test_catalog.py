"""The catalog itself: complete, consistent, documented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpudiag.core.catalog import (
    BLOCKERS,
    CAUSED_BY,
    LAYER_ORDER,
    WARNINGS,
    caused_by,
    entry,
    layer_rank,
)
from gpudiag.core.verdict import Finding
from scripts.gen_blocker_docs import render

DESIGN_CODES = {
    "probe_timeout", "probe_crashed", "probe_error", "visible_devices_empty",
    "visible_devices_invalid", "device_nodes_missing", "device_nodes_no_access",
    "driver_library_missing", "driver_not_loaded", "driver_library_mismatch",
    "nvml_no_permission", "nvml_error", "gpu_lost", "gpu_reset_required",
    "gpu_ecc_uncorrectable", "gpu_inforom_corrupted", "cuda_library_missing", "cuda_no_device",
    "cuda_driver_mismatch", "cuda_driver_too_old", "cuda_system_not_ready",
    "cuda_devices_unavailable", "cuda_out_of_memory", "cuda_init_failed", "cuda_context_failed",
    "jax_not_installed", "jax_gpu_backend_absent", "jax_cpu_fallback", "jax_backend_init_failed",
    "jax_plugin_version_mismatch", "jax_cuda_libs_mismatch", "jax_preallocation_enabled",
    "jax_compute_failed", "iree_not_installed", "iree_driver_unavailable", "iree_no_device",
    "iree_device_create_failed", "iree_execute_failed", "insufficient_devices",
    "insufficient_free_memory", "devices_busy", "device_state_unknown",
    "visible_devices_conflict", "admission_changed", "lock_timeout",
}


def test_catalog_holds_every_design_code() -> None:
    assert DESIGN_CODES <= set(BLOCKERS)


@pytest.mark.parametrize("code", sorted(BLOCKERS) + sorted(WARNINGS))
def test_every_row_has_a_layer_summary_and_remediation(code: str) -> None:
    row = entry(code)
    assert row.layer in LAYER_ORDER
    assert row.summary.endswith(".") and row.remediation.endswith(".")
    finding = Finding.of(code, "why")
    assert finding.layer == row.layer and finding.remediation == row.remediation


def test_unknown_codes_are_refused() -> None:
    with pytest.raises(KeyError):
        entry("no_such_code")


def test_docs_match_the_catalog() -> None:
    docs = Path(__file__).resolve().parent.parent / "docs" / "blockers.md"
    assert docs.read_text() == render(), "run: .venv/bin/python scripts/gen_blocker_docs.py"


# Words of a fix that only sends the reader back to what they already have.
_POINTS_BACK = re.compile(r"\b(read|see|look at|is in|are in|in the message|in evidence|"
                          r"names? the cause|says? why)\b", re.IGNORECASE)


@pytest.mark.parametrize("code", sorted(BLOCKERS) + sorted(WARNINGS))
def test_no_fix_only_points_back_at_the_message(code: str) -> None:
    fix = entry(code).remediation
    steps = [s.strip() for s in re.split(r"[.;:]\s+|\.$", fix) if s.strip()]
    assert any(not _POINTS_BACK.search(s) for s in steps), (
        f"{code}'s remediation names no next step, only where to read: {fix!r}")


def test_cuda_init_failed_names_the_next_steps() -> None:
    fix = entry("cuda_init_failed").remediation
    for step in ("dmesg", "NVRM", "nvidia-uvm", "nvidia-persistenced", "nvidia-smi -r",
                 "reboot"):
        assert step in fix, step


@pytest.mark.parametrize("code", sorted(CAUSED_BY))
def test_every_declared_consequence_is_a_blocker_caused_only_from_below(code: str) -> None:
    assert code in BLOCKERS
    for layer in CAUSED_BY[code]:
        assert layer_rank(layer) < layer_rank(BLOCKERS[code].layer), (code, layer)


@pytest.mark.parametrize(("code", "root"), [
    ("devices_busy", "cuda"), ("iree_not_installed", "jax"), ("jax_not_installed", "cuda"),
    ("lock_timeout", "driver"), ("jax_preallocation_enabled", "cuda")])
def test_findings_that_hold_whatever_happens_below_are_nobodys_consequence(
        code: str, root: str) -> None:
    assert not caused_by(code, root)
