"""engine/processes.py: process trees read with psutil, and the daemon's exit-time group kill."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from gpudiag.engine.processes import cmdline, descendants, ended, own_process_tree


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


def test_own_process_tree_is_this_process_its_ancestors_and_every_descendant() -> None:
    # The test session's other processes below this one (a module's daemon and its probe
    # children) come and go meanwhile: in the tree too, but not this test's to count or kill.
    child = subprocess.Popen(["sh", "-c", "sleep 30 & wait"])
    other = subprocess.Popen(["sleep", "30"], start_new_session=True)
    grandchildren: set[int] = set()
    try:
        deadline = time.monotonic() + 10
        while not grandchildren and time.monotonic() < deadline:
            time.sleep(0.02)
            grandchildren = {p.pid for p in descendants(child.pid)}
        mine = {child.pid, other.pid, *grandchildren}
        before = {p.pid for p in descendants()}
        tree = own_process_tree()
        after = {p.pid for p in descendants()}
        assert len(grandchildren) == 1 and mine <= before  # sh's sleep; all below this process
        ancestors = set()
        pid = os.getppid()
        while pid > 1:
            ancestors.add(pid)
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        # The set the process table gives: this process, what is below, what is above (a
        # process of the session's that started and ended between the reads aside).
        assert {os.getpid(), *mine, *ancestors} <= tree
        unexplained = tree - {os.getpid(), *before, *after, *ancestors}
        assert all(not os.path.exists(f"/proc/{p}") for p in unexplained), unexplained
        assert 1 not in tree and 0 not in tree
        assert own_process_tree(child.pid) >= {child.pid, os.getpid()}
        assert other.pid not in own_process_tree(child.pid)  # a sibling is someone else
    finally:
        for pid in grandchildren:  # before it is orphaned
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        for proc in (child, other):
            proc.kill()
            proc.wait()


def test_own_process_tree_of_a_process_that_ended_is_only_its_pid() -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    assert own_process_tree(proc.pid) == frozenset({proc.pid})


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
