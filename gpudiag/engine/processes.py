"""The process tree below a process, read with psutil: one implementation for every layer.

``gpudiag run`` follows its job's descendants (it is their subreaper and reaps them itself:
that part stays in runner/execute.py); ``gpudiag serve`` kills its probe children's groups on
the way out. psutil reads /proc for us (a well-kept library that already copes with processes
vanishing mid-read, comm names with spaces or parentheses, and permission errors), so gpudiag
keeps no /proc parser of its own. Linux only, like the rest of gpudiag. Each function imports
psutil itself: the import is 11 ms of every CLI start, and most name no process.
"""

from __future__ import annotations

import contextlib
import os
import signal

from gpudiag.core import registry
from gpudiag.core.records import dataclass


@dataclass(frozen=True)
class ProcessInfo:
    """One process as seen now: its parent, its short name (comm) and its state."""

    pid: int
    ppid: int
    comm: str
    status: str  # psutil's: "running", "sleeping", "zombie", ...


def process_table() -> dict[int, ProcessInfo]:
    """Every process visible now, by pid (processes that end while being read are left out)."""
    import psutil
    table: dict[int, ProcessInfo] = {}
    for proc in psutil.process_iter(["ppid", "name", "status"]):
        info = proc.info
        if info.get("ppid") is None:
            continue
        table[proc.pid] = ProcessInfo(proc.pid, int(info["ppid"]), str(info.get("name") or ""),
                                      str(info.get("status") or ""))
    return table


def descendants(root: int | None = None,
                table: dict[int, ProcessInfo] | None = None) -> list[ProcessInfo]:
    """Every process below ``root`` (default: this one) now, parents before their children."""
    table = process_table() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, info in table.items():
        children.setdefault(info.ppid, []).append(pid)
    found: list[ProcessInfo] = []
    stack = list(children.get(os.getpid() if root is None else root, []))
    while stack:
        pid = stack.pop()
        found.append(table[pid])
        stack.extend(children.get(pid, []))
    return found


def own_process_tree(pid: int | None = None) -> frozenset[int]:
    """This process, its ancestors and its descendants: the processes that are not "someone
    else" on a GPU (a job that runs gpudiag, or gpudiag's own probe children)."""
    import psutil
    root = os.getpid() if pid is None else pid
    pids = {root}
    # The daemon asks on every nvml round and every guarded probe: psutil's children() reads
    # only each process's parent (one /proc/PID/stat), a third of what the table's name and
    # state cost, for the same tree.
    with contextlib.suppress(psutil.Error):
        process = psutil.Process(root)
        pids.update(p.pid for p in process.children(recursive=True))
        pids.update(p.pid for p in process.parents())
    pids.difference_update({0, 1})  # init is everyone's ancestor, never a GPU's user
    return frozenset(pids)


def cmdline(pid: int) -> list[str]:
    """The argv of ``pid``, or [] when it cannot be read (ended, a zombie, not ours)."""
    import psutil
    try:
        return list(psutil.Process(pid).cmdline())
    except (psutil.Error, OSError):
        return []



def is_probe_child(argv: list[str]) -> bool:
    """Whether ``argv`` is a gpudiag probe child that touches a GPU (``python -m
    gpudiag.probes cuda``): another gpudiag proving a GPU, not a job using it."""
    for i, word in enumerate(argv[:-2]):
        if word == "-m" and argv[i + 1] == "gpudiag.probes":
            return argv[i + 2] in registry.gpu_touching()
    return False


def ended(pid: int) -> bool:
    """Whether ``pid`` has ended: gone, or a zombie nobody reaped yet (its files are closed)."""
    import psutil
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def kill_group_leaders_below(root: int) -> int:
    """SIGKILL the group of every process below ``root`` that leads a group of its own (a
    fork server's probe children); returns how many groups were killed."""
    count = 0
    for info in descendants(root):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(info.pid) == info.pid:
                os.killpg(info.pid, signal.SIGKILL)
                count += 1
    return count


def kill_child_groups() -> int:
    """SIGKILL the process group of every direct child of this process, and of every process
    below them that leads a group of its own (the probe fork server's children, which are
    not its group's); returns how many groups or lone children were killed."""
    import psutil
    own_group, count = os.getpgrp(), 0
    try:
        kids = psutil.Process().children()
    except psutil.Error:
        return 0
    # Leaders below the children first: a fork server killed first would orphan them.
    count += sum(kill_group_leaders_below(kid.pid) for kid in kids)
    for kid in kids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            pgid = os.getpgid(kid.pid)
            # A child still in our own group (it never reached setsid) is killed alone.
            if pgid != own_group:
                os.killpg(pgid, signal.SIGKILL)
            else:
                os.kill(kid.pid, signal.SIGKILL)
            count += 1
    return count
