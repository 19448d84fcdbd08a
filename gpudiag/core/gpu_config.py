"""A GPU's configuration and firmware inventory, and the two questions asked of it.

The inventory is what an operator, a firmware flash or a driver upgrade sets on a GPU: the
driver, VBIOS, InfoROM and GSP firmware versions, the configured power limit, the application
clocks, persistence, ECC (now and after the next reset), compute and MIG mode. It is read
from NVML (probes/nvml.py, never set) and asked two questions:

- ``gpu_config_drift``: does a GPU differ from the majority of its node's GPUs of its model?
  (A tie names no majority and says nothing, as nic_config_drift does for HCAs.)
- ``diagnostic_side_effect``: did a diagnostic (a qualification) leave a GPU other than it
  found it? Only fields known both before and after count: a field that became unreadable
  is not a change anyone made.

Values are short texts (``"700"``, ``"on"``, ``"exclusive_process"``): they are what a
message, an info series' ``value`` label and ``gpudiag fleet --drift`` compare. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gpudiag.core.observations import NvmlDevice
from gpudiag.core.records import dataclass

# Every field of the inventory, in the order messages and series name them.
FIELDS: tuple[str, ...] = (
    "driver_version", "vbios_version", "inforom_image_version", "gsp_firmware_version",
    "power_limit_w", "applications_clock_sm_mhz", "applications_clock_memory_mhz",
    "persistence_mode", "ecc_mode", "ecc_mode_pending", "compute_mode", "mig_mode",
    "mig_mode_pending")
# MIG is partitioned per GPU on purpose (the GPU operator's "mixed" strategy): a GPU in MIG
# mode among whole GPUs is a choice, not drift; a diagnostic that turns it on still changed it.
NOT_DRIFT = frozenset({"mig_mode", "mig_mode_pending"})
COMPUTE_MODES = {0: "default", 1: "exclusive_thread", 2: "prohibited", 3: "exclusive_process"}

Inventory = Mapping[str, str]  # field -> value text, known fields only


def _flag(value: bool | None) -> str | None:
    return None if value is None else ("on" if value else "off")


def _number(value: float | None) -> str | None:
    return None if value is None else f"{float(value):g}"


def inventory(d: NvmlDevice, driver_version: object = None) -> dict[str, str]:
    """The known fields of ``d``'s inventory (``driver_version``: the node's, from NVML)."""
    c = d.config
    values: dict[str, str | None] = {
        "driver_version": None if driver_version is None else str(driver_version),
        "vbios_version": c.vbios_version if c else None,
        "inforom_image_version": c.inforom_image_version if c else None,
        "gsp_firmware_version": c.gsp_firmware_version if c else None,
        "power_limit_w": _number(c.power_management_limit_w) if c else None,
        "applications_clock_sm_mhz": _number(c.applications_clock_sm_mhz) if c else None,
        "applications_clock_memory_mhz":
            _number(c.applications_clock_memory_mhz) if c else None,
        "persistence_mode": _flag(d.persistence_mode),
        "ecc_mode": _flag(c.ecc_mode_current) if c else None,
        "ecc_mode_pending": _flag(c.ecc_mode_pending) if c else None,
        "compute_mode": None if d.compute_mode is None
        else COMPUTE_MODES.get(d.compute_mode, f"mode_{d.compute_mode}"),
        "mig_mode": _flag(d.mig.enabled) if d.mig else None,
        "mig_mode_pending": _flag(d.mig.pending) if d.mig else None,
    }
    return {k: v for k, v in values.items() if v}


@dataclass(frozen=True)
class Drift:
    """One field of one GPU against the majority of its node's GPUs of its model."""

    field: str
    value: str
    majority: str
    agree: int   # GPUs with the majority's value
    of: int      # GPUs of the model that know this field


def drift(devices: Sequence[NvmlDevice]) -> dict[str, tuple[Drift, ...]]:
    """Each GPU (by label) whose inventory differs from its model's majority, and how."""
    readable = [d for d in devices if d.ok]
    found: dict[str, list[Drift]] = {}
    for model in sorted({d.name or "" for d in readable}):
        group = [(d.label, inventory(d)) for d in readable if (d.name or "") == model]
        for name in FIELDS:
            if name in NOT_DRIFT:
                continue
            known = [(label, inv[name]) for label, inv in group if name in inv]
            counts: dict[str, int] = {}
            for _, value in known:
                counts[value] = counts.get(value, 0) + 1
            ranked = sorted(counts.items(), key=lambda kv: -kv[1])
            if len(ranked) < 2 or ranked[0][1] == ranked[1][1]:
                continue  # all agree, or no majority to name
            majority, agree = ranked[0]
            for label, value in known:
                if value != majority:
                    found.setdefault(label, []).append(
                        Drift(name, value, majority, agree, len(known)))
    return {label: tuple(ds) for label, ds in found.items()}


def drift_text(d: NvmlDevice, drifts: Sequence[Drift]) -> str:
    """The warning's message: the fields that differ, each with the majority's value."""
    model = f"{d.name} GPUs" if d.name else "GPUs"
    said = "; ".join(f"{x.field} {x.value} (the majority: {x.majority}, {x.agree} of {x.of})"
                     for x in drifts)
    return f"GPU {d.index} differs from the node's other {model}: {said}"


@dataclass(frozen=True)
class Change:
    """One field of one GPU that a diagnostic changed."""

    uuid: str
    field: str
    before: str
    after: str


def changes(before: Mapping[str, Inventory], after: Mapping[str, Inventory]
            ) -> tuple[Change, ...]:
    """The fields of the GPUs (by UUID) known both before and after that differ."""
    out: list[Change] = []
    for uuid in sorted(before.keys() & after.keys()):
        b, a = before[uuid], after[uuid]
        out += [Change(uuid, name, b[name], a[name]) for name in FIELDS
                if name in b and name in a and b[name] != a[name]]
    return tuple(out)
