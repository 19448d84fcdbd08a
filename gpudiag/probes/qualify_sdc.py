"""The sdc tier inside the qualify child: memory test, repeated GEMM and golden hash.

Called by gpudiag.probes.qualify for one target already under the watcher (an abort when
another process appears is ``guard.check()`` raising). core.sdc holds the rules and sizes.

- Memory (``memory_*``): through the CUDA driver API (cuMemcpyHtoD/DtoH through a pinned
  staging buffer) on a GPU, through JAX's device_put on the CPU route. The whole region is
  written, then read back and compared word for word, per pass; a failure reports the byte
  offset, the 8-byte word expected and got, and the bits that differ.
- GEMM (``gemm_repeat``, ``golden``): through JAX (XLA with deterministic ops; bf16 inputs,
  fp32 accumulation and output) on the GPU or JAX's CPU devices. The fake driver computes no
  kernels, so the test suite sets ``GPUDIAG_TEST_SDC_GEMM=host`` (the same programs in fp32
  by numpy on the host, route ``test-host``: never a claim about a GPU).
- Test hook ``GPUDIAG_TEST_SDC_FAULT=IDX:CHECK:ITERATION:ELEMENT:BIT[,...]``: flip bit BIT of
  output element ELEMENT of product ITERATION (``golden``: its one product) on the GPU of
  index IDX. The check's record says ``injected: true``. Only the test suite sets it.

Every check records the conditions (clocks, temperature, power limit, throttle mask) read from
NVML when it ended, and the budget (core.sdc.SDC.budget_s) is kept: a check the budget cut
below its minimum size is ``unknown``.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.metadata
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from gpudiag.core.records import dataclass
from gpudiag.core.sdc import (
    FAIL,
    PASS,
    PENDING,
    SDC,
    UNKNOWN,
    SdcSpec,
    gemm_size,
    memory_test_bytes,
)

FAULT_ENV = "GPUDIAG_TEST_SDC_FAULT"
GEMM_ROUTE_ENV = "GPUDIAG_TEST_SDC_GEMM"
THROTTLE_BITS = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap",
    0x8: "hw_slowdown", 0x10: "sync_boost", 0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


@dataclass
class Budget:
    """The per-GPU time budget: checks stop starting work once it has passed."""

    deadline: float

    def expired(self) -> bool:
        return time.monotonic() >= self.deadline

    def until(self, share: float, started: float, total_s: float) -> Budget:
        """A sub-budget: at most ``share`` of the total from ``started``, within this one."""
        return Budget(min(self.deadline, started + share * total_s))


@dataclass(frozen=True)
class Fault:
    """One test-injected bit flip."""

    check: str
    iteration: int
    element: int
    bit: int


def injected_faults(index: Any, env: Mapping[str, str] | None = None) -> list[Fault]:
    """The test hook's faults for the GPU of ``index`` (none unless the test suite set it)."""
    text = (os.environ if env is None else env).get(FAULT_ENV, "")
    out = []
    for entry in filter(None, (e.strip() for e in text.split(","))):
        parts = entry.split(":")
        if len(parts) == 5 and parts[0] == str(index):
            with contextlib.suppress(ValueError):
                out.append(Fault(parts[1], int(parts[2]), int(parts[3]), int(parts[4])))
    return out


# -- conditions and versions -----------------------------------------------------------------

