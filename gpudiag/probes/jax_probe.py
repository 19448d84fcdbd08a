"""The JAX probe: does JAX really come up on the required platform, and does it compute?

Runs in a child with the runner's environment. It reads back the XLA_PYTHON_CLIENT_*
variables it really got (before jax is imported), records versions, JAX_PLATFORMS, the
backends JAX brought up and the per-platform errors, then runs a tiny jitted computation on
the required platform and checks its result. JAX failures are recorded, never raised: the
child's stderr (where JAX and XLA log the real causes) travels back with the observation.

Options: ``{"platform": "gpu" | "cpu", "static": REASON}``. For ``gpu`` JAX runs under the caller's
JAX_PLATFORMS as given, so what it does is what the job would do; a CPU device never counts
as the GPU. For ``cpu`` the child sets JAX_PLATFORMS=cpu (the caller's value is recorded), so
a broken GPU plugin cannot block a CPU-only job. ``static`` (used when no GPU is free to
prove the backend on) only imports JAX and reads what is installed (versions, the CUDA plugins
JAX would discover): what needs no GPU is known even when every GPU is busy, and no backend is
initialized, so no GPU is touched.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
import time
import traceback
from collections.abc import Mapping
from typing import Any

from gpudiag.core.environment import PREALLOCATION_OFF, allow_listed, preallocation_disabled

GPU_PLATFORMS = frozenset({"gpu", "cuda", "rocm"})
# The CUDA runtime wheels too: the driver's CUDA version is checked against what they need.
DISTRIBUTIONS = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt",
                 "jax-cuda13-plugin", "jax-cuda13-pjrt", "nvidia-cuda-runtime-cu12",
                 "nvidia-cuda-runtime")
# x * 2 + 1 summed over arange(8): 2 * 28 + 8.
EXPECTED_SUM = 64.0


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in DISTRIBUTIONS:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _error(e: BaseException) -> dict[str, Any]:
    """An exception as evidence: type, text, and where it was raised (a bare assert has no text)."""
    frames = traceback.extract_tb(e.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None
    code = frames[-1].line if frames else None
    return {"type": type(e).__name__, "message": str(e), "where": where, "code": code,
            "traceback": "".join(traceback.format_exception(e))[-8192:]}


def _plugins() -> list[str]:
    """The PJRT plugins JAX would discover: ``jax_plugins`` modules and entry points."""
    import importlib.util
    import pkgutil

    found: set[str] = set()
    try:
        spec = importlib.util.find_spec("jax_plugins")
        paths = list(spec.submodule_search_locations or []) if spec is not None else []
        found.update(m.name for m in pkgutil.iter_modules(paths))
    except (ImportError, ValueError):  # no namespace package: no plugin module
        pass
    try:
        found.update(ep.name for ep in importlib.metadata.entry_points(group="jax_plugins"))
    except Exception:  # broken metadata of some distribution: a missing fact, not a failure
        pass
    return sorted(found)


def _device(d: Any) -> dict[str, Any]:
    return {"id": int(getattr(d, "id", -1)), "platform": str(getattr(d, "platform", "")),
            "kind": str(getattr(d, "device_kind", ""))}


def _private_state(xb: Any) -> dict[str, Any]:
    """xla_bridge's private per-platform state; guarded because it may change between versions."""
    out: dict[str, Any] = {}
    try:
        out["backend_errors"] = {str(k): str(v) for k, v in dict(xb._backend_errors).items()}
    except Exception as e:  # a private name that moved is a missing fact, not a failure
        out["backend_errors"] = None
        out["backend_errors_unavailable"] = f"{type(e).__name__}: {e}"
    try:
        out["registered_platforms"] = sorted(str(k) for k in xb._backend_factories)
    except Exception:
        out["registered_platforms"] = None
    try:
        out["platforms"] = sorted(str(k) for k in xb._backends)
    except Exception:
        out["platforms"] = None
    return out


def _nvidia_gpu_visible() -> bool | None:
    """JAX's own check: it skips CUDA unless /dev/nvidia0, /dev/nvidiactl or /dev/dxg exists."""
    try:
        from jax._src import hardware_utils

        return bool(hardware_utils.has_visible_nvidia_gpu())
    except Exception:
        return None


def _compute(jax: Any, device: Any) -> dict[str, Any]:
    """A tiny jitted computation on ``device``, its result checked."""
    import numpy as np

    started = time.monotonic()
    try:
        x = jax.device_put(np.arange(8, dtype=np.float32), device)
        fn = jax.jit(lambda v: (v * 2.0 + 1.0).sum())
        result = fn(x)
        result.block_until_ready()
        value = float(result)
        placed = [str(d) for d in result.devices()] if hasattr(result, "devices") else []
        ok = value == EXPECTED_SUM
        out: dict[str, Any] = {"ok": ok, "result": value, "expected": EXPECTED_SUM,
                               "device": str(device), "result_devices": placed}
        if not ok:
            out["error"] = {"type": "WrongResult",
                            "message": f"sum(arange(8) * 2 + 1) gave {value}, "
                                       f"expected {EXPECTED_SUM}"}
    except Exception as e:
        out = {"ok": False, "device": str(device), "error": _error(e)}
    out["duration_s"] = round(time.monotonic() - started, 4)
    return out


