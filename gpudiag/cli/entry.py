"""The ``gpudiag`` console entry: a fast path for the calls a job runner makes on every job.

``gpudiag --version`` and a daemon-answered ``gpudiag preflight|health --format kv|json`` (a
Slurm prolog, a pytest session, ``gpudiag run``'s callers) are answered here without click,
the classifier or the probe engine: most of their wall time was Python importing what they
do not use (docs/benchmarks.md, "CLI start"). ``gpudiag probe`` in any format (without
``--watch`` or ``--config``) runs its probes here without click (``gpudiag.cli.probing``,
which the click command calls too), with the same spinner on a terminal and the same
rendering. Everything else, and every case the fast path does not recognize exactly (other
flags, ``--help``, a bad value, a terminal on stderr for a daemon's answer, no daemon answer),
goes to the
click commands in ``gpudiag.cli.commands`` unchanged, which then say what is wrong or run the
probes here. When the daemon was asked and gave no usable answer, that answer (its reason and
the time it took) goes to the click path with the call, which never asks again: one deadline
per call (docs/reference.md). The fast path only asks the daemon the same way
(``gpudiag.engine.client.ask_daemon``) and prints the same bytes with the same exit code.
"""

from __future__ import annotations

import os
import sys

from gpudiag.core.limits import (
    EXIT_BLOCKED,
    EXIT_FAILED,
    EXIT_READY,
    MAX_DEVICES,
)

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (see gpudiag/__init__)
if TYPE_CHECKING:
    from collections.abc import Mapping

    from gpudiag.core.verdict import Verdict
    from gpudiag.engine.answercheck import Question
    from gpudiag.engine.client import DaemonAnswer
    from gpudiag.engine.forkclient import ForkServer
    from gpudiag.engine.jobpython import JobPython
    from gpudiag.engine.wire import RawReply

    # An exit code; the daemon's failed answer for the click path (one ask per call); or
    # None: click answers from scratch (usage errors, a URL it must word).
    Fast = int | DaemonAnswer | None

# The options the fast path understands, per command: every one also exists on the click
# command with the same meaning (tests/test_cli_entry.py checks both lists against click's).
FAST_OPTIONS = {
    "preflight": frozenset({"--require", "--devices", "--min-devices", "--min-free-memory",
                            "--gpus", "--timeout", "--format", "--daemon-url", "--python"}),
    "health": frozenset({"--require", "--timeout", "--format", "--daemon-url", "--python"}),
    "probe": frozenset({"--backend", "--format", "--timeout", "--expected-gpus", "--python"}),
}
# The on/off flags the fast path understands (click is_flag options), per command.
FAST_FLAGS = {"probe": frozenset({"--json", "--wide"})}
# click.IntRange bounds of the integer options, checked here so that click reports the rest.
_INT_RANGES = {"--min-devices": (0, MAX_DEVICES), "--gpus": (1, 64),
               "--expected-gpus": (1, 1024)}
# The formats the fast path prints, per command: probe's text too (its own verdict, rendered
# as the click command renders it); a daemon's verdict in text goes to click's path.
FAST_FORMATS = {"preflight": ("kv", "json"), "health": ("kv", "json"),
                "probe": ("text", "kv", "json")}


def parse_fast(argv: list[str]) -> tuple[str, dict[str, str]] | None:
    """(command, options) when argv is a call the fast path answers exactly; else None.

    A flag maps to ""; ``--json`` becomes ``--format json``, as the click command reads it.
    """
    if len(argv) < 1 or argv[0] not in FAST_OPTIONS:
        return None
    allowed, flags = FAST_OPTIONS[argv[0]], FAST_FLAGS.get(argv[0], frozenset())
    options: dict[str, str] = {}
    rest = argv[1:]
    while rest:
        token = rest.pop(0)
        name, eq, value = token.partition("=")
        if name in options or (name not in allowed and (name not in flags or eq)):
            return None  # a flag it does not know, given twice or given a value: click decides
        if name in flags:
            value = ""
        elif not eq:
            if not rest:
                return None
            value = rest.pop(0)
        options[name] = value
    if "--json" in options:
        if options.setdefault("--format", "json") != "json":
            return None  # --json with another --format: click words the disagreement
    if options.setdefault("--format", "text") not in FAST_FORMATS[argv[0]]:
        return None  # a format this path does not print: click's path
    for name, (low, high) in _INT_RANGES.items():
        if name in options:
            text = options[name]
            if not (text.isascii() and text.isdigit()) or not low <= int(text) <= high:
                return None
    return argv[0], options


def answer_fast(command: str, options: dict[str, str]) -> Fast:
    """Print the verdict and return the exit code; else what the click path needs to answer
    (the daemon's failed answer, so that it never asks again, or None)."""
    if command == "probe":
        return answer_probe(options)
    return answer_daemon(command, options)


