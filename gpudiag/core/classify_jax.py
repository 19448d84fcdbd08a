"""Pure JAX classification: the jax probe's observation and stderr -> jax blockers.

The real cause of a JAX GPU failure is mostly in the child's stderr (JAX's warnings, XLA's
C++ log), not in the exception: the exception says "No visible GPU devices", the log says
which cuInit error. Specific causes are tried first; the CPU fallback is reported next to
them, never instead of them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from gpudiag.core.findings import Findings, GpuContext
from gpudiag.core.observations import ErrorInfo, JaxObservation
from gpudiag.core.records import dataclass
from gpudiag.core.verdict import UNPROVEN, BackendRequirement, BackendStatus

TYPE_CHECKING = False  # BackendRun is a Protocol for the type checker only
if TYPE_CHECKING:
    from gpudiag.core.backend import BackendRun

BACKEND = "jax"
GPU_PLATFORMS = frozenset({"gpu", "cuda", "rocm"})
PLUGIN_DISTRIBUTIONS = ("jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin",
                        "jax-cuda13-pjrt")
CUDA_ERROR_MEANINGS: dict[str, str] = {
    "CUDA_ERROR_NO_DEVICE": "no CUDA-capable device is visible",
    "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH": "libcuda and the kernel driver versions differ",
    "CUDA_ERROR_INSUFFICIENT_DRIVER": "the driver is older than this CUDA needs",
    "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE": "the cuda-compat library does not support "
                                                "this GPU",
    "CUDA_ERROR_SYSTEM_NOT_READY": "the system is not ready (fabric manager not running?)",
    "CUDA_ERROR_DEVICE_UNAVAILABLE": "the GPU is busy or unavailable (exclusive-process "
                                     "mode, or held by another process)",
    "CUDA_ERROR_INVALID_DEVICE": "the device ordinal is not valid",
    "CUDA_ERROR_NO_BINARY_FOR_GPU": "no kernel image for this GPU's architecture",
    "CUDA_ERROR_UNSUPPORTED_PTX_VERSION": "the driver is too old for this PTX",
    "CUDA_ERROR_INVALID_PTX": "the PTX could not be compiled for this GPU",
    "CUDA_ERROR_ECC_UNCORRECTABLE": "an uncorrectable ECC error was detected",
    "CUDA_ERROR_LAUNCH_FAILED": "a kernel launch failed",
    "CUDA_ERROR_ILLEGAL_ADDRESS": "a kernel accessed an illegal address",
    "CUDA_ERROR_OUT_OF_MEMORY": "the GPU is out of memory",
    "CUDA_ERROR_NOT_INITIALIZED": "the CUDA driver is not initialized",
    "CUDA_ERROR_UNKNOWN": "an unknown CUDA error (often a driver or device-node problem)",
    "CUDA_ERROR_OPERATING_SYSTEM": "an operating-system call inside the driver failed",
    "CUDA_ERROR_NOT_PERMITTED": "the operation is not permitted",
}

_MISMATCH_RE = re.compile(r"Mismatched PJRT plugin PJRT API version[^\n]*")
_LIBS_RE = re.compile(r"(Unable to use CUDA because of the following issues with CUDA "
                      r"components:(?:\n(?!\n)[^\n]*){0,6}|Unable to load (?:CUDA|[\w.]+)\. "
                      r"Is it installed\?|Outdated [\w.]+ installation found\.[^\n]*)")
_FALLBACK_RE = re.compile(r"An NVIDIA GPU may be present on this machine, but a CUDA-enabled "
                          r"jaxlib is not installed\. Falling back to \w+\.")
# XLA's cuda_driver.cc, where jaxlib had CUDA built in (jax 0.4.x) and in TensorFlow.
_CUINIT_RE = re.compile(r"failed call to cuInit:[^\n]*")
_CUDA_ERROR_RE = re.compile(r"\bCUDA_ERROR_[A-Z_]+\b")
# Where JAX and XLA say why the GPU did not come up, most telling first (the texts and the
# versions that print them: docs/testing.md).
_INNER_CAUSE_RES = (
    # The CUDA plugin's initialize() (jaxlib/cuda/versions_helpers.cc; seen in jax 0.10.2).
    re.compile(r"operation cuInit\(0\) failed:[^\n]*"),
    _CUINIT_RE,
    # XLA's platform_util.cc, per device (jax 0.10.2): no VMM, cudart's or the driver's error.
    re.compile(r"Failed to create stream executor for device [^\n]*"),
    re.compile(r"CUDA Runtime error:[^\n]*"),
)
# The CUDA runtime's (cudart's) error names: meaning, and the cuda-layer code where the name
# alone proves the cause.
_CUDA_RUNTIME_ERROR_RE = re.compile(r"\bcudaError[A-Z][A-Za-z]*\b")
CUDA_RUNTIME_ERRORS: dict[str, tuple[str | None, str]] = {
    "cudaErrorInsufficientDriver": ("cuda_driver_too_old",
                                    "the driver is older than this CUDA runtime needs"),
    "cudaErrorNoDevice": ("cuda_no_device", "no CUDA-capable device is visible"),
    "cudaErrorSystemDriverMismatch": ("cuda_driver_mismatch",
                                      "libcuda and the kernel driver versions differ"),
    "cudaErrorSystemNotReady": ("cuda_system_not_ready", "the system is not ready "
                                "(fabric manager not running?)"),
    "cudaErrorDevicesUnavailable": ("cuda_devices_unavailable", "the GPU is busy or "
                                    "unavailable (exclusive-process mode, or held by another "
                                    "process)"),
    "cudaErrorMemoryAllocation": ("cuda_out_of_memory", "the GPU is out of memory"),
    "cudaErrorCallRequiresNewerDriver": (None, "the driver lacks an entry point this CUDA "
                                         "runtime calls"),
    "cudaErrorSymbolNotFound": (None, "a driver symbol the CUDA runtime needs is missing"),
    "cudaErrorInitializationError": (None, "the CUDA runtime failed to initialize"),
    "cudaErrorNotSupported": (None, "the operation is not supported"),
    "cudaErrorUnknown": (None, "an unknown CUDA error"),
}
# XLA's log prefix: "E1130 15:44:41.808336   32489 platform_util.cc:271] ".
_GLOG_PREFIX_RE = re.compile(r"^\s*[IWEF]\d{4} [\d:.]+\s+\d+ [\w.]+:\d+\] ")
# The CUDA runtime wheels a jax-cudaNN plugin installs; the first one present is checked.
CUDA_RUNTIME_DISTRIBUTIONS = ("nvidia-cuda-runtime-cu12", "nvidia-cuda-runtime")
_INIT_RE = re.compile(r"Unable to initialize backend '(?:cuda|gpu|rocm)':[^\n]*")


@dataclass(frozen=True)
class Cause:
    """One JAX blocker: its code and message."""

    code: str
    message: str


def _platforms(obs: JaxObservation) -> str:
    value = obs.jax_platforms
    return "(unset)" if value is None else repr(value)


def _text(error: ErrorInfo | None) -> str:
    if error is None:
        return ""
    return f"{error.type}: {error.message}"


def cuda_error_meaning(text: str) -> str | None:
    """``CUDA_ERROR_NO_DEVICE (no CUDA-capable device is visible)`` for the first name in text."""
    return _named(_CUDA_ERROR_RE, CUDA_ERROR_MEANINGS, text)


def runtime_error_meaning(text: str) -> str | None:
    """``cudaErrorInsufficientDriver (the driver is older ...)`` for the first cudart name."""
    return _named(_CUDA_RUNTIME_ERROR_RE, _RUNTIME_MEANINGS, text)


_RUNTIME_MEANINGS = {name: meaning for name, (_, meaning) in CUDA_RUNTIME_ERRORS.items()}


def _named(pattern: re.Pattern[str], meanings: Mapping[str, str], text: str) -> str | None:
    """``NAME (meaning)`` for the first name ``pattern`` finds; the bare name when unknown."""
    m = pattern.search(text)
    if m is None:
        return None
    meaning = meanings.get(m.group())
    return f"{m.group()} ({meaning})" if meaning else m.group()


def _inner_cause(texts: Sequence[str]) -> str | None:
    """The line JAX or XLA logged about the cause, with its CUDA error name explained."""
    for regex in _INNER_CAUSE_RES:
        for text in texts:
            m = regex.search(text)
            if m:
                meaning = cuda_error_meaning(m.group()) or runtime_error_meaning(m.group())
                return m.group().strip() + (f" [{meaning}]" if meaning else "")
    for text in texts:
        meaning = cuda_error_meaning(text) or runtime_error_meaning(text)
        if meaning:
            return meaning
    return None


def _with_inner_cause(cause: Cause, inner: str | None) -> Cause:
    """``cause`` with the inner cause appended, unless its message already carries it."""
    if inner is None or inner in cause.message:
        return cause
    return Cause(cause.code, f"{cause.message}; inner cause from stderr: {inner}")


def _plugin_version_skew(versions: Mapping[str, Any]) -> str | None:
    jaxlib = versions.get("jaxlib")
    skewed = [f"{name} {versions[name]}" for name in PLUGIN_DISTRIBUTIONS
              if versions.get(name) and jaxlib and versions[name] != jaxlib]
    return f"{', '.join(skewed)} installed with jaxlib {jaxlib}" if skewed else None


def _gpu_errors(obs: JaxObservation) -> dict[str, str]:
    errors = obs.backend_errors or {}
    return {str(k): str(v) for k, v in errors.items() if k in GPU_PLATFORMS}


@dataclass(frozen=True)
class _Reading:
    """What gpu_cause reads: the observation, the child's stderr and the error texts."""

    obs: JaxObservation
    stderr: str
    errors: dict[str, str]     # the GPU platforms' recorded errors
    texts: tuple[str, ...]     # the init error, those errors and stderr, in that order
    present: str               # the platforms that came up, for messages
    skew: str | None           # plugin/jaxlib version skew, if any