def read_conditions(uuid: str | None) -> dict[str, Any]:
    """Clocks, temperature, power limit and throttle mask of ``uuid`` from NVML (no context);
    a field NVML cannot give is None and ``reason`` says why."""
    out: dict[str, Any] = {"sm_clock_mhz": None, "memory_clock_mhz": None,
                           "temperature_c": None, "power_limit_w": None,
                           "throttle_mask": None, "throttle_reasons": [], "reason": None}
    if uuid is None or not uuid.startswith("GPU-"):
        out["reason"] = "no GPU: JAX's CPU devices have no clocks"
        return out
    missing = []
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
    except Exception as e:  # NVML's own errors: the figure stands, its conditions unknown
        out["reason"] = f"NVML: {type(e).__name__}: {e}"
        return out
    reads: dict[str, Callable[[], Any]] = {
        "sm_clock_mhz": lambda: int(pynvml.nvmlDeviceGetClockInfo(handle, 1)),  # NVML_CLOCK_SM
        "memory_clock_mhz": lambda: int(pynvml.nvmlDeviceGetClockInfo(handle, 2)),  # _MEM
        "temperature_c": lambda: int(pynvml.nvmlDeviceGetTemperature(handle, 0)),
        "power_limit_w": lambda: pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0,
        "throttle_mask": lambda: int(pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle)),
    }
    for key, read in reads.items():
        try:
            out[key] = read()
        except Exception:  # one unsupported field never loses the others
            missing.append(key)
    mask = out["throttle_mask"]
    if isinstance(mask, int):
        out["throttle_reasons"] = [n for bit, n in THROTTLE_BITS.items() if mask & bit]
    if missing:
        out["reason"] = f"NVML could not read {', '.join(missing)}"
    return out


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def library_versions(route: str) -> dict[str, str]:
    """The versions a product's bits depend on: the driver, and the GEMM route's libraries."""
    out: dict[str, str] = {}
    try:
        import pynvml

        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
        out["driver"] = driver.decode() if isinstance(driver, bytes) else str(driver)
    except Exception:
        out["driver"] = "unknown"
    names = (("numpy",) if route == "test-host" else
             ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin",
              "jax-cuda13-pjrt", "nvidia-cublas-cu12", "nvidia-cublas"))
    for name in names:
        v = _version(name)
        if v is not None:
            out[name] = v
    return out


# -- memory test -----------------------------------------------------------------------------

class MemoryPort(Protocol):
    """A region of device memory the test writes and reads back, in 8-byte words."""

    def write(self, offset: int, words: Any) -> None: ...

    def read(self, offset: int, count: int) -> Any: ...


class DriverMemory:
    """Device memory through the CUDA driver API, staged through pinned host memory."""

    def __init__(self, lib: ctypes.CDLL, check: Callable[[str, int], None], device: int,
                 chunk: int) -> None:
        import numpy as np

        self.lib, self._check, self.device = lib, check, device
        self.host = ctypes.c_void_p()
        check("cuMemHostAlloc", lib.cuMemHostAlloc(ctypes.byref(self.host),
                                                   ctypes.c_size_t(chunk), 0))
        assert self.host.value is not None
        staging = memoryview((ctypes.c_char * chunk).from_address(self.host.value)).cast("B")
        self.view = np.frombuffer(staging, dtype=np.uint64)

    def write(self, offset: int, words: Any) -> None:
        n = int(words.nbytes)
        self.view[:words.size] = words
        self._check("cuMemcpyHtoD_v2", self.lib.cuMemcpyHtoD_v2(
            ctypes.c_uint64(self.device + offset), self.host, ctypes.c_size_t(n)))

    def read(self, offset: int, count: int) -> Any:
        self._check("cuMemcpyDtoH_v2", self.lib.cuMemcpyDtoH_v2(
            self.host, ctypes.c_uint64(self.device + offset), ctypes.c_size_t(count * 8)))
        return self.view[:count]

    def close(self) -> None:
        if self.host.value:
            self.lib.cuMemFreeHost(self.host)
            self.host = ctypes.c_void_p()


