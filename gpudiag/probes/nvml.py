"""The NVML probe (nvidia-ml-py's ``pynvml``): versions and per-device health.

Runs in a child. An unsupported field is ``None`` with its reason under ``unsupported``; a
device that fails (GPU lost) fails alone and the others are still reported.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from gpudiag.core.recovery import RECOVERY_ACTION_NAMES
from gpudiag.core.visibility import VISIBILITY_VARIABLES

T = TypeVar("T")

# Errors that mean the device itself is gone or broken, not that a field is unsupported.
DEVICE_FATAL = {14, 15, 16}
_THROTTLE_BITS = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap",
    0x8: "hw_slowdown", 0x10: "sync_boost", 0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
RECOVERY_ACTIONS = dict(enumerate(RECOVERY_ACTION_NAMES))
FIELD_RECOVERY_ACTION = 230
NVLINK_MAX_LINKS = 18  # nvml.h's NVML_NVLINK_MAX_LINKS where pynvml lacks it (newer: 36)
_NO_SUCH_LINK = {2, 3}  # INVALID_ARGUMENT past the last link, NOT_SUPPORTED without NVLink
# nvmlIntNvLinkDeviceType_t: what an NVLink link's remote end is (0xFF: unknown).
_DEVICE_TYPES = {0: "gpu", 1: "ibmnpu", 2: "switch"}


@functools.cache
def _error_names(pynvml: Any) -> dict[int, str]:
    # Once per process: scanning the module's names costs about a millisecond, and every
    # unsupported field of every GPU asks.
    return {getattr(pynvml, n): n for n in dir(pynvml) if n.startswith("NVML_ERROR_")}


def error_record(pynvml: Any, exc: BaseException) -> dict[str, Any]:
    """An NVML error as JSON: numeric code, constant name and text."""
    code = int(getattr(exc, "value", -1))
    return {"code": code, "name": _error_names(pynvml).get(code, f"NVML_ERROR_{code}"),
            "message": str(exc)}


class _DeviceFailed(Exception):
    """A device-fatal NVML error (lost, reset required, InfoROM) during a field read."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(error["message"])
        self.error = error


class _Fields:
    """Reads fields of one device; unsupported ones become None plus a reason."""

    def __init__(self, pynvml: Any) -> None:
        self.pynvml = pynvml
        self.unsupported: dict[str, str] = {}

    def read(self, name: str, fn: Callable[[], T]) -> T | None:
        try:
            return fn()
        except self.pynvml.NVMLError as e:
            rec = error_record(self.pynvml, e)
            if rec["code"] in DEVICE_FATAL:
                raise _DeviceFailed(rec) from e
            self.unsupported[name] = f"{rec['name']}: {rec['message']}"
            return None


def _decode(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _memory(pynvml: Any, handle: Any) -> dict[str, int]:
    mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
    return {"total_bytes": int(mem.total), "used_bytes": int(mem.used),
            "free_bytes": int(mem.free)}


Reader = Callable[[str, Callable[[], Any]], Any]


def readings(pynvml: Any, handle: Any, read: Reader) -> dict[str, Any]:
    """Memory, utilization, temperature and power: the one vocabulary of NVML readings.

    The nvml probe's devices and the XID watcher's telemetry both carry exactly these names
    (gpudiag.core.observations.GpuReadings parses both); ``read`` decides what an
    unsupported reading becomes (None plus a reason, or just None).
    """
    util = read("utilization", lambda: pynvml.nvmlDeviceGetUtilizationRates(handle))
    power_mw = read("power", lambda: int(pynvml.nvmlDeviceGetPowerUsage(handle)))
    return {
        "memory": read("memory", lambda: _memory(pynvml, handle)),
        "utilization_gpu_ratio": None if util is None else int(util.gpu) / 100.0,
        "temperature_c": read("temperature",
                              lambda: int(pynvml.nvmlDeviceGetTemperature(handle, 0))),
        "power_w": None if power_mw is None else power_mw / 1000.0,
    }


def _process_entries(procs: Any) -> list[dict[str, Any]]:
    return [{"pid": int(p.pid),
             "used_memory_bytes": None if p.usedGpuMemory is None else int(p.usedGpuMemory),
             **_process_owner(int(p.pid))}
            for p in procs]


def _processes(pynvml: Any, handle: Any) -> list[dict[str, Any]]:
    # The _v3 call directly: the unsuffixed wrapper refuses on an NVML version mismatch.
    return _process_entries(pynvml.nvmlDeviceGetComputeRunningProcesses_v3(handle))


def _process_owner(pid: int) -> dict[str, str | None]:
    """The process's name and user as nvidia-smi and nvitop show them; None where /proc hides
    them (another PID namespace, hidepid, systemd's ProtectProc=invisible)."""
    import pwd

    try:
        uid = os.stat(f"/proc/{pid}").st_uid
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as fh:
            name: str | None = fh.read().strip() or None
    except OSError:
        return {"name": None, "user": None}
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:  # a uid without a passwd entry (a container's, a dynamic user's)
        user = str(uid)
    return {"name": name, "user": user}


def _field_value(pynvml: Any, handle: Any, field_id: int) -> int:
    values = pynvml.nvmlDeviceGetFieldValues(handle, [field_id])
    v = values[0]
    if v.nvmlReturn != 0:
        raise pynvml.NVMLError(v.nvmlReturn)
    member = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal"}
    return int(getattr(v.value, member.get(int(v.valueType), "ullVal")))


def _graphics_processes(pynvml: Any, handle: Any) -> list[dict[str, Any]]:
    # Graphics clients hold memory too: memory has no owner only without either kind.
    return _process_entries(pynvml.nvmlDeviceGetGraphicsRunningProcesses_v3(handle))


def _pcie(pynvml: Any, handle: Any) -> dict[str, int]:
    # "Max" is what this GPU and its slot can do together (NVML's definition).
    return {"current_generation": int(pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle)),
            "max_generation": int(pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle)),
            "current_width": int(pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle)),
            "max_width": int(pynvml.nvmlDeviceGetMaxPcieLinkWidth(handle))}


