"""Which boot of the node this is: the kernel's boot id.

``/proc/sys/kernel/random/boot_id`` is a random UUID the kernel draws at each boot; the same
id means the same boot, whatever the clock did. ``GPUDIAG_BOOT_ID_FILE`` names another file
(tests). A boot id that cannot be read is None: holds are then kept as they are.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from gpudiag.core.fileio import RefusedFile, read_regular

BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"
ENV = "GPUDIAG_BOOT_ID_FILE"
_ID = re.compile(r"[0-9A-Za-z-]{8,64}")


def boot_id(env: Mapping[str, str]) -> str | None:
    """The kernel's boot id (or the file ``GPUDIAG_BOOT_ID_FILE`` names), None if unreadable."""
    path = env.get(ENV) or BOOT_ID_FILE
    try:
        raw, _st = read_regular(path, 4096, follow=True)
    except (RefusedFile, OSError):
        return None
    text = raw.decode("ascii", errors="replace").strip()
    return text if _ID.fullmatch(text) else None
