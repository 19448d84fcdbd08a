"""Typed probe observations: each child's JSON parsed once, where it enters, into frozen records.

A probe child prints one JSON object (the probe child protocol). ``registry.parse_observation``
checks its shape (its backend spec's, with gpudiag.core.observation: a malformed observation
is a ``probe_error`` naming the field) and builds the records below; nothing above core reads
the raw dict. Fields the shape check does not cover are read leniently (a wrong type is None),
so a probe may add fields and a foreign or truncated one never raises. Raw sub-records that
only travel into evidence are kept as ``Mapping`` (dicts only at the JSON edge).

One NVML vocabulary: ``GpuReadings`` (memory, utilization, temperature, power) is what both
the nvml probe's devices and the XID watcher's telemetry lines carry, under the same names.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias

Number: TypeAlias = int | float
Scalar: TypeAlias = str | int | float | bool
Record: TypeAlias = Mapping[str, Any]
_EMPTY: Record = {}


# -- lenient readers: the shape check already refused wrong types where it looks --------------


def _map(value: Any) -> Record:
    return value if isinstance(value, Mapping) else _EMPTY


def _num(value: Any) -> Number | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _int(value: Any) -> int | None:
    n = _num(value)
    return None if n is None or n != n or n in (float("inf"), float("-inf")) else int(n)


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _text(value: Any) -> str | None:
    """Any JSON value as the text a message shows (None stays None)."""
    return None if value is None else str(value)


def _scalar(value: Any) -> Scalar | None:
    return value if isinstance(value, (str, int, float, bool)) else None


def _flag(value: Any) -> bool | None:
    """True/False as the probe said it; None when absent (``ok is False`` differs from unset)."""
    return None if value is None else bool(value)


def _bool(value: Any) -> bool | None:
    """A JSON true/false; anything else (absent, unsupported) is None."""
    return value if isinstance(value, bool) else None


def _code(value: Any) -> int | str | None:
    """An error code: an int stays an int (it is looked up), anything else is its text."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return str(value)


def _strs(value: Any) -> tuple[str, ...]:
    return tuple(str(v) for v in value) if isinstance(value, list) else ()


def _records(value: Any) -> tuple[Record, ...]:
    return tuple(v for v in value if isinstance(v, Mapping)) if isinstance(value, list) else ()


def _str_map(value: Any) -> dict[str, str | None]:
    return {str(k): (None if v is None else str(v)) for k, v in _map(value).items()}


# -- shared records --------------------------------------------------------------------------


@dataclass(frozen=True)
class ErrorInfo:
    """An error a probe recorded (NVML, CUDA, Python or IREE); ``record`` is its JSON."""

    code: int | str | None = None
    name: str | None = None
    message: str | None = None
    type: str | None = None
    step: str | None = None
    where: str | None = None
    record: Record = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def parse(cls, value: Any) -> ErrorInfo | None:
        """The error in ``value``; None when absent or empty (an empty record says nothing)."""
        if not isinstance(value, Mapping) or not value:
            return None
        return cls(_code(value.get("code")), _text(value.get("name")),
                   _text(value.get("message")), _text(value.get("type")),
                   _text(value.get("step")), _text(value.get("where")), value)

    def without_traceback(self) -> dict[str, Any]:
        """The record without its (long) traceback, for verdict details."""
        return {k: v for k, v in self.record.items() if k != "traceback"}


@dataclass(frozen=True)
class Memory:
    """Device memory as NVML reads it, in bytes."""

    total_bytes: int | None = None
    free_bytes: int | None = None
    used_bytes: int | None = None

    @classmethod
    def parse(cls, value: Any) -> Memory | None:
        """Parsed from the probe's JSON (already shape-checked)."""
        if not isinstance(value, Mapping):
            return None
        return cls(_int(value.get("total_bytes")), _int(value.get("free_bytes")),
                   _int(value.get("used_bytes")))


