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
from dataclasses import field

from gpudiag.core.records import dataclass
from gpudiag.core.verdict import BackendRequirement

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
    # The backends this runtime must serve, as requirement entries (``jax``, ``jax:cpu``,
    # ``iree:local-task``): a blocker of this runtime when one cannot start. None: every
    # backend installed there (its fingerprint says) on the GPU, none for the daemon's own.
    require: tuple[str, ...] | None = None
    # Who its children run as (docs/security.md, "Who can run code where"): ``user`` as the
    # config names it (None: not named), and the uid and gid it resolved to. None: the
    # daemon's own identity (a daemon that is not root and cannot change it, or own).
    user: str | None = None
    uid: int | None = None
    gid: int | None = None

    @property
    def own(self) -> bool:
        """Whether this is the daemon's own environment."""
        return self.python is None

    @property
    def identity(self) -> tuple[int, int] | None:
        """(uid, gid) its children run as; None: the daemon's own."""
        return None if self.uid is None or self.gid is None else (self.uid, self.gid)

    def required(self, installed: frozenset[str]) -> tuple[BackendRequirement, ...]:
        """The backends it must serve, given those installed in it (in the given order)."""
        if self.require is not None:
            return tuple(_entry(spec) for spec in self.require)
        return () if self.own else tuple(BackendRequirement(n) for n in sorted(installed))

    def platform_of(self, backend: str) -> str | None:
        """The platform its ``require`` names for ``backend`` (None: the default, the GPU)."""
        for spec in self.require or ():
            entry = _entry(spec)
            if entry.name == backend:
                return entry.platform
        return None


def _entry(spec: str) -> BackendRequirement:
    """``jax:cpu`` -> BackendRequirement("jax", "cpu") (the config parser checked it)."""
    name, _, platform = spec.partition(":")
    return BackendRequirement(name, platform or None)
