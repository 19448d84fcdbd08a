"""The qualification probe: measure one idle GPU (or JAX's CPU devices) and check its answers.

Runs in a child (``python -m gpudiag.probes qualify OPTIONS``) that the engine starts only for
a GPU it found FREE and holds the full-UUID lock of. Options::

    {"tier": "quick"|"full", "platform": "cuda"|"cpu", "deadline_s": S, "seed": N,
     "targets": [{"uuid", "index", "name", "memory_total_bytes"}]}

``cuda``: one target, visible as the only device (CUDA_VISIBLE_DEVICES=its UUID). The CUDA
driver API through ctypes times cuMemcpyDtoD/HtoD/DtoH with pinned host memory and checks a
seeded memory pattern read back; JAX (when its CUDA plugin is installed) times the matmuls
and checks a known answer (probes.qualify_jax). GPU memory stays within core.qualify's
budget (10% of the GPU or 4 GiB, the smaller).

Never on a busy GPU: a watcher thread re-reads NVML every ``WATCH_PERIOD_S``; when another
process appears (or NVML cannot say) the measurements stop between two operations, memory
and context are freed, and the result says ``aborted``. Should the main thread not stop
within ``ABORT_GRACE_S`` (a driver call stuck), the watcher ends the process (exit
``EXIT_ABORTED``): the driver frees a dead process's context. Either way the GPU is left
within 1 s of the process appearing.

``cpu``: every target is one of JAX's CPU devices (XLA_FLAGS=
--xla_force_host_platform_device_count=N): the same measurements and checks through JAX,
so the whole pipeline runs for real on a machine without a GPU.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import random
import stat
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import field
from typing import Any

from gpudiag.core.qualify import TIERS, TierSpec, memory_budget_bytes, sized_copy_bytes
from gpudiag.core.records import dataclass
from gpudiag.core.sdc import SDC
from gpudiag.probes.cuda import _foreign_pids, _load, _uuid_string
from gpudiag.probes.qualify_sdc import read_conditions

WATCH_PERIOD_S = 0.25
ABORT_GRACE_S = 0.5
EXIT_ABORTED = 75
PATTERN_BLOCK = 1 << 20


class Aborted(Exception):
    """The run must stop now: another process appeared, or the deadline passed.
    ``yielded``: it stopped for the busy rule (someone else's process, a waiting job)."""

    def __init__(self, reason: str, *, yielded: bool = False) -> None:
        super().__init__(reason)
        self.yielded = yielded


@dataclass
class Guard:
    """The stop signal between the watcher and the measurements, and the deadline."""

    deadline: float
    reason: str | None = None
    stopped: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)

    def check(self) -> None:
        """Raise Aborted when the watcher said stop or the deadline passed."""
        if self.stopped.is_set():
            raise Aborted(self.reason or "stopped", yielded=True)
        if time.monotonic() > self.deadline:
            raise Aborted("the tier's deadline passed before the measurements ended")

    def stop(self, reason: str) -> None:
        self.reason = reason
        self.stopped.set()


def job_waiting(path: str | None) -> bool:
    """Whether anyone holds the flock of ``path`` (a GPU's waiting mark): the kernel's O(1)
    answer to a non-blocking attempt on a fresh open file description, let go at once (never
    a read of /proc/locks, which any user can grow and which hides other pid namespaces): a
    job waits for the GPU, and qualification yields to it."""
    if not path:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    return False


def watch(guard: Guard, uuid: str, read: Callable[[str], list[int] | None] = _foreign_pids,
          waiting: Callable[[], bool] = lambda: False) -> threading.Thread:
    """Start the NVML watcher of ``uuid``: stop the run when anyone else shows up on it, or
    a job is waiting for it (``waiting``)."""

    def loop() -> None:
        while not guard.done.is_set():
            pids = read(uuid)
            job = not pids and pids is not None and waiting()
            if pids is None or pids or job:
                why = ("NVML could not list the GPU's processes (UNKNOWN is never FREE)"
                       if pids is None else
                       "a job is waiting for the GPU (gpudiag run): qualification yields"
                       if job else
                       f"process(es) {', '.join(map(str, pids))} appeared on the GPU")
                guard.stop(why)
                if not guard.done.wait(ABORT_GRACE_S):
                    print(f"gpudiag-qualify: aborted: {why}; the measurement did not stop "
                          f"within {ABORT_GRACE_S} s, ending the process", file=sys.stderr,
                          flush=True)
                    os._exit(EXIT_ABORTED)
                return
            guard.done.wait(WATCH_PERIOD_S)

    thread = threading.Thread(target=loop, name="gpudiag-qualify-watch", daemon=True)
    thread.start()
    return thread