class JaxMemory:
    """JAX device buffers as the region (the CPU route: the pipeline without a GPU)."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.blocks: dict[int, Any] = {}

    def write(self, offset: int, words: Any) -> None:
        import jax
        import numpy as np

        # As bytes: JAX without x64 would narrow 64-bit words to 32 bits.
        self.blocks[offset] = jax.device_put(words.view(np.uint8).copy(),
                                             self.device).block_until_ready()

    def read(self, offset: int, count: int) -> Any:
        import numpy as np

        return np.asarray(self.blocks[offset]).view(np.uint64)[:count]


def _address_words(np: Any, offset: int, count: int) -> Any:
    # Each word holds its own position in the region (address-in-address): an address line
    # stuck or shorted makes two words alias, and one then holds the other's number.
    return np.arange(offset // 8, offset // 8 + count, dtype=np.uint64)


_WALKING: dict[tuple[int, int], Any] = {}


def _walking_words(np: Any, offset: int, count: int) -> Any:
    # Word i holds 1 << (i mod 64): periodic, so one block serves every chunk at the same phase.
    key = (offset // 8 % 64, count)
    if key not in _WALKING:
        if len(_WALKING) > 4:
            _WALKING.clear()
        _WALKING[key] = np.left_shift(np.uint64(1), (np.arange(
            offset // 8, offset // 8 + count, dtype=np.uint64) % np.uint64(64)))
    return _WALKING[key]


_RANDOM_BLOCK: dict[tuple[int, int], Any] = {}


def _random_words(np: Any, seed: int, offset: int, count: int) -> Any:
    # One seeded random block, made distinct per position by XOR with a multiple of the
    # golden-ratio constant of the word index: cheap to make again for the read-back.
    key = (seed, count)
    if key not in _RANDOM_BLOCK:
        _RANDOM_BLOCK.clear()
        _RANDOM_BLOCK[key] = np.random.default_rng(seed).integers(
            0, 2 ** 64 - 1, count, dtype=np.uint64, endpoint=True)
    spread = np.uint64(0x9E3779B97F4A7C15 * (offset // 8 + 1) % 2 ** 64)
    return _RANDOM_BLOCK[key] ^ spread


@dataclass
class PassOutcome:
    """One pass of one pattern over the region."""

    compared: int            # bytes written and read back before the pass ended
    fault: dict[str, str] | None = None
    cut: bool = False        # the budget ended it early


def _fault_evidence(np: Any, region_offset: int, want: Any, got: Any, n_bytes: int
                    ) -> dict[str, str]:
    wrong = np.flatnonzero(want != got)
    i = int(wrong[0])
    e, g = int(want[i]), int(got[i])
    bits = [b for b in range(64) if (e ^ g) >> b & 1]
    off = region_offset + 8 * i
    return {"where": f"byte offset {off} (word {off // 8}) of the {n_bytes} bytes tested; "
                     f"bit(s) {', '.join(map(str, bits))} of the word differ; "
                     f"{wrong.size} wrong word(s) in that block",
            "expected": f"0x{e:016x}", "got": f"0x{g:016x}"}


def _one_pass(port: MemoryPort, n_bytes: int, chunk: int, make: Callable[[int, int], Any],
              check: Callable[[], None], budget: Budget) -> PassOutcome:
    import numpy as np

    written = 0
    for offset in range(0, n_bytes, chunk):
        check()
        if budget.expired():
            break
        count = min(chunk, n_bytes - offset) // 8
        port.write(offset, make(offset, count))
        written = offset + count * 8
    cut = written < n_bytes
    compared = 0
    for offset in range(0, written, chunk):
        check()
        count = min(chunk, written - offset) // 8
        want = make(offset, count)
        got = port.read(offset, count)
        if not np.array_equal(want, got):
            return PassOutcome(compared, _fault_evidence(np, offset, want, got, written), cut)
        compared = offset + count * 8
        if budget.expired() and compared < written:
            return PassOutcome(compared, None, True)
    return PassOutcome(compared, None, cut)


def memory_checks(port: MemoryPort, n_bytes: int, check: Callable[[], None], budget: Budget,
                  conditions: Callable[[], dict[str, Any]], route: str,
                  spec: SdcSpec = SDC, why_small: str = "") -> list[dict[str, Any]]:
    """The three memory checks over ``n_bytes`` of ``port``; each pass writes the whole region
    before reading it back, so that aliasing shows."""
    import numpy as np

    def invert(f: Callable[[int, int], Any]) -> Callable[[int, int], Any]:
        return lambda o, c: np.invert(f(o, c))

    seed = spec.seed
    plans: list[tuple[str, list[Callable[[int, int], Any]], str]] = [
        ("memory_address", [lambda o, c: _address_words(np, o, c)],
         "each 8-byte word written with its own position and read back"),
        ("memory_walking_ones", [lambda o, c: _walking_words(np, o, c),
                                 invert(lambda o, c: _walking_words(np, o, c))],
         "walking ones, then walking zeros, written and read back"),
        ("memory_random", [lambda o, c: _random_words(np, seed, o, c),
                           invert(lambda o, c: _random_words(np, seed, o, c))],
         f"a seeded random pattern (seed {seed}), then its complement, written and read back"),
    ]
    out = []
    for name, passes, method in plans:
        started = time.monotonic()
        tested, fault, cut = n_bytes, None, False
        if n_bytes < spec.memory_min_bytes:
            tested = 0
        else:
            for make in passes:
                result = _one_pass(port, n_bytes, spec.chunk_bytes, make, check, budget)
                tested = min(tested, result.compared)
                cut = cut or result.cut
                if result.fault is not None:
                    fault = result.fault
                    break
        record: dict[str, Any] = {"check": name, "bytes_tested": tested,
                                  "bytes_target": n_bytes, "route": route,
                                  "duration_s": round(time.monotonic() - started, 4)}
        if fault is not None:
            record.update(status=FAIL, detail=f"{method}: a word read back wrong", **fault)
        elif tested >= spec.memory_min_bytes:
            record.update(status=PASS, detail=f"{method}: {tested} bytes unchanged"
                          + (f" (the budget ended it at {tested} of {n_bytes})" if cut else ""))
        else:
            why = (why_small or f"{n_bytes} bytes could be tested"
                   if n_bytes < spec.memory_min_bytes else
                   f"the time budget ended it after {tested} bytes")
            record.update(status=UNKNOWN, detail=f"not run at its minimum size "
                          f"({spec.memory_min_bytes} bytes): {why}")
        record["conditions"] = conditions()
        out.append(record)
    return out


def driver_memory_checks(lib: ctypes.CDLL, check_call: Callable[[str, int], None],
                         cap_bytes: int, check: Callable[[], None], budget: Budget,
                         conditions: Callable[[], dict[str, Any]], spec: SdcSpec = SDC
                         ) -> tuple[list[dict[str, Any]], int]:
    """The memory checks on the current context's GPU (results, bytes held on the GPU)."""
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    check_call("cuMemGetInfo_v2", lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)))
    n = memory_test_bytes(int(free.value), cap_bytes, spec)
    why = (f"{free.value} bytes free: {spec.memory_share:.0%} of it, within the cap of "
           f"{cap_bytes} bytes, is {n}")
    if n < spec.memory_min_bytes:
        return memory_checks(_NoMemory(), n, check, budget, conditions, "driver", spec,
                             why), 0
    ptr = ctypes.c_uint64()
    check_call("cuMemAlloc_v2", lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(n)))
    port = None
    try:
        port = DriverMemory(lib, check_call, int(ptr.value), min(spec.chunk_bytes, n))
        return memory_checks(port, n, check, budget, conditions, "driver", spec), n
    finally:
        if port is not None:
            port.close()
        lib.cuMemFree_v2(ptr)


