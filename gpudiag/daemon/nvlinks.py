"""The most NVLink links seen active per GPU, kept in the state directory across restarts.

``gpu_nvlink_down`` compares each GPU's active links with the most seen before (when
``[nvml] expected_nvlinks`` is unset). A restart must not forget that count, or a link that
went down while the daemon was stopped would never be missed. One small JSON object,
``{uuid: count}``, written atomically when a count grows; read once at start, leniently
(a missing, foreign or damaged file is an empty memory, said in the log, never a failure).
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Mapping
from pathlib import Path

from gpudiag.core.fileio import atomic_write, write_error

log = logging.getLogger(__name__)
FILE_NAME = "nvlinks.json"
MAX_BYTES = 64 * 1024


def load(path: Path) -> dict[str, int]:
    """The remembered counts; empty when the file is absent or not ours to trust."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return {}
    except OSError as e:
        log.warning("NVLink memory %s not read: %s", path, e.strerror or e)
        return {}
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            log.warning("NVLink memory %s ignored: not a regular file of this user", path)
            return {}
        raw = fh.read(MAX_BYTES + 1)
    try:
        data = json.loads(raw) if len(raw) <= MAX_BYTES else None
    except ValueError:
        data = None
    if not isinstance(data, dict):
        log.warning("NVLink memory %s ignored: not a JSON object of counts", path)
        return {}
    return {k: v for k, v in data.items()
            if isinstance(k, str) and type(v) is int and 0 < v <= 64}


def save(path: Path, counts: Mapping[str, int]) -> None:
    """Write the counts; a failed write is logged (the counts stay in memory)."""
    try:
        atomic_write(path, json.dumps(dict(sorted(counts.items()))) + "\n", mode=0o600)
    except OSError as e:
        log.warning("NVLink memory not kept: %s", write_error(path, e))