@dataclass(frozen=True)
class GpuReadings:
    """One GPU's live readings, the one vocabulary of the nvml probe and the XID watcher."""

    index: int | None = None
    memory: Memory | None = None
    utilization_gpu_ratio: Number | None = None
    temperature_c: Number | None = None
    power_w: Number | None = None

    @classmethod
    def parse(cls, value: Any) -> GpuReadings:
        """The readings in a device record or a telemetry line; a bad field is None."""
        v = _map(value)
        return cls(_int(v.get("index")), Memory.parse(v.get("memory")),
                   _num(v.get("utilization_gpu_ratio")), _num(v.get("temperature_c")),
                   _num(v.get("power_w")))

    def updated_by(self, newer: GpuReadings | None) -> GpuReadings:
        """These readings with every value ``newer`` has replacing the older one."""
        if newer is None:
            return self
        mem, new_mem = self.memory or Memory(), newer.memory or Memory()
        memory = Memory(*(n if n is not None else o for n, o in (
            (new_mem.total_bytes, mem.total_bytes), (new_mem.free_bytes, mem.free_bytes),
            (new_mem.used_bytes, mem.used_bytes))))
        return GpuReadings(
            self.index, memory if self.memory is not None or newer.memory is not None else None,
            _newer(newer.utilization_gpu_ratio, self.utilization_gpu_ratio),
            _newer(newer.temperature_c, self.temperature_c), _newer(newer.power_w, self.power_w))


def _newer(new: Number | None, old: Number | None) -> Number | None:
    return old if new is None else new


def parse_telemetry(value: Any) -> dict[int, GpuReadings]:
    """A watcher ``telemetry`` line's ``gpus`` list by GPU index; malformed entries dropped."""
    out: dict[int, GpuReadings] = {}
    for raw in value if isinstance(value, list) else []:
        if not isinstance(raw, Mapping):
            continue
        index = raw.get("index")
        if isinstance(index, int) and not isinstance(index, bool):
            out[index] = GpuReadings.parse(raw)
    return out


# -- nvml ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuProcess:
    """A compute process NVML lists on a GPU or MIG instance."""

    pid: int | None
    used_memory_bytes: Number | None = None
    name: str | None = None  # its command name (/proc/PID/comm); None where /proc hides it
    user: str | None = None  # its owner's user name (or uid); None where /proc hides it


def _processes(value: Any) -> tuple[GpuProcess, ...] | None:
    if not isinstance(value, list):
        return None
    return tuple(GpuProcess(_int(p.get("pid")), _num(p.get("used_memory_bytes")),
                            _str(p.get("name")), _str(p.get("user")))
                 for p in value if isinstance(p, Mapping))


@dataclass(frozen=True)
class Ecc:
    """ECC error counters; None where the GPU does not report them."""

    volatile_corrected: Number | None = None
    volatile_uncorrected: Number | None = None
    aggregate_corrected: Number | None = None
    aggregate_uncorrected: Number | None = None

    @classmethod
    def parse(cls, value: Any) -> Ecc | None:
        """Parsed from the probe's JSON (already shape-checked)."""
        if not isinstance(value, Mapping):
            return None
        return cls(*(_num(value.get(k)) for k in (
            "volatile_corrected", "volatile_uncorrected", "aggregate_corrected",
            "aggregate_uncorrected")))


@dataclass(frozen=True)
class RemappedRows:
    """Row remapping: counts, and whether a remap is pending or has failed."""

    correctable: Number | bool | None = None
    uncorrectable: Number | bool | None = None
    pending: Number | bool | None = None
    failure: Number | bool | None = None

    @classmethod
    def parse(cls, value: Any) -> RemappedRows | None:
        """Parsed from the probe's JSON (already shape-checked)."""
        if not isinstance(value, Mapping):
            return None
        return cls(*(v if isinstance(v := value.get(k), (int, float, bool)) else None
                     for k in ("correctable", "uncorrectable", "pending", "failure")))

    def states(self) -> dict[str, float]:
        """The readings that exist, as numbers (pending and failure are 0 or 1)."""
        return {k: float(v) for k, v in (
            ("correctable", self.correctable), ("uncorrectable", self.uncorrectable),
            ("pending", self.pending), ("failure", self.failure)) if v is not None}


@dataclass(frozen=True)
class PcieLink:
    """The PCIe link now and at most (what this GPU and its slot can do together)."""

    current_generation: int | None = None
    max_generation: int | None = None
    current_width: int | None = None
    max_width: int | None = None

    @classmethod
    def parse(cls, value: Any) -> PcieLink | None:
        """Parsed from the probe's JSON (already shape-checked)."""
        if not isinstance(value, Mapping):
            return None
        return cls(*(_int(value.get(k)) for k in (
            "current_generation", "max_generation", "current_width", "max_width")))


