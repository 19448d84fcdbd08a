"""A daemon thread that runs one cycle each tick, or at once when woken.

Remediation (daemon/remediation.py) and the GPU reset rung (daemon/gpu_reset.py) act the same
way: look at the latest facts, act at most once, wait for the next tick or a wake-up. A cycle
that fails is a bug of ours: it is logged, and the next one tries again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("gpudiag.daemon")


class CycleThread:
    """``cycle()`` every ``tick_s()`` seconds on a thread named ``name``; ``wake()`` runs the
    next one now; ``stop()`` ends the thread (safe before ``start``)."""

    def __init__(self, name: str, cycle: Callable[[], object], tick_s: Callable[[], float]
                 ) -> None:
        self._name, self._cycle, self._tick_s = name, cycle, tick_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def wake(self) -> None:
        self._wake.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._tick_s())
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self._cycle()
            except Exception:  # a bug of ours: said, and the next cycle tries again
                log.exception("%s cycle failed", self._name)
