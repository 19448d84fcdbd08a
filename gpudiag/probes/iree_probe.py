"""The IREE probe: can IREE's HAL driver create a device and run a tiny kernel on it?

Runs in a child. For each required driver (default cuda; local-task is added as a control):
create the driver, query its devices, create the device, then, where iree.compiler is
installed, compile a tiny kernel for the driver's target and run it, checking the result.
Every IREE failure is recorded with its status text (``<file>:<line>: STATUS; message``),
never raised.

Compiling dominates the probe's time (a quarter to a second), so the compiled module is kept
in a per-user cache keyed by the compiler version, target, flags and source. Only a
successful compile is cached; the device is created and the kernel runs on every probe, and
a cached module that fails to run is recompiled and run again before anything is blamed.
Options: ``{"drivers": [...], "compile": true, "cache": true, "cuda_target": "sm_80",
"static": REASON}``. ``static`` (no GPU free to prove the backend on) only loads each required
driver (``get_driver`` loads libcuda but calls no cuInit and makes no context): what needs no
GPU is known even when every GPU is busy.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import stat
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpudiag.core.environment import CACHE_VARIABLE, allow_listed
from gpudiag.core.fileio import RefusedFile, atomic_write, read_regular

# IREE 3.13 compiles for sm_80/86/89 without a GPU, not for sm_90+ (FIELD-NOTES).
DEFAULT_CUDA_TARGET = "sm_80"
CONTROL_DRIVER = "local-task"
CPU_DRIVERS = frozenset({"local-task", "local-sync"})
SOURCE = """
func.func @probe(%a: tensor<4xf32>, %b: tensor<4xf32>) -> tensor<4xf32> {
  %0 = arith.mulf %a, %b : tensor<4xf32>
  %1 = arith.addf %0, %a : tensor<4xf32>
  return %1 : tensor<4xf32>
}
"""
INPUT_A = (1.0, 2.0, 3.0, 4.0)
INPUT_B = (2.0, 2.0, 2.0, 2.0)
EXPECTED = tuple(a * b + a for a, b in zip(INPUT_A, INPUT_B, strict=True))


def _error(step: str, e: BaseException) -> dict[str, Any]:
    return {"step": step, "type": type(e).__name__, "message": str(e)}


def _version(dist: str) -> str | None:
    import importlib.metadata  # ~40 ms to import: only when the packages' own files fail

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _compiler_version_file() -> tuple[str | None, str]:
    """iree.compiler's generated version.py (VERSION and REVISIONS), read without importing
    the compiler (a quarter second)."""
    spec = importlib.util.find_spec("iree.compiler")
    if spec is None or not spec.submodule_search_locations:
        return None, ""
    path = Path(list(spec.submodule_search_locations)[0]) / "version.py"
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None, ""
    m = re.search(r'^VERSION\s*=\s*"([^"]+)"', text, re.MULTILINE)
    return (m.group(1) if m else None), text


def _runtime_version(rt: Any) -> str | None:
    try:
        from iree.runtime import version

        return str(version.VERSION)
    except Exception:
        return _version("iree-base-runtime")


def _target(driver: str, cuda_target: str) -> tuple[str, list[str]] | None:
    """The compiler backend and flags for a driver, or None when the probe knows none."""
    if driver in CPU_DRIVERS:
        return "llvm-cpu", ["--iree-llvmcpu-target-cpu=host"]
    if driver == "cuda":
        return "cuda", [f"--iree-cuda-target={cuda_target}"]
    return None


def cache_dir() -> Path | None:
    """A private per-user cache folder, or None when none is safe to use."""
    root = os.environ.get(CACHE_VARIABLE)
    # A folder the user names may be reached through links; the default one may not.
    base = (Path(root).resolve() if root
            else Path(tempfile.gettempdir()) / f"gpudiag-{os.getuid()}")
    path = base / "iree-vmfb"
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        for p in (base, path):
            st = p.lstat()
            # Another user's folder, a shared writable one or a planted link could feed us
            # a doctored module.
            if (not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid()
                    or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)):
                return None
    except OSError:
        return None
    return path


# The compiler's native library: what really produces the module's bytes.
COMPILER_LIBRARY = Path("_mlir_libs") / "libIREECompiler.so"
MODULE_LIMIT_BYTES = 16 * 2**20  # the tiny kernel's module is a few KiB


def _compiler_library_identity() -> str:
    """The compiler library's path, inode, size and mtime: a reinstalled or replaced library
    changes the cache key even when its version.py reads the same."""
    spec = importlib.util.find_spec("iree.compiler")
    if spec is None or not spec.submodule_search_locations:
        return "no compiler"
    path = Path(list(spec.submodule_search_locations)[0]) / COMPILER_LIBRARY
    try:
        st = os.stat(path)
    except OSError as e:
        return f"{path}: {e.strerror}"
    return f"{path}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


def _cache_key(backend: str, flags: list[str]) -> str:
    """The compiler's exact build (version, source revisions and the library file's
    identity), target, flags and source: everything that decides the module's bytes."""
    version, version_file = _compiler_version_file()
    text = "\n".join([version or "", version_file, _compiler_library_identity(), backend,
                      *flags, SOURCE])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def read_cached(path: Path) -> tuple[bytes | None, str | None]:
    """A cached module and None, or None and why it was refused (or None, None: absent).

    Only a regular file (``read_regular``: never through a link, never a FIFO), owned by
    this user, that no one else may write: a module planted by another local user must never
    be loaded.
    """
    try:
        data, st = read_regular(path, MODULE_LIMIT_BYTES)
    except RefusedFile as e:
        if isinstance(e.__cause__, FileNotFoundError):
            return None, None
        return None, f"{path}: {e}"
    if st.st_uid != os.getuid():
        return None, f"{path} is owned by uid {st.st_uid}, not {os.getuid()}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return None, f"{path} is writable by others (mode {oct(st.st_mode & 0o777)})"
    if not data:
        return None, f"{path} has 0 bytes"
    return data, None


