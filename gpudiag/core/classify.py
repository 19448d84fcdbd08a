"""Pure classification: probe observations + requirement -> Verdict. No I/O here.

The primary ``gpu_validation_blocker`` is the root cause (the lowest layer); everything the
root cause brings with it stays listed under ``blockers`` as consequences.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from gpudiag.core import registry
from gpudiag.core.environment import (
    FULL_UUID,
    KnownDevice,
    Resolution,
    Visibility,
    VisibleEntry,
    entry_of,
    job_view,
    match_entry,
)
from gpudiag.core.findings import Findings, GpuContext, XidEvent
from gpudiag.core.gpu_config import drift, drift_text
from gpudiag.core.gpu_processes import device_processes
from gpudiag.core.gpunames import NamedGpu, matches, no_gpu_named
from gpudiag.core.identity import GpuIdentity
from gpudiag.core.missing import missing_gpu_findings, pci_address, sysfs_bus_ids
from gpudiag.core.nic import NicObservation, gpus_nic_trouble
from gpudiag.core.nvml_health import (
    NvmlHealthPolicy,
    NvmlHistory,
    device_health,
    held_memory_blocks,
)
from gpudiag.core.observations import (
    CommandResult,
    CudaObservation,
    CudaStep,
    ErrorInfo,
    HostObservation,
    Memory,
    NvmlDevice,
    NvmlObservation,
)
from gpudiag.core.probe_run import ProbeRun
from gpudiag.core.readiness import ProbeScope, require_proof, settle, with_proof_gpu
from gpudiag.core.records import dataclass
from gpudiag.core.verdict import (
    UNPROVEN,
    BackendStatus,
    DeviceInfo,
    Finding,
    Requirement,
    Verdict,
)
from gpudiag.core.visibility import VISIBILITY_VARIABLES
from gpudiag.core.xids import XidRules, judge_xids, xid_description

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



def _probe_layer(runs: Mapping[str, ProbeRun], f: Findings) -> None:
    for name, run in runs.items():
        if run.timed_out:
            f.block("probe_timeout", run.error or f"probe {name} timed out", backend=name)
        elif run.signal is not None:
            f.block("probe_crashed", run.error or f"probe {name} crashed", backend=name)
        elif run.error is not None:
            f.block("probe_error", run.error, backend=name)


def _ok(run: ProbeRun | None) -> ProbeRun | None:
    return run if run is not None and run.ok else None


def _known(devs: Sequence[NvmlDevice]) -> list[KnownDevice]:
    return [KnownDevice(d.index, d.uuid or "", d.mig_uuids) for d in devs]


def _visibility(env_raw: tuple[str | None, str | None], devs: Sequence[NvmlDevice],
                nvml_ok: bool, f: Findings) -> list[NvmlDevice]:
    """Visibility blockers; returns the NVML devices the job would see (its candidates)."""
    view = job_view(dict(zip(VISIBILITY_VARIABLES, env_raw, strict=True)), _known(devs))
    for vis in view.empties:
        f.block("visible_devices_empty", vis.reason or f"{vis.variable} hides every GPU")
    if view.empties:
        return []
    if not nvml_ok:
        return list(devs)
    unknown_uuid = [d for d in devs if not d.uuid]
    for vis in (view.nvidia, view.cuda):  # the container's view first, then CUDA's within it
        if vis.mode == "list":
            _misnamed(vis, view.resolution(vis), len(devs), bool(unknown_uuid), f)
    by_index = {d.index: d for d in devs}
    chosen = [by_index[i] for i in view.indices if i in by_index]
    return chosen + [d for d in unknown_uuid if d not in chosen]


def _misnamed(vis: Visibility, res: Resolution, n_devices: int, uuids_unknown: bool,
              f: Findings) -> None:
    """visible_devices_invalid for the entries of ``vis`` that name no device it can see."""
    invalid = [e.raw for e in vis.entries if e.kind in ("invalid", "mig_legacy")]
    unresolved = [u for u in res.unresolved if u not in invalid]
    # A UUID that no readable device carries may belong to a device whose UUID could
    # not be read (lost GPU): then the device fault is the cause, not the variable.
    if uuids_unknown and all(_entry_kind(vis, u) != "index" for u in unresolved):
        unresolved = []
    bad = invalid + unresolved
    if bad:
        names = ", ".join(repr(b) for b in bad)
        amb = f" (ambiguous prefix: {', '.join(res.ambiguous)})" if res.ambiguous else ""
        f.block("visible_devices_invalid",
                f"{vis.variable}={vis.raw!r} names {names}, which matches none of the "
                f"{n_devices} GPU(s) NVML reports{amb}; the CUDA driver stops reading "
                "the list at the first bad entry")


def _entry_kind(vis: Visibility, raw: str) -> str:
    found: VisibleEntry | None = next((e for e in vis.entries if e.raw == raw), None)
    return found.kind if found else "invalid"


def _device_nodes(host: HostObservation | None, inits_failed: bool, f: Findings) -> None:
    """Device-node findings: missing nodes, and nodes this user cannot open."""
    if host is None:
        return
    nodes = host.device_nodes
    present = nodes.control_present and nodes.gpu_nodes > 0
    where = nodes.dir or "/dev"
    if not present:
        missing = [] if nodes.control_present else [f"{where}/nvidiactl"]
        if not nodes.gpu_nodes:
            missing.append(f"{where}/nvidia[0-9]*")
        text = f"missing device nodes: {', '.join(missing)}"
        if inits_failed and host.driver_present:
            f.block("device_nodes_missing",
                    f"{text} while the kernel driver is loaded "
                    f"({host.driver_path} exists): this is why "
                    "NVML/CUDA cannot initialize")
        elif not inits_failed:
            f.warn("device_nodes_missing", f"{text}, but NVML and CUDA initialized")
    denied = nodes.permission_denied
    if denied and inits_failed:
        f.block("device_nodes_no_access",
                f"cannot open {', '.join(denied)} (permission denied): NVML/CUDA cannot "
                "reach the GPUs as this user")


def _error_text(err: ErrorInfo | None) -> tuple[int | str | None, str | None, str | None]:
    return (err.code, err.name, err.message) if err is not None else (None, None, None)


def _nvml_findings(nvml: NvmlObservation | None, host: HostObservation | None,
                   f: Findings) -> None:
    if nvml is None or nvml.ok:
        return
    code, name, text = _error_text(nvml.error)
    if name == "IMPORT_ERROR":
        f.block("nvml_error", str(text), backend="nvml")
        return
    blocker = NVML_INIT_CODES.get(code) if isinstance(code, int) else None
    message = f"nvmlInit failed: {name} ({code}): {text}"
    if blocker == "driver_library_missing":
        smi = host.nvidia_smi if host is not None else CommandResult()
        smi_text = ("nvidia-smi is missing" if smi.missing
                    else f"nvidia-smi exited {smi.exit_code}")
        message = (f"libnvidia-ml.so.1 could not be loaded: "
                   f"{nvml.library_error or text}; {smi_text}")
    f.block(blocker or "nvml_error", message, backend="nvml")


def _device_findings(devs: Sequence[NvmlDevice], xids: Sequence[XidEvent],
                     f: Findings, history: NvmlHistory | None = None,
                     policy: NvmlHealthPolicy | None = None,
                     peers: Sequence[NvmlDevice] = (),
                     xid_rules: XidRules | None = None) -> None:
    for d in devs:
        label = d.label
        if not d.ok:
            code, name, text = _error_text(d.error)
            blocker = NVML_DEVICE_CODES.get(code) if isinstance(code, int) else None
            f.block(blocker or "nvml_error", f"GPU {d.index}: {name} ({code}): {text}",
                    backend="nvml", device=label)
            continue
        device_health(d, f, history=history, policy=policy, peers=peers)
        if d.persistence_mode is False:
            f.warn("gpu_persistence_off", f"GPU {d.index}: persistence mode is off",
                   backend="nvml", device=label)
    # Against the whole node's GPUs, not just those selected: one odd GPU is odd for every job.
    drifted = drift(peers or devs)
    for d in devs:
        if d.ok and d.label in drifted:
            f.warn("gpu_config_drift", drift_text(d, drifted[d.label]), backend="nvml",
                   device=d.label)
    by_uuid = {d.uuid: d for d in devs}
    by_index: dict[int | None, NvmlDevice] = {d.index: d for d in devs}
    for j in judge_xids(xids, xid_rules):
        x = j.event
        found = by_uuid.get(x.uuid) if x.uuid else by_index.get(x.device_index)
        if found is None:
            continue
        d = found
        label = d.label
        code, what = j.code, f"({xid_description(x.xid)})"
        if j.promoted is not None:
            f.block(code, f"GPU {d.index}: critical XID {x.xid} {what} seen {j.occurrences} "
                    f"times within {j.promoted.window_s:g} s: promoted from a warning at "
                    f"{j.promoted.count}", backend="nvml", device=label)
        elif code == "gpu_lost":
            f.block("gpu_lost", f"GPU {d.index}: XID {x.xid} (fallen off the bus)",
                    backend="nvml", device=label)
        elif code in ("gpu_reset_required", "node_reboot_required"):
            f.block(code, f"GPU {d.index}: critical XID {x.xid} {what}",
                    backend="nvml", device=label)
        elif code == "gpu_xid_application":
            f.warn(code, f"GPU {d.index}: application XID {x.xid} {what}",
                   backend="nvml", device=label)


def _cuda_findings(cuda: CudaObservation | None, candidate_uuids: set[str] | None,
                   f: Findings) -> None:
    if cuda is None:
        return
    if not cuda.library_loaded:
        f.block("cuda_library_missing", f"libcuda.so.1 could not be loaded: {cuda.library_error}",
                backend="cuda")
        return
    init = cuda.init or CudaStep(ok=None)
    if not init.ok:
        code = init.code
        blocker = CUDA_INIT_CODES.get(code) if isinstance(code, int) else None
        f.block(blocker or "cuda_init_failed", str(init.message), backend="cuda")
        return
    for d in cuda.devices:
        uuid = d.uuid
        if candidate_uuids is not None and uuid and uuid not in candidate_uuids:
            continue
        label = str(uuid or f"cuda ordinal {d.ordinal}")
        if d.error is not None:
            f.block("cuda_init_failed", str(d.error.message), backend="cuda", device=label)
            continue
        for rec in (d.context, d.alloc):
            if rec is not None and not rec.ok:
                code = rec.code
                blocker = CUDA_CONTEXT_CODES.get(code) if isinstance(code, int) else None
                f.block(blocker or "cuda_context_failed", str(rec.message),
                        backend="cuda", device=label)


def _select(candidates: Sequence[NvmlDevice], requirement: Requirement,
            f: Findings) -> list[NvmlDevice]:
    """The devices the requirement selects (indices are positions among the visible ones)."""
    if requirement.devices is None:
        return list(candidates)
    # --devices names GPUs by position among the visible ones or by full GPU/MIG UUID: the
    # resolver's full-UUID rule over the candidates, numbered by position.
    positions = [KnownDevice(pos, d.uuid or "", d.mig_uuids)
                 for pos, d in enumerate(candidates)]
    chosen: list[NvmlDevice] = []
    named = [NamedGpu(pos, d.uuid or "", d.pci_bus_id) for pos, d in enumerate(candidates)]
    for sel in requirement.devices:
        match = [candidates[p.index] for p in
                 match_entry(entry_of(sel), positions, FULL_UUID)]
        if not match:
            # One way to name a GPU everywhere (core.gpunames): a unique UUID prefix (as the
            # table shows it) or a PCI bus id select it too; the verdict names its full UUID.
            kind, found = matches(sel, named)
            if len(found) == 1 and kind in ("UUID prefix", "PCI bus id"):
                match = [candidates[found[0].index]]
            elif len(found) > 1:
                f.block("insufficient_devices", f"{kind} {sel!r} names {len(found)} GPUs "
                        f"({', '.join(g.uuid for g in found)}): give more of the UUID",
                        device=sel)
            else:
                f.block("insufficient_devices", no_gpu_named(sel, named), device=sel)
        chosen.extend(m for m in match if m not in chosen)
    return chosen


def _remembered(devs: Sequence[NvmlDevice], last_seen: Mapping[int, GpuIdentity] | None
                ) -> tuple[list[NvmlDevice], set[int]]:
    """GPUs whose UUID cannot be read now (lost) named by the UUID their index last had, so
    that their blockers name it; never a UUID another GPU carries now. Returns the indices
    so named."""
    carried = {d.uuid for d in devs if d.uuid}
    named: set[int] = set()
    out: list[NvmlDevice] = []
    for d in devs:
        last = (last_seen or {}).get(d.index)
        if not d.uuid and last is not None and last.uuid and last.uuid not in carried:
            d = replace(d, uuid=last.uuid, pci_bus_id=d.pci_bus_id or last.pci_bus_id or None)
            named.add(d.index)
        out.append(d)
    return out, named


def _device_info(d: NvmlDevice, sysfs_bus_id: str | None = None,
                 remembered: bool = False) -> DeviceInfo:
    mem = d.memory or Memory()
    procs = list(d.processes or ())
    for inst in d.mig.instances if d.mig else ():
        procs.extend(inst.processes or ())
    pids = (tuple(sorted({p.pid for p in procs if p.pid is not None}))
            if d.processes is not None or procs else None)
    util, temp = d.readings.utilization_gpu_ratio, d.readings.temperature_c
    return _smi_columns(d, DeviceInfo(index=d.index, uuid=d.uuid, name=d.name, serial=d.serial,
                      pci_bus_id=(sysfs_bus_id or d.pci_bus_id) if remembered
                      else d.pci_bus_id or sysfs_bus_id,
                      uuid_source=("last_seen" if remembered else "nvml" if d.uuid else None),
                      memory_total_bytes=mem.total_bytes, memory_free_bytes=mem.free_bytes,
                      memory_used_bytes=mem.used_bytes,
                      utilization_ratio=None if util is None else float(util),
                      temperature_c=None if temp is None else float(temp), pids=pids,
                      processes=None if pids is None else device_processes(procs)))


def _smi_columns(d: NvmlDevice, info: DeviceInfo) -> DeviceInfo:
    """What nvidia-smi shows beside memory and utilization, for the table's --wide columns."""
    ecc = d.ecc
    power, limit = d.readings.power_w, d.power_limit_w

    def count(value: object) -> int | None:
        return int(value) if isinstance(value, (int, float)) and not isinstance(
            value, bool) else None

    return replace(
        info, power_w=None if power is None else float(power),
        power_limit_w=None if limit is None else float(limit),
        sm_clock_mhz=d.sm_clock_mhz, memory_clock_mhz=d.memory_clock_mhz, pstate=d.pstate,
        fan_ratio=None if d.fan_ratio is None else float(d.fan_ratio),
        ecc_volatile_corrected=count(ecc.volatile_corrected) if ecc else None,
        ecc_volatile_uncorrected=count(ecc.volatile_uncorrected) if ecc else None)


