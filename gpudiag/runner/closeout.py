"""The closeout of one ``gpudiag run`` (schema ``gpudiag.closeout/1``), typed.

The route builds it once at the start (refused, nothing launched) and replaces fields as the
run goes on; ``record()`` is the JSON of ``closeout.json`` (docs/reference.md, "The closeout
record") and ``closeout_kv`` the lines of ``closeout.txt``. Sub-records that only travel into
the file (blockers, evidence, attribution, the job record) stay JSON-ready mappings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

from gpudiag.core.attribution import Attribution
from gpudiag.core.records import dataclass
from gpudiag.core.recordtext import kv_value
from gpudiag.core.usage import GpuUsage

CLOSEOUT_SCHEMA = "gpudiag.closeout/1"
ROUTE = "gpudiag-run"


@dataclass(frozen=True)
class GpuSlot:
    """One admitted GPU leaf (a GPU, or a MIG instance), as the closeout names it."""

    uuid: str | None
    kind: str
    parent_uuid: str | None
    name: str | None
    index: int | None
    memory_total_bytes: int | None
    memory_free_bytes: int | None

    def record(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Closeout:
    """What ``gpudiag run`` says about one run, whatever became of it."""

    started_at: str
    host: str
    gpudiag_version: str
    container_image: str | None
    artifacts: Mapping[str, str]
    schema: str = CLOSEOUT_SCHEMA
    gpu_execution_route: str = ROUTE
    gpu_validation_blocker: str = "none"
    ready: bool = False
    launched: bool = False
    status: str = "refused"  # refused | launch_failed | exited | signaled | timed_out
    exit_code: int = 125
    exit_signal: int | None = None
    timed_out: bool = False
    preallocation_disabled: str = "no"        # yes | no
    preallocation_source: str = "none"        # child | plan | none
    xla_allocator: str | None = None          # a launched run: the job's XLA allocator
    gpu_injection: str | None = None          # --image: how the GPUs reach the container
    ended_at: str | None = None
    duration_s: float | None = None
    verdict_source: str | None = None         # daemon | inline
    gpus: tuple[GpuSlot, ...] = ()
    blockers: tuple[Mapping[str, Any], ...] = ()
    evidence: Mapping[str, Any] | None = None
    error: str | None = None
    # A launched run only (runner.attribution): who failed it, and where the job was reported.
    attribution: Mapping[str, Any] | None = None
    job_record: Mapping[str, Any] | None = None
    # A launched run only: per GPU, its energy, peak memory, throttle reasons and XIDs.
    gpu_usage: tuple[GpuUsage, ...] | None = None

    def record(self) -> dict[str, Any]:
        """closeout.json, in the schema's key order (attribution keys only once launched)."""
        out: dict[str, Any] = {}
        for name in _ORDER:
            value = getattr(self, name)
            if name in ("attribution", "job_record", "gpu_usage") and value is None:
                continue
            out[name] = ([g.record() for g in value] if name in ("gpus", "gpu_usage")
                         else [dict(b) for b in value] if name == "blockers"
                         else dict(value) if isinstance(value, Mapping) else value)
        return out


_ORDER = ("schema", "gpu_execution_route", "gpu_validation_blocker", "ready", "launched",
          "status", "exit_code", "exit_signal", "timed_out", "preallocation_disabled",
          "preallocation_source", "xla_allocator", "container_image", "gpu_injection",
          "started_at", "ended_at", "duration_s", "host", "gpudiag_version", "verdict_source",
          "gpus", "artifacts",
          "blockers", "evidence", "error", "attribution", "job_record", "gpu_usage")


def closeout_kv(closeout: Mapping[str, Any]) -> str:
    """closeout.txt from the record: one key=value per line, scalars, then flattened lists."""
    lines = [f"{k}={kv_value(closeout.get(k), lenient=True)}" for k in (
        "gpu_execution_route", "gpu_validation_blocker", "ready", "launched", "status",
        "exit_code", "exit_signal", "timed_out", "preallocation_disabled",
        "preallocation_source", "xla_allocator", "container_image", "gpu_injection", "started_at",
        "ended_at", "duration_s", "verdict_source", "host", "gpudiag_version")]
    attribution = Attribution.from_record(closeout.get("attribution"))
    if attribution is not None:
        lines.append(f"gpu_failure_attribution={attribution.kv()}")
    gpus: Sequence[Mapping[str, Any]] = closeout.get("gpus") or []
    lines.append(f"gpus.count={len(gpus)}")
    lines.append(f"gpus.uuids={','.join(str(g['uuid']) for g in gpus)}")
    for i, g in enumerate(gpus):
        for k in ("uuid", "kind", "parent_uuid", "name", "memory_total_bytes",
                  "memory_free_bytes"):
            lines.append(f"gpus.{i}.{k}={kv_value(g.get(k), lenient=True)}")
    for i, u in enumerate(closeout.get("gpu_usage") or []):
        for k in ("uuid", "energy_joules", "peak_memory_used_bytes", "throttle_reasons",
                  "xids", "why_missing"):
            lines.append(f"gpu_usage.{i}.{k}={kv_value(u.get(k), lenient=True)}")
    for k, v in (closeout.get("artifacts") or {}).items():
        lines.append(f"artifacts.{k}={v}")
    blockers: Sequence[Mapping[str, Any]] = closeout.get("blockers") or []
    lines.append(f"blockers={','.join(b['code'] for b in blockers)}")
    for i, b in enumerate(blockers):
        for k in ("code", "layer", "device", "message", "remediation"):
            lines.append(f"blockers.{i}.{k}={kv_value(b.get(k), lenient=True)}")
    if closeout.get("evidence") is not None:
        lines.append(f"evidence={kv_value(closeout['evidence'], lenient=True)}")
    if closeout.get("error"):
        lines.append(f"error={kv_value(closeout['error'], lenient=True)}")
    return "\n".join(lines) + "\n"

