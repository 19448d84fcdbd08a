"""Backend settings for the probe children a one-shot command runs (no click: the fast path
``gpudiag probe --json`` reads them too, gpudiag.cli.entry)."""

from __future__ import annotations

from gpudiag.core.limits import NODE_CONFIG


def backend_settings(path: str | None, *, explicit: bool) -> None:
    """Hand the config's backend settings ([backends.nic] expect, ...) to the probe children
    run here, as the daemon hands them to its own. ``path`` None: the node's config file when
    it exists. A bad explicit file raises (ConfigError, OSError); a bad node file is said on
    stderr and the defaults stand (a probe still runs)."""
    import os
    import sys

    if path is None and not os.path.exists(NODE_CONFIG):
        return  # the common case, and the fast path's: no import of the config loader
    from gpudiag.daemon.config import (
        SETTINGS_VARIABLE,
        ConfigError,
        backend_settings_json,
        load_config,
    )

    path = path if path is not None else NODE_CONFIG
    try:
        cfg = load_config(path)
    except (ConfigError, OSError) as e:
        if explicit:
            raise
        print(f"gpudiag: {path}: {e}; backend settings at their defaults", file=sys.stderr)
        return
    os.environ[SETTINGS_VARIABLE] = backend_settings_json(cfg)