def _free(d: NvmlDevice) -> int | None:
    return d.memory.free_bytes if d.memory is not None else None


def _requirement_findings(selected: Sequence[NvmlDevice], requirement: Requirement,
                          f: Findings) -> None:
    blocked = {b.device for b in f.blockers if b.device}
    healthy = [d for d in selected if d.ok and d.label not in blocked]
    need = requirement.effective_min_devices
    named_nothing = any(b.code == "insufficient_devices" for b in f.blockers)
    if len(healthy) < need and not named_nothing:  # a name that matched nothing said it
        f.block("insufficient_devices",
                f"{len(healthy)} usable GPU(s) of {len(selected)} selected; "
                f"the requirement asks for {need}")
        return
    floor = requirement.min_free_memory_bytes
    if floor is None:
        return
    fitting = [d for d in healthy if (_free(d) or 0) >= floor]
    short = [d for d in healthy if d not in fitting]
    if (requirement.devices is not None and short) or len(fitting) < need:
        for d in short:
            f.block("insufficient_free_memory",
                    f"GPU {d.index} has {_free(d)} bytes free; the requirement asks for {floor}",
                    device=d.label)


def _status(run: ProbeRun | None, f: Findings, name: str,
            versions: Mapping[str, Any] | None = None, detail: Mapping[str, Any] | None = None
            ) -> BackendStatus:
    if run is None:
        return BackendStatus(UNPROVEN, None)
    blocked = any(b.backend == name for b in f.blockers)
    return BackendStatus("blocked" if blocked else "ok", round(run.duration_s, 4),
                         dict(versions or {}), dict(detail or {}))