def write_cached(path: Path, data: bytes) -> None:
    """Write a module atomically: a fresh 0600 file (never through a link), then renamed
    over ``path`` (which replaces a planted link itself, not what it points to)."""
    atomic_write(path, data, 0o600)


def _compile(backend: str, flags: list[str], use_cache: bool) -> tuple[bytes, dict[str, Any]]:
    """The compiled module and how it was obtained; raises what the compiler raises."""
    folder = cache_dir() if use_cache else None
    cached = folder / f"{_cache_key(backend, flags)}.vmfb" if folder else None
    started = time.monotonic()
    refused: str | None = None
    if cached is not None:
        data, refused = read_cached(cached)
        if data is not None:
            return data, {"cached": True, "path": str(cached),
                          "duration_s": round(time.monotonic() - started, 4)}
    import iree.compiler as ireec

    data = bytes(ireec.compile_str(SOURCE, target_backends=[backend], extra_args=flags))
    info: dict[str, Any] = {"cached": False,
                            "duration_s": round(time.monotonic() - started, 4)}
    if refused is not None:
        info["cache_refused"] = refused
    if cached is not None:
        try:
            write_cached(cached, data)
            info["path"] = str(cached)
        except OSError as e:  # no cache is slower, not wrong
            info["cache_error"] = str(e)
    return data, info


def _run(rt: Any, device: Any, vmfb: bytes) -> dict[str, Any]:
    import numpy as np

    started = time.monotonic()
    ctx = rt.SystemContext(config=rt.Config(device=device))
    module = rt.VmModule.copy_buffer(ctx.instance, vmfb)
    ctx.add_vm_module(module)
    result = ctx.modules.module["probe"](np.array(INPUT_A, np.float32),
                                         np.array(INPUT_B, np.float32))
    got = tuple(float(x) for x in np.asarray(result).tolist())
    out: dict[str, Any] = {"ok": got == EXPECTED, "result": list(got),
                           "expected": list(EXPECTED),
                           "duration_s": round(time.monotonic() - started, 4)}
    if not out["ok"]:
        out["error"] = {"step": "run", "type": "WrongResult",
                        "message": f"a*b+a gave {list(got)}, expected {list(EXPECTED)}"}
    return out