# -- the CUDA driver API route ---------------------------------------------------------------

class CudaFailed(Exception):
    """A driver call failed (the message names it and its CUresult)."""


def _check(lib: ctypes.CDLL, call: str, code: int) -> None:
    if code != 0:
        name = ctypes.c_char_p()
        lib.cuGetErrorName(code, ctypes.byref(name))
        raise CudaFailed(f"{call} failed: {(name.value or b'?').decode()} ({code})")


@dataclass
class Buffers:
    """What the run holds on the GPU and in pinned host memory (freed in ``release``)."""

    lib: ctypes.CDLL
    ctx: ctypes.c_void_p = field(default_factory=ctypes.c_void_p)
    device: list[ctypes.c_uint64] = field(default_factory=list)
    host: list[ctypes.c_void_p] = field(default_factory=list)
    bytes_used: int = 0

    def release(self) -> None:
        for d in self.device:
            self.lib.cuMemFree_v2(d)
        for h in self.host:
            self.lib.cuMemFreeHost(h)
        if self.ctx.value:
            self.lib.cuCtxDestroy_v2(self.ctx)
            self.ctx = ctypes.c_void_p()
        self.device.clear()
        self.host.clear()


def _open_device(lib: ctypes.CDLL, uuid: str) -> ctypes.c_int:
    _check(lib, "cuInit", lib.cuInit(0))
    count = ctypes.c_int()
    _check(lib, "cuDeviceGetCount", lib.cuDeviceGetCount(ctypes.byref(count)))
    for ordinal in range(count.value):
        handle, raw = ctypes.c_int(), ctypes.create_string_buffer(16)
        _check(lib, "cuDeviceGet", lib.cuDeviceGet(ctypes.byref(handle), ordinal))
        _check(lib, "cuDeviceGetUuid", lib.cuDeviceGetUuid(raw, handle))
        if _uuid_string(raw.raw) == uuid:
            return handle
    raise CudaFailed(f"{uuid} is not among the {count.value} device(s) CUDA shows here")


def _allocate(buf: Buffers, handle: ctypes.c_int, n: int) -> None:
    lib = buf.lib
    _check(lib, "cuCtxCreate_v2", lib.cuCtxCreate_v2(ctypes.byref(buf.ctx), 0, handle))
    for _ in range(2):
        ptr = ctypes.c_uint64()
        _check(lib, "cuMemAlloc_v2", lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(n)))
        buf.device.append(ptr)
        buf.bytes_used += n
        host = ctypes.c_void_p()
        _check(lib, "cuMemHostAlloc", lib.cuMemHostAlloc(ctypes.byref(host), ctypes.c_size_t(n), 0))
        buf.host.append(host)


