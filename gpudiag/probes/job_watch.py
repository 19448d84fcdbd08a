"""The job watch's NVML child: ``python -m gpudiag.probes.job_watch [OPTIONS-JSON]``.

Options: ``interval_s``. The daemon writes the GPUs to watch on stdin, one JSON line each
time they change (``{"gpus": ["GPU-...", ...]}``); the child reads, every ``interval_s``,
each one's utilization, power, enforced power limit and, where the driver has them, SM clock,
clocks event (throttle) reasons and link throughput (PCIe and NVLink byte counters, as KB/s
between two readings), and every ``SLOW_EVERY`` samples its PCIe link against its maximum
and pending row remaps. It prints one line per sample:
``{"type": "sample", "ts", "gpus": [{"uuid", "utilization_ratio", "power_w",
"power_limit_w", "sm_clock_mhz", "throttle_reasons", "link_kbps", "pcie_degraded",
"ecc_pending"}]}`` (core.job_watch.GpuSample reads it). A call the driver does not support
is None and not asked again on that GPU; the child ends when its stdin closes. NVML only:
no CUDA context, so it runs beside the jobs it watches.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
from collections.abc import Callable
from dataclasses import field
from typing import IO, Any

from gpudiag.core.records import dataclass
from gpudiag.probes.nvml import throttle_reasons

SLOW_EVERY = 10  # samples between reads of what changes slowly (power limit, PCIe link, ECC)
# Byte counters: PCIe TX/RX (NVML_FI_DEV_PCIE_COUNT_{TX,RX}_BYTES, bytes) and NVLink data
# TX/RX of every link (NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_{TX,RX}, KiB; scope UINT_MAX).
_PCIE_FIELDS = (197, 198)
_NVLINK_FIELDS = (138, 139)
_ALL_LINKS = 0xFFFFFFFF


@dataclass
class _Gpu:
    uuid: str
    handle: Any = None
    skip: set[str] = field(default_factory=set)  # calls the driver does not support here
    limit_w: float | None = None
    pcie_degraded: bool | None = None
    ecc_pending: bool | None = None
    counters: tuple[float, float] | None = None  # (monotonic s, link KB so far)
    samples: int = 0


def _reader(pynvml: Any, gpu: _Gpu) -> Callable[[str, Callable[[], Any]], Any]:
    def read(what: str, fn: Callable[[], Any]) -> Any:
        if what in gpu.skip:
            return None
        try:
            return fn()
        except pynvml.NVMLError as e:
            # NOT_SUPPORTED (3) or FUNCTION_NOT_FOUND (13): never asked again on this GPU.
            if getattr(e, "value", None) in (3, 13):
                gpu.skip.add(what)
            return None
    return read


def _link_kb(pynvml: Any, gpu: _Gpu, read: Callable[[str, Callable[[], Any]], Any]
             ) -> float | None:
    """The GPU's link traffic so far in KB (PCIe bytes and NVLink KiB), None when neither
    counter is shown."""
    ids = [*_PCIE_FIELDS, *((f, _ALL_LINKS) for f in _NVLINK_FIELDS)]
    values = read("link_counters", lambda: pynvml.nvmlDeviceGetFieldValues(gpu.handle, ids))
    if values is None:
        return None
    total, seen = 0.0, False
    for k, v in enumerate(values):
        if int(v.nvmlReturn) != 0:
            continue
        raw = float(v.value.ullVal)
        total += raw / 1000.0 if k < len(_PCIE_FIELDS) else raw * 1.024
        seen = True
    if not seen:
        gpu.skip.add("link_counters")  # the driver counts neither: not asked again
        return None
    return total


def _slow(pynvml: Any, gpu: _Gpu, read: Callable[[str, Callable[[], Any]], Any]) -> None:
    """What changes slowly: the enforced power limit, the PCIe link, pending row remaps."""
    limit = read("power_limit", lambda: int(pynvml.nvmlDeviceGetEnforcedPowerLimit(gpu.handle)))
    gpu.limit_w = None if limit is None else limit / 1000.0
    cur = read("pcie_width", lambda: int(pynvml.nvmlDeviceGetCurrPcieLinkWidth(gpu.handle)))
    top = read("pcie_max_width", lambda: int(pynvml.nvmlDeviceGetMaxPcieLinkWidth(gpu.handle)))
    gpu.pcie_degraded = None if cur is None or top is None else cur < top
    rows = read("remapped_rows", lambda: pynvml.nvmlDeviceGetRemappedRows(gpu.handle))
    gpu.ecc_pending = None if rows is None else bool(rows[2])


def sample(pynvml: Any, gpu: _Gpu) -> dict[str, Any]:
    """One GPU's readings now (None where the driver gives none)."""
    read = _reader(pynvml, gpu)
    if gpu.samples % SLOW_EVERY == 0:  # its first sample too: the limit is needed at once
        _slow(pynvml, gpu, read)
    gpu.samples += 1
    util = read("utilization", lambda: pynvml.nvmlDeviceGetUtilizationRates(gpu.handle))
    power = read("power", lambda: int(pynvml.nvmlDeviceGetPowerUsage(gpu.handle)))
    clock = read("sm_clock", lambda: int(pynvml.nvmlDeviceGetClockInfo(gpu.handle, 1)))
    mask = read("throttle", lambda: int(pynvml.nvmlDeviceGetCurrentClocksEventReasons(
        gpu.handle)))
    kb, now, rate = _link_kb(pynvml, gpu, read), time.monotonic(), None
    if kb is not None:
        if gpu.counters is not None and now > gpu.counters[0] and kb >= gpu.counters[1]:
            rate = (kb - gpu.counters[1]) / (now - gpu.counters[0])
        gpu.counters = (now, kb)
    return {"uuid": gpu.uuid,
            "utilization_ratio": None if util is None else int(util.gpu) / 100.0,
            "power_w": None if power is None else power / 1000.0,
            "power_limit_w": gpu.limit_w, "sm_clock_mhz": clock,
            "throttle_reasons": None if mask is None else throttle_reasons(mask),
            "link_kbps": None if rate is None else round(rate, 1),
            "pcie_degraded": gpu.pcie_degraded, "ecc_pending": gpu.ecc_pending}


