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


# How many of the daemon's newest verdict changes to search for the GPUs it has seen.
_KNOWN_FROM = 200


@click.command(short_help="Release the XID blockers the daemon holds for a repaired GPU.",
               epilog=examples(
                   "gpudiag clear --gpu 3 --reason 'nvidia-smi -r -i 3'",
                   "gpudiag clear --gpu GPU-5f3a2b1c --reason 'reseated'",
                   "gpudiag clear --gpu 0000:1b:00.0 --reason 'reseated'",
                   "sudo -u gpudiag gpudiag clear --all --reason 'node rebooted'",
                   "gpudiag clear --gpu 2 --no-repair --reason 'false alarm: passed dcgmi diag'"))
@click.option("--gpu", "gpu", metavar="GPU",
              help="The repaired GPU: its index, full UUID, a unique UUID prefix (as in "
                   "`gpudiag probe`'s table) or PCI bus id, as `nvidia-smi -i` takes them.")
@click.option("--all", "all_gpus", is_flag=True, help="Clear every GPU.")
@click.option("--reason", default="", metavar="TEXT",
              help="Why (the repair done); recorded in the history with your uid.")
@click.option("--no-repair", is_flag=True,
              help="Nothing was repaired: the blockers this clears were false (counted in "
                   "gpudiag_false_blockers_total{code}; docs/numbers.md gives the budget).")
@click.option("--state-dir", metavar="DIR", type=click.Path(file_okay=False),
              help="The daemon's state dir.  [default: as for `gpudiag serve`]")
def clear(gpu: str | None, all_gpus: bool, reason: str, no_repair: bool,
          state_dir: str | None) -> None:
    """Release the XID blockers the daemon holds for a repaired GPU, then re-probe at once.

    A GPU that still fails is blocked again by that probe round. Only a user who can write
    the daemon's state directory (its own user, root) can clear. Exits 0 when the request
    was handed over, 2 when refused or misused, 3 when gpudiag failed.
    """
    from gpudiag.cli.daemon import default_state_dir
    from gpudiag.daemon.clears import request_dir, write_request

    if (gpu is None) == (not all_gpus):
        raise click.UsageError("name exactly one of --gpu GPU or --all")
    folder = Path(state_dir) if state_dir else default_state_dir()
    if not folder.is_dir():
        raise click.UsageError(f"no daemon state directory at {folder}: pass the --state-dir "
                               "that `gpudiag serve` uses")
    if gpu is not None and not (gpu.startswith(("GPU-", "MIG-")) and is_full_uuid(gpu)):
        gpu = _full_uuid(gpu, folder)
    try:
        write_request(folder, gpu, reason, no_repair=no_repair)
    except OSError as e:
        if e.errno in _REFUSED:
            raise click.UsageError(
                f"you (uid {os.getuid()}) cannot write the daemon's state directory "
                f"{request_dir(folder)}: {e.strerror}. Only its owner or root may clear a "
                "GPU: run this as the daemon's user (e.g. sudo -u gpudiag) or as root") from e
        raise _Failed(f"could not write the clear request into {folder}: "
                      f"{e.strerror or e}") from e
    click.echo(f"clear of {gpu or 'all GPUs'}{' (no repair: a false blocker)' if no_repair else ''}"
               " requested; the running daemon "
               "applies it on its next loop, re-probes at once, and records it in "
               "`gpudiag history`")


def _full_uuid(selector: str, folder: Path) -> str:
    """The full UUID an index, UUID prefix or PCI bus id names, by the daemon's history."""
    from gpudiag.daemon.clears import ClearRequestError, known_in_history, resolve_gpu
    from gpudiag.daemon.store import HistoryError, default_path

    try:
        known = known_in_history(folder, _KNOWN_FROM)
    except HistoryError as e:
        raise _Failed(str(e)) from e
    if known is None:
        raise click.UsageError(f"--gpu {selector!r} is not a full GPU UUID and there is no "
                               f"daemon history at {default_path(folder)} to look it up in; "
                               "pass the full UUID (`nvidia-smi -L` lists them)")
    try:
        return resolve_gpu(selector, known).uuid
    except ClearRequestError as e:
        raise click.UsageError(f"--gpu: {e}") from e
