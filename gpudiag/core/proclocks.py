"""The kernel's table of file locks (``/proc/locks``), parsed: who holds which flock.

A lock file's holder is whoever the kernel says holds its flock, never what the file says
(anyone who can open the file can write it): docs/security.md, "Kernel facts decide". One
line per lock, ``ID: FLOCK  ADVISORY  WRITE PID MAJ:MIN:INODE START END``; lines with
``->`` are processes waiting for a lock, not holding one. Parsing only: the reading is
``gpudiag.engine.locks``.
"""

from __future__ import annotations

import re

from gpudiag.core.records import dataclass

# "12: FLOCK  ADVISORY  WRITE 4242 fe:00:2146312 0 EOF" (device numbers in hex, as the
# kernel prints them; the pid is 0 for a holder outside the reader's pid namespace).
_LINE = re.compile(r"[0-9]+:\s+(?P<waiting>->\s+)?(?P<kind>[A-Z]+)\s+\S+\s+"
                   r"(?P<mode>[A-Z]+)\s+(?P<pid>-?[0-9]+)\s+(?P<major>[0-9a-f]+):"
                   r"(?P<minor>[0-9a-f]+):(?P<inode>[0-9]+)\s")


@dataclass(frozen=True)
class KernelLock:
    """One lock the kernel holds for a process: its kind, mode, locker pid and file."""

    kind: str  # FLOCK, POSIX, OFDLCK, LEASE, ...
    shared: bool  # READ (flock -s, LOCK_SH) rather than WRITE (LOCK_EX)
    pid: int  # the locker as the kernel recorded it; 0 or less: not visible from here
    major: int
    minor: int
    inode: int


def parse_proc_locks(text: str) -> list[KernelLock]:
    """The held locks of a ``/proc/locks`` text (waiters and unreadable lines left out)."""
    out: list[KernelLock] = []
    for line in text.splitlines():
        m = _LINE.match(line.strip() + " ")
        if m is None or m.group("waiting"):
            continue
        out.append(KernelLock(m.group("kind"), m.group("mode") == "READ", int(m.group("pid")),
                              int(m.group("major"), 16), int(m.group("minor"), 16),
                              int(m.group("inode"))))
    return out


def flocks_on(locks: list[KernelLock], major: int, minor: int, inode: int
              ) -> list[KernelLock]:
    """The flock(2) locks held on one file (by its device numbers and inode)."""
    return [lk for lk in locks if lk.kind == "FLOCK" and lk.inode == inode
            and lk.major == major and lk.minor == minor]
