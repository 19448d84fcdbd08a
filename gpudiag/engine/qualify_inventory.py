"""A qualification leaves the GPU as it found it: its inventory read before and after.

Every tier on a GPU reads NVML's inventory of it (core.gpu_config: driver, firmware, power
limit, application clocks, persistence, ECC, compute and MIG mode) before the child runs and
again after it; any field that differs is a ``diagnostic_side_effect`` of that run, kept in
its result (``GpuResult.side_effects``) and so in the history, the report and the daemon's
verdicts (core.qualify_verdict). The reading after one GPU's run is the reading before the
next GPU's: one NVML child per GPU qualified. Reads only: nothing here sets a GPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from gpudiag.core.gpu_config import Inventory, changes, inventory
from gpudiag.core.observations import NvmlObservation
from gpudiag.core.qualify_score import GpuResult
from gpudiag.engine.isolation import run_probe

NVML_TIMEOUT_S = 10.0


def inventories(nvml: NvmlObservation | None) -> dict[str, Inventory]:
    """Each readable GPU's inventory, by UUID."""
    if nvml is None or not nvml.ok:
        return {}
    return {d.uuid: inventory(d, nvml.driver_version) for d in nvml.devices
            if d.ok and d.uuid}


def read_inventories(env: Mapping[str, str]) -> dict[str, Inventory]:
    """The GPUs' inventories now (an nvml child); empty when NVML cannot be read."""
    run = run_probe("nvml", env=env, timeout_s=NVML_TIMEOUT_S)
    return inventories(run.nvml if run.ok else None)


def with_side_effects(results: Sequence[GpuResult], before: Mapping[str, Inventory],
                      after: Mapping[str, Inventory]) -> list[GpuResult]:
    """``results`` with each GPU's changed fields (``field before -> after``) recorded."""
    out = []
    for r in results:
        found = changes({r.uuid: before[r.uuid]} if r.uuid in before else {}, after)
        out.append(replace(r, side_effects=tuple(
            f"{c.field} {c.before} -> {c.after}" for c in found)) if found else r)
    return out