@dataclass(frozen=True)
class NvLinks:
    """The GPU's NVLink links by state (a GPU without NVLink has none: the field is None)."""

    active: tuple[int, ...] = ()
    inactive: tuple[int, ...] = ()

    @classmethod
    def parse(cls, value: Any) -> NvLinks | None:
        """Parsed from the probe's JSON (already shape-checked)."""
        if not isinstance(value, Mapping):
            return None
        return cls(*(tuple(n for x in value.get(k) or () if (n := _int(x)) is not None)
                     for k in ("active", "inactive")))


@dataclass(frozen=True)
class FabricInfo:
    """NVSwitch fabric registration: state 0 not supported, 1 not started, 2 in progress,
    3 completed; status is the nvmlReturn_t of the registration once completed."""

    state: int | None = None
    status: int | None = None

    @classmethod
    def parse(cls, value: Any) -> FabricInfo | None:
        """Parsed from the probe's JSON (already shape-checked)."""
        if not isinstance(value, Mapping):
            return None
        return cls(_int(value.get("state")), _int(value.get("status")))


@dataclass(frozen=True)
class MigInstance:
    """One MIG instance: a schedulable leaf of its GPU."""

    slot: int | None
    uuid: str | None
    memory: Memory | None
    processes: tuple[GpuProcess, ...] | None
    error: ErrorInfo | None


@dataclass(frozen=True)
class MigState:
    """MIG mode of a GPU and its instances."""

    enabled: bool
    pending: bool
    instances: tuple[MigInstance, ...]

    @classmethod
    def parse(cls, value: Any) -> MigState | None:
        """Parsed from the probe's JSON (already shape-checked)."""
        if not isinstance(value, Mapping):
            return None
        instances = tuple(MigInstance(_int(i.get("slot")), _str(i.get("uuid")) or None,
                                      Memory.parse(i.get("memory")),
                                      _processes(i.get("processes")),
                                      ErrorInfo.parse(i.get("error")))
                          for i in _records(value.get("instances")))
        return cls(bool(value.get("enabled")), bool(value.get("pending")), instances)


@dataclass(frozen=True)
class NvmlDevice:
    """One GPU as the nvml probe read it; ``ok`` is False when the device itself failed."""

    index: int
    ok: bool
    error: ErrorInfo | None = None
    uuid: str | None = None
    name: str | None = None
    pci_bus_id: str | None = None
    readings: GpuReadings = field(default_factory=GpuReadings)
    processes: tuple[GpuProcess, ...] | None = None
    ecc: Ecc | None = None
    remapped_rows: RemappedRows | None = None
    clocks_event_reasons: tuple[str, ...] = ()
    persistence_mode: bool | None = None
    compute_mode: int | None = None
    mig: MigState | None = None
    recovery_action: str | None = None
    retired_pages_pending: bool | None = None
    pcie: PcieLink | None = None
    nvlinks: NvLinks | None = None
    fabric: FabricInfo | None = None
    graphics_processes: tuple[GpuProcess, ...] | None = None

    @property
    def memory(self) -> Memory | None:
        """The memory reading (None when NVML could not read it)."""
        return self.readings.memory

    @property
    def label(self) -> str:
        """How findings name the device: its UUID, else its NVML index."""
        return self.uuid or f"index {self.index}"

    @property
    def mig_uuids(self) -> tuple[str, ...]:
        """The UUIDs of the MIG instances that could be read."""
        return tuple(i.uuid for i in (self.mig.instances if self.mig else ()) if i.uuid)

    @classmethod
    def parse(cls, d: Record) -> NvmlDevice:
        """Parsed from the probe's JSON (already shape-checked)."""
        reasons = _map(d.get("clocks_event_reasons")).get("reasons")
        persistence = d.get("persistence_mode")
        action = d.get("recovery_action")
        return cls(
            index=int(d["index"]), ok=bool(d.get("ok")), error=ErrorInfo.parse(d.get("error")),
            uuid=_str(d.get("uuid")) or None, name=_str(d.get("name")),
            pci_bus_id=_str(d.get("pci_bus_id")), readings=GpuReadings.parse(d),
            processes=_processes(d.get("processes")), ecc=Ecc.parse(d.get("ecc")),
            remapped_rows=RemappedRows.parse(d.get("remapped_rows")),
            clocks_event_reasons=_strs(reasons),
            persistence_mode=persistence if isinstance(persistence, bool) else None,
            compute_mode=_int(d.get("compute_mode")),
            mig=MigState.parse(d.get("mig")), recovery_action=_text(action),
            retired_pages_pending=_bool(d.get("retired_pages_pending")),
            pcie=PcieLink.parse(d.get("pcie")), nvlinks=NvLinks.parse(d.get("nvlinks")),
            fabric=FabricInfo.parse(d.get("fabric")),
            graphics_processes=_processes(d.get("graphics_processes")))


