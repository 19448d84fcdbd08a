"""A runtime: one job environment a node serves, whose backends the daemon proves.

docs/design-notes.md, "Whose environment is proven". The operator names the environments
jobs run in (``[runtimes.NAME]``: a venv's, a conda env's or a module's Python, and the
variables it runs with); the daemon proves each runtime's backends by running the probe
child under that interpreter, and answers a job from a runtime's proof only when the job's
fingerprint matches it. The daemon's own environment is the runtime ``gpudiag``; it serves
no job unless configured to (``[runtimes.gpudiag] require = "jax"``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

OWN_RUNTIME = "gpudiag"
RUNTIME_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,31}")


@dataclass(frozen=True)
class Runtime:
    """One job environment: its interpreter, its variables, the backends it must serve."""

    name: str
    # The interpreter (an absolute path); None: the daemon's own (the ``gpudiag`` runtime).
    python: str | None = None
    # Variables set over the daemon's probe environment for this runtime's children.
    env: Mapping[str, str] = field(default_factory=dict)
    # The backends this runtime must serve: a node-health blocker when one cannot start.
    # None: every backend installed there (its fingerprint says), none for the daemon's own.
    require: tuple[str, ...] | None = None

    @property
    def own(self) -> bool:
        """Whether this is the daemon's own environment."""
        return self.python is None

    def required(self, installed: frozenset[str]) -> tuple[str, ...]:
        """The backends it must serve, given those installed in it (in the given order)."""
        if self.require is not None:
            return self.require
        return () if self.own else tuple(sorted(installed))
