"""Limits and well-known names and numbers that more than one layer needs: one definition each.

Everything here is part of a contract (docs/reference.md) or shared by layers that must agree: the
daemon's port, the IREE driver names, the device limit and the exit codes. The probe names and
their deadlines are in each backend's spec (gpudiag.core.registry).
"""

from __future__ import annotations

# The daemon's TCP port (loopback by default): clients and the daemon's config agree on it.
DEFAULT_PORT = 9477

# IREE HAL drivers a requirement may name (`iree:DRIVER`), the same rule for the CLI, the
# Python API and HTTP: each distinct driver list is a probe key the daemon keeps, so names
# beyond the drivers IREE builds would grow it without bound (and can never work anyway).
IREE_DRIVERS: tuple[str, ...] = ("cuda", "hip", "local-sync", "local-task", "vulkan")

# The most devices one requirement, preflight or `gpudiag run` may ask for or list.
MAX_DEVICES = 64

# The longest a caller waits for the daemon's answer: a Slurm prolog has 60 s in all. Here,
# not in engine/route.py, so that the CLI's fast path need not import the router for it.
MAX_DAEMON_WAIT_S = 60.0
# One deadline per call (docs/reference.md "Deadlines"): a call without --timeout waits this
# long for the daemon (its own preflight_wait_s, 20 s by default, plus a margin), once, and its
# fallback probes get what is left of CALL_BUDGET_S, so that the whole call fits a prolog's
# 60 s with room for the interpreter's start and the printing.
DEFAULT_DAEMON_WAIT_S = 25.0
CALL_BUDGET_S = 55.0
# The least deadline a fallback probe gets, however long the daemon wait was.
MIN_PROBE_DEADLINE_S = 1.0

# Exit codes of `gpudiag probe` and `gpudiag preflight` (docs/reference.md: a contract).
EXIT_READY, EXIT_BLOCKED, EXIT_USAGE, EXIT_FAILED = 0, 1, 2, 3
# Exit codes of `gpudiag run` when ARGV did not run (as env(1) and the shells use them).
EXIT_REFUSED, EXIT_CANNOT_EXECUTE, EXIT_NOT_FOUND = 125, 126, 127

# The node's config file: the systemd unit's and the Kubernetes manifests' `--config`, and what
# the one-shot commands read backend settings from when it exists and no --config is given.
NODE_CONFIG = "/etc/gpudiag/gpudiag.toml"