def _execute(rt: Any, device: Any, driver: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """Compile (or reuse) the tiny kernel for this driver and run it on ``device``."""
    target = _target(driver, str(options.get("cuda_target") or DEFAULT_CUDA_TARGET))
    if target is None:
        return {"skipped": f"no compile target known for driver {driver!r}"}
    backend, flags = target
    use_cache = bool(options.get("cache", True))
    out: dict[str, Any] = {"target": backend, "flags": flags}
    for attempt in ("cached", "fresh") if use_cache else ("fresh",):
        try:
            vmfb, out["compile"] = _compile(backend, flags, attempt == "cached")
        except Exception as e:
            out["compile"] = {"ok": False, "error": _error("compile", e)}
            out["ok"] = False
            out["error"] = out["compile"]["error"]
            return out
        try:
            run = _run(rt, device, vmfb)
        except Exception as e:
            run = {"ok": False, "error": _error("run", e)}
        out["run"] = run
        out["ok"] = bool(run.get("ok"))
        out["error"] = run.get("error")
        if out["ok"] or not out["compile"].get("cached"):
            break
        # A cached module that fails is recompiled before the device is blamed.
        out["cached_attempt"] = {"compile": out["compile"], "run": run}
    return out


def _driver_loads(rt: Any, name: str, compiled_in: list[str]) -> dict[str, Any]:
    """Whether the driver loads (its library is there), touching no device."""
    out: dict[str, Any] = {"driver": name, "ok": False, "compiled_in": name in compiled_in,
                           "error": None}
    try:
        rt.get_driver(name)
    except Exception as e:
        out["error"] = _error("driver", e)
    return out


def _driver(rt: Any, name: str, compiled_in: list[str], options: Mapping[str, Any]
            ) -> dict[str, Any]:
    out: dict[str, Any] = {"driver": name, "ok": False, "compiled_in": name in compiled_in,
                           "error": None}
    started = time.monotonic()
    try:
        drv = rt.get_driver(name)
    except Exception as e:
        out["error"] = _error("driver", e)
        out["init_s"] = round(time.monotonic() - started, 4)
        return out
    try:
        devices = [dict(d) for d in drv.query_available_devices()]
    except Exception as e:
        out["error"] = _error("query", e)
        out["init_s"] = round(time.monotonic() - started, 4)
        return out
    out["devices"] = [{k: str(v) if k != "device_id" else v for k, v in d.items()}
                      for d in devices]
    if not devices:
        out["error"] = {"step": "query", "type": "NoDevice",
                        "message": f"driver {name} lists no device"}
        out["init_s"] = round(time.monotonic() - started, 4)
        return out
    try:
        device = drv.create_device(devices[0])
    except Exception as e:
        out["error"] = _error("create", e)
        out["init_s"] = round(time.monotonic() - started, 4)
        return out
    out["init_s"] = round(time.monotonic() - started, 4)
    if options.get("compile", True) and importlib.util.find_spec("iree.compiler") is not None:
        started = time.monotonic()
        out["execute"] = _execute(rt, device, name, options)
        out["compute_s"] = round(time.monotonic() - started, 4)
        if out["execute"].get("ok") is False:
            out["error"] = out["execute"]["error"]
            return out
    else:
        out["execute"] = {"skipped": "iree.compiler is not installed" if options.get(
            "compile", True) else "compile disabled by the caller"}
    out["ok"] = True
    return out


def probe(options: Mapping[str, Any]) -> dict[str, Any]:
    """Create each required IREE driver and device and run a tiny kernel; never raises."""
    required = [str(d) for d in (options.get("drivers") or ["cuda"])]
    drivers = list(dict.fromkeys(required))
    if any(d not in CPU_DRIVERS for d in drivers) and CONTROL_DRIVER not in drivers:
        drivers.append(CONTROL_DRIVER)  # tells "IREE is broken" from "the GPU is"
    out: dict[str, Any] = {
        "required": required,
        "versions": {},
        "environment": allow_listed(os.environ),
        "installed": False,
        "ok": False,
    }
    started = time.monotonic()
    try:
        import iree.runtime as rt
    except Exception as e:
        out["import_error"] = _error("import", e)
        out["versions"] = {"iree-base-runtime": _version("iree-base-runtime")}
        return out
    out["installed"] = True
    out["versions"] = {"iree-base-runtime": _runtime_version(rt),
                       "iree-base-compiler": _compiler_version_file()[0]}
    out["import_s"] = round(time.monotonic() - started, 4)
    out["compiler_installed"] = importlib.util.find_spec("iree.compiler") is not None
    try:
        compiled_in = [str(d) for d in rt.query_available_drivers()]
    except Exception as e:
        compiled_in = []
        out["compiled_in_error"] = _error("query_drivers", e)
    out["compiled_in_drivers"] = compiled_in
    if options.get("static"):
        out["static"] = str(options["static"])
        out["drivers"] = {name: _driver_loads(rt, name, compiled_in) for name in required}
        out["ok"] = None if all(d["error"] is None for d in out["drivers"].values()) else False
        return out
    out["drivers"] = {name: _driver(rt, name, compiled_in, options) for name in drivers}
    out["ok"] = all(out["drivers"][d]["ok"] for d in required)
    return out