def gpu_cause(obs: JaxObservation, stderr: str) -> Cause | None:
    """Why JAX has no usable GPU, most specific cause first; None when it has one."""
    errors = _gpu_errors(obs)
    r = _Reading(obs, stderr, errors, (_text(obs.init_error), *errors.values(), stderr),
                 ",".join(obs.platforms or ()) or "none", _plugin_version_skew(obs.versions))
    return _refused_cause(r) or _init_cause(r) or _platform_cause(r)


def _refused_cause(r: _Reading) -> Cause | None:
    """The CUDA plugin was refused (version) or did not register (libraries), as JAX said."""
    for text in r.texts:
        m = _MISMATCH_RE.search(text)
        if m:
            return Cause("jax_plugin_version_mismatch",
                         f"the JAX CUDA plugin was refused: {m.group().strip()}; "
                         f"platforms present are: {r.present}")
    for text in r.texts:
        m = _LIBS_RE.search(text)
        if m:
            found = " ".join(m.group().split())
            return Cause("jax_cuda_libs_mismatch",
                         f"JAX's CUDA plugin did not register the cuda backend: {found}; "
                         f"platforms present are: {r.present}")
    return None


def _init_cause(r: _Reading) -> Cause | None:
    """A backend initialization that failed, by JAX's own words or its bare assertion."""
    obs, init_error = r.obs, r.obs.init_error
    init_line = next((m.group() for t in r.texts if (m := _INIT_RE.search(t))), None)
    if init_line is not None:
        inner = _inner_cause([r.stderr, *r.errors.values()])
        because = f"; inner cause from stderr: {inner}" if inner else ""
        if r.skew:
            because += f"; note: {r.skew}"
        return Cause("jax_backend_init_failed", f"{init_line.strip()}{because}")
    if init_error and init_error.type == "AssertionError" and not init_error.message:
        nodes = ("" if obs.nvidia_gpu_visible is not False else
                 "none of /dev/nvidia0, /dev/nvidiactl, /dev/dxg exists (device nodes "
                 "missing), so JAX skipped its CUDA backend, and ")
        return Cause("jax_backend_init_failed",
                     f"JAX_PLATFORMS={_platforms(obs)}: {nodes}with no platform left JAX "
                     f"failed with a bare AssertionError at {init_error.where} "
                     f"({init_error.code})")
    if r.skew:
        return Cause("jax_plugin_version_mismatch", f"JAX has no GPU platform: {r.skew}")
    if init_error:
        inner = _inner_cause([r.stderr])
        return Cause("jax_backend_init_failed",
                     f"JAX failed to initialize: {r.texts[0]}"
                     + (f"; inner cause from stderr: {inner}" if inner else ""))
    return None