def _evidence(runs: Mapping[str, ProbeRun], host: HostObservation | None,
              nvml: NvmlObservation | None, cuda: CudaObservation | None,
              visibility: tuple[str | None, str | None] | None) -> dict[str, Any]:
    ev: dict[str, Any] = {}
    if host is not None:
        for key in ("nvidia_smi", "nvidia_smi_xml", "environment", "device_nodes",
                    "driver_proc"):
            ev[key] = host.evidence.get(key)
        if visibility is not None:
            ev["environment"] = _with_visibility(host.evidence.get("environment"), visibility)
    ev["driver"] = {
        "version": nvml.driver_version if nvml else None,
        "cuda_driver_version": (nvml.cuda_driver_version if nvml else None)
        or (cuda.driver_version if cuda else None),
        "kernel_module_version": host.kernel_module_version if host else None,
    }
    ev["probe_stderr"] = {n: r.stderr_tail for n, r in runs.items() if r.stderr_tail}
    if not ev.get("environment"):
        # Without a host probe (jax:cpu, iree:local-task) a backend child read it instead.
        for spec in registry.specs():
            run = runs.get(spec.name) if spec.classify is not None else None
            env = getattr(run.parsed, "environment", None) if run is not None else None
            if isinstance(env, Mapping):
                ev["environment"] = dict(env)
                break
    return ev