@dataclass(frozen=True)
class NvmlObservation:
    """What the nvml probe read: versions and every device."""

    ok: bool | None
    error: ErrorInfo | None = None
    library_error: str | None = None
    devices: tuple[NvmlDevice, ...] = ()
    device_count: Number | None = None
    visibility_env: Mapping[str, str | None] = field(default_factory=dict)
    driver_version: Scalar | None = None
    cuda_driver_version: Scalar | None = None
    nvml_version: Scalar | None = None

    @classmethod
    def parse(cls, o: Record) -> NvmlObservation:
        """Parsed from the probe's JSON (already shape-checked)."""
        return cls(
            ok=_flag(o.get("ok")), error=ErrorInfo.parse(o.get("error")),
            library_error=_text(o.get("library_error")),
            devices=tuple(NvmlDevice.parse(d) for d in _records(o.get("devices"))),
            device_count=_num(o.get("device_count")),
            visibility_env=_str_map(o.get("visibility_env")),
            driver_version=_scalar(o.get("driver_version")),
            cuda_driver_version=_scalar(o.get("cuda_driver_version")),
            nvml_version=_scalar(o.get("nvml_version")))

    @property
    def visibility(self) -> tuple[str | None, str | None]:
        """CUDA_VISIBLE_DEVICES and NVIDIA_VISIBLE_DEVICES as the nvml child saw them."""
        return (self.visibility_env.get("CUDA_VISIBLE_DEVICES"),
                self.visibility_env.get("NVIDIA_VISIBLE_DEVICES"))


# -- host ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceNodes:
    """The /dev/nvidia* nodes the host probe found (absent means none were found)."""

    dir: str | None = None
    control_present: bool = False
    gpu_nodes: int = 0
    node_count: int = 0
    permission_denied: tuple[str, ...] = ()

    @classmethod
    def parse(cls, value: Any) -> DeviceNodes:
        """Parsed from the probe's JSON (already shape-checked)."""
        v = _map(value)
        nodes = v.get("nodes")
        return cls(_str(v.get("dir")), bool(v.get("control_present")),
                   _int(v.get("gpu_nodes")) or 0,
                   len(nodes) if isinstance(nodes, (list, Mapping)) else 0,
                   _strs(v.get("permission_denied")))


@dataclass(frozen=True)
class CommandResult:
    """How a command the host probe ran (nvidia-smi) ended."""

    missing: bool = False
    timed_out: bool = False
    exit_code: int | str | None = None

    @classmethod
    def parse(cls, value: Any) -> CommandResult:
        """Parsed from the probe's JSON (already shape-checked)."""
        v = _map(value)
        return cls(bool(v.get("missing")), bool(v.get("timed_out")), _code(v.get("exit_code")))


