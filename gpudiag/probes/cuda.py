"""The CUDA driver API probe: the proof that the backend really initializes.

Runs in a child, through ctypes on libcuda.so.1: cuInit, cuDriverGetVersion, device count,
per visible device name, UUID and total memory, then a context, a small allocation, free,
destroy. Every failure keeps its CUDA_ERROR name and string.

Busy GPUs (docs/design-notes.md): with the option ``contexts_on`` (a list of full UUIDs, the
GPUs the parent found FREE and holds the locks of), a context is made only on those; every
other device is enumerated (cuInit makes no context) and reported ``"skipped": "not_free"``.
Right before each context the probe asks NVML once more whether another process appeared on
that GPU, and skips it (``"skipped": "became_busy"``) if one did: the window between the
parent's reading and the context is then microseconds, not the length of a probe round.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Mapping
from typing import Any

ALLOC_BYTES = 1 << 20


class _CudaError(Exception):
    def __init__(self, record: dict[str, Any]) -> None:
        super().__init__(record["message"])
        self.record = record


class _Driver:
    """A thin typed wrapper over the few driver entry points the probe needs."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    def error(self, call: str, code: int) -> dict[str, Any]:
        name_p, text_p = ctypes.c_char_p(), ctypes.c_char_p()
        name = text = None
        try:
            if self.lib.cuGetErrorName(code, ctypes.byref(name_p)) == 0 and name_p.value:
                name = name_p.value.decode(errors="replace")
            if self.lib.cuGetErrorString(code, ctypes.byref(text_p)) == 0 and text_p.value:
                text = text_p.value.decode(errors="replace")
        except AttributeError:
            pass
        name = name or f"CUDA_ERROR_{code}"
        return {"call": call, "code": code, "name": name,
                "message": f"{call} failed: {name} ({code}): {text or 'no description'}"}

    def check(self, call: str, code: int) -> None:
        if code != 0:
            raise _CudaError(self.error(call, code))


def _load() -> tuple[ctypes.CDLL | None, str | None]:
    try:
        return ctypes.CDLL("libcuda.so.1"), None
    except OSError as e:
        return None, str(e)


def _uuid_string(raw: bytes) -> str:
    h = raw.hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _foreign_pids(uuid: str) -> list[int] | None:
    """PIDs other than this process's with a context on ``uuid`` (None: NVML could not say)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses_v3(handle)
    except Exception:
        return None
    own = os.getpid()
    return sorted({int(p.pid) for p in procs if int(p.pid) != own})


def _device(drv: _Driver, ordinal: int,
            contexts_on: frozenset[str] | None = None) -> dict[str, Any]:
    lib = drv.lib
    dev: dict[str, Any] = {"ordinal": ordinal, "ok": False, "error": None}
    handle = ctypes.c_int()
    try:
        drv.check("cuDeviceGet", lib.cuDeviceGet(ctypes.byref(handle), ordinal))
        name = ctypes.create_string_buffer(256)
        drv.check("cuDeviceGetName", lib.cuDeviceGetName(name, 256, handle))
        dev["name"] = name.value.decode(errors="replace")
        uuid = ctypes.create_string_buffer(16)
        drv.check("cuDeviceGetUuid", lib.cuDeviceGetUuid(uuid, handle))
        dev["uuid"] = _uuid_string(uuid.raw)
        total = ctypes.c_size_t()
        drv.check("cuDeviceTotalMem_v2", lib.cuDeviceTotalMem_v2(ctypes.byref(total), handle))
        dev["memory_total_bytes"] = int(total.value)
    except _CudaError as e:
        dev["error"] = e.record
        return dev
    if contexts_on is not None:
        if dev["uuid"] not in contexts_on:
            dev["skipped"] = "not_free"
            return dev
        foreign = _foreign_pids(dev["uuid"])
        if foreign:
            dev["skipped"] = "became_busy"
            dev["foreign_pids"] = foreign
            return dev
    ctx = ctypes.c_void_p()
    started = time.monotonic()
    try:
        drv.check("cuCtxCreate_v2", lib.cuCtxCreate_v2(ctypes.byref(ctx), 0, handle))
    except _CudaError as e:
        dev["context"] = {**e.record, "ok": False}
        return dev
    try:
        ptr = ctypes.c_uint64()
        try:
            drv.check("cuMemAlloc_v2", lib.cuMemAlloc_v2(ctypes.byref(ptr),
                                                         ctypes.c_size_t(ALLOC_BYTES)))
        except _CudaError as e:
            dev["context"] = {"ok": True}
            dev["alloc"] = {**e.record, "ok": False}
            return dev
        drv.check("cuMemFree_v2", lib.cuMemFree_v2(ptr))
        dev["context"] = {"ok": True}
        dev["alloc"] = {"ok": True, "bytes": ALLOC_BYTES}
        dev["ok"] = True
    except _CudaError as e:
        dev["alloc"] = {**e.record, "ok": False}
    finally:
        lib.cuCtxDestroy_v2(ctx)
        dev["context_duration_s"] = round(time.monotonic() - started, 4)
    return dev


def _contexts_on(options: Mapping[str, Any]) -> frozenset[str] | None:
    value = options.get("contexts_on")
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(u, str) for u in value):
        raise ValueError("option contexts_on must be a list of full GPU UUIDs")
    return frozenset(value)


def probe(options: Mapping[str, Any]) -> dict[str, Any]:
    """cuInit, then a context on every visible device the options allow; never raises for a
    CUDA failure."""
    contexts_on = _contexts_on(options)
    lib, load_error = _load()
    out: dict[str, Any] = {"library": {"loaded": lib is not None, "error": load_error},
                           "init": None, "ok": False}
    if lib is None:
        return out
    drv = _Driver(lib)
    started = time.monotonic()
    code = lib.cuInit(0)
    out["init_duration_s"] = round(time.monotonic() - started, 4)
    if code != 0:
        out["init"] = {**drv.error("cuInit", code), "ok": False}
        return out
    out["init"] = {"ok": True}
    version = ctypes.c_int()
    if lib.cuDriverGetVersion(ctypes.byref(version)) == 0:
        out["driver_version"] = int(version.value)
    count = ctypes.c_int()
    code = lib.cuDeviceGetCount(ctypes.byref(count))
    if code != 0:
        out["init"] = {**drv.error("cuDeviceGetCount", code), "ok": False}
        return out
    out["device_count"] = int(count.value)
    out["devices"] = [_device(drv, i, contexts_on) for i in range(count.value)]
    out["ok"] = True
    return out
