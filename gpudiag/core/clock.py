"""The clock in records: RFC 3339 UTC with milliseconds and a Z."""

from __future__ import annotations

import time
from datetime import datetime, timezone


def rfc3339(wall: float) -> str:
    """A wall-clock time as RFC 3339 UTC with milliseconds."""
    dt = datetime.fromtimestamp(wall, timezone.utc)
    return dt.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def now_rfc3339() -> str:
    """The current UTC time, RFC 3339 with a Z."""
    return rfc3339(time.time())