def _nvlinks(pynvml: Any, handle: Any) -> dict[str, Any]:
    """Active and inactive NVLink links, and where each active one ends (``_remotes``);
    raises NOT_SUPPORTED for a GPU without NVLink."""
    active: list[int] = []
    inactive: list[int] = []
    # The first link past the GPU's last answers INVALID_ARGUMENT: the bound rarely matters.
    for link in range(int(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", NVLINK_MAX_LINKS))):
        try:
            state = int(pynvml.nvmlDeviceGetNvLinkState(handle, link))
        except pynvml.NVMLError as e:
            if int(getattr(e, "value", -1)) in _NO_SUCH_LINK and link > 0:
                break  # past this GPU's last link
            raise
        (active if state == 1 else inactive).append(link)
    remotes, error = _remotes(pynvml, handle, active)
    return {"active": active, "inactive": inactive, "remotes": remotes, "remote_error": error}


def _remotes(pynvml: Any, handle: Any, links: list[int]
             ) -> tuple[list[dict[str, Any]] | None, str | None]:
    """Where each active link ends (the GPU reset rung's NVLink domain): the remote device
    type (a GPU peer, an NVSwitch) and PCI bus id. A driver without the type call
    (FUNCTION_NOT_FOUND) leaves the type None, to be told by the bus id; any other error
    leaves the whole topology unread (None, and why): a domain is never guessed smaller."""
    out: list[dict[str, Any]] = []
    typed = True
    for link in links:
        try:
            kind: str | None = None
            if typed:
                try:
                    kind = _DEVICE_TYPES.get(
                        int(pynvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link)), "unknown")
                except pynvml.NVMLError as e:
                    if int(getattr(e, "value", -1)) != 13:  # FUNCTION_NOT_FOUND: older driver
                        raise
                    typed = False
            bus = _decode(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)
        except pynvml.NVMLError as e:
            rec = error_record(pynvml, e)
            if rec["code"] in DEVICE_FATAL:
                raise
            return None, f"link {link}: {rec['name']}: {rec['message']}"
        out.append({"link": link, "device_type": kind, "pci_bus_id": bus})
    return out, None


def _fabric(pynvml: Any, handle: Any) -> dict[str, int]:
    """Fabric state and status; the versioned call first, the v1 call on older drivers."""
    try:
        info: Any = pynvml.c_nvmlGpuFabricInfo_v2_t()
        pynvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(info))
    except pynvml.NVMLError as e:
        if int(getattr(e, "value", -1)) != 13:  # FUNCTION_NOT_FOUND: a driver before 550
            raise
        info = pynvml.c_nvmlGpuFabricInfo_t()
        pynvml.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(info))
    return {"state": int(info.state), "status": int(info.status)}


def _ecc(pynvml: Any, handle: Any, fields: _Fields) -> dict[str, int | None]:
    out: dict[str, int | None] = {}
    for err_name, err_type in (("corrected", 0), ("uncorrected", 1)):
        for ctr_name, ctr_type in (("volatile", 0), ("aggregate", 1)):
            key = f"{ctr_name}_{err_name}"
            out[key] = fields.read(f"ecc.{key}", functools.partial(
                _ecc_count, pynvml, handle, err_type, ctr_type))
    return out


def _ecc_count(pynvml: Any, handle: Any, error_type: int, counter_type: int) -> int:
    return int(pynvml.nvmlDeviceGetTotalEccErrors(handle, error_type, counter_type))


