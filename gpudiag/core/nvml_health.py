"""What NVML says about a GPU's health without a context: the device-layer rules, pure.

One function, :func:`device_health`, turns one readable NVML device (plus what the daemon
remembers between rounds, :class:`NvmlHistory`) into blockers and warnings. The rules:

- recovery action (``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``): each value has one code
  (``RECOVERY_ACTION_CODES``);
- row remapping or page retirement *pending*: NVIDIA says new work may still start and the
  reset applies it, so it is a ``gpu_reset_pending`` warning naming the reason; a remap
  *failure* or volatile uncorrectable ECC is a ``gpu_ecc_uncorrectable`` blocker;
- PCIe: a width below the maximum warns always (blocks below ``pcie_block_below_width``
  lanes); a generation below the maximum warns only while the GPU works (links drop their
  generation at idle to save power);
- NVLink: links down against ``expected_nvlinks`` or the most links seen active before;
- NVSwitch fabric registration not started, in progress or failed: ``gpu_fabric_not_ready``;
- memory held while no compute or graphics process is listed: ``gpu_memory_held_without_process``
  (a warning; :func:`held_memory_blocks` makes it the blocker where it is why the
  requirement's free memory is not met);
- thermal and power clock events: warnings only once held for a dwell time while working.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import field, replace

from gpudiag.core.findings import Findings
from gpudiag.core.observations import Ecc, NvmlDevice, NvmlObservation, RemappedRows
from gpudiag.core.records import dataclass
from gpudiag.core.settings import Count, seconds, setting

# NVIDIA's recovery-action values (core.recovery's names, as the probe reports them):
# name -> (code, what to do). "none" needs nothing.
RECOVERY_ACTION_CODES: dict[str, tuple[str, str]] = {
    "gpu_reset": ("gpu_reset_required",
                  "stop the GPU's processes and reset it (nvidia-smi -r)"),
    "node_reboot": ("node_reboot_required", "reboot the node"),
    "drain_p2p": ("gpu_reset_required",
                  "quiesce peer-to-peer traffic (stop P2P processes, turn UVM persistence "
                  "off), then read the recovery action again"),
    "drain_and_reset": ("gpu_reset_required",
                        "quiesce peer-to-peer traffic, then reset the GPU"),
    "recover_imex_domain": ("gpu_fabric_not_ready", "recover the IMEX domain"),
    "bus_reset": ("gpu_reset_required", "reset the GPU's PCIe bus"),
    "system_reboot": ("node_reboot_required", "reboot the system"),
}
# An action value newer than this table: a reset is the least that NVIDIA asks for.
UNKNOWN_ACTION = ("gpu_reset_required", "an action this gpudiag does not know")

FABRIC_STATES = {0: "not supported", 1: "not started", 2: "in progress", 3: "completed"}
THERMAL_REASONS = frozenset({"hw_thermal_slowdown", "sw_thermal_slowdown", "hw_slowdown"})
# Not sw_power_cap: a busy GPU held at its power cap is working as designed, never a fault.
POWER_REASONS = frozenset({"hw_power_brake_slowdown"})
CLOCK_GROUPS: dict[str, tuple[frozenset[str], str]] = {
    "thermal": (THERMAL_REASONS, "gpu_thermal_throttling"),
    "power": (POWER_REASONS, "gpu_power_throttling"),
}
GIB = 1024 ** 3
# The codes these rules give, for the per-GPU condition metric (seeded for every GPU).
CODES: tuple[str, ...] = (
    "gpu_reset_required", "gpu_reset_pending", "node_reboot_required", "gpu_ecc_uncorrectable",
    "gpu_ecc_correctable", "gpu_pcie_link_degraded", "gpu_nvlink_down",
    "gpu_fabric_not_ready", "gpu_memory_held_without_process", "gpu_thermal_throttling",
    "gpu_power_throttling")


@dataclass(frozen=True)
class ClockHold:
    """One clock-event group held on one GPU while it worked: since when, and how often."""

    since_wall: float
    held_samples: int
    working_samples: int
    reasons: tuple[str, ...] = ()


@dataclass(frozen=True)
class NvmlHistory:
    """What the daemon remembers between NVML rounds (empty for a one-shot probe)."""

    # uuid -> the most NVLink links seen active at once.
    nvlinks_active: Mapping[str, int] = field(default_factory=dict)
    # (uuid, "thermal"|"power") -> the hold in progress.
    clock_holds: Mapping[tuple[str, str], ClockHold] = field(default_factory=dict)
    now_wall: float = 0.0


@dataclass(frozen=True)
class NvmlHealthPolicy:
    """The thresholds (daemon config; these defaults everywhere else)."""

    expected_nvlinks: int | None = setting(None, Count(
        1, 18, "the number of NVLink links each GPU must have active, an integer from 1 to 18 "
        "(leave it out to compare with the most links seen active)"))
    clock_dwell_s: float = setting(60.0, seconds(0.0, 86400.0), at="clock_event_dwell_s")
    # Used memory above max(floor, share of total) with no process listed is "held".
    held_memory_floor_bytes: int = GIB
    held_memory_share: float = 0.02
    # A link narrower than this many lanes blocks (None: a narrow link only ever warns).
    pcie_block_below_width: int | None = setting(None, Count(
        1, 32, "a PCIe lane count from 1 to 32; a narrower link blocks (leave it out to only "
        "warn)"))


def working(d: NvmlDevice) -> bool:
    """The GPU works now: a process is listed or NVML saw it busy over its sample period."""
    util = d.readings.utilization_gpu_ratio
    return bool(d.processes) or bool(d.graphics_processes) or (util is not None and util > 0)


def advance(history: NvmlHistory, nvml: NvmlObservation | None, now_wall: float
            ) -> NvmlHistory:
    """The history after one more NVML round (the daemon calls this once per nvml result)."""
    if nvml is None or not nvml.ok:
        return replace(history, now_wall=now_wall)
    links = dict(history.nvlinks_active)
    holds = dict(history.clock_holds)
    for d in nvml.devices:
        if not d.ok or not d.uuid:
            continue
        if d.nvlinks is not None:
            links[d.uuid] = max(links.get(d.uuid, 0), len(d.nvlinks.active))
        busy = working(d)
        for group, (reasons, _code) in CLOCK_GROUPS.items():
            key = (d.uuid, group)
            held = tuple(sorted(set(d.clocks_event_reasons) & reasons))
            hold = _next_hold(holds.get(key), held, busy, now_wall)
            if hold is None:
                holds.pop(key, None)
            else:
                holds[key] = hold
    return NvmlHistory(links, holds, now_wall)


def _next_hold(old: ClockHold | None, held: tuple[str, ...], busy: bool, now_wall: float
               ) -> ClockHold | None:
    """One group's hold after one more sample of one GPU (None: no hold)."""
    if not busy:
        # Idle: a clock event never starts a hold; a quiet idle GPU ends one.
        return old if held else None
    if old is None:
        return ClockHold(now_wall, 1, 1, held) if held else None
    hold = ClockHold(old.since_wall, old.held_samples + bool(held), old.working_samples + 1,
                     held or old.reasons)
    # A hold survives short breaks; it ends when held under half the working samples.
    return None if hold.held_samples * 2 < hold.working_samples else hold


