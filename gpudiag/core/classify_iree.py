"""Pure IREE classification: the iree probe's observation -> iree blockers.

IREE's status decides the Python exception type (NOT_FOUND -> ValueError, UNAVAILABLE ->
RuntimeError, ...), so the type says little. The probe step that failed and IREE's status
text (``<file>:<line>: STATUS; message``), with the inner CUDA_ERROR name, say what broke.
"""

from __future__ import annotations

import re
from typing import Any

from gpudiag.core.classify_jax import cuda_error_meaning
from gpudiag.core.findings import Findings, GpuContext
from gpudiag.core.observations import ErrorInfo, IreeObservation
from gpudiag.core.records import dataclass
from gpudiag.core.verdict import UNPROVEN, BackendRequirement, BackendStatus

TYPE_CHECKING = False  # BackendRun is a Protocol for the type checker only
if TYPE_CHECKING:
    from gpudiag.core.backend import BackendRun

BACKEND = "iree"
_STATUS_RE = re.compile(r"(?P<file>[\w./\\-]+\.(?:c|cc|cpp|h)):(?P<line>\d+): "
                        r"(?P<status>[A-Z_]+); (?P<message>.*)", re.DOTALL)
_CUDA_RE = re.compile(r"CUDA error '(?P<name>CUDA_ERROR_[A-Z_]+)' \((?P<code>\d+)\)")
STEP_CODES = {"driver": "iree_driver_unavailable", "query": "iree_no_device",
              "create": "iree_device_create_failed", "compile": "iree_execute_failed",
              "run": "iree_execute_failed"}
STEP_WORDS = {"driver": "creating the driver", "query": "querying devices",
              "create": "creating the device", "compile": "compiling the tiny kernel",
              "run": "running the tiny kernel"}


@dataclass(frozen=True)
class IreeStatus:
    """IREE's status text taken apart."""

    file: str | None
    line: int | None
    status: str | None
    message: str
    cuda_error: str | None


def parse_status(text: str) -> IreeStatus:
    """``.../cuda_driver.c:136: FAILED_PRECONDITION; CUDA error 'X' (100): ...`` -> parts."""
    m = _STATUS_RE.search(text)
    cuda = _CUDA_RE.search(text)
    name = cuda.group("name") if cuda else None
    if name is None:
        loose = re.search(r"\bCUDA_ERROR_[A-Z_]+\b", text)
        name = loose.group() if loose else None
    return IreeStatus(
        file=m.group("file") if m else None,
        line=int(m.group("line")) if m else None,
        status=m.group("status") if m else None,
        message=(m.group("message") if m else text).strip(),
        cuda_error=name,
    )


def _code(step: str, st: IreeStatus) -> str:
    # A missing device shows up at whatever step first touches it.
    if st.cuda_error == "CUDA_ERROR_NO_DEVICE" and step in ("query", "create"):
        return "iree_no_device"
    return STEP_CODES.get(step, "iree_execute_failed")


def _message(driver: str, err: ErrorInfo, compiled_in: bool) -> str:
    step = str(err.step)
    text = err.message or ""
    st = parse_status(text)
    where = f" at {st.file}:{st.line}" if st.file else ""
    status = f"{st.status}: " if st.status else ""
    cuda = ""
    if st.cuda_error:
        meaning = cuda_error_meaning(st.cuda_error)
        cuda = f" [{meaning}]" if meaning else ""
    extra = "" if compiled_in else " (this IREE build does not include the driver)"
    return (f"IREE {driver}: {STEP_WORDS.get(step, step)} failed{where}: {status}"
            f"{st.message}{cuda}{extra}")


def _summary(obs: IreeObservation) -> list[str]:
    """One short line per driver for people: ``cuda: failed creating the driver``."""
    out = []
    for name, d in obs.drivers.items():
        if not d.ok:
            step = str(d.error.step) if d.error else "None"
            out.append(f"{name}: failed {STEP_WORDS.get(step, 'probing')}")
            continue
        ex = d.execute
        if ex.skipped:
            out.append(f"{name}: ok (device created; kernel not run: {ex.skipped})")
        else:
            how = "cached module" if ex.cached else "compiled"
            out.append(f"{name}: ok (kernel ran, {how})")
    return out


def _detail(obs: IreeObservation) -> dict[str, Any]:
    drivers: dict[str, Any] = {}
    devices: list[str] = []
    init: dict[str, Any] = {}
    compute: dict[str, Any] = {}
    for name, d in obs.drivers.items():
        ex = d.execute
        drivers[name] = {"ok": d.ok, "error": d.error.record if d.error else None,
                         "compile": ex.compile, "run": ex.run, "skipped": ex.skipped}
        devices.extend(f"{name}:{dev.text}" for dev in d.devices)
        init[name] = d.init_s
        if d.compute_s is not None:
            compute[name] = d.compute_s
    return {"required": None if obs.required is None else list(obs.required),
            "drivers": _summary(obs), "driver_detail": drivers,
            "compiled_in_drivers": obs.compiled_in_drivers, "devices": devices,
            "device_count": len(devices), "import_s": obs.import_s,
            "init_s": init, "compute_s": compute}


def classify_iree(run: BackendRun, req: BackendRequirement, gpu: GpuContext,
                  f: Findings) -> BackendStatus:
    """The iree backend's status; blockers only for the required drivers, not the control."""
    duration = round(run.duration_s, 4)
    obs = run.parsed if isinstance(run.parsed, IreeObservation) else None
    if obs is None or not run.ok:
        return BackendStatus("blocked", duration, {}, {"error": run.error})
    versions = {k: v for k, v in obs.versions.items() if v}
    if not obs.installed:
        err = obs.import_error or ErrorInfo()
        f.block("iree_not_installed",
                f"import iree.runtime failed: {err.type}: {err.message}",
                backend=BACKEND)
        return BackendStatus("not_installed", duration, versions,
                             {"import_error": err.message})
    required = list(obs.required) if obs.required else [req.platform or "cuda"]
    blocked = False
    for name in required:
        d = obs.drivers.get(name)
        failure = d.error if d is not None else None
        if d is None or d.ok or failure is None:
            continue
        blocked = True
        message = _message(name, failure, d.compiled_in)
        control = obs.drivers.get("local-task")
        if control is not None and name != "local-task" and control.ok:
            message += "; the local-task control works, so IREE itself is fine"
        code = _code(str(failure.step), parse_status(failure.message or ""))
        f.block(code, message, backend=BACKEND, device=None)
    if not blocked and obs.static is not None:
        detail = {**_detail(obs), "installation_only": True,
                  "reason": f"not proven: {obs.static}; IREE and its drivers load, but no "
                            "device was created"}
        return BackendStatus(UNPROVEN, duration, versions, detail)
    return BackendStatus("blocked" if blocked else "ok", duration, versions, _detail(obs))