def _watched(pynvml: Any, line: bytes, known: dict[str, _Gpu]) -> dict[str, _Gpu]:
    """The GPUs a stdin line names (handles kept for those already watched)."""
    try:
        names = json.loads(line).get("gpus")
    except (ValueError, AttributeError):
        return known
    out: dict[str, _Gpu] = {}
    for uuid in names if isinstance(names, list) else ():
        gpu = known.get(str(uuid)) or _Gpu(str(uuid))
        if gpu.handle is None:
            try:
                gpu.handle = pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid.encode())
            except pynvml.NVMLError:
                continue  # gone or not a GPU here: no readings, the rule sees it unread
        out[gpu.uuid] = gpu
    return out


def watch(interval_s: float, stdin: IO[bytes], out: IO[str]) -> int:
    """Sample the GPUs stdin names every ``interval_s`` until stdin closes."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as e:  # ImportError or an NVMLError: said once, then exit
        out.write(json.dumps({"type": "error", "message": f"NVML is not usable: {e}"}) + "\n")
        out.flush()
        return 1
    try:
        gpus: dict[str, _Gpu] = {}
        fd, buf = stdin.fileno(), b""
        next_at = time.monotonic()
        while True:
            wait = max(0.0, next_at - time.monotonic())
            readable, _, _ = select.select([fd], [], [], wait)
            if readable:
                chunk = os.read(fd, 65536)
                if not chunk:
                    return 0  # the daemon closed our stdin: nothing left to watch
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    gpus = _watched(pynvml, line, gpus)
                continue
            next_at += interval_s
            if next_at < time.monotonic():  # a stall (suspended, overloaded): no catch-up
                next_at = time.monotonic() + interval_s
            if gpus:
                rows = [sample(pynvml, g) for g in gpus.values()]
                out.write(json.dumps({"type": "sample", "ts": time.time(), "gpus": rows},
                                     separators=(",", ":")) + "\n")
                out.flush()
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def main(argv: list[str]) -> int:
    try:
        options = json.loads(argv[0]) if argv else {}
        interval_s = max(0.05, float(options.get("interval_s", 1.0)))
    except (ValueError, TypeError, AttributeError) as e:
        print(f"bad job watch options: {e}", file=sys.stderr)
        return 2
    try:
        return watch(interval_s, sys.stdin.buffer, sys.stdout)
    except BrokenPipeError:
        os._exit(0)  # the daemon is gone: its end of the pipe closed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
