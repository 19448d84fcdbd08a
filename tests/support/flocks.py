"""Foreign flocks, as any user can hold them: processes each holding many locks on files of
their own (the kernel's global lock table grows with them). Used by tests/test_lock_flood.py
and benchmarks/lock_view.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PER_HOLDER = 19000  # under this machine's RLIMIT_NOFILE hard limit (20000): 190,000 in ten
HOLDER = """
import fcntl, os, resource, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
folder, n = sys.argv[1], int(sys.argv[2])
fds = []
for i in range(n):
    fd = os.open(f"{folder}/{i}", os.O_RDONLY | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    fds.append(fd)
print("ready", flush=True)
sys.stdin.read()
"""


def hold_foreign(total: int, work: Path, procs: list[subprocess.Popen[str]] | None = None
                 ) -> list[subprocess.Popen[str]]:
    """Processes holding ``total`` flocks between them, each on its own files under ``work``;
    each is appended to ``procs`` as soon as it starts (so a caller's cleanup sees it even
    when a later one fails). Kill them to drop their locks."""
    procs = [] if procs is None else procs
    left, i = total, 0
    while left > 0:
        n = min(PER_HOLDER, left)
        folder = work / f"holder{i}"
        folder.mkdir(parents=True)
        proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder), str(n)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        left, i = left - n, i + 1
    return procs