def _with_visibility(environment: Any, visibility: tuple[str | None, str | None]
                     ) -> dict[str, Any]:
    """The evidence environment as the job's visibility variables would have made it."""
    env = dict(environment) if isinstance(environment, Mapping) else {}
    for name, value in zip(VISIBILITY_VARIABLES, visibility, strict=True):
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env



@dataclass(frozen=True)
class _Layer:
    """The device layer's runs that came back whole, and their typed observations."""

    host_run: ProbeRun | None
    nvml_run: ProbeRun | None
    cuda_run: ProbeRun | None

    @property
    def host(self) -> HostObservation | None:
        """The host probe's observation, if it came back."""
        return self.host_run.host if self.host_run else None

    @property
    def nvml(self) -> NvmlObservation | None:
        """The NVML probe's observation, if it came back."""
        return self.nvml_run.nvml if self.nvml_run else None

    @property
    def cuda(self) -> CudaObservation | None:
        """The CUDA probe's observation, if it came back."""
        return self.cuda_run.cuda if self.cuda_run else None

    @property
    def nvml_ok(self) -> bool:
        """NVML initialized."""
        return bool(self.nvml and self.nvml.ok)

    @property
    def cuda_ok(self) -> bool:
        """cuInit succeeded."""
        return bool(self.cuda and self.cuda.init_ok)