class _NoMemory:
    def write(self, offset: int, words: Any) -> None:
        raise AssertionError("no memory to test")

    def read(self, offset: int, count: int) -> Any:
        raise AssertionError("no memory to test")


# -- GEMM ------------------------------------------------------------------------------------

class GemmRoute(Protocol):
    """Where the products run: ``product(seed, n)`` gives a callable returning the output
    (an fp32 array, device or host) of the same seeded product each time."""

    name: str
    library: str

    def program(self, seed: int, n: int) -> tuple[str, Callable[[], Any]]: ...

    def to_host(self, out: Any) -> Any: ...

    def equal_bits(self, a: Any, b: Any) -> tuple[int, int]: ...


class HostGemm:
    """The test suite's stand-in on the fake driver: numpy fp32 on the host (route
    ``test-host``), never a claim about a GPU."""

    name = "test-host"
    library = "numpy fp32"

    def program(self, seed: int, n: int) -> tuple[str, Callable[[], Any]]:
        import numpy as np

        rng = np.random.default_rng(seed)
        a = rng.standard_normal((n, n), dtype=np.float32)
        b = rng.standard_normal((n, n), dtype=np.float32)
        return f"gemm-f32-n{n}-seed{seed}-host", lambda: a @ b

    def to_host(self, out: Any) -> Any:
        return out

    def equal_bits(self, a: Any, b: Any) -> tuple[int, int]:
        import numpy as np

        neq = a.view(np.uint32) != b.view(np.uint32)
        count = int(neq.sum())
        return count, int(np.argmax(neq)) if count else -1


