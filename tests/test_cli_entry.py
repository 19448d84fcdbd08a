"""The console entry's fast path: same bytes and exit codes as the click commands, fewer imports.

A real `gpudiag serve` on the fakes answers over its unix socket; each call runs once through
``gpudiag.cli.entry`` (what ``gpudiag`` and ``python -m gpudiag`` run) and once straight
through the click commands (``gpudiag.cli.commands.main``), and the two must agree.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpudiag.cli import commands
from gpudiag.cli.entry import _INT_RANGES, FAST_FLAGS, FAST_FORMATS, FAST_OPTIONS, parse_fast
from gpudiag.core.version import __version__
from gpudiag.engine.client import query_string
from tests.fakes.build import FakeDriver
from tests.support.daemon import Daemon, daemon_toml, host_env, write_config
from tests.support.host import entry_in_child

CLICK_MAIN = "import sys; from gpudiag.cli.commands import main; sys.exit(main())"
# What the daemon-answered path must never load: the terminal renderer, process tables,
# metrics, the classifier, probe engine and router, click, the stdlib HTTP client and URL
# parser (ipaddress), entry points; and, for this version's own record on the unix socket,
# the typed verdict model, the requirement parser and backend registry, and dataclasses.
NOT_ON_THE_FAST_PATH = ("click", "rich", "psutil", "prometheus_client", "gpudiag.core.classify",
                        "gpudiag.engine.inline", "gpudiag.engine.isolation",
                        "gpudiag.engine.route", "http.client", "urllib.parse", "ipaddress",
                        "importlib.metadata", "typing", "dataclasses", "inspect",
                        "gpudiag.core.verdict", "gpudiag.core.requirement",
                        "gpudiag.core.registry", "gpudiag.engine.client")
# What `gpudiag probe --format json|kv` never loads in its parent: it runs the probes and
# classifies, but needs no click, terminal renderer or metrics.
NOT_ON_THE_PROBE_PATH = ("click", "rich", "prometheus_client", "gpudiag.cli.commands",
                         "gpudiag.cli.render", "importlib.metadata")
# What moves between two probe runs of the same host: times, durations, nvidia-smi's clock.
_VOLATILE = (re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?Z"),
             re.compile(r"(duration_s[\\\"]*[=:] ?)[0-9.e-]+"),
             re.compile(r"\w{3} \w{3} [ 0-9]\d \d\d:\d\d:\d\d \d{4}"),
             re.compile(r"\b\d+\.\d\ds\b"))  # the text table's probe durations


@pytest.fixture(scope="module")
def daemon(fakes: FakeDriver, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[Daemon, dict[str, str]]]:
    """A daemon on a socket in a root-owned folder (trusted), rounds far apart: one snapshot."""
    tmp = tmp_path_factory.mktemp("entry")
    top = Path(tempfile.mkdtemp(prefix="gpudiag-entry-"))
    top.chmod(0o755)
    (top / "daemon").mkdir(mode=0o755)
    sock = top / "daemon" / "gpudiag.sock"
    env = host_env(fakes, tmp / "host", gpus=2)
    slow = {"interval_s": 3600}
    cfg = write_config(tmp / "gpudiag.toml", daemon_toml(
        {"backends.host": slow, "backends.nvml": slow, "backends.cuda": slow}))
    d = Daemon(env, cfg, tmp / "state", extra_args=("--socket", str(sock)))
    try:
        d.wait_ready()
        yield d, {**env, "GPUDIAG_DAEMON_URL": f"unix:{sock}"}
    finally:
        d.stop()
        shutil.rmtree(top, ignore_errors=True)


def _run(argv: list[str], env: dict[str, str], *, via_click: bool = False
         ) -> subprocess.CompletedProcess[str]:
    head = [sys.executable, "-c", CLICK_MAIN] if via_click else [sys.executable, "-m", "gpudiag"]
    return subprocess.run([*head, *argv], env=env, capture_output=True, text=True, timeout=60,
                          check=False)


def _without_age(text: str, fmt: str) -> str:
    """The output less age_s, the one field that moves between two calls."""
    if fmt == "json":
        record = json.loads(text)
        record.pop("age_s")
        return json.dumps(record)
    return "".join(line for line in text.splitlines(keepends=True)
                   if not line.startswith("age_s="))


@pytest.mark.parametrize("argv", [
    ["preflight", "--require", "cuda", "--format", "kv"],
    ["preflight", "--format=json", "--require=cuda,nvml", "--gpus", "1"],
    ["preflight", "--format", "kv", "--devices", "0", "--min-free-memory", "1GiB",
     "--min-devices", "1", "--timeout", "30"],
    ["preflight", "--format", "json", "--gpus", "2", "--min-free-memory", "1000TiB"],
    ["health", "--format", "kv"],
    ["health", "--require", "nvml", "--format", "json", "--timeout", "5"],
])
def test_a_daemon_answered_call_prints_what_the_click_command_prints(
        daemon: tuple[Daemon, dict[str, str]], argv: list[str]) -> None:
    _, env = daemon
    assert parse_fast(argv) is not None, "this call should take the fast path"
    fast, slow = _run(argv, env), _run(argv, env, via_click=True)
    fmt = "json" if any("json" in a for a in argv) else "kv"
    assert (fast.returncode, fast.stderr) == (slow.returncode, slow.stderr)
    assert fast.returncode in (0, 1)
    assert ("source=daemon\n" in fast.stdout if fmt == "kv"
            else json.loads(fast.stdout)["source"] == "daemon")
    assert _without_age(fast.stdout, fmt) == _without_age(slow.stdout, fmt)


def test_the_fast_path_loads_no_renderer_metrics_classifier_or_click(
        daemon: tuple[Daemon, dict[str, str]], tmp_path: Path) -> None:
    _, env = daemon
    rc, stdout, modules = entry_in_child(["preflight", "--format", "kv"], env,
                                         tmp_path / "modules.json")
    assert rc in (0, 1) and "gpu_validation_blocker=" in stdout
    loaded = [m for m in NOT_ON_THE_FAST_PATH if m in modules]
    assert loaded == [], f"the daemon-answered path imported {loaded}"


def test_version_is_click_s_words_without_click(tmp_path: Path) -> None:
    fast = _run(["--version"], dict(os.environ))
    slow = _run(["--version"], dict(os.environ), via_click=True)
    assert fast.stdout == slow.stdout == f"gpudiag, version {__version__}\n"
    assert fast.returncode == slow.returncode == 0


def test_without_a_daemon_the_click_path_runs_the_probes_here(
        gpu_env: object, tmp_path: Path) -> None:
    env = gpu_env()  # type: ignore[operator]
    argv = ["preflight", "--format", "json", "--daemon-url", f"unix:{tmp_path}/none.sock"]
    proc = _run(argv, env)
    record = json.loads(proc.stdout)
    assert proc.returncode == 0 and record["source"] == "inline"
    assert record["evidence"]["daemon"]["used"] is False


def test_bad_values_get_click_s_usage_errors(daemon: tuple[Daemon, dict[str, str]]) -> None:
    _, env = daemon
    for argv in (["preflight", "--format", "kv", "--require", "cuda,bogus"],
                 ["preflight", "--format", "kv", "--gpus", "0"],
                 ["health", "--format", "json", "--timeout", "-1"],
                 ["preflight", "--format", "kv", "--daemon-url", "ftp://x"]):
        fast, slow = _run(argv, env), _run(argv, env, via_click=True)
        assert fast.returncode == slow.returncode == 2, fast.stderr
        assert fast.stderr == slow.stderr and "Error" in fast.stderr


def _steady(text: str) -> str:
    """A probe's output less what moves between two runs (times and durations)."""
    for pattern in _VOLATILE:
        text = pattern.sub(lambda m: (m.group(1) if m.groups() else "") + "T", text)
    return text


