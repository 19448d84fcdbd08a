"""Where the daemon's state directory is by default: one rule for the daemon and its clients.

``gpudiag serve`` keeps its history there; ``gpudiag clear`` and ``gpudiag run`` drop
request and closeout files into its inboxes; ``gpudiag explain`` reads it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def default_state_dir(env: Mapping[str, str] | None = None) -> Path:
    """$GPUDIAG_STATE_DIR, $STATE_DIRECTORY (systemd), /var/lib/gpudiag for root, else
    $XDG_STATE_HOME/gpudiag (~/.local/state/gpudiag)."""
    environ = os.environ if env is None else env
    if environ.get("GPUDIAG_STATE_DIR"):
        return Path(environ["GPUDIAG_STATE_DIR"])
    if environ.get("STATE_DIRECTORY"):
        return Path(environ["STATE_DIRECTORY"].split(":")[0])
    if os.geteuid() == 0:
        return Path("/var/lib/gpudiag")
    base = environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "gpudiag"
