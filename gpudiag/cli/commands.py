"""The thin click layer: parse flags, call the library, render, map to exit codes.

Exit codes (docs/reference.md): 0 ready, 1 blocked, 2 usage or configuration error, 3 gpudiag itself
failed.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from gpudiag.cli import options, probing
from gpudiag.cli.spinner import progress
from gpudiag.cli.watch import watch_command, watch_option
from gpudiag.core import registry
from gpudiag.core.limits import (
    EXIT_BLOCKED,
    EXIT_FAILED,
    EXIT_READY,
    MAX_DEVICES,
)
from gpudiag.core.requirement import (
    RequirementError,
    parse_requirement,
    parse_timeout,
)
from gpudiag.core.verdict import Requirement, Verdict
from gpudiag.core.version import __version__


class Failed(click.ClickException):
    """gpudiag itself could not do its job (exit 3), as opposed to a blocked host (exit 1)."""

    exit_code = EXIT_FAILED


def _usage(message: str) -> click.UsageError:
    return click.UsageError(message)


def _timeout(value: str | None, name: str = "--timeout") -> float | None:
    if value is None:
        return None
    try:
        return parse_timeout(value, name=name)
    except RequirementError as e:
        raise _usage(str(e)) from e


def _emit(verdict: Verdict, fmt: str, wide: bool = False) -> None:
    if fmt == "json":
        click.echo(verdict.json())
    elif fmt == "kv":
        click.echo(verdict.kv(), nl=False)
    else:
        from gpudiag.cli.render import render_text

        render_text(verdict, sys.stdout, color=sys.stdout.isatty(), wide=wide)


def examples(*lines: str) -> str:
    """A help epilog of example command lines that click prints as written."""
    return "\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines)


def check_record_path(path: str | None) -> None:
    """A --record path that cannot be written is a usage error, found before any probe runs."""
    if path is None:
        return
    from gpudiag.core.fileio import UnwritableTarget, check_output_target

    target = Path(path)
    folder = target.parent
    if target.is_dir():
        raise _usage(f"could not write --record {path}: Is a directory (name a file in it, "
                     f"e.g. {target / 'verdict.json'})")
    try:
        if check_output_target(path) != "file":
            return  # a stream (stdout, a FIFO, a tty): written in place
    except UnwritableTarget as e:
        raise _usage(f"could not write --record {path}: {e}") from e
    if not folder.is_dir():
        raise _usage(f"could not write --record {path}: No such file or directory (the folder "
                     f"{folder} does not exist: create it with mkdir -p {folder}, or name a "
                     "file in an existing folder)")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise _usage(f"could not write --record {path}: Permission denied (you cannot write "
                     f"into {folder}: name a file in a folder you can write)")


def _record(verdict: Verdict, path: str | None) -> None:
    if path is None:
        return
    from gpudiag.core.fileio import UnwritableTarget, write_failure, write_output

    try:
        # A file: the old one or the new, never half; a stream: written in place.
        write_output(path, verdict.json() + "\n")
    except UnwritableTarget as e:
        raise _usage(f"could not write --record {path}: {e}") from e
    except OSError as e:
        raise Failed(f"could not write --record {path}: {write_failure(e)}") from e


class LazyGroup(click.Group):
    """A group whose heavier subcommands load only when they run: `probe` starts fast."""

    lazy: dict[str, str] = {"serve": "gpudiag.cli.daemon:serve",
                            "history": "gpudiag.cli.daemon:history",
                            "run": "gpudiag.cli.run:run",
                            "clear": "gpudiag.cli.clear:clear",
                            "fleet": "gpudiag.cli.fleet:fleet",
                            "qualify": "gpudiag.cli.qualify:qualify",
                            "explain": "gpudiag.cli.explain:explain",
                            "fingerprint": "gpudiag.cli.fingerprint:fingerprint",
                            "npd-relay": "gpudiag.cli.npd:npd_relay"}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy:
            module, attr = self.lazy[cmd_name].split(":")
            command: click.Command = getattr(importlib.import_module(module), attr)
            return command
        return super().get_command(ctx, cmd_name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]},
             epilog=examples(
                 "gpudiag probe                       # this host at a glance",
                 "gpudiag preflight --require jax --gpus 1",
                 "gpudiag health                      # for Slurm health checks",
                 "gpudiag COMMAND --help              # each command's own examples",
                 "",
                 "Contracts: docs/reference.md. No GPU? docs/try-without-a-gpu.md"))
@click.version_option(__version__, prog_name="gpudiag")
def cli() -> None:
    """gpudiag: can this job's backend really initialize on this host's GPUs now, and if
    not, why?

    Every probe runs in an isolated child process with a deadline. The verdict's
    gpu_validation_blocker is `none` or a stable reason code, with evidence.
    """


_wide_option = click.option("--wide", is_flag=True,
                            help="Full GPU UUIDs in the text output (lines may be wider than "
                            "the terminal).")


@cli.command(short_help="Probe every backend and GPU here and show what blocks them.",
             epilog=examples(
                 "gpudiag probe                          # every backend, every GPU",
                 "gpudiag probe --backend host,nvml,cuda # the NVIDIA stack only",
                 "gpudiag probe --backend jax:cpu,iree:local-task   # no GPU needed",
                 "gpudiag probe --format json | jq .gpu_validation_blocker",
                 "gpudiag probe --expected-gpus 8        # fewer than 8 is gpu_missing",
                 "gpudiag probe --backend nvml --watch   # every 2 s, redrawn in place"))
@click.option("--backend", "backend_text", default=probing.default_backends(),
              show_default=True, metavar="LIST", help="Backends to probe, comma-separated "
              "(jax:cpu and iree:local-task pick a platform).")
@click.option("--format", "fmt", type=click.Choice(["text", "json", "kv"]), default=None,
              help="Output format: text for people, json (the verdict record), kv "
              "(key=value lines).  [default: text]")
@click.option("--json", "as_json", is_flag=True, help="Same as --format json.")
@click.option("--timeout", "timeout_text", metavar="S",
              help="Deadline in seconds for each probe child.  [default: per backend]")
@click.option("--expected-gpus", type=click.IntRange(1, 1024), metavar="N",
              help="NVIDIA GPUs this node must show (PCI, NVML, cuInit); fewer is the "
              "blocker gpu_missing. Checked by probes run here, not by a daemon.")
@options.python
@_wide_option
@watch_option
@options.config
def probe(backend_text: str, fmt: str | None, as_json: bool, timeout_text: str | None,
          expected_gpus: int | None, python_path: str | None, wide: bool,
          watch_text: str | None) -> None:
    """Probe every backend and device and show blockers with their remediation.

    JAX and IREE run under the job's interpreter (--python); without --backend, a backend
    the job's environment does not have is not checked (a warning), never a blocker.
    Exits 0 when everything probed is ready, 1 when blocked, 2 on bad flags, 3 when gpudiag
    itself failed.
    """
    if as_json and fmt not in (None, "json"):
        raise _usage(f"--json and --format {fmt} disagree; give one of them")
    timeout_s = _timeout(timeout_text)
    try:
        names = probing.parse_backends(backend_text)
    except probing.BackendListError as e:
        raise _usage(str(e)) from e
    try:
        requirement = probing.probe_requirement(names)
    except RequirementError as e:
        raise _usage(f"--backend: {e}") from e
    python = options.job_python(python_path, needed=any(
        registry.environment_dependent(n.split(":")[0]) for n in names))
    named = (click.get_current_context().get_parameter_source("backend_text")
             != click.core.ParameterSource.DEFAULT)

    def produce() -> Verdict:
        return probing.probe_verdict(names, requirement, timeout_s=timeout_s,
                                     expected_gpus=expected_gpus, python=python, named=named)

    fmt = "json" if as_json else fmt or "text"
    if watch_text is not None:
        sys.exit(watch_command(produce, watch_text, "gpudiag probe --backend " + ",".join(names),
                               fmt, wide))
    with progress("probing " + ", ".join(names)):
        verdict = produce()
    _emit(verdict, fmt, wide)
    sys.exit(EXIT_READY if verdict.ready else EXIT_BLOCKED)


# The options of the commands that answer a question (preflight, health), in help order.
_ANSWER_OPTIONS = (
    click.option("--timeout", "timeout_text", metavar="S",
                 help="Deadline per probe, in seconds.  [default: per backend]"),
    click.option("--format", "fmt", type=click.Choice(["text", "json", "kv"]),
                 default="text", show_default=True, help="Output format."),
    click.option("--record", "record_path", metavar="PATH", type=click.Path(dir_okay=False),
                 help="Also write the verdict JSON to PATH atomically."),
    click.option("--daemon-url", metavar="URL",
                 help="Ask this gpudiag daemon first (http://HOST:PORT also works); inline "
                 "probes if none answers or the socket's peer is not the daemon's user "
                 "($GPUDIAG_DAEMON_USER).  [default: $GPUDIAG_DAEMON_URL or "
                 "unix:/run/gpudiag/daemon/gpudiag.sock]"),
    click.option("--no-daemon", is_flag=True,
                 help="Always run the probes here, never ask a daemon."),
    options.python,
)


def _answer_options(command: Callable[..., None]) -> Callable[..., None]:
    """Add the options every question-answering command takes."""
    for option in reversed(_ANSWER_OPTIONS):
        command = option(command)
    return _wide_option(command)


@cli.command(short_help="Can a job with this requirement start here now? Exit 0 or 1.",
             epilog=examples(
                 "gpudiag preflight                            # one CUDA GPU, every GPU usable",
                 "gpudiag preflight --require jax --gpus 2     # 2 healthy free GPUs for JAX",
                 "gpudiag preflight --require iree:local-task  # IREE on the CPU",
                 "gpudiag preflight --format kv --record /tmp/verdict.json",
                 "gpudiag preflight --no-daemon --devices 0,1 --min-free-memory 8GiB"))
@options.require
@click.option("--devices", "devices_text", metavar="LIST",
              help="Devices the job will use: indices among the visible GPUs, full UUIDs, "
              "unique UUID prefixes (as the table shows them) or PCI bus ids.")
@click.option("--min-devices", type=click.IntRange(0, MAX_DEVICES), metavar="N",
              help="At least N usable GPUs among --devices (else the visible ones), each "
              "of them usable: for GPUs a scheduler already gave the job (the Slurm Prolog "
              "asks --devices $SLURM_JOB_GPUS --min-devices N).  [default: 1 for a GPU "
              "requirement]")
@click.option("--min-free-memory", "min_free_text", metavar="SIZE",
              help="Free memory each selected GPU needs: 8GiB, 8GB, or bytes.")
@click.option("--gpus", type=click.IntRange(1, 64), metavar="N",
              help="Job readiness on N GPUs the job may still choose: ready when at least N "
              "visible GPUs are healthy and free (not used by other processes); the verdict "
              "names them, and a fault on another GPU is then a warning. Without it every "
              "visible GPU must be usable (see --min-devices).")
@_answer_options
@click.option("--expected-gpus", type=click.IntRange(1, 1024), metavar="N",
              help="NVIDIA GPUs this node must show (PCI, NVML, cuInit); fewer is the "
              "blocker gpu_missing. Checked by probes run here, not by a daemon.")
@options.config
def preflight(require_text: str, devices_text: str | None, min_devices: int | None,
              min_free_text: str | None, gpus: int | None, timeout_text: str | None, fmt: str,
              record_path: str | None, daemon_url: str | None, no_daemon: bool,
              python_path: str | None, expected_gpus: int | None, wide: bool) -> None:
    """The verdict for a job's requirement: exit 0 ready, 1 blocked, 2 usage, 3 failure."""
    try:
        requirement = parse_requirement(require_text, devices=devices_text,
                                        min_devices=min_devices, min_free_memory=min_free_text,
                                        gpus=gpus)
    except RequirementError as e:
        raise _usage(str(e)) from e
    _answer(requirement, "preflight " + require_text, timeout_text, fmt, record_path,
            daemon_url, no_daemon, expected_gpus, wide=wide, python_path=python_path)


