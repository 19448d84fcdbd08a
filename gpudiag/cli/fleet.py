"""``gpudiag fleet``: which nodes can run this requirement now, answered from Prometheus.

Exit codes: 0 at least one node can run it, 1 none can, 2 usage, 3 Prometheus cannot be asked.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from gpudiag.cli.commands import examples
from gpudiag.core.limits import EXIT_BLOCKED, EXIT_FAILED, EXIT_READY, MAX_DEVICES
from gpudiag.core.requirement import RequirementError, parse_backends
from gpudiag.engine.fleet import (
    DEFAULT_JOB,
    DEFAULT_MAX_AGE_S,
    FleetAnswer,
    FleetQuery,
    FleetUsageError,
    PrometheusAccess,
    PrometheusClient,
    PrometheusError,
    ask_fleet,
)
from gpudiag.engine.fleet_drift import DEFAULT_GROUP_LABEL, DriftQuery, ask_drift, render_drift


class _Failed(click.ClickException):
    exit_code = EXIT_FAILED


def _positive(value: float, name: str) -> float:
    if not value > 0:
        raise click.BadParameter(f"must be more than 0 seconds, got {value}", param_hint=name)
    return value


@click.command(short_help="Ask Prometheus which nodes can run a requirement now.",
               epilog=examples(
                   "gpudiag fleet --prometheus http://prometheus:9090",
                   "gpudiag fleet --prometheus http://prometheus:9090 --require jax --gpus 4",
                   "gpudiag fleet --prometheus http://prometheus:9090 --qualified 86400",
                   "gpudiag fleet --prometheus http://prometheus:9090 --drift",
                   "gpudiag fleet --prometheus https://prom.example --bearer-token-file "
                   "/etc/gpudiag/token --format json"))
@click.option("--prometheus", "url", envvar="GPUDIAG_PROMETHEUS_URL", metavar="URL",
              help="Prometheus's base URL, e.g. http://prometheus:9090.  [default: "
              "$GPUDIAG_PROMETHEUS_URL]")
@click.option("--require", "require", default="cuda", show_default=True, metavar="LIST",
              help="Backends the job needs, comma-separated: cuda, jax, iree.")
@click.option("--gpus", type=click.IntRange(1, MAX_DEVICES), default=1, show_default=True,
              metavar="N", help="Healthy free GPUs the job needs on one node.")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text",
              show_default=True, help="Output format: text for people, json (every node's "
              "answer).")
@click.option("--job", default=DEFAULT_JOB, show_default=True, metavar="NAME",
              help="The scrape job's name in Prometheus.")
@click.option("--max-age", "max_age_s", type=float, default=DEFAULT_MAX_AGE_S,
              show_default=True, metavar="SECONDS",
              help="A node whose newest sample is older than this is unknown, never ready.")
@click.option("--qualified", "qualified_s", type=float, default=None, metavar="SECONDS",
              help="Count only GPUs whose qualification passed within this many seconds "
              "(gpudiag qualify; docs/qualify.md).")
@click.option("--drift", is_flag=True,
              help="Instead: name the nodes whose GPU inventory (driver, firmware, power "
              "limit, clocks, modes) differs from the majority of their group; exits 1 when "
              "one does.")
@click.option("--drift-by", "drift_by", default=DEFAULT_GROUP_LABEL, show_default=True,
              metavar="LABEL", help="With --drift: the target label that groups nodes "
              "(nodes without it form one group); each group is split by GPU model.")
@click.option("--timeout", "timeout_s", type=float, default=10.0, show_default=True,
              metavar="SECONDS", help="Per request to Prometheus.")
@click.option("--user", default=None, metavar="NAME", help="Basic auth user.")
@click.option("--password-file", type=click.Path(dir_okay=False), default=None,
              help="File holding the basic auth password.")
@click.option("--bearer-token-file", type=click.Path(dir_okay=False), default=None,
              help="File holding a bearer token (instead of basic auth).")
@click.option("--ca-file", type=click.Path(dir_okay=False), default=None,
              help="CA bundle to verify Prometheus's TLS certificate with.")
@click.option("--insecure-skip-tls-verify", "insecure", is_flag=True,
              help="Do not verify Prometheus's TLS certificate (verification is on by default).")
def fleet(url: str | None, require: str, gpus: int, fmt: str, job: str, max_age_s: float,
          qualified_s: float | None, drift: bool, drift_by: str, timeout_s: float,
          user: str | None, password_file: str | None, bearer_token_file: str | None,
          ca_file: str | None, insecure: bool) -> None:
    """Ask Prometheus which nodes can run the requirement on N GPUs now, and why not the others.

    A node can when its daemon proved every required backend, at least N GPUs are healthy
    and free, and its metrics are fresh; a node whose daemon stopped answering is unknown.
    Exits 0 when at least one node can, 1 when none can, 2 on usage errors, 3 when
    Prometheus cannot be asked. With --drift: 0 when every node agrees with its group, 1
    when one differs.
    """
    if not url:
        raise click.UsageError("no Prometheus to ask: pass --prometheus URL or set "
                               "$GPUDIAG_PROMETHEUS_URL (e.g. http://prometheus:9090)")
    _positive(max_age_s, "--max-age")
    _positive(timeout_s, "--timeout")
    try:
        backends = tuple(dict.fromkeys(b.name for b in parse_backends(require)))
        password = _read_secret(password_file, "--password-file") if password_file else None
        if password_file and user is None:
            raise FleetUsageError("--password-file needs --user")
        token = PrometheusAccess.read_token(bearer_token_file) if bearer_token_file else None
        access = PrometheusAccess(url=url, username=user, password=password,
                                  bearer_token=token, ca_file=ca_file,
                                  verify_tls=not insecure, timeout_s=timeout_s)
        query = FleetQuery(backends=backends, gpus=gpus, job=job, max_age_s=max_age_s,
                           qualified_within_s=qualified_s)
        client = PrometheusClient(access)
        drift_query = DriftQuery(job=job, group_label=drift_by) if drift else None
    except (RequirementError, FleetUsageError) as e:
        raise click.UsageError(str(e)) from e
    if drift_query is not None:
        _drift(drift_query, client, fmt)
    try:
        answer = ask_fleet(query, client, url=url)
    except PrometheusError as e:
        raise _Failed(str(e)) from e
    # allow_nan=False: the output is JSON for any parser (the answer holds no NaN by design).
    click.echo(json.dumps(answer.record(), indent=2, allow_nan=False) if fmt == "json"
               else render_text(answer))
    raise SystemExit(EXIT_READY if answer.any_ready else EXIT_BLOCKED)


def _drift(query: DriftQuery, client: PrometheusClient, fmt: str) -> None:
    try:
        answer = ask_drift(query, client)
    except PrometheusError as e:
        raise _Failed(str(e)) from e
    click.echo(json.dumps(answer.record(), indent=2, allow_nan=False) if fmt == "json"
               else render_drift(answer))
    raise SystemExit(EXIT_BLOCKED if answer.any_drifted else EXIT_READY)


def _read_secret(path: str, name: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8").rstrip("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise FleetUsageError(f"{name}: cannot read {path}: {e}") from e


def render_text(answer: FleetAnswer) -> str:
    """One line per node: state, free healthy GPUs, blocker, evidence age, why."""
    q = answer.query
    head = f"fleet: --require {','.join(q.backends)} --gpus {q.gpus} (job {q.job})"
    if not answer.nodes:
        return f"{head}\nno nodes: Prometheus has no `up{{job=\"{q.job}\"}}` series"
    rows = [("INSTANCE", "STATE", "FREE", "BLOCKER", "AGE", "WHY")]
    for n in answer.nodes:
        rows.append((n.instance, n.state, "-" if n.gpus_ready_free is None
                     else str(n.gpus_ready_free), n.gpu_validation_blocker or "-",
                     "-" if n.age_s is None else f"{n.age_s:.0f}s", n.reason))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:5], widths, strict=True)) + "  " + r[5]
             for r in rows]
    ready = sum(1 for n in answer.nodes if n.ready)
    return "\n".join([head, *lines, f"{ready} of {len(answer.nodes)} node(s) can run it now"])
