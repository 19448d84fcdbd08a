"""Qualification through JAX: matmul throughput, the known-answer matmul, and the CPU route.

Called by gpudiag.probes.qualify inside its child. ``check`` is the run's stop signal: it
raises when another process appeared on the GPU or the deadline passed, and is called
between every two operations, so no single step outlasts the abort window.

Known answers (seeded, so every run computes the same thing):
- bf16: integer inputs in [-4, 4] are exact in bf16, and their products summed in fp32 stay
  exact (|sum| <= 16 n < 2^24): the result must equal the float64 product exactly;
- fp32 at full precision (no TF32): Gaussian inputs, the largest error against float64 at most
  ``FP32_TOLERANCE`` of the largest element (fp32 accumulation of n terms errs about
  sqrt(n) * 6e-8 relative; 1e-4 leaves room and still catches a wrong element).
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Mapping
from dataclasses import field
from typing import Any

from gpudiag.core.qualify import TierSpec
from gpudiag.core.records import dataclass
from gpudiag.probes import qualify_iree

FP32_TOLERANCE = 1e-4
CHECK_N = 256  # the known-answer matmul: small, exact to compute in float64 on the host
MEASURE_NAMES = {"bfloat16": "matmul_bf16", "float32": "matmul_fp32"}


@dataclass
class MatmulOutcome:
    """Matmul measurements and known answers, as the result's JSON lists."""

    measurements: list[dict[str, Any]] = field(default_factory=list)
    known_answers: list[dict[str, Any]] = field(default_factory=list)
    bytes_used: int = 0


def _dtypes(spec: TierSpec) -> list[str]:
    return [d for d, m in MEASURE_NAMES.items() if m in spec.measures]