def _platform_cause(r: _Reading) -> Cause:
    """No error said why: the platforms pinned, registered and installed say it."""
    obs, present, versions = r.obs, r.present, r.obs.versions
    registered = obs.registered_platforms or ()
    jax_platforms = obs.jax_platforms
    if jax_platforms and not any(p.strip() in GPU_PLATFORMS
                                 for p in str(jax_platforms).split(",")):
        return Cause("jax_cpu_fallback",
                     f"JAX_PLATFORMS={_platforms(obs)} keeps JAX off the GPU; platforms "
                     f"present are: {present}")
    if "cuda" in registered and "cuda" not in (obs.platforms or ()):
        why = ("JAX found no /dev/nvidia0, /dev/nvidiactl or /dev/dxg (device nodes missing)"
               if obs.nvidia_gpu_visible is False else "no error was recorded")
        return Cause("jax_backend_init_failed",
                     f"the cuda backend is registered but did not start: {why}; platforms "
                     f"present are: {present}")
    required = _text(obs.required_error)
    fallback = next((m.group() for t in r.texts if (m := _FALLBACK_RE.search(t))), None)
    if not any(versions.get(n) for n in PLUGIN_DISTRIBUTIONS) and "cuda" not in registered:
        said = f"; JAX says: {fallback}" if fallback else ""
        return Cause("jax_gpu_backend_absent",
                     f"JAX has no GPU platform: no jax-cuda12/13 plugin is installed "
                     f"(jaxlib {versions.get('jaxlib')}); platforms present are: {present}"
                     f"{said}" + (f" ({required})" if required else ""))
    return Cause("jax_backend_init_failed",
                 f"JAX has no GPU device; platforms present are: {present}"
                 + (f" ({required})" if required else ""))


