"""``--watch [SECONDS]`` of ``gpudiag probe`` and ``gpudiag health``: the answer again and again.

On a terminal the whole view is redrawn in place each round, as ``watch nvidia-smi`` and
nvitop do (cursor home, each line cleared to its end, the rest of the screen cleared: no
flicker, no scrolling). Into a pipe or a file each round is one plain line (or one JSON
record with ``--format json``), so a log of the watch reads as a time series. Ctrl-C ends it
with the exit code of the last answer (0 ready, 1 blocked).
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import IO

import click

from gpudiag.core.verdict import Verdict

DEFAULT_INTERVAL_S = 2.0
MIN_INTERVAL_S = 0.5
_HOME, _CLEAR_LINE, _CLEAR_BELOW = "\x1b[H", "\x1b[K", "\x1b[J"
_CLEAR_SCREEN, _HIDE_CURSOR, _SHOW_CURSOR = "\x1b[2J", "\x1b[?25l", "\x1b[?25h"
_SECONDS = re.compile(r"[0-9]+(?:\.[0-9]+)?")


def watch_option(command: Callable[..., None]) -> Callable[..., None]:
    """``--watch [SECONDS]``: the option as ``probe`` and ``health`` take it."""
    return click.option(
        "--watch", "watch_text", is_flag=False, flag_value=str(DEFAULT_INTERVAL_S),
        default=None, metavar="[SECONDS]",
        help="Ask again every SECONDS until Ctrl-C: redrawn in place on a terminal (as "
        "nvidia-smi -l, nvitop), one line per round into a pipe.  [default: 2 when "
        "given alone]")(command)


def parse_interval(text: str) -> float:
    """``--watch`` SECONDS: a number of seconds, at least MIN_INTERVAL_S."""
    if not _SECONDS.fullmatch(text.strip()) or float(text) < MIN_INTERVAL_S:
        raise click.UsageError(f"--watch {text!r} is not an interval; give seconds, at least "
                               f"{MIN_INTERVAL_S} (e.g. --watch 5), or --watch alone for "
                               f"{DEFAULT_INTERVAL_S:g}")
    return float(text)


def watch_command(produce: Callable[[], Verdict], watch_text: str, title: str, fmt: str,
                  wide: bool) -> int:
    """What ``--watch`` runs for a command: the checked interval, then the rounds."""
    if fmt == "kv":
        raise click.UsageError("--watch shows text or JSON lines, not kv: use --format text "
                               "or json")
    return run_watch(produce, parse_interval(watch_text), title, as_json=fmt == "json",
                     wide=wide)


def summary_line(verdict: Verdict) -> str:
    """One round in one plain line: when, the blocker, and how many GPUs are in each state."""
    from gpudiag.cli.render import device_status

    words = Counter(device_status(verdict, d).split(" ")[0].rstrip(",")
                    for d in verdict.devices)
    states = " ".join(f"gpus.{word}={n}" for word, n in sorted(words.items()))
    return (f"{verdict.checked_at} gpu_validation_blocker={verdict.gpu_validation_blocker} "
            f"ready={str(verdict.ready).lower()} gpus={len(verdict.devices)}"
            + (f" {states}" if states else ""))


def frame(verdict: Verdict, title: str, columns: int, rows: int, wide: bool) -> str:
    """One full-screen view: a title line and the text rendering, cut to the screen's rows."""
    from gpudiag.cli.render import render_text

    buffer = io.StringIO()
    render_text(verdict, buffer, color=True, wide=wide, width=columns)
    stamp = time.strftime("%H:%M:%SZ", time.gmtime())
    # The clock is what a watcher reads: a narrow screen cuts the title, never the clock.
    room = max(columns - len(stamp) - 4, 0)
    shown = title if len(title) <= room else title[:max(room - 1, 0)] + "…"
    head = f"{shown}    {stamp}"[-columns:] if room else stamp[:columns]
    lines = [head, *buffer.getvalue().splitlines()][:max(rows - 1, 1)]
    return _HOME + "".join(line + _CLEAR_LINE + "\n" for line in lines) + _CLEAR_BELOW


def _screen(stream: IO[str]) -> tuple[int, int]:
    try:
        size = os.get_terminal_size(stream.fileno())
        return size.columns, size.lines
    except (OSError, ValueError):
        return 80, 24


def run_watch(produce: Callable[[], Verdict], interval_s: float, title: str, *,
              as_json: bool = False, wide: bool = False, stream: IO[str] | None = None,
              sleep: Callable[[float], None] = time.sleep) -> int:
    """Produce and show a verdict every ``interval_s`` until Ctrl-C; the last exit code."""
    out = stream or sys.stdout
    tty = out.isatty() and not as_json
    last: Verdict | None = None
    if tty:
        out.write(_HIDE_CURSOR + _CLEAR_SCREEN)
    ctrl_c = _CtrlC()
    try:
        while not ctrl_c.pressed:
            started = time.monotonic()
            last = produce()
            if as_json:
                out.write(json.dumps(last.record(), separators=(",", ":")) + "\n")
            elif tty:
                columns, rows = _screen(out)  # read each round: the window may be resized
                out.write(frame(last, f"every {interval_s:g} s: {title}  (Ctrl-C ends)",
                                columns, rows, wide))
            else:
                out.write(summary_line(last) + "\n")
            out.flush()
            sleep(max(0.0, interval_s - (time.monotonic() - started)))
    except KeyboardInterrupt:
        pass
    finally:
        ctrl_c.restore()
        if tty:
            out.write(_SHOW_CURSOR + "\n")
            out.flush()
    if last is None:
        return 130  # interrupted before a first answer: nothing was said
    return 0 if last.ready else 1


class _CtrlC:
    """Ctrl-C ends the watch even when its KeyboardInterrupt is lost: Python swallows (and
    prints "Exception ignored in ...") an exception raised while a finalizer runs, and a
    round's probes make and drop many objects, so now and then the interrupt landed there and
    the watch drew on. The handler also sets a flag that the loop reads each round. Only in
    the main thread, and never over an inherited SIG_IGN (``nohup``: Ctrl-C is not wanted)."""

    def __init__(self) -> None:
        self.pressed = False
        self._previous: object = None
        if threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            self._previous = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        self.pressed = True
        raise KeyboardInterrupt

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)  # type: ignore[arg-type]
            self._previous = None