def answer_probe(options: dict[str, str]) -> int | None:
    """``gpudiag probe``'s verdict from probes run here; None for a value click must word."""
    from gpudiag.cli.ahead import nvml_ahead

    forker = nvml_ahead(options.get("--backend"))  # first: it runs while the rest imports
    try:
        return _probe_here(options, forker)
    finally:
        if forker is not None:
            forker.close()


def _probe_here(options: dict[str, str], forker: ForkServer | None) -> int | None:
    from gpudiag.cli.probing import (
        BackendListError,
        default_backends,
        parse_backends,
        probe_requirement,
        probe_verdict,
    )
    from gpudiag.core.requirement import RequirementError, parse_timeout
    from gpudiag.engine.jobpython import JobPythonError

    try:
        timeout_s = (parse_timeout(options["--timeout"], name="--timeout")
                     if "--timeout" in options else None)
        names = parse_backends(options.get("--backend", default_backends()))
        requirement = probe_requirement(names)
        python = _job_python(options, ",".join(names))
    except (RequirementError, BackendListError, JobPythonError):
        return None
    expected = options.get("--expected-gpus")
    from gpudiag.cli.settings import backend_settings

    backend_settings(None, explicit=False)  # the node's config file, as the click path reads it
    from gpudiag.cli.spinner import progress

    with progress("probing " + ", ".join(names)):
        verdict = probe_verdict(names, requirement, timeout_s=timeout_s,
                                expected_gpus=None if expected is None else int(expected),
                                python=python, named="--backend" in options,
                                forker=forker)
    return _printed(verdict, options["--format"], wide="--wide" in options)


def answer_daemon(command: str, options: dict[str, str]) -> Fast:
    """Print the daemon's verdict and return the exit code; else the failed answer (or None)
    for the click path, which then runs the probes here without asking the daemon again."""
    import time

    from gpudiag.core.deadlines import RequirementError, daemon_wait_s, parse_timeout
    from gpudiag.engine import wire
    from gpudiag.engine.jobpython import JobPythonError

    try:
        timeout_s = (parse_timeout(options["--timeout"], name="--timeout")
                     if "--timeout" in options else None)
        url = options.get("--daemon-url") or wire.default_url()
        python = _job_python(options, options.get("--require", "cuda"))
    except (RequirementError, JobPythonError):
        return None  # click's path words the usage error
    read_timeout_s = daemon_wait_s(timeout_s)
    if not url.startswith("unix:"):
        return _answer_typed(command, options, url, read_timeout_s, python)
    # On the unix socket, only the daemon's user answers (wire.get checks the peer), and
    # the daemon parses the requirement with the same parser as click's path: a value it
    # refuses (400) goes to click, which words it.
    endpoint = "/v1/health" if command == "health" else "/v1/preflight"
    query = _raw_query(options, os.environ, python)
    if query is None:
        return None  # a backend registered from outside: click's path reads the registry
    started = time.monotonic()
    try:
        status, body, why, refused = wire.get(url, endpoint, query,
                                              env=os.environ, read_timeout_s=read_timeout_s)
    except wire.DaemonUrlError:
        return None
    if status != 200:
        # No daemon, refused, or an error: click's path says why and runs the probes here,
        # with this answer and the time it took (a 400 is a value click words first).
        return _to_click(url, (status, body, why, refused), started, None)
    import json

    from gpudiag.core.recordtext import own_record_text
    from gpudiag.core.version import __version__

    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        data = None
    question = _raw_question(command, options, query)
    if data is not None and (_leaves_proof_here(data) or _does_not_hold(data, question)):
        # A backend to prove in this environment (the click path makes the hybrid answer
        # from this one), or an answer that does not hold (said once, answered here): the
        # typed answer goes to the click path, which never asks again.
        return _to_click(url, (status, body, why, refused), started, question)
    fmt = options["--format"]
    if isinstance(data, dict):
        _as_jobs(data, query, python)
    own = own_record_text(data, fmt, __version__) if data is not None else None
    if own is None:  # another version's record, or an odd one: the typed model checks it
        return _print_record(url, status, body, fmt, time.monotonic() - started)
    text, ready = own
    _echo(text)
    return EXIT_READY if ready else EXIT_BLOCKED


def _to_click(url: str, got: RawReply, started: float,
              question: Question | None) -> Fast:
    """The daemon's answer as the click path takes it (engine.client), with the time it took."""
    import time

    from gpudiag.engine.client import answer_of, reply_of

    return answer_of(url, reply_of(url, *got), time.monotonic() - started, question)