def _fallback(obs: JaxObservation, stderr: str) -> Cause | None:
    """The job would silently run on the CPU: JAX's default backend came up as cpu."""
    if obs.default_backend != "cpu":
        return None
    if obs.required_devices:
        # JAX_PLATFORMS=cpu,cuda: the GPU is there, but jit and new arrays default to the CPU.
        return Cause("jax_cpu_fallback",
                     f"JAX has GPU devices but its default backend is the CPU "
                     f"(JAX_PLATFORMS={_platforms(obs)}): jit and un-placed arrays would run "
                     "on the CPU")
    warned = _FALLBACK_RE.search(stderr)
    said = f"; JAX warned: {warned.group()}" if warned else ""
    return Cause("jax_cpu_fallback",
                 f"JAX initialized on the CPU as its default backend while a GPU is required "
                 f"(JAX_PLATFORMS={_platforms(obs)}): a job would run on the CPU "
                 f"without an error{said}")


def _compute_failure(obs: JaxObservation) -> Cause | None:
    compute = obs.compute
    if compute is None or compute.ok:
        return None
    err = compute.error or ErrorInfo()
    return Cause("jax_compute_failed",
                 f"a tiny jitted computation on {compute.device} failed: "
                 f"{err.type}: {err.message}")


def _preallocation(obs: JaxObservation) -> list[Cause]:
    """The child read XLA's preallocation on: a job would take 75% of each GPU."""
    if obs.preallocation_disabled:
        return []
    xla = obs.xla_env or {}
    seen = ", ".join(f"{k}={v if v is not None else '(unset)'}" for k, v in xla.items())
    return [Cause("jax_preallocation_enabled",
                  f"the JAX child read {seen}: XLA would preallocate 75% of each GPU")]


def causes(obs: JaxObservation, platform: str, stderr: str) -> list[Cause]:
    """Every JAX blocker the observation shows for the required platform, cause first."""
    out: list[Cause] = []
    if platform == "cpu":
        if not obs.required_devices:
            err = obs.init_error or obs.required_error
            out.append(Cause("jax_backend_init_failed",
                             f"JAX did not come up on the CPU (JAX_PLATFORMS=cpu): "
                             f"{_text(err) or 'no cpu device'}"))
    else:
        if not obs.required_devices:
            cause = gpu_cause(obs, stderr)
            if cause is not None:
                out.append(cause)
        fallback = _fallback(obs, stderr)
        if fallback is not None and all(c.code != fallback.code for c in out):
            out.append(fallback)
        # Every GPU-side message keeps what JAX or XLA logged (with JAX_PLATFORMS unset JAX
        # falls back to the CPU and the cause is only on stderr).
        inner = _inner_cause([stderr, *_gpu_errors(obs).values()])
        out = [_with_inner_cause(c, inner) for c in out]
    compute = _compute_failure(obs)
    if compute is not None:
        out.append(compute)
    out.extend(_preallocation(obs))
    return out