@dataclass(frozen=True)
class HostObservation:
    """What the host probe saw; the raw records travel on into evidence as they are."""

    ok: bool | None = None
    environment: Mapping[str, str | None] = field(default_factory=dict)
    device_nodes: DeviceNodes = field(default_factory=DeviceNodes)
    driver_present: bool = False
    driver_path: str | None = None
    kernel_module_version: str | None = None
    nvidia_smi: CommandResult = field(default_factory=CommandResult)
    preallocation_disabled: bool = False
    evidence: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def visibility(self) -> tuple[str | None, str | None]:
        """CUDA_VISIBLE_DEVICES and NVIDIA_VISIBLE_DEVICES as the probe saw them."""
        return (self.environment.get("CUDA_VISIBLE_DEVICES"),
                self.environment.get("NVIDIA_VISIBLE_DEVICES"))

    @classmethod
    def parse(cls, o: Record) -> HostObservation:
        """Parsed from the probe's JSON (already shape-checked)."""
        proc = _map(o.get("driver_proc"))
        return cls(
            ok=_flag(o.get("ok")), environment=_str_map(o.get("environment")),
            device_nodes=DeviceNodes.parse(o.get("device_nodes")),
            driver_present=bool(proc.get("present")), driver_path=_text(proc.get("path")),
            kernel_module_version=_str(proc.get("kernel_module_version")),
            nvidia_smi=CommandResult.parse(o.get("nvidia_smi")),
            preallocation_disabled=bool(o.get("preallocation_disabled")),
            evidence={k: o.get(k) for k in ("nvidia_smi", "nvidia_smi_xml", "environment",
                                            "device_nodes", "driver_proc")})


# -- cuda ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CudaStep:
    """One driver call's outcome (cuInit, context, allocation); ``record`` is its JSON."""

    ok: bool | None
    code: int | str | None = None
    message: str | None = None
    record: Record = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def parse(cls, value: Any) -> CudaStep | None:
        """Parsed from the probe's JSON (already shape-checked)."""
        if not isinstance(value, Mapping) or not value:
            return None
        return cls(_flag(value.get("ok")), _code(value.get("code")),
                   _text(value.get("message")), value)


@dataclass(frozen=True)
class CudaDevice:
    """One device as cuInit listed it, with its context and allocation steps."""

    ordinal: Any
    uuid: str | None
    error: ErrorInfo | None
    context: CudaStep | None
    alloc: CudaStep | None


@dataclass(frozen=True)
class CudaObservation:
    """What the cuda probe proved: library, cuInit, and a context per device."""

    ok: bool | None
    library_loaded: bool = False
    library_error: str | None = None
    init: CudaStep | None = None
    device_count: Number | None = None
    devices: tuple[CudaDevice, ...] = ()
    driver_version: Scalar | None = None
    init_duration_s: Number | None = None

    @property
    def init_ok(self) -> bool:
        """Whether cuInit succeeded."""
        return bool(self.init and self.init.ok)

    @classmethod
    def parse(cls, o: Record) -> CudaObservation:
        """Parsed from the probe's JSON (already shape-checked)."""
        lib = _map(o.get("library"))
        devices = tuple(CudaDevice(d.get("ordinal"), _str(d.get("uuid")) or None,
                                   ErrorInfo.parse(d.get("error")),
                                   CudaStep.parse(d.get("context")),
                                   CudaStep.parse(d.get("alloc")))
                        for d in _records(o.get("devices")))
        return cls(_flag(o.get("ok")), bool(lib.get("loaded")), _text(lib.get("error")),
                   CudaStep.parse(o.get("init")), _num(o.get("device_count")), devices,
                   _scalar(o.get("driver_version")), _num(o.get("init_duration_s")))


# -- jax -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class JaxDevice:
    """A device JAX listed."""

    platform: Any
    id: Any
    kind: Any

    @property
    def text(self) -> str:
        """How the verdict detail lists the device."""
        return f"{self.platform}:{self.id} {self.kind}"