@dataclass(frozen=True)
class NodeFacts:
    """What a verdict weighs besides this round's probe runs: what the node's daemon knows
    (held XIDs, its warnings, qualification findings, NVML's history, each index's last
    identity) and the site's expectations. An inline run knows only ``expected_gpus``."""

    xids: Sequence[XidEvent] = ()
    extra_warnings: Sequence[Finding] = ()
    # They name GPUs (by label) and come from outside the probe round (the daemon's
    # qualification); only those of GPUs the requirement selects count.
    device_blockers: Sequence[Finding] = ()
    device_warnings: Sequence[Finding] = ()
    expected_gpus: int | None = None
    # Feed the NVML health rules (core.nvml_health).
    nvml_history: NvmlHistory | None = None
    nvml_policy: NvmlHealthPolicy | None = None
    # Each GPU index's last identity (the daemon's core.identity memory).
    last_seen: Mapping[int, GpuIdentity] | None = None
    # How held XIDs become findings (core.xids.judge_xids; None: the catalog's).
    xid_rules: XidRules | None = None


def classify(runs: Mapping[str, ProbeRun], requirement: Requirement, *, host: str,
             checked_at: str, source: str = "inline",
             visibility: tuple[str | None, str | None] | None = None,
             scope: ProbeScope | None = None, facts: NodeFacts = NodeFacts()) -> Verdict:
    """The verdict for ``requirement`` from what the probe children observed.

    ``visibility`` is the job's (CUDA_VISIBLE_DEVICES, NVIDIA_VISIBLE_DEVICES) when it
    differs from what the host probe saw (the daemon answers for jobs that see a subset); it
    applies only where a host observation exists, which is where visibility is read from.
    ``scope`` says which GPUs the active probes could touch and each GPU's occupancy
    (core.readiness); without it every GPU is taken as probed (a caller without NVML).
    ``facts``: what else the verdict weighs (``NodeFacts``: the daemon's memory).
    """
    f = Findings()
    f.warnings.extend(facts.extra_warnings)
    _probe_layer(runs, f)
    layer = _Layer(_ok(runs.get("host")), _ok(runs.get("nvml")), _ok(runs.get("cuda")))
    if layer.host is None:
        visibility = None
    devices: list[DeviceInfo] = []
    if requirement.needs_gpu:
        candidates, selected, remembered = _select_gpus(runs, layer, requirement, visibility,
                                                        facts.last_seen, f)
        _device_findings(selected, facts.xids, f, facts.nvml_history, facts.nvml_policy,
                         peers=layer.nvml.devices if layer.nvml is not None else (),
                         xid_rules=facts.xid_rules)
        labels = {d.label for d in selected}
        f.blockers.extend(b for b in facts.device_blockers if b.device in labels)
        f.warnings.extend(w for w in facts.device_warnings if w.device in labels)
        _layer_findings(layer, candidates, selected, requirement, facts.expected_gpus, f)
        # A lost GPU keeps the PCI bus id sysfs knows for its place (nvidia-smi shows it too).
        bus_ids = sysfs_bus_ids(_json(layer.host_run), _json(layer.nvml_run))
        devices = [_device_info(d, bus_ids.get(d.index), d.index in remembered)
                   for d in selected]
        if scope is not None:
            devices = list(settle(f, devices, requirement, scope, checked_at=checked_at,
                                  nic_trouble=_nic_trouble(runs.get("nic"), selected)))
    gpu = GpuContext(nvml_ok=layer.nvml_ok, cuda_ok=layer.cuda_ok,
                     gpu_blocked=bool(f.blockers),
                     cuda_driver_version=_driver_cuda_version(layer.nvml, layer.cuda))
    backends = _backend_statuses(runs, requirement, gpu, scope, f)
    # Proven or not ready: a required backend that was not tried never passes.
    require_proof(f, requirement, backends)
    backends.update(_layer_statuses(runs, layer, f))
    # One order everywhere (probe, preflight, JSON, kv, text): the registry's.
    backends = {n: backends[n] for n in sorted(backends, key=registry.order)}
    return Verdict(
        requirement=requirement,
        blockers=tuple(f.blockers),
        warnings=tuple(f.warnings),
        devices=tuple(devices),
        backends=backends,
        evidence=_evidence(runs, layer.host, layer.nvml, layer.cuda, visibility),
        preallocation_disabled=_preallocation_disabled(runs, layer.host),
        host=host,
        checked_at=checked_at,
        source=source,
    )


