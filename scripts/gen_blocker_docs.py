"""Write docs/blockers.md from the catalog (a test checks the file is current)."""

from __future__ import annotations

import sys
from pathlib import Path

from gpudiag.core.catalog import (
    BLOCKERS,
    DRAINS,
    LAYER_ORDER,
    QUALIFICATION,
    RUN_WARNINGS,
    WARNINGS,
)

# Where a code's meaning follows NVIDIA's own word, the page that says it.
SOURCES: tuple[str, ...] = (
    "`gpu_reset_pending` (warning) and `gpu_ecc_uncorrectable`: NVIDIA's *GPU Memory Error "
    "Management* guide, [Error Recovery and Response Flags](https://docs.nvidia.com/deploy/"
    "a100-gpu-mem-error-mgmt/error-recovery-and-response-flags.html), says a pending row "
    "remap is applied at the next GPU reset and that running and new work may go on until "
    "then (so it warns, never blocks), and sends a row-remapping failure to its RMA policy "
    "thresholds (so it blocks as `gpu_ecc_uncorrectable`). NVML's reference for "
    "`nvmlDeviceGetRemappedRows` agrees: the reset performs the remap, and a pending one does "
    "not harm later work thanks to error containment and dynamic page blacklisting.",
    "Recovery action (`NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`), the same page: none (nothing); "
    "gpu_reset, drain_p2p, drain_and_reset and bus_reset -> `gpu_reset_required`; node_reboot "
    "and system_reboot -> `node_reboot_required`; recover_imex_domain -> "
    "`gpu_fabric_not_ready`; a value newer than this list -> `gpu_reset_required`.",
    "`gpu_fabric_not_ready`: NVML's reference for `nvmlDeviceGetGpuFabricInfoV` (fabric "
    "state not started, in progress or completed, and a status once completed); cuInit "
    "answers `CUDA_ERROR_SYSTEM_NOT_READY` (802) until the fabric manager has registered "
    "the GPU.",
    "`gpu_pcie_link_degraded`: NVML's maximum PCIe width and generation are what the device "
    "and the system (its slot) can do together; the current generation drops at idle to save "
    "power, so only a working GPU's generation is judged.",
)


def render() -> str:
    """The catalog as Markdown, one table per layer, then the warnings."""
    out = ["# Blocker and warning codes", "",
           "Generated from `gpudiag/core/catalog.py` by `scripts/gen_blocker_docs.py`; "
           "do not edit.",
           "The primary `gpu_validation_blocker` is the blocker of the lowest layer, in this "
           "order: " + " < ".join(f"`{layer}`" for layer in LAYER_ORDER) + ".", ""]
    for layer in LAYER_ORDER:
        rows = [e for e in BLOCKERS.values() if e.layer == layer]
        out += [f"## {layer}", "", "| code | meaning | remediation |", "|---|---|---|"]
        out += [f"| `{e.code}` | {e.summary} | {e.remediation} |" for e in rows]
        out.append("")
    out += ["## Warnings (never set gpu_validation_blocker)", "",
            "| code | layer | meaning | what to do |", "|---|---|---|---|"]
    out += [f"| `{e.code}` | {e.layer} | {e.summary} | {e.remediation} |"
            for e in WARNINGS.values()]
    out += ["", "## Codes the daemon's remediation drains on", "",
            "With `[remediation] mode = \"act\"` (docs/operations.md) the daemon drains its "
            "node on these blockers only: hardware faults of a GPU or of the node. Every other "
            "code (busy, unproven, software, configuration, a runtime's backend) and every "
            "warning never drains.", "",
            ", ".join(f"`{c}`" for c in BLOCKERS if c in DRAINS)]
    out += ["", "## Sources", ""]
    out += [f"- {line}" for line in SOURCES]
    out += ["", "## Qualification outcomes (gpudiag qualify; docs/qualify.md)", "",
            "The daemon adds each GPU's latest outcome to its verdicts: "
            + ", ".join(f"`{c}`" for c in QUALIFICATION if c in BLOCKERS or c in WARNINGS)
            + " are in the tables above; these never change a verdict:", "",
            "| code | layer | meaning | what to do |", "|---|---|---|---|"]
    out += [f"| `{e.code}` | {e.layer} | {e.summary} | {e.remediation} |"
            for e in QUALIFICATION.values() if e.code not in BLOCKERS and e.code not in WARNINGS]
    out += ["", "## Warnings on a running job (the daemon's job watch; docs/daemon.md)", "",
            "On a run, never in a verdict: in its closeout, `gpudiag explain`, /v1/health's "
            "`runs` evidence and `gpudiag_job_stalled` / `gpudiag_gpu_straggler_suspect`. "
            "Never a blocker, never a drain.", "",
            "| code | layer | meaning | what to do |", "|---|---|---|---|"]
    out += [f"| `{e.code}` | {e.layer} | {e.summary} | {e.remediation} |"
            for e in RUN_WARNINGS.values()]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    target = Path(__file__).resolve().parent.parent / "docs" / "blockers.md"
    target.write_text(render())
    sys.stdout.write(f"wrote {target}\n")