def _cuda_plugin_installed() -> bool:
    try:  # find_spec of a submodule imports its package, which may be absent
        return any(importlib.util.find_spec(name) is not None
                   for name in ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13"))
    except ImportError:
        return False


def measure_cuda(spec: TierSpec, check: Callable[[], None], budget_bytes: int,
                 seed: int) -> MatmulOutcome:
    """The matmuls on JAX's one visible CUDA device, or why they were not measured."""
    outcome = MatmulOutcome()
    reason = None
    if not _cuda_plugin_installed():
        reason = "JAX's CUDA plugin is not installed here: the matmuls were not measured"
    else:
        try:
            import jax

            device = jax.devices("cuda")[0]
        except Exception as e:  # the JAX probe classifies JAX failures; here it is a gap
            reason = f"JAX could not use the GPU: {type(e).__name__}: {str(e)[:300]}"
    if reason is not None:
        outcome.measurements = [{"measure": MEASURE_NAMES[d], "value": None, "reason": reason}
                                for d in _dtypes(spec)]
        return outcome
    # Three n x n fp32 operands must fit the memory budget.
    n = min(spec.matmul_n, int((budget_bytes / 12) ** 0.5) // 128 * 128)
    return matmuls(device, spec, n, check, seed)


def matmuls(device: Any, spec: TierSpec, n: int, check: Callable[[], None],
            seed: int) -> MatmulOutcome:
    """Throughput (best of the tier's repeats) and the known answer, per dtype, on ``device``."""
    outcome = MatmulOutcome()
    for dtype in _dtypes(spec):
        check()
        outcome.known_answers.append(_known_answer(device, dtype, seed))
        check()
        flops, used = _throughput(device, dtype, n, spec.matmul_repeats, check, seed)
        outcome.bytes_used = max(outcome.bytes_used, used)
        outcome.measurements.append({"measure": MEASURE_NAMES[dtype], "value": flops,
                                     "route": "jax", "bytes": used,
                                     "repeats": spec.matmul_repeats})
    return outcome


def _matmul_fn(dtype: str) -> Any:
    import jax
    import jax.numpy as jnp

    if dtype == "bfloat16":
        return jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
    return jax.jit(lambda a, b: jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST))


def _throughput(device: Any, dtype: str, n: int, repeats: int, check: Callable[[], None],
                seed: int) -> tuple[float, int]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    a = jax.device_put(jnp.asarray(rng.standard_normal((n, n)), dtype=dtype), device)
    b = jax.device_put(jnp.asarray(rng.standard_normal((n, n)), dtype=dtype), device)
    fn = _matmul_fn(dtype)
    fn(a, b).block_until_ready()  # compile and warm up
    best = float("inf")
    for _ in range(repeats):
        check()
        started = time.perf_counter()
        fn(a, b).block_until_ready()
        best = min(best, time.perf_counter() - started)
    used = n * n * (2 * a.dtype.itemsize + 4)
    return 2.0 * n ** 3 / best, used


def _known_answer(device: Any, dtype: str, seed: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed + 1)
    if dtype == "bfloat16":
        a64 = rng.integers(-4, 5, (CHECK_N, CHECK_N)).astype(np.float64)
        b64 = rng.integers(-4, 5, (CHECK_N, CHECK_N)).astype(np.float64)
    else:
        a64, b64 = rng.standard_normal((CHECK_N, CHECK_N)), rng.standard_normal((CHECK_N, CHECK_N))
    a = jax.device_put(jnp.asarray(a64, dtype=dtype), device)
    b = jax.device_put(jnp.asarray(b64, dtype=dtype), device)
    got = np.asarray(_matmul_fn(dtype)(a, b), dtype=np.float64)
    want = a64 @ b64
    err = float(np.max(np.abs(got - want)))
    scale = float(np.max(np.abs(want))) or 1.0
    tol = 0.0 if dtype == "bfloat16" else FP32_TOLERANCE * scale
    ok = bool(np.isfinite(got).all()) and err <= tol
    return {"check": MEASURE_NAMES[dtype], "ok": ok,
            "detail": f"{CHECK_N}x{CHECK_N} seeded product, largest error {err:.3g} against "
                      f"float64 (tolerance {tol:.3g})"}


def _bandwidths(device: Any, n: int, repeats: int, check: Callable[[], None],
                seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Device, host-to-device and device-to-host bandwidth and the memory pattern, via JAX."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    host = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    flip = jax.jit(lambda x: x ^ jnp.uint8(0x5A))  # reads n bytes and writes n on the device
    x = jax.device_put(host, device)
    back = np.asarray(flip(x)) ^ np.uint8(0x5A)
    wrong = np.flatnonzero(back != host)
    answer = {"check": "memory_pattern", "ok": wrong.size == 0,
              "detail": (f"{n} bytes written, transformed on the device and read back unchanged"
                         if wrong.size == 0 else f"byte {int(wrong[0])} read back wrong "
                         f"({wrong.size} wrong byte(s))")}
    times: dict[str, float] = {"memory_bandwidth": float("inf"),
                               "host_to_device_bandwidth": float("inf"),
                               "device_to_host_bandwidth": float("inf")}
    flip(x).block_until_ready()
    for _ in range(repeats):
        check()
        t0 = time.perf_counter()
        y = flip(x).block_until_ready()
        t1 = time.perf_counter()
        jax.device_put(host, device).block_until_ready()
        t2 = time.perf_counter()
        np.array(y, copy=True)  # a real copy: a CPU array may share host memory
        t3 = time.perf_counter()
        for key, dt in (("memory_bandwidth", t1 - t0), ("host_to_device_bandwidth", t2 - t1),
                        ("device_to_host_bandwidth", t3 - t2)):
            times[key] = min(times[key], dt)
    moved = {"memory_bandwidth": 2 * n}
    return [{"measure": k, "value": moved.get(k, n) / t if t > 0 else None, "route": "jax",
             "bytes": n, "repeats": repeats} for k, t in times.items()], answer


def cpu_target(target: Mapping[str, Any], out: dict[str, Any], spec: TierSpec,
               check: Callable[[], None], seed: int) -> dict[str, Any]:
    """Qualify one of JAX's CPU devices (``target["index"]``): the pipeline without a GPU."""
    import jax

    try:
        device = jax.devices("cpu")[int(target.get("index") or 0)]
        n_bytes = min(spec.copy_bytes, 16 * 1024 ** 2)  # a CPU "device" shares host memory
        held = time.monotonic()
        measures, answer = _bandwidths(device, n_bytes, spec.copy_repeats, check, seed)
        mm = matmuls(device, spec, spec.cpu_matmul_n, check, seed)
        if qualify_iree.MEASURE in spec.measures:
            iree_measure, iree_answer = qualify_iree.measure_cpu(
                spec.cpu_matmul_n, spec.matmul_repeats, check, seed)
            mm.measurements.append(iree_measure)
            mm.known_answers += [iree_answer] if iree_answer else []
        out["measurements"] = measures + mm.measurements
        out["known_answers"] = [answer, *mm.known_answers]
        out["bytes_used"] = max(2 * n_bytes, mm.bytes_used)
        out["gpu_seconds"] = round(time.monotonic() - held, 4)
    except Exception as e:  # Aborted (deadline) or a JAX failure: this result stops here
        out["aborted"] = f"{type(e).__name__}: {e}"
    return out