def _job_python(options: dict[str, str], names: str) -> JobPython | None:
    """The job's interpreter when ``--python`` names one or a backend of ``names`` (a
    --require or --backend list) is proven in the job's environment; else None (a question
    about the device layer alone never looks for one). JobPythonError for a bad one."""
    from gpudiag.core.fingerprint_inputs import BUILT_IN, backend_names
    from gpudiag.engine.jobpython import find

    if "--python" not in options and not backend_names(names) & set(BUILT_IN):
        return None
    return find(os.environ, explicit=options.get("--python"))


def _as_jobs(data: dict[str, object], query: Mapping[str, str], python: JobPython | None
             ) -> None:
    """The daemon's record as the job's (engine.route.as_jobs, on the raw record): which
    interpreter was the job's, and preallocation from the job's environment."""
    off = True  # unset: a child gets core.fingerprint_inputs.PREALLOCATION_OFF (probe_environment)
    if "XLA_PYTHON_CLIENT_PREALLOCATE" in os.environ:  # the rule itself costs typing's import
        from gpudiag.core.environment import job_preallocation

        off = job_preallocation(os.environ)
    data["preallocation_disabled"] = "yes" if off else "no"
    evidence = data.get("evidence")
    if python is not None and "fingerprint" in query and isinstance(evidence, dict):
        evidence["job_python"] = python.record()


def _raw_question(command: str, options: dict[str, str], query: Mapping[str, str]
                  ) -> Question:
    """The question ``_raw_query`` asks, as engine/answercheck compares it with the answer.

    Spelled without the requirement parser (not imported here): a spelling that differs
    from the record's only sends the call to the typed path, which parses and checks it.
    """
    from gpudiag.core.sizes import size_bytes
    from gpudiag.engine.answercheck import Question, fingerprint_of, raw_backends

    devices = options.get("--devices")
    gpus, low = options.get("--gpus"), options.get("--min-devices")
    memory = options.get("--min-free-memory", "")
    return Question(raw_backends(options.get("--require", "cuda")),
                    devices=None if devices is None else tuple(
                        d.strip() for d in devices.split(",")),
                    gpus=None if gpus is None else int(gpus),
                    min_devices=None if low is None else int(low),
                    # A floor as typed (200GiB): compared in bytes; one this cannot read
                    # (-1) matches no answer, so it never passes unchecked.
                    min_free_memory_bytes=None if not memory else (
                        -1 if (floor := size_bytes(memory)) is None else floor),
                    question="node_health" if command == "health" else "job",
                    extra={"fingerprint": fingerprint_of(query.get("fingerprint"))})


def _raw_query(options: dict[str, str], env: Mapping[str, str], python: JobPython | None
               ) -> dict[str, str] | None:
    """The daemon's parameters as given: what ``engine.client.query_for`` sends, unparsed;
    None when a required backend's environment declaration is not a built-in one."""
    query = {"require": options.get("--require", "cuda"), "visibility": "1"}
    for option in ("--devices", "--min-devices", "--min-free-memory", "--gpus"):
        if option in options:
            query[option[2:].replace("-", "_")] = options[option]
    from gpudiag.engine.wire import visibility_params

    query.update(visibility_params(env))
    ids = _fingerprint_ids(query["require"], env, python)
    if ids is None:
        return None
    if ids:
        from gpudiag.engine.fingerprint import query_value

        query["fingerprint"] = query_value(ids)
    return query


def _fingerprint_ids(require: str, env: Mapping[str, str], python: JobPython | None
                     ) -> dict[str, str] | None:
    """The job's fingerprint ids of the backends ``require`` names (the built-in
    declarations, gpudiag.core.fingerprint_inputs), read by the job's interpreter; None for a
    name this path does not know."""
    from gpudiag.core.fingerprint_inputs import BUILT_IN, DEVICE_LAYER, backend_names

    names = backend_names(require) - DEVICE_LAYER
    if not names:
        return {}
    if not names <= set(BUILT_IN):
        return None
    from gpudiag.engine.jobpython import find, fingerprint_ids

    return fingerprint_ids({n: BUILT_IN[n] for n in names}, env, python or find(env))


def _leaves_proof_here(data: object) -> bool:
    """Whether a daemon's record leaves a backend to prove here (evidence.proof)."""
    evidence = data.get("evidence") if isinstance(data, dict) else None
    proof = evidence.get("proof") if isinstance(evidence, dict) else None
    return isinstance(proof, dict) and any(
        isinstance(e, dict) and e.get("where") == "prove_here" for e in proof.values())


def _does_not_hold(data: object, question: Question) -> bool:
    """Whether a daemon's record fails engine/answercheck for the question asked."""
    from gpudiag.engine.answercheck import check_answer

    return check_answer(data, question) is not None


def _print_record(url: str, status: int, body: bytes, fmt: str, waited_s: float) -> Fast:
    """A daemon's record read with the typed model, printed; else the unusable answer, which
    click's path explains in the evidence of the probes it runs instead."""
    from gpudiag.engine.client import answer_of, reply_of

    answer = answer_of(url, reply_of(url, status, body, "", False), waited_s, None)
    verdict = answer.verdict
    if verdict is None:
        return answer
    return _printed(verdict, fmt)


