"""Click options more than one command shares: one object each, one help text."""

from __future__ import annotations

import os

import click

from gpudiag.cli.settings import backend_settings
from gpudiag.core import registry

TYPE_CHECKING = False
if TYPE_CHECKING:
    from gpudiag.engine.jobpython import JobPython


def _require_help() -> str:
    """``--require``'s help, from the backend registry (so it cannot drift from the parser)."""
    parts: list[str] = []
    for spec in registry.specs():
        if not spec.requirable:
            continue
        parts.append(spec.name)
        other = [p for p in spec.platforms or () if p not in ("gpu", "cuda")]
        word = spec.platform_word.split()[-1].upper()
        if len(other) == 1:
            parts.append(f"{spec.name}:{other[0]}")
        elif other:
            parts.append(f"{spec.name}:{word} ({', '.join(other)})")
    return ("What the job needs, comma-separated: " + ", ".join(parts)
            + ". Without a platform a backend runs on the NVIDIA GPU.")


# The one --require of probe-answering commands (preflight, health, run).
require = click.option("--require", "require_text", default="cuda", show_default=True,
                       metavar="LIST", help=_require_help())


def _apply_config(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    try:
        backend_settings(value, explicit=value is not None)
    except (ValueError, OSError) as e:  # ConfigError is a ValueError
        raise click.BadParameter(str(e), ctx=ctx, param=param) from e


# The one --config of the one-shot commands (probe, preflight, health): the backend settings
# their probe children use, read as `gpudiag serve --config` reads them.
config = click.option("--config", "config_path", metavar="PATH", expose_value=False,
                      type=click.Path(dir_okay=False), callback=_apply_config,
                      help="The daemon's TOML config to read backend settings from "
                      "([backends.nic] expect, ...).  [default: /etc/gpudiag/gpudiag.toml "
                      "when it exists]")


# The one --python of every command that proves or asks for a job (probe, preflight, health,
# run, fingerprint): the job's interpreter (engine/jobpython.py).
python = click.option(
    "--python", "python_path", metavar="PATH",
    help="The job's Python interpreter: JAX and IREE are proven under it and the daemon is "
    "sent its environment's fingerprint.  [default: $GPUDIAG_JOB_PYTHON, else the job's "
    "active environment ($VIRTUAL_ENV, $CONDA_PREFIX), else the first python3 on PATH; "
    "never gpudiag's own unless it is one of these]")


def job_python(path: str | None, *, command: tuple[str, ...] | None = None,
               error: type[click.UsageError] = click.UsageError, needed: bool = True
               ) -> JobPython | None:
    """The job's interpreter for a command's ``--python`` (``error`` for a bad one: exit 2,
    or 125 for ``gpudiag run``, whose ARGV never started); None when no backend asked needs
    it (``needed`` false) and none was given: a question about the device layer alone never
    looks for one."""
    from gpudiag.engine.jobpython import JobPythonError, find

    if path is None and not needed:
        return None
    try:
        return find(os.environ, explicit=path, command=command)
    except JobPythonError as e:
        raise error(str(e)) from e
