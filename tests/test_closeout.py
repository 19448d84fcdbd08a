"""The typed closeout: its record keeps the schema's keys and order, and every key is documented."""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path

from gpudiag.runner.closeout import Closeout, GpuSlot, closeout_kv

REPO = Path(__file__).resolve().parent.parent
# closeout.json's keys before the closeout was typed (a refused run has no attribution keys).
REFUSED_KEYS = ["schema", "gpu_execution_route", "gpu_validation_blocker", "ready", "launched",
                "status", "exit_code", "exit_signal", "timed_out", "preallocation_disabled",
                "preallocation_source", "xla_allocator", "container_image", "gpu_injection",
                "started_at", "ended_at", "duration_s", "host", "gpudiag_version",
                "verdict_source", "gpus", "artifacts", "blockers", "evidence", "error"]


def _refused() -> Closeout:
    return Closeout(started_at="2026-12-01T00:00:00Z", host="node1", gpudiag_version="0",
                    container_image=None, artifacts={"plan": "/runs/1/plan.json"})


def test_a_refused_closeout_has_the_schemas_keys_in_order() -> None:
    record = _refused().record()
    assert list(record) == REFUSED_KEYS
    assert record["schema"] == "gpudiag.closeout/1" and record["status"] == "refused"
    assert record["exit_code"] == 125 and record["gpus"] == [] and record["blockers"] == []


def test_a_launched_closeout_adds_attribution_and_renders_as_kv() -> None:
    slot = GpuSlot("GPU-1", "gpu", None, "NVIDIA H200", 0, 100, 90)
    done = replace(_refused(), launched=True, ready=True, status="exited", exit_code=0,
                   gpus=(slot,), attribution={"kind": "none", "rule": "job_succeeded"},
                   job_record={"path": None, "error": "no daemon"})
    record = done.record()
    assert list(record) == [*REFUSED_KEYS, "attribution", "job_record"]
    assert record["gpus"][0]["uuid"] == "GPU-1"
    text = closeout_kv(record)
    assert "status=exited\n" in text and "gpus.0.name=NVIDIA H200\n" in text


def test_every_closeout_key_is_in_the_reference() -> None:
    doc = (REPO / "docs" / "reference.md").read_text()
    table = doc.split("### The closeout record", 1)[1].split("\n## ", 1)[0]
    for f in fields(Closeout):
        assert f"`{f.name}`" in table, f"docs/reference.md: document closeout key {f.name}"