def _nic_trouble(run: ProbeRun | None, devs: Sequence[NvmlDevice]
                 ) -> dict[str, tuple[str, ...]]:
    """Each GPU (by label) whose nearest NICs include one down or degraded (core.nic)."""
    obs = run.parsed if run is not None and run.ok else None
    if not isinstance(obs, NicObservation):
        return {}
    by_bus = gpus_nic_trouble(obs)
    return {d.label: ports for d in devs
            if d.pci_bus_id and (ports := by_bus.get(pci_address(d.pci_bus_id) or ""))}


def _select_gpus(runs: Mapping[str, ProbeRun], layer: _Layer, requirement: Requirement,
                 visibility: tuple[str | None, str | None] | None,
                 last_seen: Mapping[int, GpuIdentity] | None, f: Findings
                 ) -> tuple[list[NvmlDevice], list[NvmlDevice], set[int]]:
    """The visible GPUs, those the requirement selects, and the selected ones remembered."""
    host_obs, nvml = layer.host, layer.nvml
    raw: tuple[str | None, str | None]
    if visibility is not None:
        raw = visibility
    elif host_obs is not None and host_obs.environment:
        raw = host_obs.visibility
    else:
        raw = nvml.visibility if nvml else (None, None)
    inits_failed = (("nvml" in runs and not layer.nvml_ok)
                    or ("cuda" in runs and not layer.cuda_ok))
    _device_nodes(host_obs, inits_failed, f)
    _nvml_findings(nvml, host_obs, f)
    all_devs = list(nvml.devices) if nvml is not None and nvml.ok else []
    candidates = _visibility(raw, all_devs, layer.nvml_ok, f)
    selected, remembered = _remembered(_select(candidates, requirement, f), last_seen)
    return candidates, selected, remembered


