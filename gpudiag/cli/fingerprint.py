"""``gpudiag fingerprint``: this environment's fingerprint, as the daemon is sent it."""

from __future__ import annotations

import json
import os

import click

from gpudiag.cli.commands import examples
from gpudiag.core import registry
from gpudiag.engine.fingerprint import fingerprints, query_value


@click.command(short_help="Print this environment's fingerprint (what the daemon matches).",
               epilog=examples(
                   "gpudiag fingerprint                    # per backend: id, installed",
                   "gpudiag fingerprint --format query     # the fingerprint= parameter",
                   "curl --unix-socket /run/gpudiag/daemon/gpudiag.sock \\",
                   "  \"http://localhost/v1/preflight?require=jax&fingerprint=$(gpudiag "
                   "fingerprint --format query)\""))
@click.option("--format", "fmt", type=click.Choice(["text", "json", "query"]), default="text",
              show_default=True, help="text for people; json: the whole reading; query: the "
              "value of /v1/preflight's fingerprint parameter.")
def fingerprint(fmt: str) -> None:
    """This environment's fingerprint per backend proven in a job's environment (JAX, IREE):
    its interpreter, the backend's distributions and modules on the search path, and the
    variables that change how it comes up (docs/reference.md, "Runtimes and fingerprints").

    The daemon answers a job's JAX or IREE only from a proof made in an environment with
    the same fingerprint (a configured runtime, or its own); otherwise the client proves
    them itself. Compare this with the daemon's runtimes to see why a job was answered as
    it was. Nothing is imported: the folders are read.
    """
    decls = {s.name: s.environment for s in registry.specs() if s.environment is not None}
    found = fingerprints(decls, os.environ)
    if fmt == "json":
        click.echo(json.dumps(found, indent=2))
        return
    ids = {name: str(entry["id"]) for name, entry in found["backends"].items()}
    if fmt == "query":
        click.echo(query_value(ids))
        return
    interp = found["interpreter"]
    click.echo(f"interpreter {interp['executable']} (prefix {interp['prefix']}, "
               f"Python {interp['version']})")
    for name, entry in found["backends"].items():
        dists = ", ".join(f"{d} {v}" for d, v in entry["distributions"].items()) or "none"
        state = "installed" if entry["installed"] else "not installed"
        click.echo(f"{name:5s} {entry['id']}  {state}; distributions: {dists}")
