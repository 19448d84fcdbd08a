"""`gpudiag probe --watch` and `gpudiag health --watch` as a person uses them (issue 30): on a
real pseudo-terminal the view is redrawn in place and follows a GPU that breaks while it
runs; into a pipe each round is one plain line; Ctrl-C ends it with the last answer's code."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fakes.build import write_state_file
from tests.support.host import EnvFactory
from tests.support.tty import strip_ansi, watch_on_tty

COMMANDS = {"probe": ["probe", "--backend", "host,nvml,cuda"], "health": ["health"]}


@pytest.mark.parametrize("columns", [80, 120])
@pytest.mark.parametrize("command", ["probe", "health"])
def test_watch_redraws_in_place_and_follows_a_gpu_that_breaks(
        gpu_env: EnvFactory, tmp_path: Path, command: str, columns: int) -> None:
    state = tmp_path / "gpu-state"
    write_state_file(state, {})
    env = gpu_env(FAKE_GPU_STATE_FILE=str(state))

    def breaks() -> None:
        write_state_file(state, {"FAKE_NVML_DEVICE_ERRORS": "1:15"})

    rc, raw = watch_on_tty([*COMMANDS[command], "--watch", "0.5"], env, columns, [
        (lambda s: "gpu_validation_blocker=none" in s, breaks),
        (lambda s: "gpu_validation_blocker=gpu_lost" in s, lambda: None)])
    text = raw.decode(errors="replace")
    assert rc == 1, text  # Ctrl-C ends it with the last answer: blocked
    assert text.count("\x1b[2J") == 1 and text.count("\x1b[H") >= 2  # in place, no scrolling
    assert text.rstrip().endswith("\x1b[?25h")  # the cursor is given back
    screen = strip_ansi(text)
    assert "Traceback" not in screen
    assert re.search(rf"every 0\.5 s: gpudiag {command}.*\(Ctrl-C ends\)", screen)
    too_wide = [line for line in screen.splitlines() if len(line) > columns]
    assert too_wide == []
    last = screen.rsplit("every 0.5 s:", 1)[1]
    assert last.count("gpu_validation_blocker=") == 1, last  # one view per frame
    assert re.search(r"^\s+1\s+lost\b", last, re.M), last
    assert re.search(r"^\s+0\s+ready\s+GPU-f00d0000\b", last, re.M), last


@pytest.mark.parametrize("command", ["probe", "health"])
def test_watch_into_a_pipe_prints_one_plain_line_per_round(gpu_env: EnvFactory,
                                                           command: str) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "gpudiag", *COMMANDS[command], "--watch",
                             "0.5"], env=gpu_env(FAKE_NVML_DEVICE_ERRORS="3:15"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    lines = [proc.stdout.readline(), proc.stdout.readline()]
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    for line in lines:
        assert re.fullmatch(r"\S+Z gpu_validation_blocker=gpu_lost ready=false gpus=8 "
                            r"gpus\.lost=1 gpus\.ready=7\n", line), line
    assert "\x1b" not in "".join(lines) + rest and "Traceback" not in err


@pytest.mark.parametrize(("args", "says"), [
    (["--watch", "0.1"], "at least 0.5"), (["--watch", "x"], "not an interval"),
    (["--watch", "1", "--format", "kv"], "not kv")])
def test_watch_refuses_what_it_cannot_show(gpu_env: EnvFactory, args: list[str],
                                           says: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "gpudiag", "health", *args], env=gpu_env(),
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr


def test_a_ctrl_c_whose_interrupt_a_finalizer_swallowed_still_ends_the_watch() -> None:
    """Python drops an exception raised while a finalizer runs ("Exception ignored in"): a
    Ctrl-C that lands there must still end the watch after that round, not draw on."""
    import io
    import os

    from gpudiag.cli.watch import run_watch
    from tests.support.verdicts import verdict

    rounds: list[int] = []

    def produce() -> object:
        rounds.append(len(rounds))
        if len(rounds) == 2:
            try:  # the interrupt raised where Python swallows it
                os.kill(os.getpid(), signal.SIGINT)
            except KeyboardInterrupt:
                pass
        if len(rounds) > 5:
            raise AssertionError("the watch drew on after its Ctrl-C")
        return verdict()

    before = signal.getsignal(signal.SIGINT)
    rc = run_watch(produce, 0.0, "test", stream=io.StringIO(),  # type: ignore[arg-type]
                   sleep=lambda _s: None)
    assert len(rounds) == 2 and rc in (0, 1)
    assert signal.getsignal(signal.SIGINT) is before  # the handler is given back