def _layer_findings(layer: _Layer, candidates: Sequence[NvmlDevice],
                    selected: Sequence[NvmlDevice], requirement: Requirement,
                    expected_gpus: int | None, f: Findings) -> None:
    """Missing GPUs, CUDA's findings, the NVML/CUDA count check and the requirement's."""
    # core.missing reads the host probe's PCI listing, which the typed host record does
    # not carry yet: it gets the checked JSON of the three runs.
    missing_gpu_findings(_json(layer.host_run), _json(layer.nvml_run), _json(layer.cuda_run),
                         expected_gpus, f)
    uuids = {d.uuid for d in selected if d.uuid} if layer.nvml_ok else None
    cuda = layer.cuda
    _cuda_findings(cuda, uuids, f)
    if layer.nvml_ok and layer.cuda_ok and cuda is not None and requirement.devices is None:
        n_cuda = _count(cuda.device_count)
        if n_cuda != len(candidates):
            f.warn("device_count_mismatch",
                   f"NVML shows {len(candidates)} visible GPU(s), cuInit {n_cuda}",
                   backend="cuda")
    _requirement_findings(selected, requirement, f)
    held_memory_blocks(f)


def _backend_statuses(runs: Mapping[str, ProbeRun], requirement: Requirement,
                      gpu: GpuContext, scope: ProbeScope | None, f: Findings
                      ) -> dict[str, BackendStatus]:
    """Each required backend's status, from its classifier or why it was not proven."""
    backends: dict[str, BackendStatus] = {}
    for req in requirement.backends:
        run = runs.get(req.name)
        spec = registry.spec(req.name)
        classifier = spec.classifier() if spec is not None else None
        if run is not None and run.skipped is not None:
            backends[req.name] = BackendStatus(UNPROVEN, None, {}, {"reason": run.skipped})
        elif run is not None and classifier is not None and req.name not in backends:
            backends[req.name] = with_proof_gpu(classifier(run, req, gpu, f), req, scope)
        elif run is None and scope is not None and req.name in scope.backend_gpu:
            backends[req.name] = BackendStatus(UNPROVEN, None, {}, {
                "reason": "no free GPU this round: every visible GPU is in use or locked"})
    return backends


