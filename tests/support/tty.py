"""Run a command on a pseudo-terminal of a given width, as a person at a terminal would."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable, Mapping, Sequence

__all__ = ["run_on_tty", "strip_ansi", "watch_on_tty"]

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


def strip_ansi(text: str) -> str:
    """The text a person reads: escape sequences (colour, cursor) removed, CRLF as LF."""
    return _ANSI.sub("", text).replace("\r\n", "\n").replace("\r", "")


def run_on_tty(argv: Sequence[str], env: Mapping[str, str], *, columns: int, rows: int = 50,
               timeout: float = 180) -> tuple[int, str]:
    """Run ``argv`` with stdout and stderr on a pty ``columns`` wide; (exit code, text)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    child_env = {k: v for k, v in env.items() if k not in ("COLUMNS", "LINES")}
    child_env["TERM"] = "xterm-256color"
    proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=slave, stderr=slave,
                            env=child_env, close_fds=True)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            if time.monotonic() > deadline:
                proc.kill()
                raise TimeoutError(f"{argv} ran past {timeout}s")
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: every writer closed the pty
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
    finally:
        os.close(master)
    return proc.wait(timeout=10), strip_ansi(b"".join(chunks).decode(errors="replace"))


def _read(master: int, chunks: list[bytes], wait_s: float) -> bool:
    """Read what the pty has within ``wait_s``; False once every writer closed it."""
    ready, _, _ = select.select([master], [], [], wait_s)
    if not ready:
        return True
    try:
        data = os.read(master, 65536)
    except OSError:  # EIO: the child closed its end
        return False
    chunks.append(data)
    return bool(data)


def watch_on_tty(argv: Sequence[str], env: Mapping[str, str], columns: int,
                 steps: Sequence[tuple[Callable[[str], bool], Callable[[], None]]],
                 timeout_s: float = 120) -> tuple[int, bytes]:
    """Run ``argv`` on a pty; at each step wait until the screen text satisfies the check,
    then act; finally press Ctrl-C (SIGINT) and return (exit code, raw bytes)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    child_env = {k: v for k, v in env.items() if k not in ("COLUMNS", "LINES")}
    child_env["TERM"] = "xterm-256color"
    proc = subprocess.Popen([sys.executable, "-m", "gpudiag", *argv], stdin=subprocess.DEVNULL,
                            stdout=slave, stderr=slave, env=child_env, start_new_session=True)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    try:
        for check, act in steps:
            while not check(strip_ansi(b"".join(chunks).decode(errors="replace"))):
                assert time.monotonic() < deadline, b"".join(chunks).decode(errors="replace")
                assert _read(master, chunks, 0.2), "the watch ended by itself"
            act()
        proc.send_signal(signal.SIGINT)
        while time.monotonic() < deadline and _read(master, chunks, 0.5):
            if proc.poll() is not None and not select.select([master], [], [], 0.2)[0]:
                break
        return proc.wait(timeout=30), b"".join(chunks)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        os.close(master)