def device_health(d: NvmlDevice, f: Findings, *, history: NvmlHistory | None = None,
                  policy: NvmlHealthPolicy | None = None,
                  peers: Sequence[NvmlDevice] = ()) -> None:
    """Blockers and warnings for one readable NVML device; ``peers``: the node's GPUs read
    in the same round (an NVLink link down since boot shows against those of its model)."""
    history = history or NvmlHistory()
    policy = policy or NvmlHealthPolicy()
    _recovery_action(d, f)
    _memory_errors(d, f)
    _pcie(d, policy, f)
    _nvlinks(d, history, policy, f, peers)
    _fabric(d, f)
    _held_memory(d, policy, f)
    _clock_events(d, history, policy, f)


def _at(d: NvmlDevice) -> dict[str, str]:
    return {"backend": "nvml", "device": d.label}


def _recovery_action(d: NvmlDevice, f: Findings) -> None:
    action = d.recovery_action
    if action in (None, "none"):
        return
    code, todo = RECOVERY_ACTION_CODES.get(str(action), UNKNOWN_ACTION)
    f.block(code, f"GPU {d.index}: NVML recovery action {action}: {todo}", **_at(d))


def _memory_errors(d: NvmlDevice, f: Findings) -> None:
    ecc = d.ecc or Ecc()
    if (ecc.volatile_uncorrected or 0) > 0:
        f.block("gpu_ecc_uncorrectable",
                f"GPU {d.index}: {ecc.volatile_uncorrected} volatile uncorrectable "
                "ECC error(s)", **_at(d))
    rows = d.remapped_rows or RemappedRows()
    uncorrectable = 0 if rows.uncorrectable is None else rows.uncorrectable
    if rows.failure:
        f.block("gpu_ecc_uncorrectable",
                f"GPU {d.index}: row remapping failed ({uncorrectable} uncorrectable "
                "remapped row(s)): the GPU has run out of spare rows", **_at(d))
    if rows.pending:
        f.warn("gpu_reset_pending",
               f"GPU {d.index}: row remapping pending ({uncorrectable} uncorrectable "
               "remapped row(s)): the next GPU reset applies it", **_at(d))
    if d.retired_pages_pending:
        f.warn("gpu_reset_pending",
               f"GPU {d.index}: page retirement pending: the next GPU reset or driver "
               "reload retires the pages", **_at(d))
    if (ecc.volatile_corrected or 0) > 0:
        f.warn("gpu_ecc_correctable",
               f"GPU {d.index}: {ecc.volatile_corrected} correctable ECC error(s)", **_at(d))