def _answer_typed(command: str, options: dict[str, str], url: str, read_timeout_s: float,
                  python: JobPython | None) -> Fast:
    """Over TCP (no peer check): the requirement parsed here, the answer read typed."""
    from gpudiag.core.requirement import RequirementError, parse_requirement
    from gpudiag.engine.client import DaemonUrlError, ask_daemon

    try:
        min_devices = options.get("--min-devices")
        gpus = options.get("--gpus")
        requirement = parse_requirement(
            options.get("--require", "cuda"), devices=options.get("--devices"),
            min_devices=None if min_devices is None else int(min_devices),
            min_free_memory=options.get("--min-free-memory"),
            gpus=None if gpus is None else int(gpus), node_health=command == "health")
        answer = ask_daemon(url, requirement, read_timeout_s=read_timeout_s, python=python)
    except (RequirementError, DaemonUrlError):
        return None  # click's path words the usage error
    verdict = answer.verdict
    if verdict is None:
        return answer  # no daemon, or refused: click's path says why and runs the probes here
    from gpudiag.engine.client import prove_here
    from gpudiag.engine.route import as_jobs

    if prove_here(verdict):
        return answer  # a backend to prove in this environment: click's path (hybrid)
    return _printed(as_jobs(verdict, requirement, os.environ, python), options["--format"])


def _printed(verdict: Verdict, fmt: str, *, wide: bool = False) -> int:
    """Print the verdict as the click commands' ``--format`` does; its exit code."""
    if fmt == "text":
        from gpudiag.cli.render import render_text

        render_text(verdict, sys.stdout, color=sys.stdout.isatty(), wide=wide)
    else:
        _echo(verdict.json() + "\n" if fmt == "json" else verdict.kv())
    return EXIT_READY if verdict.ready else EXIT_BLOCKED


def _echo(text: str) -> None:
    """Write as click.echo does: ANSI codes stripped when stdout is not a terminal."""
    if "\x1b" in text:
        import click  # a rare record with escape codes in its evidence: click strips them

        click.echo(text, nl=False)
        return
    sys.stdout.write(text)
    sys.stdout.flush()


def main() -> int:
    """Console entry point: the fast path when it applies, else the click commands."""
    argv = sys.argv[1:]
    if argv == ["--version"]:
        from gpudiag.core.version import __version__

        print(f"gpudiag, version {__version__}")  # click.version_option's words
        return 0
    fast = parse_fast(argv)
    if fast is not None and fast[0] != "probe" and sys.stderr.isatty():
        fast = None  # a terminal gets a spinner while the click path probes here
    if fast is not None:
        # The same last lines of defence as click's standalone mode and
        # gpudiag.cli.commands.main around it, without click.
        try:
            code = answer_fast(*fast)
        except BrokenPipeError:
            _pacify()
            return 1  # what click does when the reader went away
        except (KeyboardInterrupt, EOFError):
            # click's words and code for a Ctrl-C inside a command (its blank line closes the
            # terminal's ^C), so that both paths end an interrupted probe alike.
            print("\nAborted!", file=sys.stderr)
            return 1
        except Exception as e:
            from gpudiag.cli.interrupts import interrupted

            if interrupted(e):  # a Ctrl-C whose unwinding raised a second error
                print("\nAborted!", file=sys.stderr)
                return 1
            print(f"gpudiag: internal error: {type(e).__name__}: {e}", file=sys.stderr)
            return EXIT_FAILED
        if isinstance(code, int):
            return code
        if code is not None:  # the daemon was asked and did not do: click's path never re-asks
            from gpudiag.cli.commands import main as click_main

            click_main(asked=code)
            return 0
    from gpudiag.cli.commands import main as click_main

    click_main()
    return 0


def run() -> None:
    """The ``gpudiag`` program (console script, ``python -m gpudiag``): ``main``, then the end.

    When ``main`` returns (the fast path, ``--version``) and nothing is left for Python's
    shutdown to do but take its modules apart (no atexit callback, no other thread, stdout
    and stderr flushed), the process ends at once: that teardown was 11 ms of a 120 ms
    ``gpudiag probe`` (docs/benchmarks.md, "Probe overhead"). Anything else, and every
    click path (which exits by SystemExit), ends as Python ends.
    """
    code = main()
    import atexit

    threading = sys.modules.get("threading")
    if atexit._ncallbacks() == 0 and (threading is None or threading.active_count() == 1):
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except OSError:
            sys.exit(code)  # a reader gone: Python's own shutdown says so, as without this
        os._exit(code)
    sys.exit(code)


def _pacify() -> None:
    """After a broken pipe: no second error when Python flushes stdout at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


if __name__ == "__main__":
    run()
