"""``gpudiag run``: preflight, admit GPUs, run ARGV with the exact environment, close out.

Exit codes (docs/reference.md): the child's own; 128+N when it died by signal N; 125 when gpudiag
refused (blocked, not admitted) or failed before launch; 126/127 when ARGV cannot be
executed / is not found, as ``env`` and ``docker run`` do.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import click

from gpudiag.cli import options
from gpudiag.cli.commands import examples
from gpudiag.core.environment import XLA_ALLOCATOR_CHOICES, XLA_ALLOCATOR_ENV
from gpudiag.core.limits import EXIT_REFUSED, MAX_DEVICES
from gpudiag.core.requirement import RequirementError, parse_requirement, parse_size, parse_timeout

# A docker image reference: never an option, no spaces or control characters.
_IMAGE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,511}$")


class RunUsageError(click.UsageError):
    """Bad flags for ``gpudiag run``: 125, since ARGV was never started."""

    exit_code = EXIT_REFUSED


class RunFailed(click.ClickException):
    """gpudiag failed before launch."""

    exit_code = EXIT_REFUSED


class RunCommand(click.Command):
    """A command whose usage errors exit 125: ARGV was never started."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except RunUsageError:
            raise
        except click.UsageError as e:
            raise RunUsageError(e.format_message(), ctx=e.ctx) from e


def _seconds(text: str | None, name: str, *, zero_ok: bool = False) -> float | None:
    if text is None:
        return None
    if zero_ok and text.strip() in ("0", "0.0"):
        return 0.0
    try:
        return parse_timeout(text, name=name)
    except RequirementError as e:
        raise RunUsageError(str(e)) from e


def default_artifacts_root() -> Path:
    """$GPUDIAG_ARTIFACTS_DIR, else $XDG_STATE_HOME/gpudiag/runs (~/.local/state/gpudiag/runs):
    never inside whatever checkout the job happens to start in."""
    if os.environ.get("GPUDIAG_ARTIFACTS_DIR"):
        return Path(os.environ["GPUDIAG_ARTIFACTS_DIR"])
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "gpudiag" / "runs"


def _run_folder(root: Path) -> Path:
    """A fresh private run folder (``STAMP-xxxxxxxx``, 0700) under the artifacts root
    (``--artifacts DIR``, else the default): one run never replaces another's files."""
    from gpudiag.runner.artifacts import UntrustedFolder, new_run_folder

    try:
        return new_run_folder(root)
    except UntrustedFolder as e:
        raise RunFailed(f"refusing the artifacts root: {e}; ARGV was not started") from e
    except OSError as e:
        raise RunFailed(f"cannot create a run folder under {root}: {e.strerror or e}; ARGV "
                        "was not started") from e


@click.command("run", cls=RunCommand, context_settings={"ignore_unknown_options": False,
                                        "allow_interspersed_args": False},
               short_help="Admit GPUs, run a command on them, and write its closeout.",
               epilog=examples(
                   "gpudiag run -- python train.py                # one free GPU, CUDA",
                   "gpudiag run --require jax --gpus 2 -- python train.py",
                   "gpudiag run --timeout 3600 --artifacts /scratch/runs -- ./job.sh",
                   "gpudiag run --image nvcr.io/nvidia/jax:25.04 -- python -c 'import jax'"))
@options.require
@click.option("--gpus", type=click.IntRange(0, MAX_DEVICES), default=None, metavar="N",
              help="GPUs (or MIG instances) to admit.  [default: 1 for a GPU requirement, "
              "else 0]")
@click.option("--min-free-memory", "min_free_text", metavar="SIZE",
              help="Free memory each admitted GPU must have, e.g. 8GiB.")
@click.option("--timeout", "timeout_text", metavar="S",
              help="End the whole process tree after S seconds (SIGTERM, grace, SIGKILL).")
@click.option("--kill-grace", "grace_text", default="5", show_default=True, metavar="S",
              help="Seconds between SIGTERM and SIGKILL when --timeout fires.")
@click.option("--lock-timeout", "lock_timeout_text", default="60", show_default=True,
              metavar="S", help="How long to wait for GPUs that other jobs hold (0: do not wait).")
@click.option("--artifacts", "artifacts_text", metavar="DIR",
              help="The folder under which each run gets a fresh private folder "
              "(STAMP-xxxxxxxx) for plan.json, logs, result.json and the closeout.  "
              "[default: $GPUDIAG_ARTIFACTS_DIR, else "
              "$XDG_STATE_HOME/gpudiag/runs, i.e. ~/.local/state/gpudiag/runs]")