def _remapped(pynvml: Any, handle: Any) -> dict[str, int | bool]:
    corr, unc, pending, failure = pynvml.nvmlDeviceGetRemappedRows(handle)
    return {"correctable": int(corr), "uncorrectable": int(unc), "pending": bool(pending),
            "failure": bool(failure)}


def throttle_reasons(mask: int) -> list[str]:
    """The names of the clocks event (throttle) reasons set in ``mask``."""
    return [n for bit, n in _THROTTLE_BITS.items() if mask & bit]


def _throttle(pynvml: Any, handle: Any) -> dict[str, Any]:
    mask = int(pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle))
    return {"mask": mask, "reasons": throttle_reasons(mask)}


def _mig(pynvml: Any, handle: Any, fields: _Fields) -> dict[str, Any] | None:
    mode = fields.read("mig.mode", lambda: pynvml.nvmlDeviceGetMigMode(handle))
    if mode is None:
        return None
    current = int(mode[0])
    out: dict[str, Any] = {"enabled": current == 1, "pending": int(mode[1]) == 1,
                           "instances": []}
    if current != 1:
        return out
    count = int(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle))
    for j in range(count):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, j)
        except pynvml.NVMLError as e:
            if int(getattr(e, "value", -1)) == 6:  # NOT_FOUND: no instance in this slot
                continue
            out["instances"].append({"slot": j, "error": error_record(pynvml, e)})
            continue
        inst_fields = _Fields(pynvml)
        inst: dict[str, Any] = {"slot": j}
        inst["uuid"] = inst_fields.read(
            "uuid", functools.partial(lambda m: _decode(pynvml.nvmlDeviceGetUUID(m)), mig))
        inst["memory"] = inst_fields.read("memory", functools.partial(_memory, pynvml, mig))
        inst["processes"] = inst_fields.read("processes",
                                             functools.partial(_processes, pynvml, mig))
        inst["unsupported"] = inst_fields.unsupported
        out["instances"].append(inst)
    return out


def _config(pynvml: Any, handle: Any, fields: _Fields) -> dict[str, Any]:
    """The GPU's inventory beyond the readings (core.observations.GpuConfig): read only,
    never set; each field None with its reason where the GPU cannot say."""
    limit_mw = fields.read("config.power_management_limit",
                           lambda: int(pynvml.nvmlDeviceGetPowerManagementLimit(handle)))
    ecc = fields.read("config.ecc_mode", lambda: pynvml.nvmlDeviceGetEccMode(handle))
    return {
        "vbios_version": fields.read(
            "config.vbios", lambda: _decode(pynvml.nvmlDeviceGetVbiosVersion(handle))),
        "inforom_image_version": fields.read(
            "config.inforom_image",
            lambda: _decode(pynvml.nvmlDeviceGetInforomImageVersion(handle))),
        "gsp_firmware_version": fields.read(
            "config.gsp_firmware",
            lambda: _decode(pynvml.nvmlDeviceGetGspFirmwareVersion(handle)) or None),
        "power_management_limit_w": None if limit_mw is None else limit_mw / 1000.0,
        "applications_clock_sm_mhz": fields.read(
            "config.applications_clock_sm",
            lambda: int(pynvml.nvmlDeviceGetApplicationsClock(handle, pynvml.NVML_CLOCK_SM))),
        "applications_clock_memory_mhz": fields.read(
            "config.applications_clock_memory",
            lambda: int(pynvml.nvmlDeviceGetApplicationsClock(handle, pynvml.NVML_CLOCK_MEM))),
        "ecc_mode_current": None if ecc is None else int(ecc[0]) == 1,
        "ecc_mode_pending": None if ecc is None else int(ecc[1]) == 1,
    }


