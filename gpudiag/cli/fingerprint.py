"""``gpudiag fingerprint``: this environment's fingerprint, as the daemon is sent it."""

from __future__ import annotations

import json
import os
import sys

import click

from gpudiag.cli import options
from gpudiag.cli.commands import examples
from gpudiag.core import registry
from gpudiag.core.limits import EXIT_FAILED
from gpudiag.engine import jobpython
from gpudiag.engine.fingerprint import query_value


@click.command(short_help="Print the job's environment's fingerprint (what the daemon matches).",
               epilog=examples(
                   "gpudiag fingerprint                    # per backend: id, installed",
                   "gpudiag fingerprint --format query     # the fingerprint= parameter",
                   "gpudiag fingerprint --python ~/venvs/train/bin/python",
                   "curl --unix-socket /run/gpudiag/daemon/gpudiag.sock \\",
                   "  \"http://localhost/v1/preflight?require=jax&fingerprint=$(gpudiag "
                   "fingerprint --format query)\""))
@click.option("--format", "fmt", type=click.Choice(["text", "json", "query"]), default="text",
              show_default=True, help="text for people; json: the whole reading; query: the "
              "value of /v1/preflight's fingerprint parameter.")
@options.python
def fingerprint(fmt: str, python_path: str | None) -> None:
    """The job's environment's fingerprint per backend proven in a job's environment (JAX,
    IREE), read by the job's interpreter (--python; else the active venv or the first
    python3 on PATH): the interpreter, the backend's distributions and modules on its search
    path, and the variables that change how it comes up (docs/reference.md, "Runtimes and
    fingerprints").

    The daemon answers a job's JAX or IREE only from a proof made in an environment with
    the same fingerprint (a configured runtime, or its own); otherwise the client proves
    them itself. Compare this with the daemon's runtimes to see why a job was answered as
    it was. Nothing is imported: the folders are read. Exit 3 when the interpreter could
    not say (it hung, crashed or printed garbage).
    """
    python = options.job_python(python_path)
    assert python is not None  # needed: found or refused
    decls = {s.name: s.environment for s in registry.specs() if s.environment is not None}
    found = jobpython.fingerprints(decls, os.environ, python)
    found["job_python"] = python.record()
    if fmt == "json":
        click.echo(json.dumps(found, indent=2))
    if "error" in found:
        click.echo(f"gpudiag: the job's interpreter {python.describe()} gave no "
                   f"fingerprint: {found['error']}", err=True)
        sys.exit(EXIT_FAILED)
    if fmt == "json":
        return
    ids = {name: str(entry["id"]) for name, entry in found["backends"].items()}
    if fmt == "query":
        click.echo(query_value(ids))
        return
    interp = found["interpreter"]
    if python.path is None:
        click.echo(f"interpreter: {python.describe()}")
    else:
        click.echo(f"interpreter {interp['executable']} (prefix {interp['prefix']}, "
                   f"Python {interp['version']}; the job's: {python.describe()})")
    for name, entry in found["backends"].items():
        dists = ", ".join(f"{d} {v}" for d, v in entry["distributions"].items()) or "none"
        state = "installed" if entry["installed"] else "not installed"
        click.echo(f"{name:5s} {entry['id']}  {state}; distributions: {dists}")