@dataclass(frozen=True)
class JaxCompute:
    """The tiny jitted computation: where it ran and how it ended; ``record`` is its JSON."""

    ok: bool
    device: Any
    error: ErrorInfo | None
    record: Record = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class JaxObservation:
    """What the jax probe saw: versions, platforms, errors, and the computation."""

    ok: bool | None
    installed: bool = False
    versions: Mapping[str, str | None] = field(default_factory=dict)
    import_error: ErrorInfo | None = None
    init_error: ErrorInfo | None = None
    required_error: ErrorInfo | None = None
    platforms: tuple[str, ...] | None = None
    registered_platforms: tuple[str, ...] | None = None
    jax_platforms: str | None = None
    jax_platforms_effective: Any = None
    default_backend: Scalar | None = None
    backend_errors: Mapping[str, Scalar | None] | None = None
    required_devices: tuple[Any, ...] = ()
    devices: tuple[JaxDevice, ...] = ()
    compute: JaxCompute | None = None
    xla_env: Mapping[str, Scalar | None] | None = None
    preallocation_disabled: bool = False
    nvidia_gpu_visible: bool | None = None
    environment: Mapping[str, str | None] | None = None
    import_s: Any = None
    init_s: Number | None = None
    compute_s: Any = None
    init_duration_s: Number | None = None
    # Only the installation was read (no GPU free to prove the backend on): see jax_probe.
    static: str | None = None  # why (e.g. "every GPU is in use"); None: a full probe
    plugins: tuple[str, ...] | None = None

    @classmethod
    def parse(cls, o: Record) -> JaxObservation:
        """Parsed from the probe's JSON (already shape-checked)."""
        compute = o.get("compute")
        errors = o.get("backend_errors")
        xla = o.get("xla_env")
        visible = o.get("nvidia_gpu_visible")
        env = o.get("environment")
        return cls(
            ok=_flag(o.get("ok")), installed=bool(o.get("installed")),
            versions=_str_map(o.get("versions")),
            import_error=ErrorInfo.parse(o.get("import_error")),
            init_error=ErrorInfo.parse(o.get("init_error")),
            required_error=ErrorInfo.parse(o.get("required_error")),
            platforms=_strs(o["platforms"]) if isinstance(o.get("platforms"), list) else None,
            registered_platforms=(_strs(o["registered_platforms"]) if isinstance(
                o.get("registered_platforms"), list) else None),
            jax_platforms=_str(o.get("jax_platforms")),
            jax_platforms_effective=o.get("jax_platforms_effective"),
            default_backend=_scalar(o.get("default_backend")),
            backend_errors=({str(k): _scalar(v) for k, v in errors.items()}
                            if isinstance(errors, Mapping) else None),
            required_devices=(tuple(o["required_devices"])
                              if isinstance(o.get("required_devices"), list) else ()),
            devices=tuple(JaxDevice(d.get("platform"), d.get("id"), d.get("kind"))
                          for d in _records(o.get("devices"))),
            compute=(JaxCompute(bool(compute.get("ok")), compute.get("device"),
                                ErrorInfo.parse(compute.get("error")), compute)
                     if isinstance(compute, Mapping) and compute else None),
            xla_env=({str(k): _scalar(v) for k, v in xla.items()}
                     if isinstance(xla, Mapping) else None),
            preallocation_disabled=bool(o.get("preallocation_disabled")),
            nvidia_gpu_visible=visible if isinstance(visible, bool) else None,
            environment=_str_map(env) if isinstance(env, Mapping) else None,
            import_s=o.get("import_s"), init_s=_num(o.get("init_s")),
            compute_s=o.get("compute_s"),
            init_duration_s=_num(o.get("init_duration_s")),
            static=_str(o.get("static")),
            plugins=_strs(o["plugins"]) if isinstance(o.get("plugins"), list) else None)


# -- iree ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IreeExecute:
    """The tiny kernel on one driver: compiled, run, or skipped (and why)."""

    compile: Record | None = None
    run: Record | None = None
    skipped: Scalar | None = None

    @property
    def cached(self) -> bool:
        """Whether the kernel came from the module cache."""
        return bool((self.compile or {}).get("cached"))


@dataclass(frozen=True)
class IreeDevice:
    """A device an IREE driver listed."""

    device_id: Any
    name: Any

    @property
    def text(self) -> str:
        """How the verdict detail lists the device."""
        return f"{self.device_id} {self.name}"


@dataclass(frozen=True)
class IreeDriver:
    """One IREE HAL driver as the iree probe found it."""

    ok: bool | None
    error: ErrorInfo | None = None
    compiled_in: bool = True
    execute: IreeExecute = field(default_factory=IreeExecute)
    devices: tuple[IreeDevice, ...] = ()
    init_s: Any = None
    compute_s: Any = None

    @classmethod
    def parse(cls, d: Record) -> IreeDriver:
        """Parsed from the probe's JSON (already shape-checked)."""
        ex = _map(d.get("execute"))
        compile_, run = ex.get("compile"), ex.get("run")
        return cls(_flag(d.get("ok")), ErrorInfo.parse(d.get("error")),
                   bool(d.get("compiled_in", True)),
                   IreeExecute(compile_ if isinstance(compile_, Mapping) else None,
                               run if isinstance(run, Mapping) else None,
                               _scalar(ex.get("skipped"))),
                   tuple(IreeDevice(v.get("device_id"), v.get("name"))
                         for v in _records(d.get("devices"))),
                   d.get("init_s"), d.get("compute_s"))