@pytest.mark.parametrize(("argv", "knobs", "code"), [
    (["probe", "--backend", "nvml,cuda", "--json"], {}, 0),
    (["probe", "--format=kv", "--backend=host,nvml,cuda", "--timeout", "30"], {}, 0),
    (["probe", "--backend", "nvml,cuda", "--format", "json", "--json"], {}, 0),
    (["probe", "--backend", "nvml,cuda", "--format", "kv", "--expected-gpus", "4"], {}, 1),
    (["probe", "--backend", "host,nvml,cuda", "--json"], {"FAKE_CUDA_INIT_ERROR": "999"}, 1),
    (["probe", "--backend", "nvml,cuda"], {}, 0),
    (["probe", "--backend", "nvml,cuda", "--format", "text", "--wide"], {}, 0),
    (["probe", "--backend", "host,nvml,cuda"], {"FAKE_CUDA_INIT_ERROR": "999"}, 1),
])
def test_probe_in_any_format_prints_what_the_click_command_prints(
        gpu_env: object, argv: list[str], knobs: dict[str, str], code: int) -> None:
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=2, **knobs)  # type: ignore[operator]
    assert parse_fast(argv) is not None, "this call should take the fast path"
    fast, slow = _run(argv, env), _run(argv, env, via_click=True)
    assert (fast.returncode, fast.stderr) == (slow.returncode, slow.stderr)
    assert fast.returncode == code, fast.stdout
    assert "gpu_validation_blocker" in fast.stdout
    assert _steady(fast.stdout) == _steady(slow.stdout)


