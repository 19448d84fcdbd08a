"""Who is at the other end of a unix socket (Linux SO_PEERCRED), for both sides of the API."""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True)
class PeerCredentials:
    """The peer's process and user, as the kernel recorded them at connect() or listen()."""

    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    """The credentials of a connected unix socket's peer; OSError when there are none."""
    data = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(data)
    return PeerCredentials(pid, uid, gid)