class JaxGemm:
    """bf16 inputs, fp32 accumulation and output, one jitted product on ``device``."""

    name = "jax"

    def __init__(self, device: Any) -> None:
        import jax

        self.device = device
        self.library = f"jax {jax.__version__} on {device.platform}"

    def program(self, seed: int, n: int) -> tuple[str, Callable[[], Any]]:
        import jax
        import jax.numpy as jnp
        import numpy as np

        rng = np.random.default_rng(seed)
        a = jax.device_put(jnp.asarray(rng.standard_normal((n, n)), dtype=jnp.bfloat16),
                           self.device)
        b = jax.device_put(jnp.asarray(rng.standard_normal((n, n)), dtype=jnp.bfloat16),
                           self.device)
        fn = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
        return (f"gemm-bf16-f32acc-n{n}-seed{seed}",
                lambda: fn(a, b).block_until_ready())

    def to_host(self, out: Any) -> Any:
        import numpy as np

        return np.asarray(out)

    def equal_bits(self, a: Any, b: Any) -> tuple[int, int]:
        import jax
        import jax.numpy as jnp

        neq = (jax.lax.bitcast_convert_type(a, jnp.uint32)
               != jax.lax.bitcast_convert_type(b, jnp.uint32)).ravel()
        count = int(neq.sum())
        return count, int(jnp.argmax(neq)) if count else -1


def _flip(route: GemmRoute, out: Any, fault: Fault) -> Any:
    import numpy as np

    host = np.array(route.to_host(out), dtype=np.float32)
    flat = host.reshape(-1).view(np.uint32)
    flat[fault.element % flat.size] ^= np.uint32(1 << (fault.bit % 32))
    if isinstance(route, JaxGemm):
        import jax

        return jax.device_put(host, route.device)
    return host


def _element_text(route: GemmRoute, out: Any, flat: int, n: int) -> str:
    import numpy as np

    value = np.float32(route.to_host(out).reshape(-1)[flat])
    return f"{float(value)!r} (0x{int(value.view(np.uint32)):08x})"


