"""Limits and well-known numbers that more than one layer needs: one definition each."""

from __future__ import annotations

# The daemon's TCP port (loopback by default): clients and the daemon's config agree on it.
DEFAULT_PORT = 9477
