"""A job's GPU meter: ``python -m gpudiag.probes.job_meter OPTIONS-JSON``.

Options: ``gpus`` (full GPU UUIDs: the physical GPUs of the job's leaves) and ``interval_s``.
Reads NVML's total energy counter of each GPU at the start, then samples memory used and
the clocks event (throttle) reasons every ``interval_s`` until its stdin closes (the job
ended), reads the energy counter again and prints one JSON line:
``{"type": "usage", "gpus": [{"uuid", "energy_joules", "peak_memory_used_bytes",
"throttle_reasons", "samples", "why_missing"}]}``. An ``{"type": "ready"}`` line comes first,
once the start readings are taken. It creates no CUDA context (NVML only), so it may run
beside the job; a reading NVML refuses is None with the reason, never 0.
"""

from __future__ import annotations

import functools
import json
import os
import select
import sys
from collections.abc import Callable
from dataclasses import field
from typing import IO, Any

from gpudiag.core.records import dataclass
from gpudiag.probes.nvml import throttle_reasons


@dataclass
class _Gpu:
    uuid: str
    handle: Any = None
    energy_start_mj: int | None = None
    peak_used_bytes: int | None = None
    reasons: set[str] = field(default_factory=set)
    samples: int = 0
    why: str | None = None


def _try(pynvml: Any, gpu: _Gpu, what: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except pynvml.NVMLError as e:
        gpu.why = gpu.why or f"{what}: {e}"
        return None


def _sample(pynvml: Any, gpu: _Gpu) -> None:
    if gpu.handle is None:
        return
    mem = _try(pynvml, gpu, "memory", lambda: pynvml.nvmlDeviceGetMemoryInfo(gpu.handle))
    mask = _try(pynvml, gpu, "clocks event reasons",
                lambda: int(pynvml.nvmlDeviceGetCurrentClocksEventReasons(gpu.handle)))
    if mem is not None:
        gpu.peak_used_bytes = max(gpu.peak_used_bytes or 0, int(mem.used))
    if mask is not None:
        # gpu_idle is not a throttle: a job between steps is idle.
        gpu.reasons.update(r for r in throttle_reasons(mask) if r != "gpu_idle")
    if mem is not None or mask is not None:
        gpu.samples += 1


def _energy(pynvml: Any, gpu: _Gpu) -> int | None:
    if gpu.handle is None:
        return None
    value = _try(pynvml, gpu, "energy",
                 lambda: int(pynvml.nvmlDeviceGetTotalEnergyConsumption(gpu.handle)))
    return None if value is None else int(value)


def meter(gpus: list[str], interval_s: float, stdin: IO[bytes], out: IO[str]) -> int:
    """Meter ``gpus`` until ``stdin`` closes; prints the usage line. Returns an exit status."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as e:  # ImportError or an NVMLError: no numbers, said why
        why = f"NVML is not usable: {e}"
        out.write(json.dumps({"type": "usage", "gpus": [
            {"uuid": u, "energy_joules": None, "peak_memory_used_bytes": None,
             "throttle_reasons": [], "samples": 0, "why_missing": why} for u in gpus]}) + "\n")
        out.flush()
        return 0
    try:
        state = [_Gpu(u) for u in gpus]
        for g in state:
            g.handle = _try(pynvml, g, "handle",
                            functools.partial(pynvml.nvmlDeviceGetHandleByUUID, g.uuid.encode()))
            g.energy_start_mj = _energy(pynvml, g)
            _sample(pynvml, g)
        out.write(json.dumps({"type": "ready"}) + "\n")
        out.flush()
        fd = stdin.fileno()
        while True:
            readable, _, _ = select.select([fd], [], [], interval_s)
            if readable and not os.read(fd, 4096):
                break  # stdin closed: the job ended
            for g in state:
                _sample(pynvml, g)
        rows = []
        for g in state:
            end = _energy(pynvml, g)
            energy = (None if end is None or g.energy_start_mj is None
                      or end < g.energy_start_mj else (end - g.energy_start_mj) / 1000.0)
            rows.append({"uuid": g.uuid, "energy_joules": energy,
                         "peak_memory_used_bytes": g.peak_used_bytes,
                         "throttle_reasons": sorted(g.reasons), "samples": g.samples,
                         "why_missing": g.why})
        out.write(json.dumps({"type": "usage", "gpus": rows}) + "\n")
        out.flush()
        return 0
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def main(argv: list[str]) -> int:
    # Nobody reads stderr once the run has the pid: a library's print must not block or fail.
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)
    try:
        options = json.loads(argv[0]) if argv else {}
        gpus = [str(g) for g in options.get("gpus", [])]
        interval_s = max(0.05, float(options.get("interval_s", 1.0)))
    except (ValueError, TypeError, AttributeError) as e:
        print(f"bad meter options: {e}", file=sys.stderr)
        return 2
    try:
        return meter(gpus, interval_s, sys.stdin.buffer, sys.stdout)
    except BrokenPipeError:
        os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
