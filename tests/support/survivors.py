"""The session-end check that no process a test started outlives the test session (issue 50).

tests/conftest.py draws a mark per session (``mark_session``), which every process the
session starts inherits through its environment, and at the end of the session (the xdist
controller's, once every worker is done) calls ``survivors``: processes that carry the mark,
or whose command line or working folder names the session's temporary folder.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import uuid

import psutil

# clean_env() keeps it (it starts with neither FAKE_ nor a scrubbed name).
SESSION_MARK = "GPUDIAG_TEST_SESSION"


def mark_session() -> str:
    """A new mark for this process and everything it starts from now on."""
    mark = uuid.uuid4().hex
    os.environ[SESSION_MARK] = mark
    return mark


def names_folder(text: str, folder: str) -> bool:
    """Whether ``text`` names ``folder`` or a path in it (pytest-1 is not pytest-12)."""
    return re.search(re.escape(folder) + r"(?![^/\s'\":=,;])", text) is not None


def is_ours(proc: psutil.Process, basetemp: str, mark: str) -> bool:
    """A live process this session started: its environment has the session's mark, or its
    command line or working folder names the session's temporary folder."""
    try:
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False  # it has ended; only its parent has yet to read its status
        if names_folder(" ".join(proc.cmdline()), basetemp):
            return True
        with contextlib.suppress(psutil.AccessDenied):
            if names_folder(proc.cwd(), basetemp):
                return True
        return proc.environ().get(SESSION_MARK) == mark
    except (psutil.Error, OSError):
        return False


def survivors(basetemp: str, mark: str, grace_s: float = 3.0) -> list[psutil.Process]:
    """Processes a test of this session started that are still alive, not this process or
    its ancestors; each gets ``grace_s`` to finish exiting (a daemon told to stop at a
    fixture's teardown) before it counts."""
    mine = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    found = [proc for proc in psutil.process_iter()
             if proc.pid not in mine and is_ours(proc, basetemp, mark)]
    _, alive = psutil.wait_procs(found, timeout=grace_s)
    return [proc for proc in alive if is_ours(proc, basetemp, mark)]


def kill(procs: list[psutil.Process]) -> list[str]:
    """Kills each process with its process group (what it started) unless that group is
    ours; one line per process killed, naming it."""
    lines = []
    for proc in procs:
        try:
            lines.append(f"  pid {proc.pid}: {' '.join(proc.cmdline())[:300]}")
            with contextlib.suppress(OSError):
                group = os.getpgid(proc.pid)
                if group != os.getpgid(0):
                    os.killpg(group, signal.SIGKILL)
            proc.kill()
        except psutil.Error:
            continue
    return lines
