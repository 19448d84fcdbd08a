"""``gpudiag clear``: release a repaired GPU's held XID blockers through the daemon's state dir.

No network surface: the command writes a request file into the daemon's state directory and
the daemon applies it on its next loop. Whoever cannot write there cannot clear (exit 2).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import click

from gpudiag.cli.commands import examples
from gpudiag.core.environment import is_full_uuid

EXIT_FAILED = 3
_REFUSED = (errno.EACCES, errno.EPERM, errno.EROFS)


class _Failed(click.ClickException):
    exit_code = EXIT_FAILED


@click.command(short_help="Release the XID blockers the daemon holds for a repaired GPU.",
               epilog=examples(
                   "gpudiag clear --gpu GPU-5f3a2b1c-0000-4000-8000-000000000001 "
                   "--reason 'reseated'",
                   "sudo -u gpudiag gpudiag clear --all --reason 'node rebooted'"))
@click.option("--gpu", "gpu", metavar="UUID", help="The repaired GPU's full UUID (GPU-...).")
@click.option("--all", "all_gpus", is_flag=True, help="Clear every GPU.")
@click.option("--reason", default="", metavar="TEXT",
              help="Why (the repair done); recorded in the history with your uid.")
@click.option("--state-dir", metavar="DIR", type=click.Path(file_okay=False),
              help="The daemon's state dir.  [default: as for `gpudiag serve`]")
def clear(gpu: str | None, all_gpus: bool, reason: str, state_dir: str | None) -> None:
    """Release the XID blockers the daemon holds for a repaired GPU, then re-probe at once.

    A GPU that still fails is blocked again by that probe round. Only a user who can write
    the daemon's state directory (its own user, root) can clear. Exits 0 when the request
    was handed over, 2 when refused or misused, 3 when gpudiag failed.
    """
    from gpudiag.cli.daemon import default_state_dir
    from gpudiag.daemon.clears import request_dir, write_request

    if (gpu is None) == (not all_gpus):
        raise click.UsageError("name exactly one of --gpu UUID or --all")
    if gpu is not None and not (gpu.startswith("GPU-") and is_full_uuid(gpu)):
        raise click.UsageError(f"--gpu {gpu!r} is not a full GPU UUID; `nvidia-smi -L` lists "
                               "them (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)")
    folder = Path(state_dir) if state_dir else default_state_dir()
    if not folder.is_dir():
        raise click.UsageError(f"no daemon state directory at {folder}: pass the --state-dir "
                               "that `gpudiag serve` uses")
    try:
        path = write_request(folder, gpu, reason)
    except OSError as e:
        if e.errno in _REFUSED:
            raise click.UsageError(
                f"you (uid {os.getuid()}) cannot write the daemon's state directory "
                f"{request_dir(folder)}: {e.strerror}. Only its owner or root may clear a "
                "GPU: run this as the daemon's user (e.g. sudo -u gpudiag) or as root") from e
        raise _Failed(f"could not write the clear request into {folder}: "
                      f"{e.strerror or e}") from e
    click.echo(f"clear of {gpu or 'all GPUs'} requested ({path.name}); the running daemon "
               "applies it on its next loop, re-probes at once, and records it in "
               "`gpudiag history`")
