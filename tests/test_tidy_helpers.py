"""The helpers that replaced code written twice (issue 25): inbox reads, loop threads,
state collectors, and the rule that no function in gpudiag/ runs past 80 lines."""

from __future__ import annotations

import ast
import os
import threading
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gpudiag.core.fileio import RefusedFile, inbox_names, read_regular
from gpudiag.daemon.loop import LoopThread
from gpudiag.daemon.reload import LockDirCollector, ReloadCollector, ReloadState

REPO = Path(__file__).resolve().parent.parent
MAX_FUNCTION_LINES = 80


def _long_functions() -> dict[str, int]:
    out: dict[str, int] = {}
    for path in sorted((REPO / "gpudiag").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    out[f"{path.relative_to(REPO)}:{node.name}"] = length
    return out


def test_no_function_in_gpudiag_runs_past_80_lines() -> None:
    too_long = _long_functions()
    assert not too_long, f"split these (def line to end line): {too_long}"


def test_a_regular_file_is_read_with_its_owner(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    path.write_bytes(b"{}")
    raw, st = read_regular(path, 16)
    assert (raw, st.st_uid) == (b"{}", os.getuid())


@pytest.mark.parametrize("make, why", [
    (lambda p: p.symlink_to(p.parent / "target"), "cannot open it"),
    (lambda p: os.mkfifo(p), "not a regular file"),
    (lambda p: p.mkdir(), "not a regular file"),
    (lambda p: p.write_bytes(b"x" * 17), "larger than 16 bytes"),
    (lambda p: None, "cannot open it"),
], ids=["symlink", "fifo", "folder", "too-large", "absent"])
def test_what_is_not_a_small_regular_file_is_refused_with_the_reason(
        tmp_path: Path, make: object, why: str) -> None:
    (tmp_path / "target").write_bytes(b"{}")
    path = tmp_path / "a.json"
    make(path)  # type: ignore[operator]
    started = time.monotonic()
    with pytest.raises(RefusedFile, match=why):
        read_regular(path, 16)
    assert time.monotonic() - started < 5  # a FIFO nobody writes never hangs the reader


def test_an_inbox_lists_json_files_oldest_name_first_less_the_skipped(tmp_path: Path) -> None:
    for name in ("2.json", "1.json", "3.json.rejected", "x.tmp", "skip.json"):
        (tmp_path / name).write_text("{}")
    assert inbox_names(tmp_path, {"skip.json"}) == ["1.json", "2.json"]
    assert inbox_names(tmp_path / "absent", set()) == []


def test_a_loop_thread_runs_wakes_and_stops_within_its_deadline() -> None:
    loop = LoopThread("test-loop")
    turns: list[float] = []

    def body() -> None:
        while not loop.stopping.is_set():
            turns.append(time.monotonic())
            loop.woken.wait(30.0)  # only a wake or the stop ends this wait
            loop.woken.clear()

    assert not loop.running
    loop.start(body)
    assert loop.running and any(t.name == "test-loop" for t in threading.enumerate())
    deadline = time.monotonic() + 5
    while not turns and time.monotonic() < deadline:
        time.sleep(0.01)
    loop.woken.set()
    while len(turns) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(turns) == 2
    started = time.monotonic()
    loop.stop(5.0)
    assert not loop.running and time.monotonic() - started < 5


def test_state_collectors_render_the_state_read_at_each_scrape() -> None:
    registry = CollectorRegistry(auto_describe=False)
    states = [ReloadState(reloads=2, failures=1, last_ok=False),
              ReloadState(reloads=3, failures=1, last_ok=True)]
    registry.register(ReloadCollector(lambda: states[0]))
    registry.register(LockDirCollector(False))
    first = generate_latest(registry).decode().splitlines()
    states.pop(0)
    second = generate_latest(registry).decode().splitlines()
    for line in ("gpudiag_config_reloads_total 2.0", "gpudiag_config_reload_failures_total 1.0",
                 "gpudiag_config_last_reload_successful 0.0", "gpudiag_lock_dir_shared 0.0"):
        assert line in first, first
    assert "gpudiag_config_reloads_total 3.0" in second
    assert "gpudiag_config_last_reload_successful 1.0" in second
