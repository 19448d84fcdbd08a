"""The session-end survivor check (tests/support/survivors.py) finds what a test left running."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.support.survivors import SESSION_MARK, kill, names_folder, survivors


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait(10)


def _sleep(procs: list[subprocess.Popen[bytes]], *args: str, mark: str | None = None,
           cwd: Path | None = None) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != SESSION_MARK}
    if mark is not None:
        env[SESSION_MARK] = mark
    # sh stays (two commands) with the arguments on its command line.
    proc = subprocess.Popen(["sh", "-c", "sleep 60; :", *args], env=env, cwd=cwd,
                            start_new_session=True)
    procs.append(proc)
    return proc


def test_a_folder_is_named_by_itself_and_its_paths_never_by_a_longer_name() -> None:
    assert names_folder("serve --config /tmp/p/pytest-1/x/d.toml", "/tmp/p/pytest-1")
    assert names_folder("ls /tmp/p/pytest-1", "/tmp/p/pytest-1")
    assert names_folder("--state=/tmp/p/pytest-1/s", "/tmp/p/pytest-1")
    assert not names_folder("serve --config /tmp/p/pytest-12/x/d.toml", "/tmp/p/pytest-1")
    assert not names_folder("/tmp/p/pytest-1.old/x", "/tmp/p/pytest-1")


def test_marked_processes_and_those_naming_the_folder_survive_and_are_killed(
        tmp_path: Path, started: list[subprocess.Popen[bytes]]) -> None:
    mark = "mark-of-this-check"
    marked = _sleep(started, mark=mark)
    named = _sleep(started, str(tmp_path / "x"))
    inside = _sleep(started, cwd=tmp_path)
    other = _sleep(started, mark="another-session")
    found = {p.pid for p in survivors(str(tmp_path), mark, grace_s=0.1)}
    assert {marked.pid, named.pid, inside.pid} <= found and other.pid not in found
    lines = kill([psutil.Process(p.pid) for p in (marked, named, inside)])
    assert len(lines) == 3 and all("sleep 60" in line for line in lines)
    for proc in (marked, named, inside):
        assert proc.wait(10) == -9
    assert other.poll() is None


def test_a_process_that_ends_within_the_grace_is_no_survivor(
        tmp_path: Path, started: list[subprocess.Popen[bytes]]) -> None:
    mark = "mark-of-this-check"
    proc = subprocess.Popen(["sleep", "0.3"], env={**os.environ, SESSION_MARK: mark})
    started.append(proc)
    assert survivors(str(tmp_path), mark, grace_s=5) == []
