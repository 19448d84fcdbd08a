"""Typed probe observations: each child's JSON decoded once, where it enters, into frozen records.

A probe child prints one JSON object (the probe child protocol). These records are the one
description of that JSON: ``registry.parse_observation`` decodes it with gpudiag.core.decode,
which checks every field against its type hint, so a malformed observation is a
``probe_error`` naming the field (``devices[0].index: expected an integer, got "zero"``).
A field read under another key, more loosely or converted says so in its
``metadata=from_json(...)``: ``lenient`` fields (a wrong type reads as None) are the ones a
probe fills best-effort; the rest must have their type. Raw sub-records that only travel into
evidence are kept as ``Mapping`` (dicts only at the JSON edge).

One NVML vocabulary: ``GpuReadings`` (memory, utilization, temperature, power) is what both
the nvml probe's devices and the XID watcher's telemetry lines carry, under the same names.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import field
from typing import Any, ClassVar, TypeAlias

from gpudiag.core.decode import decode, from_json
from gpudiag.core.records import dataclass
from gpudiag.core.visibility import CUDA_VISIBLE_DEVICES, NVIDIA_VISIBLE_DEVICES

Number: TypeAlias = int | float
Scalar: TypeAlias = str | int | float | bool
Record: TypeAlias = Mapping[str, Any]


# -- conversions of checked JSON values into the fields' types ------------------------------


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


def _flag(value: Any) -> bool | None:
    """True/False as the probe said it; None when absent (``ok is False`` differs from unset)."""
    return None if value is None else bool(value)


def _code(value: Any) -> int | str | None:
    """An error code: an int stays an int (it is looked up), anything else is its text."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return str(value)


def _texts(value: Any) -> tuple[str, ...] | None:
    return None if value is None else tuple(str(v) for v in value)


def _str_values(value: Any) -> dict[str, str | None]:
    return {str(k): (None if v is None else str(v)) for k, v in (value or {}).items()}


def _or_none(value: str | None) -> str | None:
    """An empty text is no value (an empty UUID names no device)."""
    return value or None


def _count(value: Any) -> int:
    return len(value) if isinstance(value, (list, Mapping)) else 0


# How fields read: any JSON value as a flag, a bool(), an error code, a text; a number as an int.
_FLAG = from_json(as_type=Any, then=_flag)
_BOOL = from_json(as_type=Any, then=bool)
_CODE = from_json(as_type=Any, then=_code)
_TEXT = from_json(as_type=Any, then=_text)
_INT = from_json(as_type=Number | None, then=_int)
_LENIENT = from_json(lenient=True)
_WHOLE = from_json(whole=True, as_type=Any)  # the record's own JSON, for evidence
_VERSIONS = from_json(as_type=Mapping[str, Scalar | None], then=_str_values)


# -- shared records --------------------------------------------------------------------------


@dataclass(frozen=True)
class ErrorInfo:
    """An error a probe recorded (NVML, CUDA, Python or IREE); ``record`` is its JSON."""

    EMPTY_IS_NONE: ClassVar[bool] = True  # an empty record says nothing: no error

    code: int | str | None = field(default=None, metadata=_CODE)
    name: str | None = field(default=None, metadata=_TEXT)
    message: str | None = field(default=None, metadata=_TEXT)
    type: str | None = field(default=None, metadata=_TEXT)
    step: str | None = field(default=None, metadata=_TEXT)
    where: str | None = field(default=None, metadata=_TEXT)
    record: Record = field(default_factory=dict, compare=False, repr=False, metadata=_WHOLE)

    def without_traceback(self) -> dict[str, Any]:
        """The record without its (long) traceback, for verdict details."""
        return {k: v for k, v in self.record.items() if k != "traceback"}


@dataclass(frozen=True)
class Memory:
    """Device memory as NVML reads it, in bytes."""

    total_bytes: int | None = field(default=None, metadata=_INT)
    free_bytes: int | None = field(default=None, metadata=_INT)
    used_bytes: int | None = field(default=None, metadata=_INT)


@dataclass(frozen=True)
class GpuReadings:
    """One GPU's live readings, the one vocabulary of the nvml probe and the XID watcher."""

    index: int | None = field(default=None, metadata=from_json(
        as_type=Number | None, then=_int, lenient=True))
    memory: Memory | None = None
    utilization_gpu_ratio: Number | None = None
    temperature_c: Number | None = None
    power_w: Number | None = None

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
            out[index] = decode(GpuReadings, raw, lenient=True)  # a bad reading is None
    return out


# -- nvml ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuProcess:
    """A compute process NVML lists on a GPU or MIG instance."""

    pid: int | None = field(metadata=_INT)
    used_memory_bytes: Number | None = None
    # its command name (/proc/PID/comm) and owner (user name or uid); None where /proc hides it
    name: str | None = field(default=None, metadata=_LENIENT)
    user: str | None = field(default=None, metadata=_LENIENT)


