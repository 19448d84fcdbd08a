"""The long-lived NVML watcher child: XID events and telemetry as JSON lines on stdout.

``python -m gpudiag.probes.xid_watch [OPTIONS-JSON]`` with options ``heartbeat_s`` and
``telemetry_s``. Lines (one JSON object each, ``type`` first):
``hello`` (devices registered), ``xid`` (one event), ``telemetry`` (per-GPU readings, named
as in the nvml probe's devices: ``memory``, ``utilization_gpu_ratio``, ``temperature_c``,
``power_w``),
``heartbeat`` (nothing happened; proves the child still answers), ``error`` (then exit 1).
Runs in a child so that the daemon never loads libnvidia-ml; a hang here only stops the
heartbeats, which the supervisor notices.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import IO, Any

from gpudiag.probes.nvml import readings

XID_CRITICAL_ERROR = 0x8
NVML_ERROR_TIMEOUT = 10


def _emit(out: IO[str], kind: str, **fields: Any) -> None:
    out.write(json.dumps({"type": kind, "ts": time.time(), **fields}, default=str) + "\n")
    out.flush()


def _decode(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _telemetry(pynvml: Any, handles: dict[int, Any]) -> list[dict[str, Any]]:
    """Each GPU's readings under the nvml probe's names (one vocabulary, one parser)."""
    def read(_name: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except pynvml.NVMLError:
            return None  # one unsupported reading leaves the others

    return [{"index": index, **readings(pynvml, h, read)} for index, h in handles.items()]


def watch(out: IO[str], heartbeat_s: float, telemetry_s: float,
          max_events: int | None = None) -> int:
    """Register for XID events on every GPU and stream them; returns an exit status."""
    try:
        import pynvml
    except ImportError as e:
        _emit(out, "error", message=f"nvidia-ml-py is not installed: {e}", code=None)
        return 1
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        _emit(out, "error", message=f"nvmlInit failed: {e}", code=getattr(e, "value", None))
        return 1
    try:
        event_set = pynvml.nvmlEventSetCreate()
        handles, uuids, failed = _register(pynvml, event_set)
        by_addr = {ctypes_addr(h): i for i, h in handles.items()}
        _emit(out, "hello", devices=[{"index": i, "uuid": uuids[i]} for i in handles],
              failed=failed)
        _emit(out, "telemetry", gpus=_telemetry(pynvml, handles))
        next_telemetry = time.monotonic() + telemetry_s
        seen = 0
        wait_ms = max(1, int(heartbeat_s * 1000))
        while max_events is None or seen < max_events:
            try:
                data = pynvml.nvmlEventSetWait(event_set, wait_ms)
            except pynvml.NVMLError as e:
                if getattr(e, "value", None) != NVML_ERROR_TIMEOUT:
                    _emit(out, "error", message=f"nvmlEventSetWait failed: {e}",
                          code=getattr(e, "value", None))
                    return 1
                data = None
            if data is not None:
                index = by_addr.get(ctypes_addr(data.device))
                _emit(out, "xid", xid=int(data.eventData), device_index=index,
                      uuid=uuids.get(index) if index is not None else None)
                seen += 1
            if time.monotonic() >= next_telemetry:
                _emit(out, "telemetry", gpus=_telemetry(pynvml, handles))
                next_telemetry = time.monotonic() + telemetry_s
            elif data is None:
                _emit(out, "heartbeat")
        return 0
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _register(pynvml: Any, event_set: Any
              ) -> tuple[dict[int, Any], dict[int, str | None], list[dict[str, Any]]]:
    """Register every GPU for XID events: the handles and UUIDs of those registered, and
    the GPUs that could not be (index, error, code)."""
    handles: dict[int, Any] = {}
    uuids: dict[int, str | None] = {}
    failed: list[dict[str, Any]] = []
    for i in range(int(pynvml.nvmlDeviceGetCount())):
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            pynvml.nvmlDeviceRegisterEvents(h, XID_CRITICAL_ERROR, event_set)
        except pynvml.NVMLError as e:
            failed.append({"index": i, "error": str(e), "code": getattr(e, "value", None)})
            continue
        handles[i] = h
        try:
            uuids[i] = _decode(pynvml.nvmlDeviceGetUUID(h))
        except pynvml.NVMLError:
            uuids[i] = None
    return handles, uuids, failed


def ctypes_addr(handle: Any) -> int | None:
    """The address an NVML device handle points at (handles from events are new objects)."""
    import ctypes

    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None


def main(argv: list[str]) -> int:
    try:
        options = json.loads(argv[0]) if argv else {}
        heartbeat_s = float(options.get("heartbeat_s", 1.0))
        telemetry_s = float(options.get("telemetry_s", 5.0))
    except (ValueError, TypeError, AttributeError) as e:
        print(f"bad watcher options: {e}", file=sys.stderr)
        return 2
    try:
        return watch(sys.stdout, heartbeat_s, telemetry_s)
    except BrokenPipeError:
        # The daemon is gone (even SIGKILLed): its end of the pipe closed, so stop too.
        os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
