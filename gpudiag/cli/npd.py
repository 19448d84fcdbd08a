"""``gpudiag npd-relay``: node-problem-detector's answer, kept fresh by a sidecar of NPD's pod."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from gpudiag.cli import options
from gpudiag.cli.commands import examples
from gpudiag.core import npd
from gpudiag.core.limits import DEFAULT_DAEMON_WAIT_S
from gpudiag.core.requirement import RequirementError, parse_requirement, parse_timeout

DEFAULT_EVERY_S = 15.0


def _seconds(text: str, name: str) -> float:
    try:
        return parse_timeout(text, name=name)
    except RequirementError as e:
        raise click.UsageError(str(e)) from e


def _check_status_file(path: str) -> None:
    """A status file that could never be written is a usage error at start, not a log line
    every round: its folder (the emptyDir) must exist, and it must be a regular file or
    absent (never a link another container could point elsewhere)."""
    from gpudiag.core.fileio import UnwritableTarget, check_output_target

    if not Path(path).parent.is_dir():
        raise click.UsageError(f"--status-file {path}: its folder does not exist (mount the "
                               "status volume there, as deploy/kubernetes/npd/"
                               "daemonset-patch.yaml does)")
    try:
        kind = check_output_target(path)
    except UnwritableTarget as e:
        raise click.UsageError(f"--status-file {path}: {e}") from e
    if kind != "file":
        raise click.UsageError(f"--status-file {path}: name a regular file")


@click.command("npd-relay",
               short_help="Keep node-problem-detector's answer fresh (a sidecar of NPD).",
               epilog=examples(
                   "gpudiag npd-relay                    # every 15 s into "
                   f"{npd.DEFAULT_STATUS_FILE}",
                   "gpudiag npd-relay --once             # what NPD would be told now",
                   "gpudiag npd-relay --require cuda,jax --every 30"))
@options.require
@click.option("--status-file", "status_file", metavar="PATH",
              help="Where NPD's plugin (deploy/kubernetes/npd/gpudiag-npd.sh) reads the "
              "answer; replaced atomically each round.  [default: "
              f"{npd.DEFAULT_STATUS_FILE}; with --once: none]")
@click.option("--every", "every_text", metavar="S", default=f"{DEFAULT_EVERY_S:g}",
              show_default=True, help="Ask the daemon every S seconds.")
@click.option("--timeout", "timeout_text", metavar="S", default=f"{DEFAULT_DAEMON_WAIT_S:g}",
              show_default=True, help="How long to wait for the daemon's answer.")
@click.option("--daemon-url", metavar="URL",
              help="The gpudiag daemon to ask (only the daemon: no probes run here).  "
              "[default: $GPUDIAG_DAEMON_URL or unix:/run/gpudiag/daemon/gpudiag.sock]")
@click.option("--once", is_flag=True,
              help="Ask once, print NPD's message and exit with NPD's code (0 OK, 1 "
              "problem, 2 unknown): a custom-plugin rule for an NPD that runs on the host.")
def npd_relay(require_text: str, status_file: str | None, every_text: str, timeout_text: str,
              daemon_url: str | None, once: bool) -> None:
    """Ask the local daemon the node-health question, as `gpudiag health` does, and keep
    node-problem-detector's answer in a status file that NPD's plugin reads.

    It runs in a sidecar of NPD's pod (gpudiag's image), so that NPD's container needs no
    gpudiag, no Python and no network (docs/operations.md, "node-problem-detector"). Only
    the daemon is asked, on its socket and only from its user: no answer (daemon down,
    restarting, an impostor) is Unknown, never a problem. A busy node is healthy in use.
    """
    from gpudiag.engine.client import DaemonUrlError, default_url
    from gpudiag.engine.npd_relay import relay, relay_once, write_status

    try:
        requirement = parse_requirement(require_text, node_health=True)
    except RequirementError as e:
        raise click.UsageError(str(e)) from e
    every_s, timeout_s = _seconds(every_text, "--every"), _seconds(timeout_text, "--timeout")
    if status_file is None and not once:
        status_file = npd.DEFAULT_STATUS_FILE
    if status_file is not None:
        _check_status_file(status_file)
    url = daemon_url or default_url()
    try:
        if once:
            import time

            answer, _ = relay_once(url, requirement, timeout_s=timeout_s)
            if status_file is not None:
                write_status(status_file, answer, time.time())
            click.echo(answer.message)
            sys.exit(answer.exit_code)
        assert status_file is not None
        relay(url, requirement, status_file, every_s, timeout_s=timeout_s)
    except DaemonUrlError as e:
        raise click.UsageError(f"--daemon-url (or GPUDIAG_DAEMON_URL): {e}") from e
    except KeyboardInterrupt:
        sys.exit(130)