@dataclass(frozen=True)
class Ecc:
    """ECC error counters; None where the GPU does not report them."""

    volatile_corrected: Number | None = None
    volatile_uncorrected: Number | None = None
    # aggregate: over the GPU's life; volatile: since the driver last loaded
    aggregate_corrected: Number | None = None
    aggregate_uncorrected: Number | None = None


@dataclass(frozen=True)
class RemappedRows:
    """Row remapping: counts, and whether a remap is pending or has failed."""

    correctable: Number | bool | None = None
    uncorrectable: Number | bool | None = None
    # counts of rows remapped so far above; flags below (true/false, or 0/1)
    pending: Number | bool | None = None
    failure: Number | bool | None = None

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


@dataclass(frozen=True)
class NvLinkEnd:
    """Where one active NVLink link ends: ``device_type`` as the driver names it (``gpu``,
    ``switch``, ``ibmnpu``, ``unknown``; None where the driver has no such call) and the
    remote end's PCI bus id (a peer GPU's own, or the NVSwitch's)."""

    link: int
    device_type: str | None = field(default=None, metadata=_LENIENT)
    pci_bus_id: str | None = field(default=None, metadata=_LENIENT)


@dataclass(frozen=True)
class NvLinks:
    """The GPU's NVLink links by state (a GPU without NVLink has none: the field is None),
    and where each active link ends (``remotes``; None when that could not be read, with
    ``remote_error`` saying why: the topology is then unknown, core.nvlink_domain)."""

    active: tuple[int, ...] = ()
    inactive: tuple[int, ...] = ()
    remotes: tuple[NvLinkEnd, ...] | None = None
    remote_error: str | None = field(default=None, metadata=_TEXT)


@dataclass(frozen=True)
class FabricInfo:
    """NVSwitch fabric registration: state 0 not supported, 1 not started, 2 in progress,
    3 completed; status is the nvmlReturn_t of the registration once completed."""

    state: int | None = None
    status: int | None = None


@dataclass(frozen=True)
class ClockEvents:
    """Why the clocks are held down: NVML's reason names, and its bit mask (checked, unread)."""

    reasons: tuple[str, ...] = ()
    mask: Number | None = None


@dataclass(frozen=True)
class MigInstance:
    """One MIG instance: a schedulable leaf of its GPU."""

    slot: int | None = field(metadata=_INT)
    uuid: str | None = field(metadata=from_json(then=_or_none))
    memory: Memory | None
    processes: tuple[GpuProcess, ...] | None
    error: ErrorInfo | None


@dataclass(frozen=True)
class MigState:
    """MIG mode of a GPU and its instances."""

    enabled: bool = field(metadata=_BOOL)
    pending: bool = field(metadata=_BOOL)
    instances: tuple[MigInstance, ...] = ()


@dataclass(frozen=True)
class GpuConfig:
    """What an operator or a firmware flash sets on a GPU, beyond the readings: firmware
    versions, the configured power limit (W), application clocks (MHz) and ECC mode now and
    after the next reset (True enabled). Each None where the GPU cannot say (core.gpu_config)."""

    vbios_version: str | None = field(default=None, metadata=_LENIENT)
    inforom_image_version: str | None = field(default=None, metadata=_LENIENT)
    gsp_firmware_version: str | None = field(default=None, metadata=_LENIENT)
    power_management_limit_w: Number | None = field(default=None, metadata=_LENIENT)
    applications_clock_sm_mhz: int | None = field(default=None, metadata=from_json(
        as_type=Number | None, then=_int, lenient=True))
    applications_clock_memory_mhz: int | None = field(default=None, metadata=from_json(
        as_type=Number | None, then=_int, lenient=True))
    ecc_mode_current: bool | None = field(default=None, metadata=_LENIENT)
    ecc_mode_pending: bool | None = field(default=None, metadata=_LENIENT)