@dataclass(frozen=True)
class RuntimeNeed:
    """The installed CUDA runtime wheel and the lowest driver CUDA version it runs on."""

    distribution: str
    version: str
    min_driver: int  # cuDriverGetVersion units: 12000 = CUDA 12.0


def runtime_need(versions: Mapping[str, Any]) -> RuntimeNeed | None:
    """What the CUDA runtime wheel of JAX's CUDA plugin needs; None without plugin or wheel.

    CUDA's minor version compatibility: a 12.x runtime runs on any CUDA 12 driver, so the
    need is the runtime's major version (cudart itself says cudaErrorInsufficientDriver).
    """
    if not any(versions.get(n) for n in PLUGIN_DISTRIBUTIONS):
        return None  # a runtime wheel some other package brought does not concern JAX
    for name in CUDA_RUNTIME_DISTRIBUTIONS:
        version = versions.get(name)
        m = re.match(r"(\d+)\.", str(version or ""))
        if m and int(m.group(1)) > 0:
            return RuntimeNeed(name, str(version), int(m.group(1)) * 1000)
    return None


def _cuda_version(value: int) -> str:
    return f"{value // 1000}.{value % 1000 // 10}"


def driver_causes(obs: JaxObservation, stderr: str,
                  driver_version: int | None) -> list[Cause]:
    """The cuda-layer causes only the JAX child shows: cudart's errors, a too-old driver."""
    texts = [stderr, *_gpu_errors(obs).values(), _text(obs.init_error)]
    said: dict[str, str] = {}
    for text in texts:
        for m in _CUDA_RUNTIME_ERROR_RE.finditer(text):
            code = CUDA_RUNTIME_ERRORS.get(m.group(), (None, ""))[0]
            if code and code not in said:
                start = text.rfind("\n", 0, m.start()) + 1
                end = text.find("\n", m.end())
                line = text[start:end if end >= 0 else None]
                said[code] = _GLOG_PREFIX_RE.sub("", line).strip()
    out: list[Cause] = []
    need = runtime_need(obs.versions)
    if need is not None and driver_version is not None and driver_version < need.min_driver:
        xla = said.pop("cuda_driver_too_old", None)
        out.append(Cause(
            "cuda_driver_too_old",
            f"the driver supports CUDA {_cuda_version(driver_version)} (cuDriverGetVersion "
            f"{driver_version}) but the installed CUDA runtime ({need.distribution} "
            f"{need.version}) needs a CUDA {need.min_driver // 1000} driver "
            f"(cuDriverGetVersion >= {need.min_driver})" + (f"; XLA says: {xla}" if xla else "")))
    out.extend(Cause(code, f"JAX's CUDA runtime failed: {line} "
                           f"[{runtime_error_meaning(line)}]") for code, line in said.items())
    return out


def _detail(obs: JaxObservation, platform: str) -> dict[str, Any]:
    return {
        "platform_required": platform,
        "cpu_allowed": platform == "cpu",
        "jax_platforms": obs.jax_platforms,
        "jax_platforms_effective": obs.jax_platforms_effective,
        "default_backend": obs.default_backend,
        "platforms": _listed(obs.platforms),
        "registered_platforms": _listed(obs.registered_platforms),
        "devices": [d.text for d in obs.devices],
        "device_count": len(obs.required_devices),
        "backend_errors": None if obs.backend_errors is None else dict(obs.backend_errors),
        "init_error": obs.init_error.without_traceback() if obs.init_error else None,
        "required_error": (obs.required_error.without_traceback() if obs.required_error
                           else None),
        "compute": obs.compute.record if obs.compute else None,
        "xla_env": None if obs.xla_env is None else dict(obs.xla_env),
        "preallocation_disabled": obs.preallocation_disabled,
        "import_s": obs.import_s,
        "init_s": obs.init_s,
        "compute_s": obs.compute_s,
    }


def _listed(values: Sequence[str] | None) -> list[str] | None:
    return None if values is None else list(values)


