"""The GPU reset rung (issue 52): which faulty GPUs the daemon may reset now, and why it
leaves the others alone. Pure: no I/O, no clock.

A reset (``nvidia-smi -r``) repairs what the catalog calls ``gpu_reset_required`` (a reset
XID such as 48, 62, 64, 74, 95, 119, 120, NVML's recovery action ``gpu_reset``, an
application XID promoted by its count) without a person or a reboot, but it ends every
context on the GPU, and on an NVLink board the driver refuses it (or worse) while any GPU
of the NVLink domain runs work. So, in the order checked:
- off unless ``[gpu_reset] enabled``; only ``gpu_reset_required`` on a GPU named by its
  full UUID;
- never a GPU in MIG mode (its instances would have to be destroyed first: a person's call);
- never a GPU that also shows something a reset does not repair (``gpu_lost``, ``gpu_missing``,
  ``node_reboot_required``);
- the GPU and every GPU of its NVLink domain must be FREE (no process, no lock; UNKNOWN is
  never FREE). The domain is read from the topology (core.nvlink_domain: the GPUs joined by
  direct links, every GPU behind an NVSwitch fabric, itself alone without an active link;
  the whole node when the topology cannot be read);
- at most ``max_attempts_per_gpu`` resets of one GPU within ``attempt_window_s``: a GPU a
  reset did not repair is a person's (the drain, if remediation is on, says so).
The daemon (daemon/gpu_reset.py) then locks the domain, looks again under the locks, and
only then runs the tool.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gpudiag.core.nvlink_domain import NvlinkDomain, nvlink_domain
from gpudiag.core.observations import NvLinkEnd
from gpudiag.core.records import dataclass
from gpudiag.core.settings import Count, Flag, executable, seconds, setting

RESET_CODE = "gpu_reset_required"
FREE = "free"

# Why a faulty GPU is left alone (the ``reason`` label of gpudiag_gpu_reset_left_alone_total).
BUSY = "busy"                # the GPU itself runs work (or is locked, or unknown)
DOMAIN_BUSY = "domain_busy"  # another GPU of its NVLink domain does
MIG = "mig"                  # MIG mode is on
ATTEMPTS = "attempts_used"   # max_attempts_per_gpu within attempt_window_s already
NO_BUS_ID = "no_bus_id"      # NVML gave no PCI bus id to name it to the tool by
SEEN_BUSY = "busy_under_lock"  # the tool showed a process on its domain under the locks
LEFT_ALONE_REASONS = (BUSY, DOMAIN_BUSY, MIG, ATTEMPTS, NO_BUS_ID, SEEN_BUSY)
# A lock of its domain was taken when the daemon tried (a probe's, a job starting): said once,
# not counted, and tried again the next cycle.
LOCKED = "locked"

# What became of a reset (the ``outcome`` label of gpudiag_gpu_resets_total).
RECOVERED = "recovered"        # a fresh pass after it found no fault on the GPU
STILL_FAULTY = "still_faulty"  # a fresh pass after it still found one
FAILED = "failed"              # the tool failed, timed out, or could not be run
UNVERIFIED = "unverified"      # no fresh pass within verify_timeout_s
OUTCOMES = (RECOVERED, STILL_FAULTY, FAILED, UNVERIFIED)


@dataclass(frozen=True)
class GpuResetConfig:
    """``[gpu_reset]``: the rung is off by default (docs/operations.md "The GPU reset rung").

    The tool comes from this root-owned file, never from the environment.
    """

    enabled: bool = setting(False, Flag())
    nvidia_smi: str = setting("/usr/bin/nvidia-smi", executable())
    command_timeout_s: float = setting(60.0, seconds(1.0, 600.0))  # each call of the tool
    max_attempts_per_gpu: int = setting(1, Count(1, 100, "a number of resets from 1 to 100"))
    attempt_window_s: float = setting(86400.0, seconds(1.0))
    # A fresh pass must come within this after a reset.
    verify_timeout_s: float = setting(300.0, seconds(1.0, 86400.0))
    tick_s: float = setting(1.0, seconds(0.05, 60.0))


@dataclass(frozen=True)
class ResetGpu:
    """One GPU as the rung sees it (from the snapshot's NVML reading and occupancy)."""

    uuid: str
    pci_bus_id: str | None
    occupancy: str      # free | busy | unknown (core.readiness)
    nvlink: bool        # it has NVLink links (any state)
    mig: bool = False   # MIG mode is on
    # Where its active links end (the nvml probe's reading); None: not read, ``unread`` says
    # why, and its domain is the whole node (core.nvlink_domain).
    ends: tuple[NvLinkEnd, ...] | None = None
    unread: str = ""


@dataclass(frozen=True)
class ResetPlan:
    """What to do about one faulty GPU: ``reset`` (``domain`` locked, its own UUID first),
    or leave it alone (``reason`` one of LEFT_ALONE_REASONS, ``why`` says it for the log)."""

    uuid: str
    reset: bool
    reason: str = ""
    why: str = ""
    bus_id: str = ""
    domain: tuple[str, ...] = ()
    nvlink: NvlinkDomain | None = None  # how the domain was found, where it was looked at


# A GPU that also shows one of these needs more than a reset (off the bus, a reboot): a reset
# would fail or hide it, and use up the GPU's attempts.
BEYOND_RESET = frozenset({"gpu_lost", "gpu_missing", "node_reboot_required"})


def reset_faults(blockers: Sequence[tuple[str, str | None]]) -> list[str]:
    """The GPUs a reset may repair: ``gpu_reset_required`` on a GPU (full UUID) and nothing
    beyond a reset on it, from the node-health verdict's (code, device) pairs, each once,
    in order."""
    beyond = {device for code, device in blockers if code in BEYOND_RESET}
    out: list[str] = []
    for code, device in blockers:
        if (code == RESET_CODE and device and device.startswith("GPU-") and device not in out
                and device not in beyond):
            out.append(device)
    return out


def attempts_within(walls: Sequence[float], now_wall: float, window_s: float) -> int:
    """The resets of one GPU within the window."""
    return sum(1 for t in walls if now_wall - t <= window_s)


def plan_reset(uuid: str, gpus: Mapping[str, ResetGpu], attempts: Sequence[float],
               now_wall: float, cfg: GpuResetConfig) -> ResetPlan:
    """Reset ``uuid`` now, or why not (the rails in the module docstring's order)."""
    gpu = gpus.get(uuid)
    if gpu is None or gpu.occupancy != FREE:
        state = gpu.occupancy if gpu is not None else "not seen"
        return ResetPlan(uuid, False, BUSY, f"GPU {uuid} is {state}: never reset in use")
    if gpu.mig:
        return ResetPlan(uuid, False, MIG, f"GPU {uuid} is in MIG mode: its instances would "
                         "have to be destroyed first (a person's call)")
    used = attempts_within(attempts, now_wall, cfg.attempt_window_s)
    if used >= cfg.max_attempts_per_gpu:
        return ResetPlan(uuid, False, ATTEMPTS,
                         f"GPU {uuid} was reset {used} time(s) within {cfg.attempt_window_s:g} s "
                         "and is faulty again: a person is needed")
    if not gpu.pci_bus_id:
        return ResetPlan(uuid, False, NO_BUS_ID, f"GPU {uuid}: NVML gave no PCI bus id")
    domain = nvlink_domain(uuid, gpus)
    busy = [u for u in domain.gpus[1:] if gpus[u].occupancy != FREE]
    if busy:
        return ResetPlan(uuid, False, DOMAIN_BUSY,
                         f"GPU {uuid} shares its NVLink domain ({domain.why}) with GPU(s) in "
                         f"use or unknown ({', '.join(busy)}): a reset would end their work",
                         nvlink=domain)
    return ResetPlan(uuid, True, bus_id=gpu.pci_bus_id, domain=domain.gpus, nvlink=domain)


def processes_on(lines: str, domain: Sequence[str]) -> list[str]:
    """The ``gpu_uuid, pid`` rows of ``nvidia-smi --query-compute-apps=gpu_uuid,pid
    --format=csv,noheader`` that are on ``domain``; a row that cannot be read counts as one
    (a reset is never made on a guess)."""
    found: list[str] = []
    for line in lines.splitlines():
        if not line.strip():
            continue
        uuid, _, pid = (p.strip() for p in line.partition(","))
        if uuid in domain or not uuid.startswith("GPU-") or not pid.isdigit():
            found.append(line.strip())
    return found