@cli.command(short_help="Is anything on this node broken? Busy GPUs count as healthy.",
             epilog=examples(
                 "gpudiag health                      # exit 0 healthy, 1 broken",
                 "gpudiag health --require cuda,jax --format kv",
                 "gpudiag health --daemon-url http://127.0.0.1:9477",
                 "gpudiag health --watch 10           # every 10 s until Ctrl-C"))
@options.require
@_answer_options
@watch_option
@options.config
def health(require_text: str, timeout_text: str | None, fmt: str, record_path: str | None,
           daemon_url: str | None, no_daemon: bool, python_path: str | None, wide: bool,
           watch_text: str | None) -> None:
    """Node health: is anything on this node broken? Busy GPUs are healthy in use.

    The question for a Slurm HealthCheckProgram or node-problem-detector: exit 0 when
    nothing is broken, 1 when something is (the record says what), 2 usage, 3 failure.
    Probes never touch a GPU that another process uses.
    """
    try:
        requirement = parse_requirement(require_text, node_health=True)
    except RequirementError as e:
        raise _usage(str(e)) from e
    _answer(requirement, "health " + require_text, timeout_text, fmt, record_path, daemon_url,
            no_daemon, wide=wide, watch_text=watch_text, python_path=python_path)


def _answer(requirement: Requirement, what: str, timeout_text: str | None, fmt: str,
            record_path: str | None, daemon_url: str | None, no_daemon: bool,
            expected_gpus: int | None = None, *, wide: bool = False,
            watch_text: str | None = None, python_path: str | None = None) -> None:
    """Ask (daemon first, else inline), record, print, exit 0 ready or 1 blocked."""
    timeout_s = _timeout(timeout_text)
    from gpudiag.engine.route import needs_job_python

    python = options.job_python(python_path, needed=needs_job_python(requirement))
    check_record_path(record_path)  # before the probes: a typo must not cost a probe round
    from gpudiag.engine.client import DaemonAnswer, DaemonUrlError, DaemonUserError
    from gpudiag.engine.route import daemon_else_inline

    # What the console entry's fast path already got from the daemon for this very call (it
    # parsed the same argv): one deadline per call, the daemon is not asked twice.
    asked = click.get_current_context().obj
    asked = asked if isinstance(asked, DaemonAnswer) else None
    if watch_text is not None:
        if record_path is not None:
            raise _usage("--record writes one verdict; --watch shows many: give one of them")

        def produce() -> Verdict:
            return daemon_else_inline(requirement, url=daemon_url, use_daemon=not no_daemon,
                                      timeout_s=timeout_s, python=python).verdict

        sys.exit(watch_command(produce, watch_text, "gpudiag " + what, fmt, wide))

    with progress(what):
        try:
            routed = daemon_else_inline(requirement, url=daemon_url, use_daemon=not no_daemon,
                                        timeout_s=timeout_s, expected_gpus=expected_gpus,
                                        asked=asked, python=python)
        except DaemonUrlError as e:
            raise _usage(str(e) if isinstance(e, DaemonUserError)
                         else f"--daemon-url (or GPUDIAG_DAEMON_URL): {e}") from e
    from gpudiag.core.redact import redact_text
    from gpudiag.core.termsafe import terminal_safe

    if routed.daemon_refused:  # an impostor, or a misconfiguration: say so, not only in evidence
        # The reason may quote the daemon's answer: no control character reaches the terminal.
        reason = terminal_safe(redact_text(routed.daemon_reason or ""), one_line=True)
        click.echo(f"gpudiag: {reason}; ran the probes here", err=True)
    elif (daemon_url is not None and routed.daemon_reason is not None
          and not routed.daemon_untrusted):  # an answer that did not hold was said already
        # An explicit --daemon-url that did not answer: say so, not only in the evidence
        # (the default URL's silence is the normal no-daemon case and stays quiet).
        reason = terminal_safe(redact_text(routed.daemon_reason), one_line=True)
        click.echo(f"gpudiag: {reason}; ran the probes here", err=True)
    verdict = routed.verdict
    _emit(verdict, fmt, wide)  # shown even when writing the record then fails
    _record(verdict, record_path)
    sys.exit(EXIT_READY if verdict.ready else EXIT_BLOCKED)


def main(argv: list[str] | None = None, *, asked: object = None) -> Any:
    """Console entry point: click's own exits for usage errors; 3 when gpudiag itself fails.

    ``asked``: the daemon's failed answer the console entry's fast path already got for this
    argv (an ``engine.client.DaemonAnswer``), so that the command does not ask again.
    """
    try:
        return cli.main(args=argv, prog_name="gpudiag", standalone_mode=True, obj=asked)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        click.echo("gpudiag: interrupted", err=True)
        sys.exit(130)
    except Exception as e:  # the last line of defence: a message, never a traceback
        from gpudiag.cli.interrupts import interrupted

        if interrupted(e):  # a Ctrl-C whose unwinding raised a second error: click's words
            click.echo("\nAborted!", err=True)
            sys.exit(1)
        click.echo(f"gpudiag: internal error: {type(e).__name__}: {e}", err=True)
        sys.exit(EXIT_FAILED)
