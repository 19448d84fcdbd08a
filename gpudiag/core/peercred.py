"""Who is at the other end of a unix socket (Linux SO_PEERCRED), for both sides of the API."""

from __future__ import annotations

# The C module under ``socket``: the daemon-answered CLI call checks its peer, and ``socket``
# itself costs it about 2 ms more to import (its enums of every constant); a ``socket.socket``
# is an ``_socket.socket``, so the daemon's side passes its own.
import _socket
import struct

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class PeerCredentials(tuple[int, int, int]):
    """The peer's (pid, uid, gid), as the kernel recorded them at connect() or listen().

    An immutable tuple rather than a frozen dataclass: the daemon-answered CLI call checks its
    peer, and importing dataclasses would cost it more than the whole answer (about 7 ms).
    """

    __slots__ = ()

    def __new__(cls, pid: int, uid: int, gid: int) -> PeerCredentials:
        return tuple.__new__(cls, (pid, uid, gid))

    @property
    def pid(self) -> int:
        return self[0]

    @property
    def uid(self) -> int:
        return self[1]

    @property
    def gid(self) -> int:
        return self[2]


def peer_credentials(sock: _socket.socket) -> PeerCredentials:
    """The credentials of a connected unix socket's peer; OSError when there are none."""
    data = sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(data)
    return PeerCredentials(pid, uid, gid)


# SO_PEERPIDFD (Linux 6.5): a pidfd of the very process that connected, which no pid reuse
# can swap for another (Python 3.11's socket module does not name it).
SO_PEERPIDFD = 77


def peer_pidfd(sock: _socket.socket) -> int | None:
    """A pidfd of a connected unix socket's peer process (the caller owns it); None when the
    kernel gives none (before Linux 6.5, or not a unix socket)."""
    try:
        data = sock.getsockopt(_socket.SOL_SOCKET, SO_PEERPIDFD, 4)
    except OSError:
        return None
    fd = int.from_bytes(data[:4], "little", signed=True)
    return fd if fd >= 0 else None
