"""``python -m gpudiag.runner.detach ARGV...``: start ARGV as an orphan and print its pid.

``gpudiag run`` reaps every child it has until none is left (it is the subreaper of the
job's tree), so a helper that must outlive the job's last process, such as the run's own
XID watcher, cannot be its child. This intermediate forks ARGV into a new session, writes
the pid as one line on stderr and exits at once: ARGV is then re-parented away from the
run (to the init process or an outer subreaper) and keeps the stdout/stderr it inherited.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> int:
    """Fork ARGV into its own session; the pid goes to stderr."""
    if not argv:
        print("usage: python -m gpudiag.runner.detach ARGV...", file=sys.stderr)
        return 2
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            os.execv(argv[0], argv)
        except OSError as e:
            os.write(2, f"cannot start {argv[0]!r}: {e.strerror or e}\n".encode())
        os._exit(127)
    os.write(2, f"{pid}\n".encode())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
