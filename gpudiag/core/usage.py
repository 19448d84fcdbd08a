"""What a job used and what stopped one: the records behind the numbers of docs/numbers.md.

Pure data and their JSON forms, shared by the runner (which writes them) and the daemon
(which reads them from its inboxes):
- ``GpuUsage``: one GPU's use by one job (the closeout's ``gpu_usage``): energy from NVML's
  total energy counter start to end, the peak memory sampled, the throttle reasons seen and
  the XIDs in the job's window;
- ``BlockRecord`` (``gpudiag.block/1``): a job gpudiag refused before it started, with the
  code that refused it (``gpudiag_preflight_blocks_total{code}``).
The GPUs a run holds (``gpudiag_gpu_allocation_info``) are its attested begin on the
daemon's socket (daemon/runs.py), never a record.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeGuard

from gpudiag.core.records import dataclass

BLOCK_SCHEMA = "gpudiag.block/1"


def _number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _opt_float(value: Any) -> float | None:
    return float(value) if _number(value) else None


def _opt_int(value: Any) -> int | None:
    return int(value) if _number(value) else None


def _strings(value: Any) -> tuple[str, ...]:
    return tuple(str(v) for v in value) if isinstance(value, list) else ()


@dataclass(frozen=True)
class GpuUsage:
    """One GPU's use by one job; None where NVML could not say (never a made-up 0)."""

    uuid: str
    energy_joules: float | None = None
    peak_memory_used_bytes: int | None = None
    throttle_reasons: tuple[str, ...] = ()
    xids: tuple[int, ...] = ()
    samples: int = 0  # memory and throttle readings taken during the job
    why_missing: str | None = None  # why energy or the samples are missing

    def record(self) -> dict[str, Any]:
        return {"uuid": self.uuid, "energy_joules": self.energy_joules,
                "peak_memory_used_bytes": self.peak_memory_used_bytes,
                "throttle_reasons": list(self.throttle_reasons), "xids": list(self.xids),
                "samples": self.samples, "why_missing": self.why_missing}

    @classmethod
    def from_record(cls, rec: Any) -> GpuUsage | None:
        """Read back what ``record`` wrote; None for anything else."""
        if not isinstance(rec, dict) or not isinstance(rec.get("uuid"), str):
            return None
        energy = _opt_float(rec.get("energy_joules"))
        why = rec.get("why_missing")
        return cls(str(rec["uuid"]), energy if energy is None or energy >= 0 else None,
                   _opt_int(rec.get("peak_memory_used_bytes")),
                   _strings(rec.get("throttle_reasons")),
                   tuple(int(x) for x in rec.get("xids") or [] if _number(x)),
                   _opt_int(rec.get("samples")) or 0, why if isinstance(why, str) else None)


def usages_of(value: Any) -> tuple[GpuUsage, ...]:
    """The ``gpu_usage`` list of a closeout or job record, the unreadable entries left out."""
    if not isinstance(value, list):
        return ()
    return tuple(u for u in map(GpuUsage.from_record, value) if u is not None)


@dataclass(frozen=True)
class BlockRecord:
    """A job gpudiag refused before it started: ``code`` is its gpu_validation_blocker."""

    pid: int
    code: str
    codes: tuple[str, ...]
    ts: float
    slurm_job_id: str | None = None

    def record(self) -> dict[str, Any]:
        return {"schema": BLOCK_SCHEMA, "pid": self.pid, "code": self.code,
                "codes": list(self.codes), "ts": self.ts, "slurm_job_id": self.slurm_job_id}

    @classmethod
    def from_record(cls, rec: Any) -> BlockRecord:
        """Parse an inbox file's JSON; ValueError names what is wrong."""
        if not isinstance(rec, dict) or rec.get("schema") != BLOCK_SCHEMA:
            raise ValueError(f"not a {BLOCK_SCHEMA} record")
        pid, code, ts = rec.get("pid"), rec.get("code"), rec.get("ts")
        if not (isinstance(pid, int) and isinstance(code, str) and code and _number(ts)):
            raise ValueError("pid, code and ts must be given")
        slurm = rec.get("slurm_job_id")
        return cls(pid, code, _strings(rec.get("codes")), float(ts),
                   str(slurm) if slurm not in (None, "") else None)


def merge_xids(usages: Sequence[GpuUsage], xids: Sequence[tuple[str | None, int]]
               ) -> tuple[GpuUsage, ...]:
    """Each usage with the XIDs (GPU UUID, XID) that fell on its GPU in the job's window."""
    out = []
    for u in usages:
        mine = tuple(x for gpu, x in xids if gpu == u.uuid)
        out.append(GpuUsage(u.uuid, u.energy_joules, u.peak_memory_used_bytes,
                            u.throttle_reasons, mine, u.samples, u.why_missing))
    return tuple(out)