@dataclass(frozen=True)
class IreeObservation:
    """What the iree probe saw: versions and each driver it tried."""

    ok: bool | None
    installed: bool = False
    versions: Mapping[str, str | None] = field(default_factory=dict)
    import_error: ErrorInfo | None = None
    required: tuple[str, ...] | None = None
    drivers: Mapping[str, IreeDriver] = field(default_factory=dict)
    compiled_in_drivers: Any = None
    environment: Mapping[str, str | None] | None = None
    import_s: Any = None
    init_s: Number | None = None
    init_duration_s: Number | None = None
    static: str | None = None  # only the drivers' loading was read, and why (see iree_probe)

    @classmethod
    def parse(cls, o: Record) -> IreeObservation:
        """Parsed from the probe's JSON (already shape-checked)."""
        required = o.get("required")
        env = o.get("environment")
        return cls(
            ok=_flag(o.get("ok")), installed=bool(o.get("installed")),
            versions=_str_map(o.get("versions")),
            import_error=ErrorInfo.parse(o.get("import_error")),
            required=tuple(str(d) for d in required) if isinstance(required, list) else None,
            drivers={str(k): IreeDriver.parse(v) for k, v in _map(o.get("drivers")).items()
                     if isinstance(v, Mapping)},
            compiled_in_drivers=o.get("compiled_in_drivers"),
            environment=_str_map(env) if isinstance(env, Mapping) else None,
            import_s=o.get("import_s"), init_s=_num(o.get("init_s")),
            init_duration_s=_num(o.get("init_duration_s")), static=_str(o.get("static")))


# -- any other probe -------------------------------------------------------------------------


@dataclass(frozen=True)
class OtherObservation:
    """An observation of a probe gpudiag does not classify: only whether it said ok."""

    ok: bool | None


ProbeObservation: TypeAlias = (HostObservation | NvmlObservation | CudaObservation
                               | JaxObservation | IreeObservation | OtherObservation)


@dataclass(frozen=True)
class Malformed:
    """Why an observation could not be read: the field that was wrong."""

    problem: str


# -- the XID watcher's lines -----------------------------------------------------------------


@dataclass(frozen=True)
class WatcherLine:
    """One JSON line of the XID watcher child (gpudiag.probes.xid_watch), typed.

    ``kind`` is hello, xid, telemetry, heartbeat or error; the fields of other kinds are
    None/empty. ``xid`` is None when an xid line's number cannot be read (it is then ignored).
    """

    kind: str | None
    ts: float | None = None
    device_count: int = 0
    xid: int | None = None
    device_index: int | None = None
    uuid: str | None = None
    telemetry: Mapping[int, GpuReadings] = field(default_factory=dict)
    message: str | None = None
    device_uuids: tuple[str, ...] = ()  # hello: the GPUs registered for XID events


def parse_watcher_line(line: bytes | str) -> WatcherLine | None:
    """The watcher's line typed; None when it is not a JSON object (a library's stray print)."""
    try:
        msg = json.loads(line)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or absurdly nested
        return None
    if not isinstance(msg, Mapping):
        return None
    kind = _str(msg.get("type"))
    ts = _num(msg.get("ts"))
    finite_ts = float(ts) if ts is not None and math.isfinite(ts) else None
    devices = msg.get("devices")
    xid: int | None
    try:
        xid = int(msg["xid"]) if kind == "xid" else None
    except (KeyError, TypeError, ValueError, OverflowError):
        xid = None
    index = msg.get("device_index")
    return WatcherLine(
        kind=kind, ts=finite_ts, device_count=len(devices) if isinstance(devices, list) else 0,
        xid=xid, device_index=index if isinstance(index, int) and not isinstance(index, bool)
        else None, uuid=_str(msg.get("uuid")),
        telemetry=parse_telemetry(msg.get("gpus")) if kind == "telemetry" else {},
        message=_text(msg.get("message")) if kind == "error" else None,
        device_uuids=tuple(u for d in devices if isinstance(d, Mapping)
                           and isinstance(u := d.get("uuid"), str))
        if isinstance(devices, list) else ())