@click.option("--image", metavar="IMAGE",
              help="Run ARGV in this container image with one `docker run` (Docker's "
              "CLI on PATH, 28+ for CDI; not podman, which set-up installs only for "
              "gpudiag's own image tests).")
@click.option("--lock-dir", "lock_dir_text", metavar="DIR",
              help="Folder of the per-UUID lock files.  [default: $GPUDIAG_LOCK_DIR, "
              "/run/gpudiag/locks, or $XDG_RUNTIME_DIR/gpudiag/locks]")
@click.option("--daemon-url", metavar="URL", help="Ask this gpudiag daemon for the verdict "
              "first; inline probes when none answers.  [default: $GPUDIAG_DAEMON_URL or "
              "unix:/run/gpudiag/daemon/gpudiag.sock]")
@click.option("--no-daemon", is_flag=True, help="Run the probes here; do not ask a daemon.")
@click.option("--xla-allocator", type=click.Choice(XLA_ALLOCATOR_CHOICES),
              envvar=XLA_ALLOCATOR_ENV, default="platform", show_default=True,
              help="platform: XLA_PYTHON_CLIENT_ALLOCATOR=platform and no CUDA host allocator "
              "(memory given back, slower; the default for shared GPUs); keep: leave both to "
              "the job (XLA's BFC allocator unless it sets one). Preallocation stays off "
              "either way (docs/runner.md).  [env: GPUDIAG_XLA_ALLOCATOR]")
@options.python
@click.argument("argv", nargs=-1, required=True, type=click.UNPROCESSED, metavar="-- ARGV...")
def run(require_text: str, gpus: int | None, min_free_text: str | None,
        timeout_text: str | None, grace_text: str, lock_timeout_text: str,
        artifacts_text: str | None, image: str | None, lock_dir_text: str | None,
        daemon_url: str | None, no_daemon: bool, xla_allocator: str,
        python_path: str | None, argv: tuple[str, ...]) -> None:
    """Admit GPUs and run ARGV with the exact child environment, then write the closeout.

    ARGV never starts when the host is blocked or no GPU can be admitted (exit 125; the
    closeout names the blocker with its evidence). Otherwise the exit code is the child's
    own, or 128+N when it died by signal N. JAX and IREE are proven under the job's
    interpreter: --python, else ARGV's own Python (python3 train.py, or a script whose #!
    line names one), else the job's venv or the first python3 on PATH.
    """
    from gpudiag.runner.execute import RunnerError, RunOptions, execute

    try:
        requirement = parse_requirement(require_text)
        floor = parse_size(min_free_text) if min_free_text is not None else None
    except RequirementError as e:
        raise RunUsageError(str(e)) from e
    if image is not None and not _IMAGE_RE.match(image):
        # The image lands in `docker run`'s argv: "-..." would be read as a docker option.
        raise RunUsageError(f"--image {image!r} is not an image reference; accepted: "
                            "[REGISTRY/]NAME[:TAG][@DIGEST], e.g. nvcr.io/nvidia/jax:25.04")
    if python_path is not None:
        options.job_python(python_path, error=RunUsageError)  # exit 125 naming it, as usage
    grace = _seconds(grace_text, "--kill-grace")
    lock_timeout = _seconds(lock_timeout_text, "--lock-timeout", zero_ok=True)
    assert grace is not None and lock_timeout is not None
    from gpudiag.engine.client import DaemonUrlError, DaemonUserError, default_url

    url = None if no_daemon else (daemon_url or default_url())
    n = gpus if gpus is not None else (1 if requirement.needs_gpu else 0)
    run_options = RunOptions(
        argv=tuple(argv), requirement=requirement,
        artifacts=_run_folder(Path(artifacts_text) if artifacts_text
                              else default_artifacts_root()),
        lock_dir=Path(lock_dir_text) if lock_dir_text else None,
        gpus=n, min_free_memory_bytes=floor, timeout_s=_seconds(timeout_text, "--timeout"),
        kill_grace_s=grace, lock_timeout_s=lock_timeout, image=image, daemon_url=url,
        xla_allocator=xla_allocator, python=python_path)
    try:
        outcome = execute(run_options, out=sys.stdout.buffer, err=sys.stderr.buffer)
    except DaemonUrlError as e:
        raise RunUsageError(
            str(e) if isinstance(e, DaemonUserError)
            else f"--daemon-url (or GPUDIAG_DAEMON_URL): {e}") from e
    except RunnerError as e:
        raise RunFailed(f"{e}; ARGV was not started") from e
    except (OSError, ValueError) as e:  # the boundary: a message and 125, never a traceback
        raise RunFailed(f"failed before or around launch: {type(e).__name__}: {e}") from e
    sys.exit(outcome.exit_code)
