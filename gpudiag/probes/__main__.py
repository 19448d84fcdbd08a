"""Child entry point: ``python -m gpudiag.probes NAME [OPTIONS-JSON]``.

stdout carries exactly one JSON line, the observation. Everything else a library prints to
fd 1 is sent to stderr, which the parent keeps as evidence. Exit codes: 0 observation
printed, 2 usage error, 70 the probe itself raised (traceback on stderr).
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import traceback
from typing import Any


def _claim_stdout() -> Any:
    """Keep fd 1 for the observation and point everything else at stderr."""
    saved = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(saved, "w", encoding="utf-8")


def _die_with_parent() -> None:
    """End this probe's whole process group if the process that started it dies.

    A SIGKILLed daemon cannot kill its probe children, and they run in their own session:
    without this a hung probe would outlive it. ctypes calls release the GIL, so this thread
    runs even while a driver call hangs (short of a task stuck in the kernel).
    """
    import signal
    import threading
    import time

    # The parent names itself: a child orphaned before this line runs is caught too.
    try:
        parent = int(os.environ.get("GPUDIAG_PROBE_PARENT_PID", ""))
    except ValueError:
        parent = os.getppid()

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os.killpg(os.getpgrp(), signal.SIGKILL)
            time.sleep(0.5)

    threading.Thread(target=watch, name="gpudiag-parent-watch", daemon=True).start()


def main(argv: list[str]) -> int:
    from gpudiag.probes import load, probe_modules

    modules = probe_modules()
    if not argv or argv[0] not in modules:
        print(f"usage: python -m gpudiag.probes {{{','.join(modules)}}} [OPTIONS-JSON]",
              file=sys.stderr)
        return 2
    try:
        options = json.loads(argv[1]) if len(argv) > 1 else {}
        if not isinstance(options, dict):
            raise ValueError("options must be a JSON object")
    except ValueError as e:
        print(f"bad probe options: {e}", file=sys.stderr)
        return 2
    # A crash inside a driver library then leaves a Python stack on stderr.
    faulthandler.enable(file=sys.stderr)
    _die_with_parent()
    out = _claim_stdout()
    try:
        observation = load(argv[0])(options)
    except Exception:
        traceback.print_exc(file=sys.stderr)
        return 70
    out.write(json.dumps(observation, default=str) + "\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