@dataclass(frozen=True)
class NvmlDevice:
    """One GPU as the nvml probe read it; ``ok`` is False when the device itself failed."""

    index: int
    ok: bool = field(metadata=_BOOL)
    error: ErrorInfo | None = None
    uuid: str | None = field(default=None, metadata=from_json(then=_or_none))
    name: str | None = None
    pci_bus_id: str | None = None
    serial: str | None = field(default=None, metadata=from_json(then=_or_none))
    # The readings are the device record's own fields (the watcher's vocabulary).
    readings: GpuReadings = field(default_factory=GpuReadings, metadata=from_json(whole=True))
    processes: tuple[GpuProcess, ...] | None = None
    ecc: Ecc | None = field(default=None, metadata=from_json(values=Number))
    remapped_rows: RemappedRows | None = field(default=None,
                                               metadata=from_json(values=Number | bool))
    clocks_event_reasons: tuple[str, ...] = field(default=(), metadata=from_json(
        as_type=ClockEvents, then=lambda c: c.reasons))
    persistence_mode: bool | None = field(default=None, metadata=_LENIENT)
    # nvidia-smi's columns: the enforced power cap (W), SM and memory clocks (MHz), the
    # performance state (0 for P0) and the fan (0..1); None where the GPU cannot say.
    power_limit_w: Number | None = field(default=None, metadata=_LENIENT)
    sm_clock_mhz: int | None = field(default=None, metadata=from_json(
        as_type=Number | None, then=_int, lenient=True))
    memory_clock_mhz: int | None = field(default=None, metadata=from_json(
        as_type=Number | None, then=_int, lenient=True))
    pstate: int | None = field(default=None, metadata=from_json(
        as_type=Number | None, then=_int, lenient=True))
    fan_ratio: Number | None = field(default=None, metadata=_LENIENT)
    compute_mode: int | None = field(default=None, metadata=from_json(
        as_type=Number | None, then=_int, lenient=True))
    mig: MigState | None = None
    recovery_action: str | None = field(default=None, metadata=from_json(
        as_type=Scalar | None, then=_text))
    retired_pages_pending: bool | None = None
    pcie: PcieLink | None = None
    nvlinks: NvLinks | None = None
    fabric: FabricInfo | None = None
    graphics_processes: tuple[GpuProcess, ...] | None = None
    config: GpuConfig | None = None

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


@dataclass(frozen=True)
class NvmlObservation:
    """What the nvml probe read: versions and every device."""

    ok: bool | None = field(metadata=_FLAG)
    error: ErrorInfo | None = None
    library_error: str | None = field(default=None, metadata=_TEXT)
    devices: tuple[NvmlDevice, ...] = ()
    device_count: Number | None = None
    visibility_env: Mapping[str, str | None] = field(default_factory=dict)
    driver_version: Scalar | None = None
    cuda_driver_version: Scalar | None = None
    nvml_version: Scalar | None = None

    @property
    def visibility(self) -> tuple[str | None, str | None]:
        """CUDA_VISIBLE_DEVICES and NVIDIA_VISIBLE_DEVICES as the nvml child saw them."""
        return _visibility(self.visibility_env)


def _visibility(env: Mapping[str, str | None]) -> tuple[str | None, str | None]:
    return env.get(CUDA_VISIBLE_DEVICES), env.get(NVIDIA_VISIBLE_DEVICES)


# -- host ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PciGpu:
    """A display or 3D controller of NVIDIA's on the PCI bus, and the driver bound to it."""

    address: str  # required: a controller without one names no GPU
    # The kernel driver bound to it (nvidia, vfio-pci, nouveau); None when none is bound.
    driver: str | None = None


@dataclass(frozen=True)
class PciBus:
    """NVIDIA's GPUs on the PCI bus (``available``: whether sysfs could be read)."""

    available: bool | None = None
    gpus: tuple[PciGpu, ...] = ()


@dataclass(frozen=True)
class DeviceNodes:
    """The /dev/nvidia* nodes the host probe found (absent means none were found)."""

    dir: str | None = None
    control_present: bool = field(default=False, metadata=_BOOL)
    gpu_nodes: int = field(default=0, metadata=from_json(
        as_type=Number, then=lambda n: _int(n) or 0))
    node_count: int = field(default=0, metadata=from_json(key="nodes", as_type=Any,
                                                          then=_count))
    permission_denied: tuple[str, ...] = ()


@dataclass(frozen=True)
class CommandResult:
    """How a command the host probe ran (nvidia-smi) ended."""

    missing: bool = field(default=False, metadata=_BOOL)
    timed_out: bool = field(default=False, metadata=_BOOL)
    exit_code: int | str | None = field(default=None, metadata=_CODE)


def _host_evidence(o: Record) -> dict[str, Any]:
    """The raw records the host probe's findings cite as evidence."""
    return {k: o.get(k) for k in ("nvidia_smi", "nvidia_smi_xml", "environment",
                                  "device_nodes", "driver_proc")}