def _pcie(d: NvmlDevice, policy: NvmlHealthPolicy, f: Findings) -> None:
    p = d.pcie
    if p is None:
        return
    floor = policy.pcie_block_below_width
    if floor is not None and p.current_width and p.current_width < floor:
        f.block("gpu_pcie_link_degraded",
                f"GPU {d.index}: PCIe link width x{p.current_width} of x{p.max_width}, "
                f"below the x{floor} that pcie_block_below_width asks for", **_at(d))
        return
    why = []
    if p.current_width and p.max_width and p.current_width < p.max_width:
        why.append(f"link width x{p.current_width} of x{p.max_width}")
    # At idle the link trains down to save power: only a working GPU's generation counts.
    if (p.current_generation and p.max_generation and p.current_generation < p.max_generation
            and working(d)):
        why.append(f"generation {p.current_generation} of {p.max_generation} while working")
    if why:
        f.warn("gpu_pcie_link_degraded", f"GPU {d.index}: PCIe {', '.join(why)}", **_at(d))


def _nvlinks(d: NvmlDevice, history: NvmlHistory, policy: NvmlHealthPolicy,
             f: Findings, peers: Sequence[NvmlDevice] = ()) -> None:
    links = d.nvlinks
    if links is None or not d.uuid:
        return
    seen = history.nvlinks_active.get(d.uuid, 0)
    expected = policy.expected_nvlinks if policy.expected_nvlinks is not None else seen
    source = ("expected_nvlinks" if policy.expected_nvlinks is not None
              else "active before")
    # A link down since boot was never seen active: the node's other GPUs of the same model
    # say how many it should have (their median, from two peers on), in a one-shot probe too.
    same = sorted(len(p.nvlinks.active) for p in peers
                  if p is not d and p.ok and p.uuid != d.uuid and p.name == d.name
                  and p.nvlinks is not None)
    if policy.expected_nvlinks is None and len(same) >= 2:
        typical = same[len(same) // 2]
        if typical > expected:
            expected, source = typical, f"on its {len(same)} peers of the same model (median)"
    if len(links.active) >= expected or not links.inactive:
        return
    down = ", ".join(str(n) for n in links.inactive)
    f.block("gpu_nvlink_down",
            f"GPU {d.index}: {len(links.active)} NVLink link(s) active, {expected} "
            f"{source}; down: link {down}", **_at(d))


def _fabric(d: NvmlDevice, f: Findings) -> None:
    fab = d.fabric
    if fab is None or fab.state in (None, 0):
        return
    state = FABRIC_STATES.get(fab.state, f"state {fab.state}")
    if fab.state in (1, 2):
        f.block("gpu_fabric_not_ready",
                f"GPU {d.index}: NVSwitch fabric registration {state}", **_at(d))
    elif fab.state == 3 and fab.status not in (None, 0):
        f.block("gpu_fabric_not_ready",
                f"GPU {d.index}: NVSwitch fabric registration failed (NVML status "
                f"{fab.status})", **_at(d))


def _held_memory(d: NvmlDevice, policy: NvmlHealthPolicy, f: Findings) -> None:
    mem = d.memory
    # A working GPU's memory has an owner even when NVML lists none (in a container, other
    # containers' processes are often not listed): leaked memory sits on an idle GPU.
    if (mem is None or mem.used_bytes is None or mem.total_bytes is None
            or d.processes is None or working(d)
            or (d.mig is not None and d.mig.enabled)):
        return
    limit = max(policy.held_memory_floor_bytes, policy.held_memory_share * mem.total_bytes)
    if mem.used_bytes > limit:
        f.warn("gpu_memory_held_without_process",
               f"GPU {d.index}: {mem.used_bytes / GIB:.1f} GiB used while no process is "
               f"listed (limit {limit / GIB:.1f} GiB): memory of a killed job or a leaked "
               "context", **_at(d))


def held_memory_blocks(f: Findings) -> None:
    """Held memory becomes the blocker where it is why the requirement's memory is short.

    Called once the requirement's findings are in: a GPU named by
    ``insufficient_free_memory`` whose memory is held by no process blocks for that reason
    (device layer, so it is the root cause); elsewhere it stays a warning.
    """
    short = {b.device for b in f.blockers if b.code == "insufficient_free_memory"}
    for w in [w for w in f.warnings
              if w.code == "gpu_memory_held_without_process" and w.device in short]:
        f.warnings.remove(w)
        f.block(w.code, w.message, backend=w.backend, device=w.device)


def _clock_events(d: NvmlDevice, history: NvmlHistory, policy: NvmlHealthPolicy,
                  f: Findings) -> None:
    if not d.uuid:
        return
    for group, (_reasons, code) in CLOCK_GROUPS.items():
        hold = history.clock_holds.get((d.uuid, group))
        if hold is None:
            continue
        held_s = history.now_wall - hold.since_wall
        if held_s < policy.clock_dwell_s:
            continue
        share = hold.held_samples / max(1, hold.working_samples)
        f.warn(code, f"GPU {d.index}: {', '.join(hold.reasons)} held {held_s:.0f} s while "
               f"working ({share:.0%} of samples; dwell {policy.clock_dwell_s:g} s)", **_at(d))
