"""Wait, within a bound and saying so, until no other apt or dpkg holds its locks.

``python3 scripts/apt_lock.py [--wait S] [LOCK ...]`` (scripts/setup.sh, before apt-get): on
a fresh cloud machine unattended-upgrades runs apt for minutes after boot, and apt-get then
dies with "Could not get lock /var/lib/dpkg/lock-frontend". apt and dpkg hold their locks
with fcntl (F_SETLK), so a non-blocking lockf on the same file tells whether one is held;
ours is let go at once. Exit 0 when none is held (at once or within S seconds), 1 when one
still is after S seconds (the message names the lock and the holder when /proc says it).
Standard library only: it runs before the virtual environment exists.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import sys
import time
from collections.abc import Callable, Sequence

LOCKS = ("/var/lib/dpkg/lock-frontend", "/var/lib/dpkg/lock", "/var/lib/apt/lists/lock",
         "/var/cache/apt/archives/lock")
POLL_S = 2.0


def held(path: str) -> bool:
    """Whether another process holds an fcntl lock on ``path`` (False when it is absent)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False  # absent, or not ours to open: not a lock we would wait for
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # closing lets our own lock go
    return False


def holder(path: str) -> str:
    """Who holds ``path``, from /proc/locks and the holder's comm ("" when unknown)."""
    try:
        inode = os.stat(path).st_ino
        with open("/proc/locks", encoding="ascii", errors="replace") as fh:
            for line in fh:
                fields = line.split()
                if len(fields) > 5 and fields[5].rsplit(":", 1)[-1] == str(inode):
                    pid = fields[4]
                    with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as c:
                        return f"process {pid} ({c.read().strip()})"
    except (OSError, ValueError):
        pass
    return ""


def wait(locks: Sequence[str], wait_s: float, say: Callable[[str], None] = print) -> bool:
    """Wait until none of ``locks`` is held, at most ``wait_s`` seconds; whether none is."""
    deadline = time.monotonic() + wait_s
    told = False
    while True:
        busy = [p for p in locks if held(p)]
        if not busy:
            if told:
                _say(say, "the apt/dpkg lock is free: going on")
            return True
        if not told:
            who = holder(busy[0])
            _say(say, f"another apt or dpkg holds {busy[0]}{' (' + who + ')' if who else ''}, "
                 "as unattended-upgrades does on a fresh machine: waiting for it, at most "
                 f"{wait_s:g} s ...")
            told = True
        elif time.monotonic() >= deadline:
            who = holder(busy[0])
            _say(say, f"gave up after {wait_s:g} s: {busy[0]} is still held"
                 f"{' by ' + who if who else ''}; run scripts/setup.sh again when that apt is "
                 "done (SETUP_APT_WAIT_S=S waits longer)")
            return False
        time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))


def _say(say: Callable[[str], None], text: str) -> None:
    say(f"setup: {text}")


def main(argv: Sequence[str] | None = None) -> int:
    """Wait for the apt/dpkg locks (the default ones, or those named)."""
    parser = argparse.ArgumentParser(prog="apt_lock.py", description=__doc__.split("\n")[0])
    parser.add_argument("--wait", type=float, default=600.0, metavar="S",
                        help="the most seconds to wait (default 600)")
    parser.add_argument("locks", nargs="*", default=list(LOCKS), metavar="LOCK")
    args = parser.parse_args(argv)
    ok = wait(args.locks, args.wait, lambda text: print(text, file=sys.stderr, flush=True))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