def test_the_probe_path_loads_no_click_renderer_or_metrics(gpu_env: object,
                                                           tmp_path: Path) -> None:
    env = gpu_env()  # type: ignore[operator]
    rc, stdout, modules = entry_in_child(["probe", "--backend", "nvml", "--format", "kv"], env,
                                         tmp_path / "modules.json")
    assert rc == 0 and "backends.nvml.status=ok" in stdout
    loaded = [m for m in NOT_ON_THE_PROBE_PATH if m in modules]
    assert loaded == [], f"the probe path imported {loaded}"


def _has_child(pid: int) -> bool:
    """Whether a process whose parent is ``pid`` runs (a probe child started)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if fields[1] == str(pid):
            return True
    return False


def test_ctrl_c_during_the_probes_ends_both_paths_alike(gpu_env: object) -> None:
    env = gpu_env(FAKE_CUDA_INIT_HANG=1)  # type: ignore[operator]
    argv = ["probe", "--backend", "nvml,cuda", "--json", "--timeout", "30"]
    ends = []
    for via_click in (False, True):
        head = [sys.executable, "-c", CLICK_MAIN] if via_click else [sys.executable, "-m",
                                                                      "gpudiag"]
        proc = subprocess.Popen([*head, *argv], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        while not _has_child(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)  # imports done, probes running: the interrupt lands in them
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        ends.append((proc.returncode, out, err))
    assert ends[0] == ends[1] == (1, "", "\nAborted!\n")


def test_bad_probe_values_get_click_s_usage_errors(gpu_env: object) -> None:
    env = gpu_env()  # type: ignore[operator]
    for argv in (["probe", "--json", "--backend", "nvml,bogus"],
                 ["probe", "--format", "kv", "--backend", " , "],
                 ["probe", "--format", "kv", "--backend", "jax:tpu"],
                 ["probe", "--json", "--timeout", "0"],
                 ["probe", "--json", "--format", "kv"],
                 ["probe", "--json", "--expected-gpus", "0"]):
        fast, slow = _run(argv, env), _run(argv, env, via_click=True)
        assert fast.returncode == slow.returncode == 2, fast.stderr
        assert fast.stderr == slow.stderr and "Error" in fast.stderr


@pytest.mark.parametrize("argv", [
    [], ["preflight"], ["preflight", "--format", "text"], ["probe", "--wide", "--wide"],
    ["probe", "--wide=1"], ["probe", "--json", "--watch"], ["probe", "--config", "x.toml"],
    ["probe", "--json", "--json"], ["probe", "--json=1"], ["probe", "--format", "json", "-h"],
    ["probe", "--json", "--format", "kv"], ["probe", "--json", "--expected-gpus", "1025"],
    ["preflight", "--format", "kv", "--json"],
    ["preflight", "--format", "kv", "--record", "/tmp/x.json"],
    ["preflight", "--format", "kv", "--no-daemon"], ["preflight", "--format", "kv", "-h"],
    ["preflight", "--format", "kv", "--require"], ["preflight", "--format", "kv", "extra"],
    ["preflight", "--format", "kv", "--require", "cuda", "--require", "jax"],
    ["preflight", "--format", "kv", "--gpus", "65"], ["preflight", "--format", "kv", "--gpus", "²"],
    ["preflight", "--format", "kv", "--expected-gpus", "8"],
    ["health", "--format", "kv", "--gpus", "1"],
])
def test_calls_the_fast_path_does_not_know_exactly_go_to_click(argv: list[str]) -> None:
    assert parse_fast(argv) is None


# What the fast path leaves to click, per command, and why: with any of these a call is no
# longer the daemon-answered kv/json call (or, for probe, the probed-here call) that the
# entry answers.
# Every other option of the click command is in the entry's table: a new click option fails
# test_the_fast_table_is_what_the_click_commands_regenerate until it is placed on one side.
CLICK_ONLY = {
    "preflight": {"--record": "writes a file, with click's wording of its errors",
                  "--no-daemon": "runs the probes here: the click path",
                  "--wide": "changes the text output only, which click renders",
                  "--expected-gpus": "checked by probes run here, never by a daemon",
                  "--config": "backend settings of probes run here (a file's errors: click)"},
    "health": {"--record": "as preflight", "--no-daemon": "as preflight",
               "--wide": "as preflight", "--watch": "many verdicts: the click path",
               "--config": "as preflight"},
    "probe": {"--watch": "as health", "--config": "as preflight"},
}


def _regenerated_table(name: str) -> tuple[frozenset[str], frozenset[str],
                                           dict[str, tuple[int, int]]]:
    """The entry's options, flags and int ranges for ``name``, read off its click command."""
    options: set[str] = set()
    flags: set[str] = set()
    ranges: dict[str, tuple[int, int]] = {}
    for param in commands.cli.commands[name].params:
        assert isinstance(param, click.Option), f"{name}: a {type(param).__name__} argument"
        (long,) = [o for o in param.opts if o.startswith("--")]
        if long in CLICK_ONLY[name]:
            continue
        # The entry reads one long name with one value (or none, for a flag) and no alias.
        assert param.opts == [long] and not param.secondary_opts and not param.multiple, long
        (flags if param.is_flag else options).add(long)
        if isinstance(param.type, click.IntRange):
            kind = param.type
            assert not (kind.min_open or kind.max_open or kind.clamp), long
            assert isinstance(kind.min, int) and isinstance(kind.max, int), long
            ranges[long] = (kind.min, kind.max)
        if long == "--format":
            assert isinstance(param.type, click.Choice)
            assert set(FAST_FORMATS[name]) <= set(param.type.choices)
    return frozenset(options), frozenset(flags), ranges


