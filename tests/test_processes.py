"""engine/processes.py: process trees read with psutil, and the daemon's exit-time group kill."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from gpudiag.engine.processes import cmdline, descendants, ended


def test_descendants_reach_grandchildren_and_ended_sees_the_reaped_and_the_zombie() -> None:
    child = subprocess.Popen(["sh", "-c", "sleep 30 & wait"])
    try:
        deadline = time.monotonic() + 10
        below: list[int] = []
        while time.monotonic() < deadline:
            below = [p.pid for p in descendants() if p.ppid == child.pid]
            if below:
                break
            time.sleep(0.02)
        assert below, "the grandchild never showed up below this process"
        mine = {p.pid: p for p in descendants()}
        assert child.pid in mine and below[0] in mine
        assert mine[below[0]].comm == "sleep" and cmdline(below[0]) == ["sleep", "30"]
        assert not ended(child.pid)
        child.kill()
        deadline = time.monotonic() + 10
        while not ended(child.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ended(child.pid)  # a zombie until waited for: it has ended all the same
    finally:
        child.kill()
        child.wait()
        for pid in below:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
    assert ended(child.pid) and cmdline(child.pid) == []


KILLER = """
import subprocess, sys, time
from gpudiag.engine.processes import descendants, ended, kill_child_groups
# One child in a session of its own with a grandchild in that group, one in our group.
own = subprocess.Popen(["sh", "-c", "sleep 30 & wait"], start_new_session=True)
same = subprocess.Popen(["sleep", "30"])
deadline = time.monotonic() + 10
while len(descendants()) < 3 and time.monotonic() < deadline:
    time.sleep(0.02)
grandchild = next(p.pid for p in descendants() if p.ppid == own.pid)
print(kill_child_groups())
own.wait(); same.wait()
deadline = time.monotonic() + 10
while not ended(grandchild) and time.monotonic() < deadline:
    time.sleep(0.02)
print(ended(grandchild))
"""


def test_kill_child_groups_kills_every_childs_group_and_returns_how_many() -> None:
    # In a child of its own: it kills every child of the process that calls it.
    proc = subprocess.run([sys.executable, "-c", KILLER], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["2", "True"]