def _device(pynvml: Any, index: int) -> dict[str, Any]:
    dev: dict[str, Any] = {"index": index, "ok": True, "error": None}
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    except pynvml.NVMLError as e:
        dev.update(ok=False, error=error_record(pynvml, e))
        return dev
    fields = _Fields(pynvml)
    try:
        dev["uuid"] = fields.read("uuid", lambda: _decode(pynvml.nvmlDeviceGetUUID(handle)))
        dev["name"] = fields.read("name", lambda: _decode(pynvml.nvmlDeviceGetName(handle)))
        dev["pci_bus_id"] = fields.read(
            "pci_bus_id", lambda: _decode(pynvml.nvmlDeviceGetPciInfo(handle).busId))
        # The board's serial: the GPU's own identity across slots, reboots and RMAs.
        dev["serial"] = fields.read("serial",
                                    lambda: _decode(pynvml.nvmlDeviceGetSerial(handle)))
        dev.update(readings(pynvml, handle, fields.read))
        dev["ecc"] = _ecc(pynvml, handle, fields)
        dev["remapped_rows"] = fields.read("remapped_rows", lambda: _remapped(pynvml, handle))
        dev["retired_pages_double_bit"] = fields.read(
            "retired_pages", lambda: len(pynvml.nvmlDeviceGetRetiredPages(handle, 1)))
        dev["retired_pages_pending"] = fields.read(
            "retired_pages_pending",
            lambda: int(pynvml.nvmlDeviceGetRetiredPagesPendingStatus(handle)) == 1)
        dev["pcie"] = fields.read("pcie", lambda: _pcie(pynvml, handle))
        dev["nvlinks"] = fields.read("nvlinks", lambda: _nvlinks(pynvml, handle))
        dev["fabric"] = fields.read("fabric", lambda: _fabric(pynvml, handle))
        dev["clocks_event_reasons"] = fields.read(
            "clocks_event_reasons", lambda: _throttle(pynvml, handle))
        # What nvidia-smi users scan for (the table's --wide columns): the power cap, SM and
        # memory clocks, performance state and fan; each None with a reason where unsupported.
        limit_mw = fields.read("power_limit",
                               lambda: int(pynvml.nvmlDeviceGetEnforcedPowerLimit(handle)))
        dev["power_limit_w"] = None if limit_mw is None else limit_mw / 1000.0
        dev["sm_clock_mhz"] = fields.read(
            "sm_clock", lambda: int(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)))
        dev["memory_clock_mhz"] = fields.read(
            "memory_clock",
            lambda: int(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM)))
        dev["pstate"] = fields.read(
            "pstate", lambda: int(pynvml.nvmlDeviceGetPerformanceState(handle)))
        fan = fields.read("fan", lambda: int(pynvml.nvmlDeviceGetFanSpeed(handle)))
        dev["fan_ratio"] = None if fan is None else fan / 100.0
        dev["persistence_mode"] = fields.read(
            "persistence", lambda: int(pynvml.nvmlDeviceGetPersistenceMode(handle)) == 1)
        dev["compute_mode"] = fields.read(
            "compute_mode", lambda: int(pynvml.nvmlDeviceGetComputeMode(handle)))
        dev["mig"] = _mig(pynvml, handle, fields)
        dev["config"] = _config(pynvml, handle, fields)
        action = fields.read("recovery_action",
                             lambda: _field_value(pynvml, handle, FIELD_RECOVERY_ACTION))
        dev["recovery_action"] = None if action is None else RECOVERY_ACTIONS.get(
            action, f"action_{action}")
        dev["processes"] = fields.read("processes", lambda: _processes(pynvml, handle))
        dev["graphics_processes"] = fields.read(
            "graphics_processes", lambda: _graphics_processes(pynvml, handle))
    except _DeviceFailed as e:
        dev.update(ok=False, error=e.error)
    dev["unsupported"] = fields.unsupported
    return dev


def _library_load_error() -> str | None:
    """The loader's own words when libnvidia-ml.so.1 cannot be opened (pynvml hides them)."""
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError as e:
        return str(e)
    return None


def probe(options: Mapping[str, Any]) -> dict[str, Any]:
    """Initialize NVML and read every device; never raises for an NVML failure."""
    try:
        import pynvml
    except ImportError as e:
        return {"ok": False, "error": {"code": None, "name": "IMPORT_ERROR",
                                       "message": f"nvidia-ml-py is not installed: {e}"}}
    # The visibility variables as this child saw them, for verdicts made without the host
    # probe (gpudiag probe --backend nvml,cuda).
    out: dict[str, Any] = {"ok": False, "error": None, "library_error": None,
                           "visibility_env": {k: os.environ.get(k) for k in VISIBILITY_VARIABLES}}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        out["error"] = error_record(pynvml, e)
        if out["error"]["code"] == 12:
            out["library_error"] = _library_load_error()
        return out
    try:
        fields = _Fields(pynvml)
        out["driver_version"] = fields.read(
            "driver_version", lambda: _decode(pynvml.nvmlSystemGetDriverVersion()))
        cuda_version = fields.read("cuda_driver_version",
                                   lambda: int(pynvml.nvmlSystemGetCudaDriverVersion()))
        out["cuda_driver_version"] = cuda_version
        out["nvml_version"] = fields.read(
            "nvml_version", lambda: _decode(pynvml.nvmlSystemGetNVMLVersion()))
        out["unsupported"] = fields.unsupported
        try:
            count = int(pynvml.nvmlDeviceGetCount())
        except pynvml.NVMLError as e:
            out["error"] = error_record(pynvml, e)
            return out
        out["device_count"] = count
        out["devices"] = [_device(pynvml, i) for i in range(count)]
        out["ok"] = True
        return out
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