def probe(options: Mapping[str, Any]) -> dict[str, Any]:
    """Import JAX, bring up its backends, compute on the required platform; never raises."""
    platform = str(options.get("platform") or "gpu").lower()
    platform = "gpu" if platform in GPU_PLATFORMS else platform
    out = _environment_reading(platform)
    started = time.monotonic()
    try:
        import jax
        from jax._src import xla_bridge as xb
    except Exception as e:
        out["import_error"] = _error(e)
        out["import_s"] = round(time.monotonic() - started, 4)
        return out
    out["installed"] = True
    out["import_s"] = round(time.monotonic() - started, 4)
    out["versions"]["jax"] = out["versions"]["jax"] or getattr(jax, "__version__", None)
    out["nvidia_gpu_visible"] = _nvidia_gpu_visible()
    out["plugins"] = _plugins()
    if options.get("static"):
        out["static"] = str(options["static"])  # why no GPU: the verdict says it
        out["ok"] = None  # nothing was proven, and nothing failed
        sys.stderr.flush()
        return out
    out.update(_bring_up(jax, xb))
    out.update(_required(jax, platform, init_failed=out["init_error"] is not None))
    sys.stderr.flush()
    return out


def _environment_reading(platform: str) -> dict[str, Any]:
    """What this child got (read before jax is imported), and the environment it runs JAX in."""
    caller_platforms = os.environ.get("JAX_PLATFORMS")
    # Evidence is the environment as the job would get it, before the CPU pin below.
    environment = allow_listed(os.environ)
    if platform == "cpu":
        # A CPU-only job must not depend on a GPU plugin initializing: pin JAX to the CPU.
        os.environ["JAX_PLATFORMS"] = "cpu"
    # Read back what this process really got, before jax can look at it.
    xla_env = {k: os.environ.get(k) for k in PREALLOCATION_OFF}
    out: dict[str, Any] = {
        "platform_required": platform,
        "cpu_allowed": platform == "cpu",
        "jax_platforms": caller_platforms,
        "jax_platforms_effective": os.environ.get("JAX_PLATFORMS"),
        "xla_env": xla_env,
        "preallocation_disabled": preallocation_disabled(
            {k: v for k, v in xla_env.items() if v is not None}),
        "environment": environment,
        "versions": _versions(),
        "installed": False,
        "ok": False,
    }
    if not out["preallocation_disabled"]:
        # The reading above is the verdict (jax_preallocation_enabled); the probe itself must
        # never take 75% of a shared card, so it initializes JAX with preallocation off.
        os.environ.update(PREALLOCATION_OFF)
        out["probe_forced_preallocation_off"] = True
    return out


def _bring_up(jax: Any, xb: Any) -> dict[str, Any]:
    """Bring up JAX's default backends: the error if any, and the devices each platform has."""
    started = time.monotonic()
    default_devices: list[Any] = []
    out: dict[str, Any] = {}
    try:
        default_devices = list(jax.devices())
        out["init_error"] = None
        out["default_backend"] = str(jax.default_backend())
    except Exception as e:  # JAX_PLATFORMS=cuda without nodes raises a bare AssertionError
        out["init_error"] = _error(e)
        out["default_backend"] = None
    out["init_s"] = round(time.monotonic() - started, 4)
    out.update(_private_state(xb))
    devices: list[dict[str, Any]] = []
    for name in out.get("platforms") or []:
        try:
            devices.extend(_device(d) for d in jax.devices(name))
        except Exception:  # listed as initialized but unusable: the required check says why
            continue
    out["devices"] = devices
    out["default_devices"] = [_device(d) for d in default_devices]
    return out


def _required(jax: Any, platform: str, *, init_failed: bool) -> dict[str, Any]:
    """The required platform's devices and the computation on the first of them."""
    required: list[Any] = []
    out: dict[str, Any] = {"required_error": None}
    if not init_failed:
        try:
            required = list(jax.devices(platform))
        except Exception as e:
            out["required_error"] = _error(e)
    if platform == "gpu":
        # A GPU requirement is never met by a CPU device, whatever JAX returned.
        required = [d for d in required if str(getattr(d, "platform", "")) in GPU_PLATFORMS]
    else:
        required = [d for d in required if str(getattr(d, "platform", "")) == platform]
    out["required_devices"] = [_device(d) for d in required]
    if required:
        out["compute"] = _compute(jax, required[0])
        out["compute_s"] = out["compute"]["duration_s"]
        out["ok"] = bool(out["compute"]["ok"])
    else:
        out["compute"] = None
        out["compute_s"] = None
    return out