@pytest.mark.parametrize("name", sorted(CLICK_ONLY))
def test_the_fast_table_is_what_the_click_commands_regenerate(name: str) -> None:
    # gpudiag.cli.entry keeps its table as literals: generating it from click at import would
    # import click and the commands on every daemon-answered call (docs/design-notes.md).
    assert set(CLICK_ONLY) == set(FAST_OPTIONS)
    names = {o for p in commands.cli.commands[name].params for o in p.opts}
    assert set(CLICK_ONLY[name]) <= names, f"{name}: CLICK_ONLY names a gone option"
    options, flags, ranges = _regenerated_table(name)
    assert FAST_OPTIONS[name] == options
    assert FAST_FLAGS.get(name, frozenset()) == flags
    assert {o: r for o, r in _INT_RANGES.items() if o in FAST_OPTIONS[name]} == ranges
    assert set(_INT_RANGES) <= {o for n in FAST_OPTIONS for o in FAST_OPTIONS[n]}


@given(st.dictionaries(st.text(min_size=1), st.text(), max_size=6))
def test_the_client_s_query_string_reads_back_as_written(params: dict[str, str]) -> None:
    # The daemon reads its parameters with parse_qsl (gpudiag/daemon/app.py).
    from urllib.parse import parse_qsl, urlencode

    text = query_string(params)
    assert dict(parse_qsl(text, keep_blank_values=True)) == params
    assert parse_qsl(text, keep_blank_values=True) == parse_qsl(urlencode(params),
                                                                keep_blank_values=True)
    assert all(c.isascii() and c.isprintable() and c not in " #+" for c in text)


def test_a_second_error_raised_while_a_ctrl_c_unwinds_is_the_interrupt_not_a_failure() -> None:
    """The click path's exit 3 under load: the interrupt cut an import short, and whatever
    touched the half-made module on the way out raised an AttributeError."""
    from gpudiag.cli.interrupts import interrupted

    def unwinding() -> None:
        try:
            raise KeyboardInterrupt
        finally:
            raise AttributeError("partially initialized module has no attribute 'LockInfo'")

    with pytest.raises(AttributeError) as caught:
        unwinding()
    assert interrupted(caught.value)
    assert not interrupted(ValueError("a real failure"))
    code = ("import sys\nfrom gpudiag.cli.commands import main\n"
            "import gpudiag.cli.commands as c\n"
            "def boom(*a, **k):\n"
            "    try:\n        raise KeyboardInterrupt\n"
            "    finally:\n        raise AttributeError('half-made module')\n"
            "c.cli.main = boom\nmain(['probe'])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert (done.returncode, done.stderr) == (1, "\nAborted!\n")