def _pattern(seed: int, n: int) -> bytes:
    block = random.Random(seed).randbytes(min(PATTERN_BLOCK, n))
    return (block * (n // len(block) + 1))[:n]


def _timed(guard: Guard, repeats: int, op: Callable[[], None]) -> float:
    """The best of ``repeats`` timings of ``op`` (after one warm-up), checking between them."""
    guard.check()
    op()
    best = float("inf")
    for _ in range(repeats):
        guard.check()
        started = time.perf_counter()
        op()
        best = min(best, time.perf_counter() - started)
    guard.check()
    return best


def _copies(buf: Buffers, guard: Guard, n: int, repeats: int, seed: int,
            conditions: Callable[[], dict[str, Any]]
            ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The three bandwidths and the memory pattern check, through the driver API."""
    lib = buf.lib
    (d0, d1), (h0, h1) = buf.device, buf.host
    pattern = _pattern(seed, n)
    ctypes.memmove(h0, pattern, n)
    ctypes.memset(h1, 0, n)
    _check(lib, "cuMemcpyHtoD_v2", lib.cuMemcpyHtoD_v2(d0, h0, ctypes.c_size_t(n)))
    _check(lib, "cuMemcpyDtoD_v2", lib.cuMemcpyDtoD_v2(d1, d0, ctypes.c_size_t(n)))
    _check(lib, "cuCtxSynchronize", lib.cuCtxSynchronize())
    _check(lib, "cuMemcpyDtoH_v2", lib.cuMemcpyDtoH_v2(h1, d1, ctypes.c_size_t(n)))
    back = ctypes.string_at(h1, n)
    answer = {"check": "memory_pattern", "ok": back == pattern,
              "detail": _first_difference(pattern, back)}

    def dtod() -> None:
        _check(lib, "cuMemcpyDtoD_v2", lib.cuMemcpyDtoD_v2(d1, d0, ctypes.c_size_t(n)))
        _check(lib, "cuCtxSynchronize", lib.cuCtxSynchronize())  # DtoD is async to the host

    def htod() -> None:
        _check(lib, "cuMemcpyHtoD_v2", lib.cuMemcpyHtoD_v2(d0, h0, ctypes.c_size_t(n)))

    def dtoh() -> None:
        _check(lib, "cuMemcpyDtoH_v2", lib.cuMemcpyDtoH_v2(h1, d1, ctypes.c_size_t(n)))

    out = []
    for measure, op, moved, route in (("memory_bandwidth", dtod, 2 * n, "cuMemcpyDtoD"),
                                      ("host_to_device_bandwidth", htod, n, "cuMemcpyHtoD"),
                                      ("device_to_host_bandwidth", dtoh, n, "cuMemcpyDtoH")):
        best = _timed(guard, repeats, op)
        out.append({"measure": measure, "value": moved / best if best > 0 else None,
                    "route": route, "bytes": n, "repeats": repeats,
                    "conditions": conditions()})
    return out, answer


def _first_difference(want: bytes, got: bytes) -> str:
    if want == got:
        return f"{len(want)} bytes written, copied on the GPU and read back unchanged"
    blocks = [s for s in range(0, len(want), PATTERN_BLOCK)
              if want[s:s + PATTERN_BLOCK] != got[s:s + PATTERN_BLOCK]]
    if not blocks or len(want) != len(got):
        return "lengths differ"
    i = next(j for j in range(blocks[0], blocks[0] + PATTERN_BLOCK) if want[j] != got[j])
    return (f"byte {i} read back 0x{got[i]:02x}, written 0x{want[i]:02x} "
            f"({len(blocks)} MiB block(s) of {len(want)} bytes differ)")


def _abort(out: dict[str, Any], e: Aborted | CudaFailed | AttributeError) -> None:
    """A measurement's end before its time: a job appeared (or waits), CUDA failed, or the
    driver library lacks a call the test makes (ctypes' AttributeError: named, never a
    traceback and exit 70)."""
    if isinstance(e, AttributeError):
        if "undefined symbol" not in str(e):
            raise e  # gpudiag's own bug: the traceback is the evidence
        symbol = str(e).rsplit(":", 1)[-1].strip()
        out["aborted"] = (f"the driver library libcuda.so.1 has no {symbol}, a call this "
                          "test makes: it is not a complete NVIDIA driver, or older than that "
                          "call; install the NVIDIA driver's own libcuda.so.1")
        return
    out["aborted"] = str(e) if isinstance(e, Aborted) else f"a CUDA call failed: {e}"
    out["yielded"] = isinstance(e, Aborted) and e.yielded


def _close_out(out: dict[str, Any], buf: Buffers, held_since: float, bytes_used: int) -> None:
    """Whatever happened: the GPU's memory goes back, and the record says how long the GPU
    was held and how much of it was used (the tiers' one ending)."""
    buf.release()
    out["gpu_seconds"] = round(time.monotonic() - held_since, 4)
    out.setdefault("bytes_used", bytes_used)


def _cuda_target(target: Mapping[str, Any], spec: TierSpec, guard: Guard, seed: int
                 ) -> dict[str, Any]:
    """Measure one GPU through the driver API (and JAX for the matmuls)."""
    from gpudiag.probes import qualify_jax

    out = _base(target, spec, "cuda")
    lib, error = _load()
    if lib is None:
        out["aborted"] = f"libcuda.so.1 could not be loaded: {error}"
        return out
    n = sized_copy_bytes(spec, target.get("memory_total_bytes"))
    buf = Buffers(lib)
    held = time.monotonic()
    uuid = str(target["uuid"])
    try:
        _allocate(buf, _open_device(lib, uuid), n)
        measures, answer = _copies(buf, guard, n, spec.copy_repeats, seed,
                                   lambda: read_conditions(uuid))
        out["measurements"] += measures
        out["known_answers"].append(answer)
        buf.release()
        budget = memory_budget_bytes(target.get("memory_total_bytes"))
        matmul = qualify_jax.measure_cuda(spec, guard.check, budget, seed)
        after = read_conditions(uuid)
        out["measurements"] += [{**m, "conditions": after} for m in matmul.measurements]
        out["known_answers"] += matmul.known_answers
        if "matmul_fp32_iree" in spec.measures:
            out["measurements"].append({
                "measure": "matmul_fp32_iree", "value": None,
                "reason": "not run on a GPU: IREE 3.x cannot compile for sm_90 (Hopper); it "
                          "runs on the CPU route"})
        out["bytes_used"] = max(buf.bytes_used, matmul.bytes_used)
    except (Aborted, CudaFailed, AttributeError) as e:
        _abort(out, e)
    finally:
        _close_out(out, buf, held, buf.bytes_used)
    return out


def _base(target: Mapping[str, Any], spec: TierSpec, platform: str) -> dict[str, Any]:
    return {"uuid": target.get("uuid"), "name": target.get("name"), "index": target.get("index"),
            "tier": spec.name, "platform": platform, "aborted": None,
            "started_at": time.time(), "measurements": [], "known_answers": []}


def probe(options: Mapping[str, Any]) -> dict[str, Any]:
    """Qualify the targets of ``options``; one result per target, never raises for a GPU's
    sake (a failure is that result's ``aborted``)."""
    spec = TIERS[str(options.get("tier", "quick"))]
    platform = str(options.get("platform", "cuda"))
    seed = int(options.get("seed", 20261201))
    targets = list(options.get("targets") or ())
    deadline_s = float(options.get("deadline_s", spec.deadline_s))
    results = []
    if spec.name == "sdc":
        _warm_sdc(platform)
    for target in targets:
        started = time.monotonic()
        guard = Guard(started + deadline_s)
        if platform == "cpu" and spec.name == "sdc":
            result = _sdc_cpu_target(target, spec, guard, started)
        elif platform == "cpu":
            from gpudiag.probes import qualify_jax

            result = qualify_jax.cpu_target(target, _base(target, spec, "cpu"), spec, guard.check,
                                            seed)
        else:
            result = _guarded_cuda_target(target, spec, guard, seed,
                                          str(options["yield_to"]) if options.get("yield_to")
                                          else None)
        result["duration_s"] = round(time.monotonic() - started, 4)
        if platform == "cpu":  # no GPU clocks to record, and the record says so
            for m in result.get("measurements") or ():
                m.setdefault("conditions", read_conditions(None))
        results.append(result)
    return {"ok": True, "results": results}


def _guarded_cuda_target(target: Mapping[str, Any], spec: TierSpec, guard: Guard,
                         seed: int, yield_to: str | None = None) -> dict[str, Any]:
    """One GPU under the watcher; first one more NVML reading, before any context exists."""
    uuid = str(target["uuid"])
    pids = _foreign_pids(uuid)
    if pids is None or pids:
        out = _base(target, spec, "cuda")
        out["aborted"] = ("NVML could not list the GPU's processes (UNKNOWN is never FREE)"
                          if pids is None else
                          f"process(es) {', '.join(map(str, pids))} on the GPU before it began")
        out["yielded"] = True
        return out
    watcher = watch(guard, uuid, waiting=lambda: job_waiting(yield_to))
    try:
        if spec.name == "sdc":
            return _sdc_cuda_target(target, spec, guard)
        return _cuda_target(target, spec, guard, seed)
    finally:
        guard.done.set()
        watcher.join(timeout=1.0)


# -- the sdc tier (probes.qualify_sdc has the checks) -----------------------------------------

def _warm_sdc(platform: str) -> None:
    """Import what the checks use before any GPU's budget starts: starting Python's
    libraries is not the GPU's time (JAX's CUDA start, a context, is, and stays inside)."""
    import numpy  # noqa: F401

    if platform == "cpu":
        import jax

        jax.devices("cpu")


def _jax_cuda_device() -> Any | None:
    from gpudiag.probes import qualify_jax

    if not qualify_jax._cuda_plugin_installed():
        return None
    try:
        import jax

        return jax.devices("cuda")[0]
    except Exception:  # the JAX probe classifies JAX failures; here the checks are unknown
        return None


def _sdc_cuda_target(target: Mapping[str, Any], spec: TierSpec, guard: Guard
                     ) -> dict[str, Any]:
    """The sdc checks on one GPU: memory through the driver API, then the GEMMs."""
    from gpudiag.probes import qualify_sdc as sdc

    out = _base(target, spec, "cuda")
    out.update(checks=[], budget_s=SDC.budget_s)
    lib, error = _load()
    if lib is None:
        out["aborted"] = f"libcuda.so.1 could not be loaded: {error}"
        return out
    uuid = str(target["uuid"])
    started = time.monotonic()
    # Checks start no new work past 90% of the budget: releasing memory and the context
    # fits in what is left, so the GPU is done within the budget.
    budget = sdc.Budget(started + 0.9 * SDC.budget_s)
    cap = memory_budget_bytes(target.get("memory_total_bytes"))
    buf = Buffers(lib)
    held = time.monotonic()

    def conditions() -> dict[str, Any]:
        return sdc.read_conditions(uuid)

    try:
        handle = _open_device(lib, uuid)
        _check(lib, "cuCtxCreate_v2", lib.cuCtxCreate_v2(ctypes.byref(buf.ctx), 0, handle))
        version = ctypes.c_int()
        lib.cuDriverGetVersion(ctypes.byref(version))
        memory, used = sdc.driver_memory_checks(
            lib, lambda call, code: _check(lib, call, code), cap, guard.check,
            budget.until(SDC.memory_time_share, started, SDC.budget_s), conditions)
        buf.release()
        out["bytes_used"] = used
        route = sdc.gemm_route(None if os.environ.get(sdc.GEMM_ROUTE_ENV) == "host"
                               else _jax_cuda_device())
        versions = sdc.library_versions(route if isinstance(route, str) else route.name)
        versions["cuda_driver"] = str(version.value)
        out["versions"] = versions
        # The golden key: the model, then every version the product's bits depend on.
        key = f"{target.get('name')}|" + ", ".join(f"{k} {v}" for k, v in sorted(
            versions.items()))
        if isinstance(route, str):
            gemms = sdc.unknown_gemm(route, conditions)
        else:
            n, golden_n = sdc.gemm_sizes("cuda", cap)
            try:
                gemms = sdc.gemm_checks(route, n, golden_n, target.get("index"), guard.check,
                                        budget, conditions, key)
            except (Aborted, CudaFailed):
                raise
            except Exception as e:  # XLA's own errors: the JAX probe classifies them
                gemms = sdc.unknown_gemm(f"the GEMM route failed: {type(e).__name__}: "
                                         f"{str(e)[:300]}", conditions)
            out["bytes_used"] = max(used, 3 * 4 * n * n)
        out["checks"] = [*gemms, *memory]
    except (Aborted, CudaFailed, AttributeError) as e:
        _abort(out, e)
    finally:
        _close_out(out, buf, held, 0)
    return out


def _sdc_cpu_target(target: Mapping[str, Any], spec: TierSpec, guard: Guard, started: float
                    ) -> dict[str, Any]:
    """The sdc checks on one of JAX's CPU devices: the pipeline without a GPU."""
    import jax

    from gpudiag.probes import qualify_sdc as sdc

    out = _base(target, spec, "cpu")
    out.update(checks=[], budget_s=SDC.budget_s)
    budget = sdc.Budget(started + 0.9 * SDC.budget_s)
    index = int(target.get("index") or 0)

    def conditions() -> dict[str, Any]:
        return sdc.read_conditions(None)

    try:
        device = jax.devices("cpu")[index]
        n_bytes = 16 * 1024 ** 2  # a CPU "device" shares host memory: a token region
        memory = sdc.memory_checks(sdc.JaxMemory(device), n_bytes, guard.check,
                                   budget.until(SDC.memory_time_share, started, SDC.budget_s),
                                   conditions, "jax")
        route = sdc.gemm_route(device)
        assert not isinstance(route, str)
        versions = sdc.library_versions(route.name)
        out["versions"] = versions
        n, golden_n = sdc.gemm_sizes("cpu", n_bytes)
        key = "cpu|" + ", ".join(f"{k} {v}" for k, v in sorted(versions.items()))
        gemms = sdc.gemm_checks(route, n, golden_n, index, guard.check, budget, conditions,
                                key)
        out["checks"] = [*gemms, *memory]
        out["bytes_used"] = n_bytes
        out["gpu_seconds"] = round(time.monotonic() - started, 4)
    except Exception as e:  # Aborted (deadline) or a JAX failure: this result stops here
        out["aborted"] = f"{type(e).__name__}: {e}"
    return out
