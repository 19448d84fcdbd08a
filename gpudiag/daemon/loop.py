"""The daemon's background loops (scheduler, qualifier): one thread each, stopped the same way.

A loop runs until ``stopping`` is set and sleeps on ``woken``, so a request or a stop cuts
its wait short; ``stop()`` sets both and joins the thread within a deadline.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class LoopThread:
    """A named daemon thread running one loop, with the events the loop stops and waits on."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.stopping = threading.Event()
        self.woken = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, loop: Callable[[], None]) -> None:
        """Run ``loop`` in a new daemon thread."""
        self._thread = threading.Thread(target=loop, name=self.name, daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        """Whether the thread was started and has not ended."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout_s: float) -> None:
        """Ask the loop to end, wake it, and wait up to ``timeout_s`` for the thread."""
        self.stopping.set()
        self.woken.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