@dataclass(frozen=True)
class HostObservation:
    """What the host probe saw; the raw records travel on into evidence as they are."""

    ok: bool | None = field(default=None, metadata=_FLAG)
    environment: Mapping[str, str | None] = field(default_factory=dict)
    device_nodes: DeviceNodes = field(default_factory=DeviceNodes)
    driver_present: bool = field(default=False, metadata=from_json(
        key="driver_proc.present", as_type=Any, then=bool))
    driver_path: str | None = field(default=None, metadata=from_json(key="driver_proc.path"))
    kernel_module_version: str | None = field(default=None, metadata=from_json(
        key="driver_proc.kernel_module_version"))
    nvidia_smi: CommandResult = field(default_factory=CommandResult)
    preallocation_disabled: bool = field(default=False, metadata=_BOOL)
    evidence: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False,
                                        metadata=from_json(whole=True, as_type=Any,
                                                           then=_host_evidence))
    nvidia_smi_xml: Record | None = field(default=None, compare=False, repr=False)
    pci: PciBus | None = None

    @property
    def visibility(self) -> tuple[str | None, str | None]:
        """CUDA_VISIBLE_DEVICES and NVIDIA_VISIBLE_DEVICES as the probe saw them."""
        return _visibility(self.environment)


# -- cuda ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CudaStep:
    """One driver call's outcome (cuInit, context, allocation); ``record`` is its JSON."""

    EMPTY_IS_NONE: ClassVar[bool] = True

    ok: bool | None = field(metadata=_FLAG)
    code: int | str | None = field(default=None, metadata=_CODE)
    message: str | None = field(default=None, metadata=_TEXT)
    record: Record = field(default_factory=dict, compare=False, repr=False, metadata=_WHOLE)


@dataclass(frozen=True)
class CudaDevice:
    """One device as cuInit listed it, with its context and allocation steps."""

    ordinal: Any
    uuid: str | None = field(metadata=from_json(then=_or_none))
    error: ErrorInfo | None
    context: CudaStep | None
    alloc: CudaStep | None


@dataclass(frozen=True)
class CudaObservation:
    """What the cuda probe proved: library, cuInit, and a context per device."""

    ok: bool | None = field(metadata=_FLAG)
    library_loaded: bool = field(default=False, metadata=from_json(
        key="library.loaded", as_type=Any, then=bool))
    library_error: str | None = field(default=None, metadata=from_json(
        key="library.error", as_type=Any, then=_text))
    init: CudaStep | None = None
    device_count: Number | None = None
    devices: tuple[CudaDevice, ...] = ()
    driver_version: Scalar | None = None
    init_duration_s: Number | None = None

    @property
    def init_ok(self) -> bool:
        """Whether cuInit succeeded."""
        return bool(self.init and self.init.ok)


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

    EMPTY_IS_NONE: ClassVar[bool] = True

    ok: bool = field(metadata=_BOOL)
    device: Any
    error: ErrorInfo | None
    record: Record = field(default_factory=dict, compare=False, repr=False, metadata=_WHOLE)


@dataclass(frozen=True)
class JaxObservation:
    """What the jax probe saw: versions, platforms, errors, and the computation."""

    ok: bool | None = field(metadata=_FLAG)
    installed: bool = field(default=False, metadata=_BOOL)
    versions: Mapping[str, str | None] = field(default_factory=dict, metadata=_VERSIONS)
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
    preallocation_disabled: bool = field(default=False, metadata=_BOOL)
    nvidia_gpu_visible: bool | None = field(default=None, metadata=_LENIENT)
    environment: Mapping[str, str | None] | None = None
    import_s: Any = None
    init_s: Number | None = None
    compute_s: Any = None
    init_duration_s: Number | None = None
    # Only the installation was read (no GPU free to prove the backend on): see jax_probe.
    static: str | None = None  # why (e.g. "every GPU is in use"); None: a full probe
    plugins: tuple[str, ...] | None = None


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

    ok: bool | None = field(metadata=_FLAG)
    error: ErrorInfo | None = None
    compiled_in: bool = field(default=True, metadata=_BOOL)
    execute: IreeExecute = field(default_factory=IreeExecute)
    devices: tuple[IreeDevice, ...] = ()
    init_s: Any = None
    compute_s: Any = None


@dataclass(frozen=True)
class IreeObservation:
    """What the iree probe saw: versions and each driver it tried."""

    ok: bool | None = field(metadata=_FLAG)
    installed: bool = field(default=False, metadata=_BOOL)
    versions: Mapping[str, str | None] = field(default_factory=dict, metadata=_VERSIONS)
    import_error: ErrorInfo | None = None
    required: tuple[str, ...] | None = field(default=None, metadata=from_json(
        as_type=tuple[Scalar, ...] | None, then=_texts))
    drivers: Mapping[str, IreeDriver] = field(default_factory=dict)
    compiled_in_drivers: Any = None
    environment: Mapping[str, str | None] | None = None
    import_s: Any = None
    init_s: Number | None = None
    init_duration_s: Number | None = None
    static: str | None = None  # only the drivers' loading was read, and why (see iree_probe)


# -- any other probe -------------------------------------------------------------------------


@dataclass(frozen=True)
class OtherObservation:
    """An observation of a probe gpudiag does not classify: only whether it said ok."""

    ok: bool | None = field(metadata=_FLAG)


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
