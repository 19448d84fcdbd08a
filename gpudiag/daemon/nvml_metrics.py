"""Per-GPU metrics of the NVML health signals (core.nvml_health), built from one snapshot.

Kept apart from the exporter's own families so that the exporter gains one line. Every
series carries ``gpu`` and ``uuid``; the condition and clock-hold series are seeded for every
GPU (0 when nothing holds) so that alerts need no absent() and series do not churn.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from gpudiag.core.gpu_config import inventory
from gpudiag.core.nvml_health import CLOCK_GROUPS, CODES
from gpudiag.core.recovery import RECOVERY_ACTION_NAMES
from gpudiag.daemon.snapshot import Snapshot

Known = Callable[[int, "str | None"], tuple[str, str, str]]


def nvml_health_metrics(snap: Snapshot, known: Known) -> Iterator[Metric]:
    """The NVML health families of ``snap``; ``known`` gives a GPU's lasting identity."""
    nvml = snap.result("nvml")
    obs = nvml.run.nvml if nvml is not None else None
    gl = ["gpu", "uuid"]
    gen = GaugeMetricFamily("gpudiag_gpu_pcie_link_generation",
                            "PCIe link generation now (current) and at most (max).",
                            labels=[*gl, "which"])
    width = GaugeMetricFamily("gpudiag_gpu_pcie_link_width",
                              "PCIe link width in lanes now (current) and at most (max).",
                              labels=[*gl, "which"])
    links = GaugeMetricFamily("gpudiag_gpu_nvlinks", "NVLink links by state.",
                              labels=[*gl, "state"])
    fabric = GaugeMetricFamily("gpudiag_gpu_fabric_state",
                               "NVSwitch fabric state: 1 not started, 2 in progress, "
                               "3 completed (0 not supported).", labels=gl)
    pending = GaugeMetricFamily("gpudiag_gpu_retired_pages_pending",
                                "1 while page retirements wait for a GPU reset.", labels=gl)
    action = GaugeMetricFamily("gpudiag_gpu_recovery_action",
                               "1 for NVML's current recovery action of the GPU.",
                               labels=[*gl, "action"])
    held = GaugeMetricFamily("gpudiag_gpu_clock_event_held_seconds",
                             "How long a thermal or power clock event has been held while "
                             "the GPU works (0 when none).", labels=[*gl, "group"])
    condition = GaugeMetricFamily("gpudiag_gpu_condition",
                                  "1 while a GPU health code (blocker or warning) names this "
                                  "GPU in the node-health verdict.", labels=[*gl, "code"])
    config = GaugeMetricFamily("gpudiag_gpu_config_info",
                               "1 per field of the GPU's configuration and firmware inventory "
                               "(driver, VBIOS, InfoROM, GSP firmware, power limit, "
                               "application clocks, persistence, ECC, compute and MIG mode): "
                               "what gpu_config_drift and gpudiag fleet --drift compare.",
                               labels=[*gl, "field", "value"])
    found = _conditions(snap)
    history = snap.nvml_history
    for d in obs.devices if obs is not None else ():
        uuid = known(d.index, d.uuid)[0]
        labels = [str(d.index), uuid]
        for code in CODES:
            condition.add_metric([*labels, code], 1.0 if (d.label, code) in found else 0.0)
        if not d.ok:
            continue
        for group in CLOCK_GROUPS:
            hold = history.clock_holds.get((uuid, group))
            seconds = 0.0 if hold is None else max(0.0, history.now_wall - hold.since_wall)
            held.add_metric([*labels, group], seconds)
        p = d.pcie
        if p is not None:
            for which, value in (("current", p.current_generation), ("max", p.max_generation)):
                if value is not None:
                    gen.add_metric([*labels, which], float(value))
            for which, value in (("current", p.current_width), ("max", p.max_width)):
                if value is not None:
                    width.add_metric([*labels, which], float(value))
        if d.nvlinks is not None:
            links.add_metric([*labels, "active"], float(len(d.nvlinks.active)))
            links.add_metric([*labels, "inactive"], float(len(d.nvlinks.inactive)))
        if d.fabric is not None and d.fabric.state is not None:
            fabric.add_metric(labels, float(d.fabric.state))
        for field, text in inventory(d, obs.driver_version if obs else None).items():
            config.add_metric([*labels, field, text], 1.0)
        if d.retired_pages_pending is not None:
            pending.add_metric(labels, 1.0 if d.retired_pages_pending else 0.0)
        if d.recovery_action is not None:
            for name in RECOVERY_ACTION_NAMES:
                action.add_metric([*labels, name], 1.0 if d.recovery_action == name else 0.0)
    yield from (gen, width, links, fabric, pending, action, held, condition, config)


def _conditions(snap: Snapshot) -> set[tuple[str, str]]:
    """(device label, code) of every finding of the node-health verdict."""
    full = snap.full
    if full is None:
        return set()
    return {(f.device, f.code) for f in (*full.blockers, *full.warnings) if f.device}
