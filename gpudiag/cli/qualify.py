"""``gpudiag qualify``: measure each idle GPU and catch the one that runs slow or wrong.

Thin: flags -> engine.qualify.QualifyOptions -> engine.qualify.qualify -> text or JSON.
Exit codes: 0 no GPU failed (a warning, a run that yielded to a job, an unknown check or a
GPU left alone is not a failure), 1 a GPU failed (gpu_compute_mismatch,
gpu_memory_test_failed, or gpu_underperforming with --block), 2 usage,
3 gpudiag could not qualify at all (NVML unreadable, or it measured nothing on any GPU it
set out to: a driver call failed or missing, the child died).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import click

from gpudiag.cli.commands import examples
from gpudiag.core.limits import EXIT_BLOCKED, EXIT_FAILED, EXIT_READY

if TYPE_CHECKING:
    from gpudiag.core.qualify import ReferenceModel


class _Failed(click.ClickException):
    exit_code = EXIT_FAILED


def _table(path: str | None) -> tuple[ReferenceModel, ...] | None:
    if path is None:
        return None
    from gpudiag.core.qualify import ReferenceError, parse_reference_table

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        return parse_reference_table(data)
    except OSError as e:
        raise click.UsageError(f"--reference {path}: {e.strerror or e}") from e
    except (ValueError, ReferenceError) as e:
        raise click.UsageError(f"--reference {path}: {e} (docs/qualify.md shows the "
                               "format)") from e


def _history_dir(state_dir: str | None, no_history: bool) -> tuple[Path | None, str | None]:
    """The state directory to keep history in, or None and why not."""
    if no_history:
        return None, None
    from gpudiag.cli.daemon import default_state_dir

    folder = Path(state_dir) if state_dir else default_state_dir()
    if state_dir is None and not os.access(folder if folder.exists() else folder.parent,
                                           os.W_OK):
        return None, f"history not kept: {folder} is not writable (pass --state-dir)"
    return folder, None


@click.command(short_help="Measure idle GPUs: catch one that runs slow or wrong.",
               epilog=examples(
                   "gpudiag qualify                          # every idle GPU, quick tier",
                   "gpudiag qualify --gpus 0,3 --tier full   # two GPUs, up to 60 s each",
                   "gpudiag qualify --tier sdc               # SDC screen, 10 s per GPU",
                   "gpudiag qualify --format json | jq '.gpus[] | {uuid, code}'",
                   "gpudiag qualify --platform cpu --reference table.json   # no GPU here",
                   "",
                   "Busy GPUs are never touched. docs/qualify.md: tiers, references, "
                   "thresholds."))
@click.option("--gpus", "gpus_text", metavar="LIST",
              help="GPUs by index, full UUID, unique UUID prefix or PCI bus id, "
              "comma-separated.  [default: every visible GPU]")
@click.option("--tier", type=click.Choice(["quick", "full", "sdc"]), default="quick",
              show_default=True,
              help="quick: at most a few seconds per GPU; full: up to 60 s per GPU, fp32 too; "
                   "sdc: the silent-data-corruption screen (repeated GEMM, cross-GPU golden, "
                   "memory test), at most 10 s per GPU.")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text",
              show_default=True, help="Output format.")
@click.option("--platform", type=click.Choice(["cuda", "cpu"]), default="cuda",
              show_default=True,
              help="cpu: qualify JAX's CPU devices instead (the pipeline without a GPU).")
@click.option("--cpu-devices", type=click.IntRange(1, 64), default=8, show_default=True,
              help="How many CPU devices JAX makes with --platform cpu.")
@click.option("--reference", "reference", metavar="FILE",
              help="A JSON reference table to use instead of the built-in data-sheet table.")
@click.option("--block", is_flag=True,
              help="gpu_underperforming fails (exit 1), as qualification.block = true does.")
@click.option("--state-dir", metavar="DIR", type=click.Path(file_okay=False),
              help="Where the history is kept.  [default: as for `gpudiag serve`]")
@click.option("--no-history", is_flag=True, help="Neither read nor write the history.")
def qualify(gpus_text: str | None, tier: str, fmt: str, platform: str, cpu_devices: int,
            reference: str | None, block: bool, state_dir: str | None,
            no_history: bool) -> None:
    """Measure each idle GPU (memory and PCIe bandwidth, matmul throughput) and check known
    answers; score each against its model's data sheet, its node peers and its own history.

    --tier sdc screens for silent data corruption instead: a GEMM repeated and compared bit
    for bit, a golden hash compared across GPUs, a memory test; a check that could not run
    at its minimum size is unknown, never a pass.

    Only GPUs that are FREE are measured, one at a time under their lock; a run stops within
    1 s when another process appears on the GPU. Exits 0 when no GPU failed, 1 when one did
    (a wrong answer; too slow with --block), 2 on bad flags, 3 when gpudiag failed (NVML
    unreadable, or nothing measured on any GPU for a reason other than a job).
    """
    from gpudiag.core.qualify_score import Thresholds
    from gpudiag.engine.qualify import QualifyError, QualifyOptions
    from gpudiag.engine.qualify import qualify as run

    gpus = tuple(g.strip() for g in gpus_text.split(",") if g.strip()) if gpus_text else None
    if gpus_text is not None and not gpus:
        raise click.UsageError("--gpus names no GPU; give indices, UUIDs or PCI bus ids")
    folder, note = _history_dir(state_dir, no_history)
    options = QualifyOptions(tier=tier, gpus=gpus, platform=platform, cpu_devices=cpu_devices,
                             table=_table(reference),
                             thresholds=Thresholds(block=block), state_dir=folder)
    try:
        report = run(options)
    except QualifyError as e:
        if str(e).startswith("--gpus") or "platform" in str(e):
            raise click.UsageError(str(e)) from e
        raise _Failed(str(e)) from e
    if note:
        click.echo(f"gpudiag qualify: {note}", err=True)
    if report.history_error:
        click.echo(f"gpudiag qualify: history not kept: {report.history_error}", err=True)
    if fmt == "json":
        click.echo(json.dumps(report.record(), indent=2))
    else:
        render(report.record(), sys.stdout)
    if report.measured_nothing and not report.failed:
        click.echo(f"gpudiag qualify: measured nothing: {report.measured_nothing}", err=True)
        sys.exit(EXIT_FAILED)
    sys.exit(EXIT_BLOCKED if report.failed else EXIT_READY)


def _figure(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    scale = 1e12 if unit == "flops_per_second" else 1e9
    return f"{value / scale:.3g} {'TFLOP/s' if scale == 1e12 else 'GB/s'}"


def _coverage_line(cov: dict[str, Any]) -> str:
    """Once per GPU: what was covered, what was not (unknown, never a pass), and a check
    that passed over far less than its target."""
    statuses = cov.get("checks") or {}
    covered = [c for c, s in statuses.items() if s != "unknown"]
    parts = [f"covered: {', '.join(covered) or 'nothing'}"]
    if cov.get("bytes_tested"):
        parts[0] += f" ({cov['bytes_tested'] / 2**20:.0f} MiB of memory tested)"
    if cov.get("unknown"):
        parts.append(f"not covered (unknown, never a pass): {', '.join(cov['unknown'])}")
    for short in cov.get("short") or ():
        parts.append(f"{short['check']} covered only {short['bytes_tested'] / 2**20:.3g} MiB "
                     f"of its {short['bytes_target'] / 2**20:.0f} MiB target")
    return "  " + "; ".join(parts) + "\n"


def render(record: dict[str, object], out: IO[str]) -> None:
    """The report for a person: one block per GPU, one line per measure with its ratios."""
    gpus = record["gpus"]
    assert isinstance(gpus, list)
    out.write(f"qualification, {record['tier']} tier on {record['platform']}: "
              f"{len(gpus)} GPU(s) measured\n")
    for q in gpus:
        out.write(f"\nGPU {q['index']} {q['uuid']} {q['name'] or ''}: {q['code']} "
                  f"({q['severity']})\n")
        low = [s["measure"] for s in q["scores"]
               if any(r["below"] for r in s["references"])]
        checks = q.get("checks") or ()
        # Each reason once: the measures' and checks' lines below say what is low, what
        # passed and what did not run, so the message (the same in one line) is shown only
        # when they do not.
        if low:
            out.write(f"  low: {', '.join(low)} (LOW below: the ratio under its threshold)\n")
        elif q["message"] and not (checks and q["code"] == "none"):
            out.write(f"  {q['message']}\n")
        if not q.get("reference_model") and q["scores"]:
            out.write(f"  no data-sheet row for {q['name'] or 'this model'!r}: compared with "
                      "its node peers and its own history only\n")
        for s in q["scores"]:
            ratios = "  ".join(f"{r['reference']} {r['ratio']:.2f}" + (" LOW" if r["below"]
                                                                        else "")
                               for r in s["references"] if r["ratio"] is not None)
            out.write(f"  {s['measure']:<26} {_figure(s['value'], s['unit']):>14}  {ratios}\n")
        for k in q["known_answers"]:
            out.write(f"  known answer {k['check']}: {'ok' if k['ok'] else 'WRONG'}: "
                      f"{k['detail']}\n")
        for c in checks:
            where = (f" at {c['where']}: expected {c['expected']}, got {c['got']}"
                     if c.get("where") else "")
            out.write(f"  check {c['check']}: {c['status'].upper()}: {c['detail']}{where}\n")
        if checks:
            out.write(_coverage_line(q.get("coverage") or {}))
        for change in q.get("side_effects") or ():
            out.write(f"  diagnostic_side_effect: the run left {change}\n")
        if q["duration_s"] is not None:
            out.write(f"  took {q['duration_s']:.2f} s, GPU held {q['gpu_seconds'] or 0:.2f} s, "
                      f"{(q['bytes_used'] or 0) / 2**20:.0f} MiB\n")
    left = record["left_alone"]
    assert isinstance(left, dict)
    for uuid, why in left.items():
        out.write(f"\nleft alone: {uuid} ({why})\n")

