"""Qualification through IREE: an fp32 matmul's throughput and known answer (the full tier).

Runs inside the qualify child, on IREE's local-task driver for the CPU route (JAX's CPU
devices: the pipeline without a GPU). The module is compiled once per size and compiler
build and kept in the IREE probe's private per-user cache (probes.iree_probe.cache_dir).
On a GPU the IREE route is not run: IREE 3.x cannot compile for Hopper (sm_90), and a
kernel on the test suite's fake driver computes nothing (its launches are no-ops).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any

from gpudiag.probes.iree_probe import (
    _compiler_library_identity,
    _compiler_version_file,
    cache_dir,
    read_cached,
    write_cached,
)

MEASURE = "matmul_fp32_iree"
TOLERANCE = 1e-4  # of the largest element, as for JAX's fp32 known answer
FLAGS = ["--iree-llvmcpu-target-cpu=host"]


def source(n: int) -> str:
    """An n x n x n fp32 matmul in MLIR (linalg)."""
    t = f"tensor<{n}x{n}xf32>"
    return (f"func.func @mm(%a: {t}, %b: {t}) -> {t} {{\n"
            "  %zero = arith.constant 0.0 : f32\n"
            f"  %e = tensor.empty() : {t}\n"
            f"  %z = linalg.fill ins(%zero : f32) outs(%e : {t}) -> {t}\n"
            f"  %r = linalg.matmul ins(%a, %b : {t}, {t}) outs(%z : {t}) -> {t}\n"
            f"  return %r : {t}\n}}\n")


def _compiled(n: int) -> bytes:
    text = source(n)
    version, version_file = _compiler_version_file()
    key = hashlib.sha256("\n".join([version or "", version_file,
                                    _compiler_library_identity(), *FLAGS, text]).encode())
    folder = cache_dir()
    cached = folder / f"qualify-{key.hexdigest()[:32]}.vmfb" if folder else None
    if cached is not None:
        data, _refused = read_cached(cached)  # refused or absent: compiled again below
        if data is not None:
            return data
    import iree.compiler as ireec

    data = bytes(ireec.compile_str(text, target_backends=["llvm-cpu"], extra_args=FLAGS))
    if cached is not None:
        try:
            write_cached(cached, data)
        except OSError:
            pass  # no cache is slower, not wrong
    return data


def measure_cpu(n: int, repeats: int, check: Callable[[], None], seed: int
                ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(measurement, known answer or None) of the fp32 matmul on IREE's local-task."""
    try:
        import iree.runtime as rt
        import numpy as np

        vmfb = _compiled(n)
        check()
        ctx = rt.SystemContext(config=rt.Config(device=rt.get_device("local-task")))
        ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, vmfb))
        fn = ctx.modules.module["mm"]
        rng = np.random.default_rng(seed + 2)
        a64, b64 = rng.standard_normal((n, n)), rng.standard_normal((n, n))
        a, b = a64.astype(np.float32), b64.astype(np.float32)
        got = np.asarray(fn(a, b), dtype=np.float64)
        best = float("inf")
        for _ in range(repeats):
            check()
            started = time.perf_counter()
            np.asarray(fn(a, b))
            best = min(best, time.perf_counter() - started)
    except ImportError as e:
        return {"measure": MEASURE, "value": None,
                "reason": f"IREE is not installed here: {e}"}, None
    except (RuntimeError, ValueError) as e:  # IREE's own errors (its status decides the type)
        return {"measure": MEASURE, "value": None,
                "reason": f"IREE failed: {type(e).__name__}: {str(e)[:300]}"}, None
    want = a64 @ b64
    err = float(np.max(np.abs(got - want)))
    tol = TOLERANCE * (float(np.max(np.abs(want))) or 1.0)
    answer = {"check": MEASURE, "ok": bool(np.isfinite(got).all()) and err <= tol,
              "detail": f"{n}x{n} seeded product on IREE local-task, largest error {err:.3g} "
                        f"against float64 (tolerance {tol:.3g})"}
    return {"measure": MEASURE, "value": 2.0 * n ** 3 / best, "route": "iree",
            "bytes": 3 * n * n * 4, "repeats": repeats}, answer
