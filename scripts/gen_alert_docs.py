"""Write docs/operations.md's alert table from prometheus/gpudiag.rules.yml (a test checks it).

Names, `for` and severity come from the rules file; what each alert means to an operator is
written here once, keyed by the alert's name, so an alert added to the rules without a line
here fails the test (and this script) instead of going undocumented.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped, unused-ignore]

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from scripts.docblock import replace_block

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "prometheus" / "gpudiag.rules.yml"
DOC = ROOT / "docs" / "operations.md"
BEGIN = "<!-- alerts: generated from prometheus/gpudiag.rules.yml by scripts/gen_alert_docs.py -->"
END = "<!-- /alerts -->"

FIRES_WHEN = {
    "GpudiagFalseBlockerBudgetExceeded": "the fleet cleared more than 1 false blocker "
                                         "(`gpudiag clear --no-repair`) per 100 nodes in a "
                                         "day (docs/numbers.md)",
    "GpudiagRemediationRefused": "a hardware fault stands but the fleet guard refused the "
                                 "drain (`gpudiag_remediation_refused`)",
    "GpudiagRemediationNeedsPerson": "gpudiag's attempts for a GPU are used up; its drain "
                                     "says `gpudiag:inspect:...` and is not resumed by "
                                     "gpudiag (`gpudiag_remediation_needs_person`)",
    "GpudiagRemediationSlurmFailing": "scontrol or sinfo keeps failing, hanging or is absent "
                                      "(`gpudiag_remediation_scontrol_failing`)",
    "GpudiagGpuResetDidNotRepair": "a GPU reset by the daemon's reset rung (`[gpu_reset]`) "
                                   "left the GPU faulty or failed "
                                   "(`gpudiag_gpu_resets_total{outcome}`): a person's now",
    "GpudiagGpuLinkDown": "a GPU has NVLink links down or its NVSwitch fabric is not ready "
                          "(`gpudiag_gpu_condition`)",
    "GpudiagGpuDegraded": "a GPU shows a degraded PCIe link, held clock events, memory no "
                          "process owns, or a reset due (`gpudiag_gpu_condition`)",
    "GpudiagGpuComputeMismatch": "a GPU's last qualification computed a wrong answer "
                                 "(docs/qualify.md)",
    "GpudiagGpuUnderperforming": "a GPU's last qualification measured it below its data "
                                 "sheet, node peers or own history (docs/qualify.md)",
    "GpudiagNodeBlocked": "`gpudiag_blocker == 1`; the code and layer are labels, the "
                          "catalog's remediation is the `remediation` annotation",
    "GpudiagBackendDown": "`gpudiag_backend_up == 0`",
    "GpudiagRuntimeFailing": "a runtime (`[runtimes.NAME]`, a job environment) fails its own "
                             "backend proof (`gpudiag_runtime_blocker`), while the node "
                             "itself is not blocked: never `GpudiagNodeBlocked`",
    "GpudiagRuntimeRefused": "the daemon refuses to run a runtime's code: another user may "
                             "write its import path (`gpudiag_runtime_refused`)",
    "GpudiagProbeTimeouts": "a probe child missed its deadline in the last 30 min (a hung "
                            "driver)",
    "GpudiagXidWatcherDead": "the XID watcher is down while enabled",
    "GpudiagProbesStale": "no probe child of a backend finished in 30 min (a stuck scheduler)",
    "GpudiagCriticalXid": "the daemon holds a critical XID (48 62 64 74 79 95 119 120) on a "
                          "GPU: seen within the hold time (an hour) and the GPU reads "
                          "unhealthy; `gpudiag clear` after the repair resolves it",
    "GpudiagEccUncorrectable": "new uncorrectable ECC errors in an hour, or row remapping "
                               "pending/failed",
    "GpudiagHistoryNotWritable": "`gpudiag_history_writable == 0` (usually a full state-dir "
                                 "disk)",
    "GpudiagHistoryDamaged": "`gpudiag_history_damaged_files > 0`: a damaged history was "
                             "moved aside",
    "GpudiagGpuUnhealthy": "`gpudiag_gpu_healthy == 0`: one GPU has a fault (per GPU; busy "
                           "GPUs are healthy in use)",
    "GpudiagExporterDown": "`up{job=\"gpudiag\"} == 0`: Prometheus cannot scrape the daemon",
}


def rules() -> list[dict[str, Any]]:
    """Every rule of the file, in its order."""
    data = yaml.safe_load(RULES.read_text())
    return [r for g in data["groups"] for r in g["rules"]]


def render() -> str:
    """The generated block: the alert table and the recording rules."""
    alerts = [r for r in rules() if "alert" in r]
    missing = [r["alert"] for r in alerts if r["alert"] not in FIRES_WHEN]
    stale = sorted(set(FIRES_WHEN) - {r["alert"] for r in alerts})
    if missing or stale:
        raise ValueError(f"scripts/gen_alert_docs.py FIRES_WHEN: add {missing}, "
                         f"remove {stale}")
    out = [BEGIN, "| alert | fires when | for | severity |", "|---|---|---|---|"]
    out += [f"| `{r['alert']}` | {FIRES_WHEN[r['alert']]} | {r.get('for', '-')} "
            f"| {r['labels']['severity']} |" for r in alerts]
    records = ", ".join(f"`{r['record']}`" for r in rules() if "record" in r)
    out += ["", f"Recording rules: {records}.", END]
    return "\n".join(out)


def rewrite(text: str) -> str:
    """``text`` (docs/operations.md) with its generated block replaced."""
    return replace_block(text, BEGIN, END, render, DOC)


if __name__ == "__main__":
    DOC.write_text(rewrite(DOC.read_text()))
    sys.stdout.write(f"wrote the alert table of {DOC}\n")
