"""systemd's sd_notify protocol without a dependency: datagrams to $NOTIFY_SOCKET.

``READY=1`` once the daemon serves; ``WATCHDOG=1`` from every scheduler-loop iteration, so a
wedged loop stops the keep-alives and systemd's WatchdogSec= restarts the unit.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Mapping

from gpudiag.core.ascii_ints import ascii_int


class Notifier:
    """Sends sd_notify messages; does nothing when NOTIFY_SOCKET is unset."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        environ = os.environ if env is None else env
        path = environ.get("NOTIFY_SOCKET", "")
        # '@' names a socket in the abstract namespace: a leading NUL byte on the wire.
        self._address = "\0" + path[1:] if path.startswith("@") else path
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        usec = environ.get("WATCHDOG_USEC", "")
        self.watchdog_usec = ascii_int(usec)

    @property
    def enabled(self) -> bool:
        return bool(self._address)

    def notify(self, message: str) -> bool:
        """Send one message; False when there is no socket or sending failed (never raises)."""
        if not self._address:
            return False
        with self._lock:
            try:
                if self._sock is None:
                    # Non-blocking: a receiver that does not read (a full queue) must not
                    # hold the scheduler's loop or a stopping daemon; the message is dropped.
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM
                                               | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
                self._sock.sendto(message.encode("utf-8"), self._address)
                return True
            except OSError:
                # systemd may be gone or restarting; the next message tries again.
                self._close_locked()
                return False

    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1" + (f"\nSTATUS={status}" if status else ""))

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={text}")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")

    def _close_locked(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._close_locked()
