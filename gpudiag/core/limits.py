"""Limits and well-known names and numbers that more than one layer needs: one definition each.

Everything here is part of a contract (docs/reference.md) or shared by layers that must agree: the
daemon's port, the probe names, the per-probe deadlines, the device limit and the exit codes.
"""

from __future__ import annotations

from types import MappingProxyType

# The daemon's TCP port (loopback by default): clients and the daemon's config agree on it.
DEFAULT_PORT = 9477

# The probe children gpudiag runs (`python -m gpudiag.probes NAME`), in run/report order:
# `gpudiag probe --backend` accepts them and the daemon schedules them.
PROBES: tuple[str, ...] = ("host", "nvml", "cuda", "jax", "iree")
# What a requirement may name (`--require`), in the order its error messages list them.
REQUIRABLE_BACKENDS: tuple[str, ...] = ("cuda", "nvml", "jax", "iree")

# IREE HAL drivers a requirement may name (`iree:DRIVER`), the same rule for the CLI, the
# Python API and HTTP: each distinct driver list is a probe key the daemon keeps, so names
# beyond the drivers IREE builds would grow it without bound (and can never work anyway).
IREE_DRIVERS: tuple[str, ...] = ("cuda", "hip", "local-sync", "local-task", "vulkan")

# Deadline of each probe child in seconds: generous for a healthy host, short enough for a
# Slurm prolog. Inline preflight and the daemon's defaults (config deadline_s) both use these.
PROBE_TIMEOUTS_S: MappingProxyType[str, float] = MappingProxyType({
    "host": 10.0, "nvml": 10.0, "cuda": 15.0, "jax": 60.0, "iree": 90.0})

# The most devices one requirement, preflight or `gpudiag run` may ask for or list.
MAX_DEVICES = 64

# Exit codes of `gpudiag probe` and `gpudiag preflight` (docs/reference.md: a contract).
EXIT_READY, EXIT_BLOCKED, EXIT_USAGE, EXIT_FAILED = 0, 1, 2, 3
# Exit codes of `gpudiag run` when ARGV did not run (as env(1) and the shells use them).
EXIT_REFUSED, EXIT_CANNOT_EXECUTE, EXIT_NOT_FOUND = 125, 126, 127