def gemm_checks(route: GemmRoute, n: int, golden_n: int, index: Any, check: Callable[[], None],
                budget: Budget, conditions: Callable[[], dict[str, Any]],
                key_prefix: str, spec: SdcSpec = SDC) -> list[dict[str, Any]]:
    """``gemm_repeat`` and ``golden`` (its hash pending the node's judgement)."""
    faults = injected_faults(index)
    out: list[dict[str, Any]] = []
    started = time.monotonic()
    record: dict[str, Any] = {"check": "gemm_repeat", "route": route.name, "bytes_tested": 0}
    if n < spec.gemm_min_n:
        record.update(status=UNKNOWN, detail=f"not run at its minimum size: n = {n} fits the "
                                             f"memory cap, the minimum is {spec.gemm_min_n}")
    else:
        program, product = route.program(spec.seed, n)
        check()
        first = product()
        compared, mismatch = 0, None
        for iteration in range(1, spec.gemm_repeats + 1):
            check()
            if budget.expired():
                break
            result = product()
            for f in faults:
                if f.check == "gemm_repeat" and f.iteration == iteration:
                    result = _flip(route, result, f)
                    record["injected"] = True
            count, flat = route.equal_bits(first, result)
            compared = iteration
            if count:
                mismatch = (iteration, count, flat, result)
                break
        if mismatch is not None:
            iteration, count, flat, result = mismatch
            record.update(status=FAIL, detail=f"{program}: product {iteration} differs from "
                          f"product 0 in {count} element(s) (bit for bit, zero tolerance)",
                          where=f"element ({flat // n}, {flat % n}) of {n}x{n}, product "
                                f"{iteration}",
                          expected=_element_text(route, first, flat, n),
                          got=_element_text(route, result, flat, n))
        elif compared >= spec.gemm_min_repeats:
            record.update(status=PASS, detail=f"{program}: {compared} product(s) bit for bit "
                                              f"equal to the first")
        else:
            record.update(status=UNKNOWN, detail=f"not run at its minimum size: the budget "
                          f"ended it after {compared} of {spec.gemm_min_repeats} products")
    record["duration_s"] = round(time.monotonic() - started, 4)
    record["conditions"] = conditions()
    out.append(record)
    out.append(golden_check(route, golden_n, faults, check, budget, conditions, key_prefix,
                            spec))
    return out


def golden_check(route: GemmRoute, n: int, faults: list[Fault], check: Callable[[], None],
                 budget: Budget, conditions: Callable[[], dict[str, Any]], key_prefix: str,
                 spec: SdcSpec = SDC) -> dict[str, Any]:
    """The golden program's output hash; the engine judges it against the node."""
    import numpy as np

    started = time.monotonic()
    record: dict[str, Any] = {"check": "golden", "route": route.name, "bytes_tested": 0}
    check()
    if n < spec.gemm_min_n or budget.expired():
        why = (f"n = {n} is below the minimum {spec.gemm_min_n}" if n < spec.gemm_min_n
               else "the time budget was spent before it began")
        record.update(status=UNKNOWN, detail=f"not run at its minimum size: {why}")
    else:
        program, product = route.program(spec.seed + 7, n)
        result = product()
        for f in faults:
            if f.check == "golden":
                result = _flip(route, result, f)
                record["injected"] = True
        digest = hashlib.sha256(np.ascontiguousarray(
            route.to_host(result), dtype=np.float32).tobytes()).hexdigest()
        record.update(status=PENDING, output_hash=digest,
                      golden_key=f"{key_prefix}|{route.library}|{program}",
                      detail=f"{program}: output hashed")
    record["duration_s"] = round(time.monotonic() - started, 4)
    record["conditions"] = conditions()
    return record


def gemm_route(device: Any | None) -> GemmRoute | str:
    """The route for the products, or why there is none (the checks are then unknown)."""
    if os.environ.get(GEMM_ROUTE_ENV) == "host":
        return HostGemm()
    if device is None:
        return "JAX's CUDA plugin is not installed or JAX could not use the GPU"
    return JaxGemm(device)


def gemm_sizes(platform: str, cap_bytes: int, spec: SdcSpec = SDC) -> tuple[int, int]:
    """(repeat n, golden n) for the platform within the memory cap (two outputs live)."""
    if platform == "cpu" or os.environ.get(GEMM_ROUTE_ENV) == "host":
        return spec.cpu_gemm_n, spec.cpu_golden_n
    return gemm_size(cap_bytes * 3 // 4, spec.gemm_n), gemm_size(cap_bytes // 2, spec.golden_n)


def unknown_gemm(why: str, conditions: Callable[[], dict[str, Any]]) -> list[dict[str, Any]]:
    """Both GEMM checks as unknown (no route): never a pass."""
    c = conditions()
    return [{"check": name, "status": UNKNOWN, "detail": f"not run: {why}", "bytes_tested": 0,
             "duration_s": 0.0, "conditions": c} for name in ("gemm_repeat", "golden")]

