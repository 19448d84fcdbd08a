"""Who failed a job: hardware, software, application or unknown, from the run's GPU events.

Pure: the caller gathers the events (the daemon's history, or the XID watcher that
``gpudiag run`` ran itself) and says which evidence sources covered the run; this module
keeps the events of the job's GPUs inside its time window and applies ``RULES`` in order.
The first rule with a matching event decides (whatever the exit status: a GPU that failed
under a job is news even when the job survived it), and the events it matched are the
answer's evidence. With no matching event, a job that exited 0 gets ``none``; a failed job
is the application's when at least one source covered the whole run, and ``unknown``
(naming what was missing) when none did.
docs/runner.md shows each rule with an example closeout.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeGuard

from gpudiag.core.clock import rfc3339
from gpudiag.core.job_watch import RunWarning, run_warnings
from gpudiag.core.records import dataclass
from gpudiag.core.usage import GpuUsage, usages_of
from gpudiag.core.xids import APPLICATION, LOST, REBOOT, RESET, xid_code, xid_description

HARDWARE = "hardware"
SOFTWARE = "software"
APPLICATION_KIND = "application"
UNKNOWN = "unknown"
NONE = "none"  # the job did not fail: nothing to attribute
KINDS: tuple[str, ...] = (HARDWARE, SOFTWARE, APPLICATION_KIND, UNKNOWN, NONE)

# An XID is logged as the GPU fails, and the job usually dies of it a moment later: events
# up to this long after the job's end still belong to it.
AFTER_END_S = 2.0

HARDWARE_XID_CODES = frozenset({LOST, RESET, REBOOT})
GPU_FAULT_CODES = frozenset({"gpu_lost", "gpu_missing", "gpu_reset_required",
                             "gpu_inforom_corrupted", "node_reboot_required"})
ECC_CODES = frozenset({"gpu_ecc_uncorrectable"})
# A backend that stopped proving: the driver or the CUDA/JAX/IREE stack, not the GPU. Busy
# or full GPUs (46, out of memory, context failures) are left out: during a job they are
# most often the job itself.
SOFTWARE_CODES = frozenset({
    "driver_library_missing", "driver_not_loaded", "driver_library_mismatch",
    "nvml_no_permission", "nvml_error", "cuda_library_missing", "cuda_no_device",
    "cuda_driver_mismatch", "cuda_driver_too_old", "cuda_system_not_ready", "cuda_init_failed",
    "jax_gpu_backend_absent", "jax_backend_init_failed", "jax_plugin_version_mismatch",
    "jax_cuda_libs_mismatch", "iree_driver_unavailable", "iree_no_device",
    "iree_device_create_failed"})


@dataclass(frozen=True)
class JobEvent:
    """One GPU event near a job: an XID, or a blocker that began (from the daemon's history)."""

    ts: float  # wall clock, seconds since the epoch
    source: str  # "daemon" or "watcher" (the run's own XID watcher)
    gpu: str | None  # full GPU UUID; None: node-wide (a driver or CUDA failure)
    code: str | None  # the blocker code; for an XID, the code the XID catalog maps it to
    xid: int | None = None
    message: str = ""

    def record(self) -> dict[str, Any]:
        """The JSON form (closeouts, ``gpudiag explain --format json``)."""
        return {"at": rfc3339(self.ts), "ts": self.ts, "source": self.source, "gpu": self.gpu,
                "code": self.code, "xid": self.xid, "message": self.message}

    @classmethod
    def from_record(cls, rec: Any) -> JobEvent | None:
        """Read back what ``record`` wrote; None for anything else."""
        if not isinstance(rec, dict):
            return None
        ts, xid = rec.get("ts"), rec.get("xid")
        if not _number(ts):
            return None
        return cls(float(ts), str(rec.get("source") or "?"), _opt_str(rec.get("gpu")),
                   _opt_str(rec.get("code")),
                   xid if isinstance(xid, int) and not isinstance(xid, bool) else None,
                   str(rec.get("message") or ""))


def _opt_str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def xid_event(ts: float, xid: int, gpu: str | None, source: str) -> JobEvent:
    """An XID as a job event, coded by the XID catalog."""
    return JobEvent(ts, source, gpu, xid_code(xid), xid, f"XID {xid} ({xid_description(xid)})")


@dataclass(frozen=True)
class Source:
    """One evidence source and whether it covered the whole run (``why`` says what not)."""

    name: str  # "daemon history" or "run watcher"
    covered: bool
    why: str | None = None


@dataclass(frozen=True)
class Window:
    """The run: when it ran and on which GPUs (full UUIDs, MIG parents included)."""

    start: float
    end: float
    gpus: frozenset[str]

    def holds(self, event: JobEvent) -> bool:
        """The event happened on the job's GPUs (or node-wide) while it ran."""
        if not self.start <= event.ts <= self.end + AFTER_END_S:
            return False
        if event.gpu is None:
            # A driver or CUDA stack failure is every job's; a GPU fault or an XID of a GPU
            # that was not named may be another job's GPU, so it is no evidence here.
            return event.xid is None and event.code in SOFTWARE_CODES
        return event.gpu in self.gpus


@dataclass(frozen=True)
class Rule:
    """One attribution rule: events it matches decide ``kind``."""

    name: str
    kind: str
    summary: str
    matches: Callable[[JobEvent], bool]


RULES: tuple[Rule, ...] = (
    Rule("hardware_xid", HARDWARE,
         "an XID whose NVIDIA action says hardware (fallen off the bus, reset or reboot "
         "needed) on the job's GPUs",
         lambda e: e.xid is not None and e.code in HARDWARE_XID_CODES),
    Rule("gpu_fault", HARDWARE,
         "NVML saw a job's GPU lost, missing, needing a reset or with a corrupted InfoROM",
         lambda e: e.xid is None and e.code in GPU_FAULT_CODES),
    Rule("ecc_uncorrectable", HARDWARE,
         "an uncorrectable ECC error or a row-remap failure on the job's GPUs",
         lambda e: e.xid is None and e.code in ECC_CODES),
    Rule("backend_stopped", SOFTWARE,
         "a backend stopped proving during the run (driver reloaded or missing, cuInit "
         "failing, the JAX or IREE GPU backend failing)",
         lambda e: e.xid is None and e.code in SOFTWARE_CODES),
    Rule("application_xid", APPLICATION_KIND,
         "an application XID (13, 31, 43, ...) on the job's GPUs: the job's own fault",
         lambda e: e.xid is not None and e.code == APPLICATION),
)
NO_EVENT_RULE = "exit_without_gpu_event"
MISSING_RULE = "evidence_missing"
SUCCEEDED_RULE = "job_succeeded"


@dataclass(frozen=True)
class Attribution:
    """The answer: ``kind``, the ``rule`` that decided it, its events, what was missing."""

    kind: str
    rule: str
    events: tuple[JobEvent, ...] = ()
    missing: tuple[str, ...] = ()

    def record(self) -> dict[str, Any]:
        """The closeout's ``attribution`` object."""
        return {"kind": self.kind, "rule": self.rule,
                "events": [e.record() for e in self.events], "missing": list(self.missing)}

    @classmethod
    def from_record(cls, rec: Any) -> Attribution | None:
        """Read back what ``record`` wrote; None for anything else."""
        if not isinstance(rec, dict) or rec.get("kind") not in KINDS:
            return None
        events = tuple(e for e in map(JobEvent.from_record, rec.get("events") or [])
                       if e is not None)
        missing = tuple(str(m) for m in rec.get("missing") or [])
        return cls(str(rec["kind"]), str(rec.get("rule") or "?"), events, missing)

    def kv(self) -> str:
        """The closeout.txt value: the kind, then the first deciding event or what was missing.

        ``hardware xid=79 gpu=GPU-...``, ``software code=cuda_init_failed``,
        ``unknown missing=daemon history: ...``.
        """
        parts = [self.kind, f"rule={self.rule}"]
        if self.events:
            e = self.events[0]
            parts += [f"xid={e.xid}"] if e.xid is not None else [f"code={e.code}"]
            if e.gpu:
                parts.append(f"gpu={e.gpu}")
        elif self.kind == UNKNOWN and self.missing:
            parts.append("missing=" + "; ".join(self.missing))
        return " ".join(parts)


def attribute(exit_code: int | None, window: Window, events: Iterable[JobEvent],
              sources: Sequence[Source]) -> Attribution:
    """Apply ``RULES`` to the events of the job's GPUs inside its window."""
    mine = sorted((e for e in events if window.holds(e)), key=lambda e: e.ts)
    missing = tuple(f"{s.name}: {s.why}" for s in sources if not s.covered and s.why)
    if not sources:
        missing = ("no evidence source: neither a daemon's history nor a watcher of the run",)
    for rule in RULES:
        hits = tuple(e for e in mine if rule.matches(e))
        if hits:
            # Also when the job exited 0: its GPU failed under it, and the node must know.
            return Attribution(rule.kind, rule.name, hits, missing)
    if exit_code == 0:
        return Attribution(NONE, SUCCEEDED_RULE, tuple(mine), missing)
    if not any(s.covered for s in sources):
        return Attribution(UNKNOWN, MISSING_RULE, (), missing)
    return Attribution(APPLICATION_KIND, NO_EVENT_RULE, (), missing)


# --- the daemon's history as job events ----------------------------------------------------


def history_events(history: Any) -> list[JobEvent] | None:
    """The XIDs and blocker episodes of a ``/v1/history`` answer as job events; None when the
    answer has no XID timeline (a daemon older than attribution)."""
    if not isinstance(history, dict) or not isinstance(history.get("xids"), list):
        return None
    events: list[JobEvent] = []
    for x in history["xids"]:
        if not isinstance(x, dict):
            continue
        ts, xid = x.get("ts"), x.get("xid")
        if _number(ts) and isinstance(xid, int) and not isinstance(xid, bool):
            events.append(xid_event(float(ts), xid, _opt_str(x.get("uuid")), "daemon"))
    for ep in history.get("episodes") or []:
        if not isinstance(ep, dict) or not _number(ep.get("started")):
            continue
        device = _opt_str(ep.get("device"))
        gpu = device if device and device.startswith(("GPU-", "MIG-")) else None
        events.append(JobEvent(float(ep["started"]), "daemon", gpu, _opt_str(ep.get("code")),
                               None, str(ep.get("message") or "")))
    return events


def _number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# --- the record a run leaves for the daemon (its job-closeouts inbox) ----------------------

JOB_SCHEMA = "gpudiag.job/1"
_RUN_ID = re.compile(r"[0-9A-Za-z_-]{1,64}")
JOB_INBOX = "job-closeouts"


@dataclass(frozen=True)
class JobRecord:
    """What a run that closed out tells the node's daemon: who ran what, when, where, and
    who failed it. ``pid`` is the ``gpudiag run`` process, ``child_pid`` the job's."""

    pid: int
    child_pid: int | None
    argv: tuple[str, ...]
    slurm_job_id: str | None
    host: str
    started: float
    ended: float
    exit_code: int
    gpus: tuple[str, ...]
    attribution: Attribution
    closeout: str | None  # closeout.json's path
    # Per GPU: energy, peak memory, throttle reasons, XIDs (gpudiag.core.usage).
    gpu_usage: tuple[GpuUsage, ...] = ()
    # The daemon's job watch (core.job_watch): job_stalled, gpu_straggler_suspect.
    warnings: tuple[RunWarning, ...] = ()
    # The id the daemon gave the run at its begin, when the run left this record because its
    # end did not reach that daemon: the record is then matched to that run alone.
    run: str | None = None

    def record(self) -> dict[str, Any]:
        """The inbox file's JSON (``warnings`` only when the job watch gave some)."""
        rec = {"schema": JOB_SCHEMA, "pid": self.pid, "child_pid": self.child_pid,
               "argv": list(self.argv), "slurm_job_id": self.slurm_job_id, "host": self.host,
               "started": self.started, "ended": self.ended, "exit_code": self.exit_code,
               "gpus": list(self.gpus), "attribution": self.attribution.record(),
               "closeout": self.closeout,
               "gpu_usage": [u.record() for u in self.gpu_usage]}
        if self.warnings:
            rec["warnings"] = [w.record() for w in self.warnings]
        if self.run is not None:
            rec["run"] = self.run
        return rec

    @property
    def window(self) -> Window:
        """The run's window, for re-attributing it from the history later."""
        return Window(self.started, self.ended, frozenset(self.gpus))

    @classmethod
    def from_record(cls, rec: Any) -> JobRecord:
        """Parse an inbox file's JSON; ValueError names what is wrong."""
        if not isinstance(rec, dict) or rec.get("schema") != JOB_SCHEMA:
            raise ValueError(f"not a {JOB_SCHEMA} record")
        attribution = Attribution.from_record(rec.get("attribution"))
        if attribution is None:
            raise ValueError("its attribution is missing or of an unknown kind")
        pid, child, code = rec.get("pid"), rec.get("child_pid"), rec.get("exit_code")
        started, ended = rec.get("started"), rec.get("ended")
        if not (isinstance(pid, int) and isinstance(code, int) and _number(started)
                and _number(ended)):
            raise ValueError("pid, exit_code, started and ended must be numbers")
        slurm, run = rec.get("slurm_job_id"), rec.get("run")
        if run is not None and not (isinstance(run, str) and _RUN_ID.fullmatch(run)):
            raise ValueError("run must be the daemon's run id (up to 64 of 0-9a-zA-Z_-)")
        return cls(pid, child if isinstance(child, int) else None,
                   tuple(str(a) for a in rec.get("argv") or []),
                   str(slurm) if slurm not in (None, "") else None, str(rec.get("host") or ""),
                   float(started), float(ended), code,
                   tuple(str(g) for g in rec.get("gpus") or []), attribution,
                   _opt_str(rec.get("closeout")), usages_of(rec.get("gpu_usage")),
                   run_warnings(rec.get("warnings")), run)