def _layer_statuses(runs: Mapping[str, ProbeRun], layer: _Layer, f: Findings
                    ) -> dict[str, BackendStatus]:
    """The status of each device-layer probe that ran (host, nvml, cuda)."""
    nvml, cuda = layer.nvml, layer.cuda
    out: dict[str, BackendStatus] = {}
    if "host" in runs:
        out["host"] = _status(runs["host"], f, "host", {}, _host_detail(layer.host))
    if "nvml" in runs:
        out["nvml"] = _status(runs["nvml"], f, "nvml", {
            "driver": nvml.driver_version if nvml else None,
            "cuda_driver": _str(nvml.cuda_driver_version if nvml else None),
            "nvml": nvml.nvml_version if nvml else None},
            {"device_count": nvml.device_count if nvml else None,
             "error": nvml.error.record if nvml and nvml.error else None})
    if "cuda" in runs:
        out["cuda"] = _status(runs["cuda"], f, "cuda",
                              {"cuda_driver": _str(cuda.driver_version if cuda else None)},
                              {"device_count": cuda.device_count if cuda else None,
                               # Why there is no cuInit to report: libcuda.so.1 not loaded.
                               "library": ("missing" if cuda and not cuda.library_loaded
                                           else None),
                               "init": cuda.init.record if cuda and cuda.init else None,
                               "init_duration_s": cuda.init_duration_s if cuda else None})
    return out


def _preallocation_disabled(runs: Mapping[str, ProbeRun], host: HostObservation | None
                            ) -> bool:
    """Whether JAX preallocation is off: the JAX child's reading, else the host probe's."""
    jax_run = _ok(runs.get("jax"))
    jax_obs = jax_run.jax if jax_run else None
    if jax_obs is not None:
        return jax_obs.preallocation_disabled
    return host.preallocation_disabled if host is not None else False


def _json(run: ProbeRun | None) -> Mapping[str, Any] | None:
    return run.observation if run is not None else None


def _host_detail(host: HostObservation | None) -> dict[str, Any]:
    """The host facts a person looks for first: nvidia-smi, device nodes, kernel module."""
    if host is None:
        return {}
    smi = host.nvidia_smi
    smi_state = ("missing" if smi.missing else "timed out" if smi.timed_out
                 else f"exit {smi.exit_code}")
    return {"nvidia_smi": smi_state, "device_nodes": host.device_nodes.node_count,
            "kernel_module": host.kernel_module_version}


def _count(value: float | int | None) -> int:
    return int(value) if value is not None and value == value and abs(value) != float(
        "inf") else 0


def _driver_cuda_version(nvml: NvmlObservation | None, cuda: CudaObservation | None
                        ) -> int | None:
    """The driver's CUDA version (cuDriverGetVersion), from NVML or else the cuda probe."""
    for value in (nvml.cuda_driver_version if nvml else None,
                  cuda.driver_version if cuda else None):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _str(value: Any) -> str | None:
    return None if value is None else str(value)

