"""``gpudiag explain``: who failed a run (hardware, software, application), after the fact.

Exit codes: 0 an answer was given (``unknown`` included: it says what was missing), 1 the run
asked about was not found, 2 usage, 3 the history could not be read.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import click

from gpudiag.cli.commands import examples
from gpudiag.core.attribution import Attribution
from gpudiag.core.gpunames import is_gpu_name
from gpudiag.core.termsafe import terminal_safe, terminal_safe_record

EXIT_NOT_FOUND = 1
EXIT_USAGE = 2
EXIT_FAILED = 3


class _NotFound(click.ClickException):
    exit_code = EXIT_NOT_FOUND


class _Failed(click.ClickException):
    exit_code = EXIT_FAILED


class _Refused(click.ClickException):
    """A run's file that is not read (a FIFO, a device, a link, too large): exit 2."""

    exit_code = EXIT_USAGE


def _time(text: str, name: str) -> float:
    """Epoch seconds or RFC 3339 (2026-12-01T14:00:00Z)."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError as e:
        raise click.UsageError(f"{name} {text!r} is neither epoch seconds nor an RFC 3339 "
                               "time such as 2026-12-01T14:00:00Z") from e


@click.command(short_help="Say who failed a run: hardware, software or the application.",
               epilog=examples(
                   "gpudiag explain --run ~/.local/state/gpudiag/runs/20261201T140000Z-k3x9q2mb",
                   "gpudiag explain --pid 4242",
                   "gpudiag explain --slurm-job 1234 --format json",
                   "gpudiag explain --since 2026-12-01T14:00:00Z --until 2026-12-01T15:00:00Z "
                   "--gpus GPU-5f3a2b1c-0000-4000-8000-000000000001"))
@click.option("--run", "run_path", metavar="CLOSEOUT", type=click.Path(exists=True),
              help="A run's closeout.json or its artifacts folder.")
@click.option("--pid", type=click.IntRange(1), metavar="PID",
              help="The `gpudiag run` process's pid or its job's.")
@click.option("--slurm-job", "slurm_job", metavar="ID", help="The Slurm job id of the run.")
@click.option("--job-uid", "job_uid", type=click.IntRange(0, 2**32 - 1), metavar="UID",
              help="With --pid or --slurm-job: only a record that uid (the job's owner, "
              "$SLURM_JOB_UID in an Epilog) or root wrote counts.")
@click.option("--since", "since_text", metavar="T", help="Window start (RFC 3339 or epoch s).")
@click.option("--until", "until_text", metavar="T", help="Window end (RFC 3339 or epoch s).")
@click.option("--gpus", "gpus_text", metavar="UUIDS",
              help="With --since/--until: the GPUs, comma-separated full UUIDs.  "
              "[default: every GPU]")
@click.option("--all-gpus", is_flag=True,
              help="The timeline shows every GPU's events.  [default: the run's GPUs (or "
              "--gpus) and the node's own]")
@click.option("--state-dir", metavar="DIR", type=click.Path(file_okay=False),
              help="The daemon's state dir.  [default: as for `gpudiag serve`]")
@click.option("--format", "fmt", type=click.Choice(["text", "json", "kv"]), default="text",
              show_default=True, help="kv: key=value lines for scripts (the Slurm Epilog).")
def explain(run_path: str | None, pid: int | None, slurm_job: str | None,
            job_uid: int | None, since_text: str | None, until_text: str | None,
            gpus_text: str | None, all_gpus: bool, state_dir: str | None, fmt: str) -> None:
    """Say who failed a run, hardware, software, application or unknown, with the events
    that decided it and the timeline of its GPUs (verdict changes, XIDs, who held them).

    Name the run by one of --run, --pid, --slurm-job, or --since and --until. The answer
    comes from the daemon's history in the state dir, with the rules the run's closeout used;
    without a history, from what the run recorded itself.
    """
    from gpudiag.daemon.explain import ExplainError, ExplainRefused, explain_in, window_of
    from gpudiag.daemon.store import HistoryError

    named = [x for x in (run_path, pid, slurm_job, since_text) if x is not None]
    if len(named) != 1 or (since_text is None) != (until_text is None):
        raise click.UsageError("name the run with exactly one of --run CLOSEOUT, --pid PID, "
                               "--slurm-job ID, or --since T --until T")
    if gpus_text is not None and since_text is None:
        raise click.UsageError("--gpus goes with --since/--until")
    if job_uid is not None and pid is None and slurm_job is None:
        raise click.UsageError("--job-uid goes with --pid or --slurm-job")
    gpus = [g.strip() for g in (gpus_text or "").split(",") if g.strip()]
    bad = [g for g in gpus if not is_gpu_name(g)]
    if bad:
        raise click.UsageError(f"--gpus {', '.join(bad)}: not GPU names (an index, a UUID or "
                               "a unique prefix of one, a PCI bus id; `gpudiag probe` lists "
                               "them)")
    gpus = _full_uuids(gpus, state_dir)
    window = None
    if since_text is not None and until_text is not None:
        since, until = _time(since_text, "--since"), _time(until_text, "--until")
        if until < since:
            raise click.UsageError("--until is before --since")
        window = window_of(since, until, gpus)
    try:
        answer = explain_in(None if state_dir is None else Path(state_dir),
                            run=None if run_path is None else Path(run_path), pid=pid,
                            slurm_job_id=slurm_job, window=window, job_uid=job_uid,
                            all_gpus=all_gpus)
    except ExplainRefused as e:
        raise _Refused(str(e)) from e
    except ExplainError as e:
        raise _NotFound(str(e)) from e
    except HistoryError as e:
        raise _Failed(str(e)) from e
    if fmt == "json":
        click.echo(json.dumps(answer.record(), indent=2))
    elif fmt == "kv":
        click.echo(_kv(answer.attribution, answer.record()), nl=False)
    else:
        # A record's argv, messages and GPU names may be another user's: no control
        # character reaches the terminal (core/termsafe).
        _text(terminal_safe_record(answer.record()))


def _full_uuids(names: list[str], state_dir: str | None) -> list[str]:
    """Each GPU name as the full UUID the daemon's history knows it by (full UUIDs as given:
    a GPU since removed is still a GPU of the history)."""
    from gpudiag.core.environment import is_full_uuid
    from gpudiag.core.gpunames import GpuNameError, resolve
    from gpudiag.daemon.clears import known_in_history
    from gpudiag.daemon.store import HistoryError
    from gpudiag.engine.statedir import default_state_dir

    if all(is_full_uuid(n) for n in names):
        return names
    try:
        known = known_in_history(default_state_dir() if state_dir is None else Path(state_dir))
    except HistoryError as e:
        raise _Failed(str(e)) from e
    try:
        return [n if is_full_uuid(n) else resolve(n, known or []).uuid for n in names]
    except GpuNameError as e:
        raise click.UsageError(f"--gpus: {e}") from e


def _kv(attribution: Attribution, rec: dict[str, Any]) -> str:
    """attribution, rule, the first deciding event's code, xid and GPU, then the closeout's
    one-line form; values on one line each (newlines in messages become spaces)."""
    first = attribution.events[0] if attribution.events else None
    job = rec.get("job") or {}
    pairs = {"attribution": attribution.kind, "rule": attribution.rule,
             "code": first.code if first else "", "xid": first.xid if first else "",
             "gpu": first.gpu if first else "", "source": rec["source"],
             "slurm_job_id": job.get("slurm_job_id") or "",
             "owner_uid": rec.get("owner_uid"),
             # socket | root | no: whether the run's window is the kernel's word (issue 38).
             "attested": rec.get("attested") or "no",
             # The job watch's warnings on the run (job_stalled, gpu_straggler_suspect).
             "warnings": ",".join(w.get("code", "") for w in job.get("warnings") or []),
             "missing": "; ".join(attribution.missing),
             "gpu_failure_attribution": attribution.kv()}
    return "".join(f"{k}={terminal_safe(' '.join(str(v if v is not None else '').split()))}\n"
                   for k, v in pairs.items())


def _run_ids(job: dict[str, Any]) -> list[str]:
    """The pids known of a run: a closeout names only the job's (gpudiag's own is not kept
    there, and is never printed as -1)."""
    ids = []
    pid, child = job.get("pid"), job.get("child_pid")
    if isinstance(pid, int) and pid > 0:
        ids.append(f"pid {pid}")
    if isinstance(child, int) and child > 0:
        ids.append(f"job pid {child}")
    if job.get("slurm_job_id"):
        ids.append(f"Slurm job {job['slurm_job_id']}")
    return ids or ["pid unknown"]


def _text(rec: dict[str, object]) -> None:
    attribution = rec["attribution"]
    assert isinstance(attribution, dict)
    window = rec["window"]
    assert isinstance(window, dict)
    source = str(rec["source"])
    source = source if source.startswith("the ") else f"the {source}"  # never "the the"
    click.echo(f"attribution: {attribution['kind']}  (rule {attribution['rule']}; from "
               f"{source})")
    job = rec.get("job")
    if isinstance(job, dict):
        click.echo("run: " + ", ".join(_run_ids(job)) + f", exit {job['exit_code']}: "
                   f"{' '.join(job['argv'])}")
    click.echo(f"window: {window['start']} .. {window['end']} on "
               f"{', '.join(window['gpus']) or 'every GPU'}")
    for e in attribution["events"]:
        click.echo(f"  decided by: {e['at']}  {e['gpu'] or 'node'}  {e['message'] or e['code']}"
                   f"  ({e['source']})")
    for m in attribution["missing"]:
        click.echo(f"  missing: {m}")
    # The daemon's job watch on the run: warnings, never what failed it.
    for w in (job.get("warnings") or []) if isinstance(job, dict) else []:
        click.echo(f"  warning: {w['code']}: {w['message']}  ("
                   + ", ".join(f"{k}={v}" for k, v in w["numbers"].items()) + ")")
    timeline = rec["timeline"]
    assert isinstance(timeline, list)
    if timeline:
        click.echo("timeline:")
    for row in timeline:
        click.echo(f"  {row['at']}  {row['what']:<13} {row['gpu'] or '-':<40} {row['detail']}")
