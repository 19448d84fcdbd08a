"""The verdict record (schema ``gpudiag.verdict/1``): dataclasses and their renderings.

Frozen dataclasses cross module boundaries; dicts appear only at the JSON edge
(``Verdict.record()`` / ``Verdict.from_record()``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import field, replace

from gpudiag.core.catalog import LAYER_ORDER, WARNINGS, entry, layer_rank
from gpudiag.core.records import dataclass
from gpudiag.core.recordtext import SCHEMA, render_kv
from gpudiag.core.redact import redact_record
from gpudiag.core.version import __version__

# typing.TYPE_CHECKING without importing typing (the daemon-answered CLI call never needs it).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    JSONValue = Any  # a JSON-able value; evidence is free-form by design


class RecordError(ValueError):
    """A verdict record that does not follow the schema."""


@dataclass(frozen=True)
class Finding:
    """A blocker or a warning: one code with where it applies and what to do."""

    code: str
    layer: str
    message: str
    remediation: str
    backend: str | None = None
    device: str | None = None

    @classmethod
    def of(cls, code: str, message: str, *, backend: str | None = None,
           device: str | None = None, warning: bool = False) -> Finding:
        """A finding whose layer and remediation come from the catalog."""
        # A code can be both (device_nodes_missing): a warning takes the warning's row.
        row = WARNINGS[code] if warning and code in WARNINGS else entry(code)
        return cls(code=code, layer=row.layer, message=message, remediation=row.remediation,
                   backend=backend, device=device)

    def record(self) -> dict[str, JSONValue]:
        return {"code": self.code, "layer": self.layer, "backend": self.backend,
                "device": self.device, "message": self.message,
                "remediation": self.remediation}


# Backends about the node, not its GPUs (BackendRequirement.needs_gpu).
NODE_BACKENDS: frozenset[str] = frozenset({"nic"})


@dataclass(frozen=True)
class BackendRequirement:
    """One required backend; ``platform`` is JAX's platform or IREE's driver."""

    name: str
    platform: str | None = None

    @property
    def needs_gpu(self) -> bool:
        """Whether this requirement can only be met by an NVIDIA GPU: the default platform
        (none named) is the GPU; a named one other than gpu/cuda (jax:cpu, iree:local-task,
        iree:hip) is not. One rule for every backend spec (gpudiag.core.registry), and one
        exception: the node's network ports (``nic``) are no GPU's, so requiring them alone
        runs no GPU probe and a GPU fault never blocks them."""
        return self.platform in (None, "gpu", "cuda") and self.name not in NODE_BACKENDS

    def spec(self) -> str:
        return self.name if self.platform is None else f"{self.name}:{self.platform}"


@dataclass(frozen=True)
class Requirement:
    """What a job needs from this host."""

    backends: tuple[BackendRequirement, ...] = (BackendRequirement("cuda"),)
    devices: tuple[str, ...] | None = None
    min_devices: int | None = None
    min_free_memory_bytes: int | None = None
    # Job readiness on N GPUs: ready when at least N visible GPUs are healthy and FREE.
    gpus: int | None = None
    # The node-health question (is anything on this node broken?) instead of job readiness:
    # busy GPUs are healthy in use, never a blocker (Slurm health checks, gpudiag_ready).
    node_health: bool = False

    @property
    def question(self) -> str:
        """Which question the verdict answers: ``job`` readiness or ``node_health``."""
        return "node_health" if self.node_health else "job"

    @property
    def needs_gpu(self) -> bool:
        return any(b.needs_gpu for b in self.backends)

    def backend(self, name: str) -> BackendRequirement | None:
        return next((b for b in self.backends if b.name == name), None)

    @property
    def effective_min_devices(self) -> int:
        if self.min_devices is not None:
            return self.min_devices
        if self.devices is not None:
            return len(self.devices)
        return 1 if self.needs_gpu else 0

    def record(self) -> dict[str, JSONValue]:
        return {
            "backends": [b.spec() for b in self.backends],
            "devices": list(self.devices) if self.devices is not None else None,
            "min_devices": self.effective_min_devices,
            "min_free_memory_bytes": self.min_free_memory_bytes,
            "gpus": self.gpus,
            "question": self.question,
        }


@dataclass(frozen=True)
class DeviceProcess:
    """A compute process on a GPU, as nvidia-smi's process table shows it; name and user are
    None where /proc hides the process from gpudiag (another PID namespace, hidepid)."""

    pid: int
    used_memory_bytes: int | None = None
    name: str | None = None
    user: str | None = None

    def record(self) -> dict[str, JSONValue]:
        return {"pid": self.pid, "used_memory_bytes": self.used_memory_bytes,
                "name": self.name, "user": self.user}

    @classmethod
    def from_record(cls, d: JSONValue) -> DeviceProcess:
        """Rebuild one process; TypeError names a field of the wrong type."""
        if not isinstance(d, Mapping):
            raise TypeError(f"devices[].processes[] holds {d!r}, not an object")
        pid, used = d.get("pid"), d.get("used_memory_bytes")
        if isinstance(pid, bool) or not isinstance(pid, int):
            raise TypeError(f"devices[].processes[].pid holds {pid!r}, not a process id")
        if used is not None and (isinstance(used, bool) or not isinstance(used, int)):
            raise TypeError(f"devices[].processes[].used_memory_bytes holds {used!r}")
        name, user = d.get("name"), d.get("user")
        return cls(pid, used, name if isinstance(name, str) else None,
                   user if isinstance(user, str) else None)


@dataclass(frozen=True)
class DeviceInfo:
    """One GPU the job could use, as the verdict reports it."""

    index: int
    uuid: str | None
    name: str | None
    pci_bus_id: str | None
    memory_total_bytes: int | None
    memory_free_bytes: int | None
    # free | busy | unknown (docs/design-notes.md "Busy GPUs"); None where no NVML reading was had.
    occupancy: str | None = None
    # No fault on this GPU (busy is healthy in use); None where nothing could be read.
    healthy: bool | None = None
    # When an active probe (context and allocation) last succeeded on it (RFC 3339).
    last_proven_at: str | None = None
    # With ``gpus=N``: whether this GPU is one of the N the verdict names for the job.
    selected: bool | None = None
    # The readings a person checks first (as nvitop and gpustat show them); None where NVML
    # could not read them. ``pids``: the compute processes NVML lists on it (MIG included).
    memory_used_bytes: int | None = None
    utilization_ratio: float | None = None
    temperature_c: float | None = None
    pids: tuple[int, ...] | None = None
    # Those processes with their GPU memory, name and user (nvidia-smi's process table).
    processes: tuple[DeviceProcess, ...] | None = None
    # Where ``uuid`` comes from: "nvml" (read now), "last_seen" (NVML cannot read it now, a
    # lost GPU: the daemon names it by the UUID its index last had), None (no UUID).
    uuid_source: str | None = None
    # The board serial NVML reports (nvmlDeviceGetSerial): the GPU's identity across slots,
    # reboots and RMAs, which history keys on beside the UUID; None where NVML has none.
    serial: str | None = None
    # With ``gpus=N``: why this GPU was chosen, or passed over ("no warning, 79.0 GiB free,
    # 1st of 2"); None without ``gpus``.
    selection: str | None = None
    # What nvidia-smi shows beside them (the table's --wide columns); None where unread.
    power_w: float | None = None
    power_limit_w: float | None = None
    sm_clock_mhz: int | None = None
    memory_clock_mhz: int | None = None
    pstate: int | None = None
    fan_ratio: float | None = None
    ecc_volatile_corrected: int | None = None
    ecc_volatile_uncorrected: int | None = None

    def record(self) -> dict[str, JSONValue]:
        return {"index": self.index, "uuid": self.uuid, "name": self.name,
                "pci_bus_id": self.pci_bus_id, "memory_total_bytes": self.memory_total_bytes,
                "memory_free_bytes": self.memory_free_bytes, "occupancy": self.occupancy,
                "healthy": self.healthy, "last_proven_at": self.last_proven_at,
                "selected": self.selected, "memory_used_bytes": self.memory_used_bytes,
                "utilization_ratio": self.utilization_ratio,
                "temperature_c": self.temperature_c,
                "pids": None if self.pids is None else list(self.pids),
                "processes": None if self.processes is None
                else [p.record() for p in self.processes],
                "uuid_source": self.uuid_source, "serial": self.serial,
                "selection": self.selection,
                "power_w": self.power_w, "power_limit_w": self.power_limit_w,
                "sm_clock_mhz": self.sm_clock_mhz, "memory_clock_mhz": self.memory_clock_mhz,
                "pstate": self.pstate, "fan_ratio": self.fan_ratio,
                "ecc_volatile_corrected": self.ecc_volatile_corrected,
                "ecc_volatile_uncorrected": self.ecc_volatile_uncorrected}

    @classmethod
    def from_record(cls, d: Mapping[str, JSONValue]) -> DeviceInfo:
        """Rebuild a device from its record; the readings are optional (older daemons) and
        fields a newer gpudiag adds are ignored (the record may be added to)."""
        known = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in d.items() if k in known}
        pids = fields.pop("pids", None)
        procs = fields.pop("processes", None)
        if procs is not None and not isinstance(procs, list):
            raise TypeError(f"devices[].processes holds {procs!r}, not a list")
        if pids is not None and not (isinstance(pids, list) and all(
                isinstance(p, int) and not isinstance(p, bool) for p in pids)):
            raise TypeError(f"devices[].pids holds {pids!r}, not a list of process ids")
        for key in ("utilization_ratio", "temperature_c", "power_w", "power_limit_w",
                    "fan_ratio"):
            value = fields.get(key)
            if value is not None and (isinstance(value, bool)
                                      or not isinstance(value, (int, float))):
                raise TypeError(f"devices[].{key} holds {value!r}, not a number")
        return cls(**fields, pids=None if pids is None else tuple(pids),
                   processes=None if procs is None
                   else tuple(DeviceProcess.from_record(p) for p in procs))


# A backend that was not tried on a GPU (none free, a sibling probing): never counted as
# proven. Its detail says why; readiness decides per question what it means.
UNPROVEN = "unproven"


@dataclass(frozen=True)
class BackendStatus:
    """How one backend fared: ok, blocked, not_installed or unproven (detail.reason: why)."""

    status: str
    duration_s: float | None
    versions: Mapping[str, str | None] = field(default_factory=dict)
    detail: Mapping[str, JSONValue] = field(default_factory=dict)

    def record(self) -> dict[str, JSONValue]:
        return {"status": self.status, "duration_s": self.duration_s,
                "versions": dict(self.versions), "detail": dict(self.detail)}


def primary_blocker(blockers: Sequence[Finding]) -> Finding | None:
    """The root cause: the blocker of the lowest layer (first listed wins a tie)."""
    if not blockers:
        return None
    return min(blockers, key=lambda b: layer_rank(b.layer))


@dataclass(frozen=True)
class Verdict:
    """The answer to: can this job's backend initialize on this host's GPUs now?"""

    requirement: Requirement
    blockers: tuple[Finding, ...]
    warnings: tuple[Finding, ...]
    devices: tuple[DeviceInfo, ...]
    backends: Mapping[str, BackendStatus]
    evidence: Mapping[str, JSONValue]
    preallocation_disabled: bool
    host: str
    checked_at: str
    age_s: float = 0.0
    source: str = "inline"
    gpudiag_version: str = __version__

    @property
    def primary(self) -> Finding | None:
        return primary_blocker(self.blockers)

    @property
    def gpu_validation_blocker(self) -> str:
        """``none`` or the root-cause code."""
        primary = self.primary
        return "none" if primary is None else primary.code

    @property
    def ready(self) -> bool:
        return not self.blockers

    def with_source(self, source: str, age_s: float) -> Verdict:
        return replace(self, source=source, age_s=round(age_s, 3))

    def record(self) -> dict[str, JSONValue]:
        """The JSON record of docs/reference.md, secrets redacted (core.redact): every output,
        file and history row is made from this."""
        record: dict[str, JSONValue] = redact_record({
            "schema": SCHEMA,
            "gpu_validation_blocker": self.gpu_validation_blocker,
            "ready": self.ready,
            "blockers": [b.record() for b in self.ordered_blockers()],
            "warnings": [w.record() for w in self.warnings],
            "requirement": self.requirement.record(),
            "devices": [d.record() for d in self.devices],
            "backends": {name: s.record() for name, s in self.backends.items()},
            "evidence": dict(self.evidence),
            "preallocation_disabled": "yes" if self.preallocation_disabled else "no",
            "host": self.host,
            "checked_at": self.checked_at,
            "age_s": self.age_s,
            "source": self.source,
            "gpudiag_version": self.gpudiag_version,
        })
        return record

    def ordered_blockers(self) -> list[Finding]:
        """The blockers root cause first (lowest layer first), as the record lists them."""
        return sorted(self.blockers, key=lambda b: layer_rank(b.layer))

    def json(self, indent: int | None = 2) -> str:
        return json.dumps(self.record(), indent=indent, sort_keys=False)

    def kv(self) -> str:
        """``key=value`` lines: the scalar fields first, then flattened lists."""
        return render_kv(self.record())

    @classmethod
    def from_record(cls, record: Mapping[str, JSONValue]) -> Verdict:
        """Rebuild a verdict from its JSON record (e.g. the daemon's answer)."""
        try:
            if record.get("schema") != SCHEMA:
                raise RecordError(f"schema is {record.get('schema')!r}, expected {SCHEMA!r}")
            req = record["requirement"]
            verdict = cls(
                requirement=Requirement(
                    backends=tuple(_parse_backend_spec(s) for s in req["backends"]),
                    devices=tuple(_str(d, "requirement.devices") for d in req["devices"])
                    if req.get("devices") is not None else None,
                    min_devices=req.get("min_devices"),
                    min_free_memory_bytes=req.get("min_free_memory_bytes"),
                    gpus=req.get("gpus"),
                    node_health=req.get("question") == "node_health",
                ),
                blockers=tuple(_finding(b) for b in record["blockers"]),
                warnings=tuple(_finding(w) for w in record["warnings"]),
                devices=tuple(DeviceInfo.from_record(d) for d in record["devices"]),
                backends={n: BackendStatus(**s) for n, s in record["backends"].items()},
                evidence=dict(record["evidence"]),
                preallocation_disabled=record["preallocation_disabled"] == "yes",
                host=str(record["host"]),
                checked_at=str(record["checked_at"]),
                age_s=float(record.get("age_s", 0.0)),
                source=str(record.get("source", "inline")),
                gpudiag_version=str(record.get("gpudiag_version", "")),
            )
            # What the CLI does next with a daemon's answer: render it. A record that
            # cannot be rendered is not one, and must fail here, not in the renderer.
            verdict.kv()
            return verdict
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise RecordError(f"not a {SCHEMA} record: {e!r}") from e


def _str(value: JSONValue, where: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{where} holds {value!r}, not a string")
    return value


def _opt_str(value: JSONValue, where: str) -> str | None:
    return None if value is None else _str(value, where)


def _finding(raw: Mapping[str, JSONValue]) -> Finding:
    layer = _str(raw["layer"], "a finding's layer")
    if layer not in LAYER_ORDER:
        raise ValueError(f"layer {layer!r} is not one of {', '.join(LAYER_ORDER)}")
    return Finding(code=_str(raw["code"], "a finding's code"), layer=layer,
                   message=_str(raw["message"], "a finding's message"),
                   remediation=_str(raw["remediation"], "a finding's remediation"),
                   backend=_opt_str(raw.get("backend"), "a finding's backend"),
                   device=_opt_str(raw.get("device"), "a finding's device"))


def _parse_backend_spec(spec: JSONValue) -> BackendRequirement:
    name, _, platform = _str(spec, "requirement.backends").partition(":")
    return BackendRequirement(name, platform or None)


def _finding_keys(verdict: Verdict | None, last_uuids: Mapping[int, str]
                  ) -> dict[tuple[str, str | None], str]:
    if verdict is None:
        return {}
    devices = {d.uuid: d for d in verdict.devices if d.uuid}
    out: dict[tuple[str, str | None], str] = {}
    for b in verdict.blockers:
        where = b.device
        if where is not None and where in devices:
            d = devices[where]
            seen = "last seen as " if d.uuid_source == "last_seen" else ""
            where = f"GPU {d.index} ({seen}{where})"
        elif where is not None and where.startswith("index "):
            number = where.removeprefix("index ")
            last = last_uuids.get(int(number)) if number.isdecimal() else None
            # A lost GPU has no UUID NVML can read now: name the one it last had.
            where = f"GPU {number}" + (f" (last seen as {last})" if last else "")
        out[(b.code, b.device)] = b.code + (f" on {where}" if where else "")
    return out


def change_summary(old: Verdict | None, new: Verdict,
                   last_uuids: Mapping[int, str] | None = None) -> str:
    """What changed between two verdicts, for a log line: which blockers appeared or went.

    ``last_uuids``: each GPU index's last UUID seen, to name a GPU that lost it.
    """
    known = dict(last_uuids or {})
    before, after = _finding_keys(old, known), _finding_keys(new, known)
    appeared = [after[k] for k in after if k not in before]
    went = [before[k] for k in before if k not in after]
    bits = []
    if appeared:
        bits.append("appeared: " + "; ".join(appeared))
    if went:
        bits.append("went: " + "; ".join(went))
    if not bits:
        old_w = {w.code for w in old.warnings} if old else set()
        new_w = {w.code for w in new.warnings}
        if new_w - old_w:
            bits.append("warnings appeared: " + ", ".join(sorted(new_w - old_w)))
        if old_w - new_w:
            bits.append("warnings went: " + ", ".join(sorted(old_w - new_w)))
    return "; ".join(bits) or "details changed"