def classify_jax(run: BackendRun, req: BackendRequirement, gpu: GpuContext,
                 f: Findings) -> BackendStatus:
    """The jax backend's status; its blockers go into ``f`` (lower layers name the root)."""
    platform = "cpu" if req.platform == "cpu" else "gpu"
    duration = round(run.duration_s, 4)
    obs = run.parsed if isinstance(run.parsed, JaxObservation) else None
    if obs is None or not run.ok:
        # The probe layer already holds the timeout/crash/error blocker for this child.
        return BackendStatus("blocked", duration, {}, {"error": run.error})
    versions = {k: v for k, v in obs.versions.items() if v}
    if not obs.installed:
        err = obs.import_error
        f.block("jax_not_installed", f"import jax failed: {_text(err)}", backend=BACKEND)
        return BackendStatus("not_installed", duration, versions,
                             {"import_error": _text(err)})
    if obs.static is not None:
        return _classify_static(obs, run, gpu, f, duration, versions)
    found = causes(obs, platform, run.stderr_tail)
    if platform == "gpu":
        # The driver itself is the cause (a cuda-layer code), unless the cuda probe said so.
        found[:0] = [c for c in driver_causes(obs, run.stderr_tail, gpu.cuda_driver_version)
                     if all(b.code != c.code for b in f.blockers)]
    for cause in found:
        message = cause.message
        if (platform == "gpu" and cause.code.startswith("jax_")
                and cause.code != "jax_preallocation_enabled" and gpu.gpu_blocked):
            message += " (the GPU layers below are blocked too: see the primary blocker)"
        f.block(cause.code, message, backend=BACKEND)
    detail = _detail(obs, platform)
    need = runtime_need(versions)
    detail["cuda_runtime"] = need and {"distribution": need.distribution,
                                       "version": need.version,
                                       "min_driver_version": need.min_driver}
    detail["cuda_driver_version"] = gpu.cuda_driver_version
    return BackendStatus("blocked" if found else "ok", duration, versions, detail)


def static_causes(obs: JaxObservation, stderr: str, driver_version: int | None) -> list[Cause]:
    """What an installation read alone shows (no backend initialized, no GPU touched): the
    CPU pinned by JAX_PLATFORMS, no CUDA plugin, plugin/jaxlib skew, a too-old driver."""
    out: list[Cause] = []
    versions = obs.versions
    jax_platforms = obs.jax_platforms
    if jax_platforms and not any(p.strip() in GPU_PLATFORMS for p in jax_platforms.split(",")):
        out.append(Cause("jax_cpu_fallback", f"JAX_PLATFORMS={_platforms(obs)} keeps JAX off "
                                             "the GPU"))
    skew = _plugin_version_skew(versions)
    if skew:
        out.append(Cause("jax_plugin_version_mismatch", f"JAX has no usable GPU plugin: {skew}"))
    elif not any(versions.get(n) for n in PLUGIN_DISTRIBUTIONS) and not obs.plugins:
        out.append(Cause("jax_gpu_backend_absent",
                         f"JAX has no GPU platform: no jax-cuda12/13 plugin is installed "
                         f"(jaxlib {versions.get('jaxlib')}) and no jax_plugins module is "
                         "importable"))
    out.extend(c for c in driver_causes(obs, stderr, driver_version)
               if c.code == "cuda_driver_too_old")
    out.extend(_preallocation(obs))
    return out


def _classify_static(obs: JaxObservation, run: BackendRun, gpu: GpuContext, f: Findings,
                     duration: float, versions: Mapping[str, Any]) -> BackendStatus:
    """An installation-only reading: blocked by what it shows, else unproven (never ok)."""
    found = [c for c in static_causes(obs, run.stderr_tail, gpu.cuda_driver_version)
             if all(b.code != c.code for b in f.blockers)]
    for cause in found:
        f.block(cause.code, cause.message, backend=BACKEND)
    detail: dict[str, Any] = {"installation_only": True, "plugins": _listed(obs.plugins),
                              "jax_platforms": obs.jax_platforms,
                              "preallocation_disabled": obs.preallocation_disabled}
    if found:
        return BackendStatus("blocked", duration, dict(versions), detail)
    detail["reason"] = (f"not proven: {obs.static}; JAX, jaxlib and its GPU plugin are "
                        "installed and consistent, but no GPU backend was initialized")
    return BackendStatus(UNPROVEN, duration, dict(versions), detail)
