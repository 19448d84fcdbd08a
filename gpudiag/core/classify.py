"""Pure classification: probe observations + requirement -> Verdict. No I/O here.

The primary ``gpu_validation_blocker`` is the root cause (the lowest layer); everything the
root cause brings with it stays listed under ``blockers`` as consequences.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from gpudiag.core.classify_iree import classify_iree
from gpudiag.core.classify_jax import classify_jax
from gpudiag.core.environment import (
    KnownDevice,
    Visibility,
    VisibleEntry,
    parse_cuda_visible_devices,
    parse_nvidia_visible_devices,
    resolve,
)
from gpudiag.core.findings import Findings, GpuContext, XidEvent
from gpudiag.core.observation import observation_problem
from gpudiag.core.probe_run import ProbeRun
from gpudiag.core.verdict import (
    BackendRequirement,
    BackendStatus,
    DeviceInfo,
    Finding,
    Requirement,
    Verdict,
)

NVML_INIT_CODES = {12: "driver_library_missing", 9: "driver_not_loaded",
                   18: "driver_library_mismatch", 4: "nvml_no_permission",
                   17: "nvml_no_permission", 15: "gpu_lost", 16: "gpu_reset_required",
                   14: "gpu_inforom_corrupted"}
NVML_DEVICE_CODES = {15: "gpu_lost", 16: "gpu_reset_required", 14: "gpu_inforom_corrupted",
                     4: "nvml_no_permission", 17: "nvml_no_permission"}
CUDA_INIT_CODES = {100: "cuda_no_device", 803: "cuda_driver_mismatch",
                   35: "cuda_driver_too_old", 802: "cuda_system_not_ready",
                   46: "cuda_devices_unavailable", 2: "cuda_out_of_memory"}
CUDA_CONTEXT_CODES = {46: "cuda_devices_unavailable", 2: "cuda_out_of_memory"}
CRITICAL_XIDS = frozenset({48, 62, 64, 74, 95, 119, 120})
LOST_XIDS = frozenset({79})
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 109})
THERMAL_REASONS = frozenset({"hw_thermal_slowdown", "sw_thermal_slowdown", "hw_slowdown"})
POWER_REASONS = frozenset({"sw_power_cap", "hw_power_brake_slowdown"})





def _obs(runs: Mapping[str, ProbeRun], name: str) -> Mapping[str, Any] | None:
    run = runs.get(name)
    return run.observation if run is not None and run.ok else None


def checked_run(run: ProbeRun) -> ProbeRun:
    """The run, or a probe_error run when its observation has a shape gpudiag cannot read."""
    if run.observation is None:
        return run
    why = observation_problem(run.backend, run.observation)
    if why is None:
        return run
    return replace(run, observation=None,
                   error=f"probe {run.backend} returned a malformed observation: {why}")


def _probe_layer(runs: Mapping[str, ProbeRun], f: Findings) -> None:
    for name, run in runs.items():
        if run.timed_out:
            f.block("probe_timeout", run.error or f"probe {name} timed out", backend=name)
        elif run.signal is not None:
            f.block("probe_crashed", run.error or f"probe {name} crashed", backend=name)
        elif run.error is not None:
            f.block("probe_error", run.error, backend=name)


def _dev_label(dev: Mapping[str, Any]) -> str:
    return str(dev.get("uuid") or f"index {dev.get('index')}")


def _nvml_devices(nvml: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    if nvml is None or not nvml.get("ok"):
        return []
    return list(nvml.get("devices") or [])


def _known(devs: Sequence[Mapping[str, Any]]) -> list[KnownDevice]:
    out = []
    for d in devs:
        migs = tuple(str(i["uuid"]) for i in ((d.get("mig") or {}).get("instances") or [])
                     if i.get("uuid"))
        out.append(KnownDevice(int(d["index"]), str(d.get("uuid") or ""), migs))
    return out


def _visibility(host: Mapping[str, Any] | None, env_raw: tuple[str | None, str | None],
                devs: Sequence[Mapping[str, Any]], nvml_ok: bool, f: Findings
                ) -> list[Mapping[str, Any]]:
    """Visibility blockers; returns the NVML devices the job would see (its candidates)."""
    cvd = parse_cuda_visible_devices(env_raw[0])
    nvd = parse_nvidia_visible_devices(env_raw[1])
    for vis in (cvd, nvd):
        if vis.mode == "empty":
            f.block("visible_devices_empty", vis.reason or f"{vis.variable} hides every GPU")
    if cvd.mode == "empty" or nvd.mode == "empty":
        return []
    candidates = list(devs)
    unknown_uuid = [d for d in devs if not d.get("uuid")]
    for vis in (nvd, cvd):  # the container's view first, then CUDA's within it
        if vis.mode != "list" or not nvml_ok:
            continue
        invalid = [e.raw for e in vis.entries if e.kind in ("invalid", "mig_legacy")]
        res = resolve(vis, _known(candidates))
        unresolved = [u for u in res.unresolved if u not in invalid]
        # A UUID that no readable device carries may belong to a device whose UUID could
        # not be read (lost GPU): then the device fault is the cause, not the variable.
        if unknown_uuid and all(_entry_kind(vis, u) != "index" for u in unresolved):
            unresolved = []
        bad = invalid + unresolved
        if bad:
            names = ", ".join(repr(b) for b in bad)
            amb = f" (ambiguous prefix: {', '.join(res.ambiguous)})" if res.ambiguous else ""
            f.block("visible_devices_invalid",
                    f"{vis.variable}={vis.raw!r} names {names}, which matches none of the "
                    f"{len(devs)} GPU(s) NVML reports{amb}; the CUDA driver stops reading "
                    "the list at the first bad entry")
        by_index = {int(d["index"]): d for d in candidates}
        chosen = [by_index[i] for i in res.indices if i in by_index]
        candidates = chosen + [d for d in unknown_uuid if d not in chosen]
    return candidates


def _entry_kind(vis: Visibility, raw: str) -> str:
    found: VisibleEntry | None = next((e for e in vis.entries if e.raw == raw), None)
    return found.kind if found else "invalid"


def _device_nodes(host: Mapping[str, Any] | None, inits_failed: bool, f: Findings) -> bool:
    """Device-node findings; returns whether the nodes are present."""
    if host is None:
        return True
    nodes = host.get("device_nodes") or {}
    present = bool(nodes.get("control_present")) and int(nodes.get("gpu_nodes") or 0) > 0
    driver_loaded = bool((host.get("driver_proc") or {}).get("present"))
    where = nodes.get("dir", "/dev")
    if not present:
        missing = [] if nodes.get("control_present") else [f"{where}/nvidiactl"]
        if not int(nodes.get("gpu_nodes") or 0):
            missing.append(f"{where}/nvidia[0-9]*")
        text = f"missing device nodes: {', '.join(missing)}"
        if inits_failed and driver_loaded:
            f.block("device_nodes_missing",
                    f"{text} while the kernel driver is loaded "
                    f"({(host.get('driver_proc') or {}).get('path')} exists): this is why "
                    "NVML/CUDA cannot initialize")
        elif not inits_failed:
            f.warn("device_nodes_missing", f"{text}, but NVML and CUDA initialized")
    denied = nodes.get("permission_denied") or []
    if denied and inits_failed:
        f.block("device_nodes_no_access",
                f"cannot open {', '.join(denied)} (permission denied): NVML/CUDA cannot "
                "reach the GPUs as this user")
    return present


def _nvml_findings(nvml: Mapping[str, Any] | None, host: Mapping[str, Any] | None,
                   f: Findings) -> None:
    if nvml is None or nvml.get("ok"):
        return
    err = nvml.get("error") or {}
    code = err.get("code")
    if err.get("name") == "IMPORT_ERROR":
        f.block("nvml_error", str(err.get("message")), backend="nvml")
        return
    blocker = NVML_INIT_CODES.get(int(code)) if isinstance(code, int) else None
    message = f"nvmlInit failed: {err.get('name')} ({code}): {err.get('message')}"
    if blocker == "driver_library_missing":
        smi = (host or {}).get("nvidia_smi") or {}
        smi_text = ("nvidia-smi is missing" if smi.get("missing")
                    else f"nvidia-smi exited {smi.get('exit_code')}")
        message = (f"libnvidia-ml.so.1 could not be loaded: "
                   f"{nvml.get('library_error') or err.get('message')}; {smi_text}")
    f.block(blocker or "nvml_error", message, backend="nvml")


def _device_findings(devs: Sequence[Mapping[str, Any]], xids: Sequence[XidEvent],
                     f: Findings) -> None:
    for d in devs:
        label = _dev_label(d)
        if not d.get("ok"):
            err = d.get("error") or {}
            code = err.get("code")
            blocker = NVML_DEVICE_CODES.get(int(code)) if isinstance(code, int) else None
            f.block(blocker or "nvml_error",
                    f"GPU {d.get('index')}: {err.get('name')} ({code}): {err.get('message')}",
                    backend="nvml", device=label)
            continue
        action = d.get("recovery_action")
        if action not in (None, "none"):
            f.block("gpu_reset_required", f"GPU {d['index']}: NVML recovery action {action}",
                    backend="nvml", device=label)
        ecc = d.get("ecc") or {}
        if (ecc.get("volatile_uncorrected") or 0) > 0:
            f.block("gpu_ecc_uncorrectable",
                    f"GPU {d['index']}: {ecc['volatile_uncorrected']} volatile uncorrectable "
                    "ECC error(s)", backend="nvml", device=label)
        rows = d.get("remapped_rows") or {}
        if rows.get("failure") or rows.get("pending"):
            state = "failed" if rows.get("failure") else "pending (a reset applies it)"
            f.block("gpu_ecc_uncorrectable",
                    f"GPU {d['index']}: row remapping {state}; "
                    f"{rows.get('uncorrectable', 0)} uncorrectable remapped row(s)",
                    backend="nvml", device=label)
        if (ecc.get("volatile_corrected") or 0) > 0:
            f.warn("gpu_ecc_correctable",
                   f"GPU {d['index']}: {ecc['volatile_corrected']} correctable ECC error(s)",
                   backend="nvml", device=label)
        reasons = set((d.get("clocks_event_reasons") or {}).get("reasons") or [])
        if reasons & THERMAL_REASONS:
            f.warn("gpu_thermal_throttling",
                   f"GPU {d['index']}: {', '.join(sorted(reasons & THERMAL_REASONS))}",
                   backend="nvml", device=label)
        if reasons & POWER_REASONS:
            f.warn("gpu_power_throttling",
                   f"GPU {d['index']}: {', '.join(sorted(reasons & POWER_REASONS))}",
                   backend="nvml", device=label)
        if d.get("persistence_mode") is False:
            f.warn("gpu_persistence_off", f"GPU {d['index']}: persistence mode is off",
                   backend="nvml", device=label)
    by_uuid = {d.get("uuid"): d for d in devs}
    by_index = {d.get("index"): d for d in devs}
    for x in xids:
        found = by_uuid.get(x.uuid) if x.uuid else by_index.get(x.device_index)
        if found is None:
            continue
        d = found
        label = _dev_label(d)
        if x.xid in LOST_XIDS:
            f.block("gpu_lost", f"GPU {d.get('index')}: XID {x.xid} (fallen off the bus)",
                    backend="nvml", device=label)
        elif x.xid in CRITICAL_XIDS:
            f.block("gpu_reset_required", f"GPU {d.get('index')}: critical XID {x.xid}",
                    backend="nvml", device=label)
        elif x.xid in APPLICATION_XIDS:
            f.warn("gpu_xid_application", f"GPU {d.get('index')}: application XID {x.xid}",
                   backend="nvml", device=label)


def _cuda_findings(cuda: Mapping[str, Any] | None, candidate_uuids: set[str] | None,
                   f: Findings) -> None:
    if cuda is None:
        return
    lib = cuda.get("library") or {}
    if not lib.get("loaded"):
        f.block("cuda_library_missing", f"libcuda.so.1 could not be loaded: {lib.get('error')}",
                backend="cuda")
        return
    init = cuda.get("init") or {}
    if not init.get("ok"):
        code = init.get("code")
        blocker = CUDA_INIT_CODES.get(int(code)) if isinstance(code, int) else None
        f.block(blocker or "cuda_init_failed", str(init.get("message")), backend="cuda")
        return
    for d in cuda.get("devices") or []:
        uuid = d.get("uuid")
        if candidate_uuids is not None and uuid and uuid not in candidate_uuids:
            continue
        label = str(uuid or f"cuda ordinal {d.get('ordinal')}")
        if d.get("error"):
            f.block("cuda_init_failed", str(d["error"].get("message")), backend="cuda",
                    device=label)
            continue
        for step in ("context", "alloc"):
            rec = d.get(step)
            if rec and not rec.get("ok"):
                code = rec.get("code")
                blocker = CUDA_CONTEXT_CODES.get(int(code)) if isinstance(code, int) else None
                f.block(blocker or "cuda_context_failed", str(rec.get("message")),
                        backend="cuda", device=label)


def _select(candidates: Sequence[Mapping[str, Any]], requirement: Requirement,
            f: Findings) -> list[Mapping[str, Any]]:
    """The devices the requirement selects (indices are positions among the visible ones)."""
    if requirement.devices is None:
        return list(candidates)
    chosen: list[Mapping[str, Any]] = []
    for sel in requirement.devices:
        if sel.isdigit():
            pos = int(sel)
            match = [candidates[pos]] if pos < len(candidates) else []
        else:
            match = [d for d in candidates if str(d.get("uuid", "")).lower() == sel.lower()
                     or any(str(i.get("uuid", "")).lower() == sel.lower()
                            for i in ((d.get("mig") or {}).get("instances") or []))]
        if not match:
            f.block("insufficient_devices",
                    f"requested device {sel} is not among the {len(candidates)} visible GPU(s)",
                    device=sel)
        chosen.extend(m for m in match if m not in chosen)
    return chosen


def _device_info(d: Mapping[str, Any]) -> DeviceInfo:
    mem = d.get("memory") or {}
    return DeviceInfo(index=int(d["index"]), uuid=d.get("uuid"), name=d.get("name"),
                      pci_bus_id=d.get("pci_bus_id"),
                      memory_total_bytes=mem.get("total_bytes"),
                      memory_free_bytes=mem.get("free_bytes"))


def _requirement_findings(selected: Sequence[Mapping[str, Any]], requirement: Requirement,
                          f: Findings) -> None:
    blocked = {b.device for b in f.blockers if b.device}
    healthy = [d for d in selected if d.get("ok") and _dev_label(d) not in blocked]
    need = requirement.effective_min_devices
    if len(healthy) < need:
        f.block("insufficient_devices",
                f"{len(healthy)} usable GPU(s) of {len(selected)} selected; "
                f"the requirement asks for {need}")
        return
    floor = requirement.min_free_memory_bytes
    if floor is None:
        return
    fitting = [d for d in healthy if ((d.get("memory") or {}).get("free_bytes") or 0) >= floor]
    short = [d for d in healthy if d not in fitting]
    if (requirement.devices is not None and short) or len(fitting) < need:
        for d in short:
            free = (d.get("memory") or {}).get("free_bytes")
            f.block("insufficient_free_memory",
                    f"GPU {d['index']} has {free} bytes free; the requirement asks for {floor}",
                    device=_dev_label(d))


def _status(run: ProbeRun | None, f: Findings, name: str,
            versions: Mapping[str, Any] | None = None, detail: Mapping[str, Any] | None = None
            ) -> BackendStatus:
    if run is None:
        return BackendStatus("skipped", None)
    blocked = any(b.backend == name for b in f.blockers)
    return BackendStatus("blocked" if blocked else "ok", round(run.duration_s, 4),
                         dict(versions or {}), dict(detail or {}))


def _evidence(runs: Mapping[str, ProbeRun], host: Mapping[str, Any] | None,
              nvml: Mapping[str, Any] | None, cuda: Mapping[str, Any] | None
              ) -> dict[str, Any]:
    ev: dict[str, Any] = {}
    if host is not None:
        ev["nvidia_smi"] = host.get("nvidia_smi")
        ev["nvidia_smi_xml"] = host.get("nvidia_smi_xml")
        ev["environment"] = host.get("environment")
        ev["device_nodes"] = host.get("device_nodes")
        ev["driver_proc"] = host.get("driver_proc")
    ev["driver"] = {
        "version": (nvml or {}).get("driver_version"),
        "cuda_driver_version": (nvml or {}).get("cuda_driver_version")
        or (cuda or {}).get("driver_version"),
        "kernel_module_version": ((host or {}).get("driver_proc") or {}).get(
            "kernel_module_version"),
    }
    ev["probe_stderr"] = {n: r.stderr_tail for n, r in runs.items() if r.stderr_tail}
    if not ev.get("environment"):
        # Without a host probe (jax:cpu, iree:local-task) a backend child read it instead.
        for name in ("jax", "iree"):
            run = runs.get(name)
            obs = run.observation if run is not None else None
            if obs and obs.get("environment") is not None:
                ev["environment"] = obs["environment"]
                break
    return ev


def classify(runs: Mapping[str, ProbeRun], requirement: Requirement, *, host: str,
             checked_at: str, source: str = "inline", xids: Sequence[XidEvent] = (),
             extra_warnings: Sequence[Finding] = ()) -> Verdict:
    """The verdict for ``requirement`` from what the probe children observed."""
    f = Findings()
    f.warnings.extend(extra_warnings)
    runs = {name: checked_run(run) for name, run in runs.items()}
    _probe_layer(runs, f)
    host_obs, nvml, cuda = _obs(runs, "host"), _obs(runs, "nvml"), _obs(runs, "cuda")
    devices: list[DeviceInfo] = []
    nvml_ok = bool(nvml and nvml.get("ok"))
    cuda_ok = bool(cuda and (cuda.get("init") or {}).get("ok"))
    nodes_present = True
    if requirement.needs_gpu:
        env = ((host_obs or {}).get("environment")
               or (nvml or {}).get("visibility_env") or {})
        raw = (env.get("CUDA_VISIBLE_DEVICES"), env.get("NVIDIA_VISIBLE_DEVICES"))
        inits_failed = ("nvml" in runs and not nvml_ok) or ("cuda" in runs and not cuda_ok)
        nodes_present = _device_nodes(host_obs, inits_failed, f)
        _nvml_findings(nvml, host_obs, f)
        all_devs = _nvml_devices(nvml)
        candidates = _visibility(host_obs, raw, all_devs, nvml_ok, f)
        selected = _select(candidates, requirement, f)
        _device_findings(selected, xids, f)
        uuids = {str(d["uuid"]) for d in selected if d.get("uuid")} if nvml_ok else None
        _cuda_findings(cuda, uuids, f)
        if nvml_ok and cuda_ok and cuda is not None and requirement.devices is None:
            n_cuda = int(cuda.get("device_count") or 0)
            if n_cuda != len(candidates):
                f.warn("device_count_mismatch",
                       f"NVML shows {len(candidates)} visible GPU(s), cuInit {n_cuda}",
                       backend="cuda")
        _requirement_findings(selected, requirement, f)
        devices = [_device_info(d) for d in selected]
    gpu = GpuContext(nvml_ok=nvml_ok, cuda_ok=cuda_ok, device_nodes_present=nodes_present,
                     gpu_blocked=bool(f.blockers),
                     cuda_driver_version=_driver_cuda_version(nvml, cuda))
    backends: dict[str, BackendStatus] = {}
    for req in requirement.backends:
        run = runs.get(req.name)
        classifier = BACKEND_CLASSIFIERS.get(req.name)
        if run is not None and classifier is not None and req.name not in backends:
            backends[req.name] = classifier(run, req, gpu, f)
    if "host" in runs:
        backends["host"] = _status(runs["host"], f, "host", {}, _host_detail(host_obs))
    if "nvml" in runs:
        backends["nvml"] = _status(runs["nvml"], f, "nvml", {
            "driver": (nvml or {}).get("driver_version"),
            "cuda_driver": _str((nvml or {}).get("cuda_driver_version")),
            "nvml": (nvml or {}).get("nvml_version")},
            {"device_count": (nvml or {}).get("device_count"),
             "error": (nvml or {}).get("error")})
    if "cuda" in runs:
        backends["cuda"] = _status(runs["cuda"], f, "cuda",
                                   {"cuda_driver": _str((cuda or {}).get("driver_version"))},
                                   {"device_count": (cuda or {}).get("device_count"),
                                    "init": (cuda or {}).get("init"),
                                    "init_duration_s": (cuda or {}).get("init_duration_s")})
    prealloc_source = _obs(runs, "jax") or host_obs or {}
    return Verdict(
        requirement=requirement,
        blockers=tuple(f.blockers),
        warnings=tuple(f.warnings),
        devices=tuple(devices),
        backends=backends,
        evidence=_evidence(runs, host_obs, nvml, cuda),
        preallocation_disabled=bool(prealloc_source.get("preallocation_disabled")),
        host=host,
        checked_at=checked_at,
        source=source,
    )


def _host_detail(host: Mapping[str, Any] | None) -> dict[str, Any]:
    """The host facts a person looks for first: nvidia-smi, device nodes, kernel module."""
    if host is None:
        return {}
    smi = host.get("nvidia_smi") or {}
    smi_state = ("missing" if smi.get("missing") else "timed out" if smi.get("timed_out")
                 else f"exit {smi.get('exit_code')}")
    nodes = host.get("device_nodes") or {}
    return {"nvidia_smi": smi_state, "device_nodes": len(nodes.get("nodes") or []),
            "kernel_module": (host.get("driver_proc") or {}).get("kernel_module_version")}


def _driver_cuda_version(nvml: Mapping[str, Any] | None, cuda: Mapping[str, Any] | None
                        ) -> int | None:
    """The driver's CUDA version (cuDriverGetVersion), from NVML or else the cuda probe."""
    for value in ((nvml or {}).get("cuda_driver_version"), (cuda or {}).get("driver_version")):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _str(value: Any) -> str | None:
    return None if value is None else str(value)


# name -> classifier(run, requirement, gpu_context, findings) -> BackendStatus
BackendClassifier = Callable[[ProbeRun, BackendRequirement, GpuContext, Findings],
                             BackendStatus]
BACKEND_CLASSIFIERS: dict[str, BackendClassifier] = {"jax": classify_jax, "iree": classify_iree}
