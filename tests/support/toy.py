"""The toy backend's one registry line (tests/toy/toy_backend.py), for children and for this
process: what tests/test_backend_registry.py and the fault matrix register it with."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from gpudiag.core import registry

REPO = Path(__file__).resolve().parents[2]
# The one registry line, run at every interpreter start (CLI, daemon and probe children).
REGISTRY_LINE = ("from gpudiag.core import registry\nfrom tests.toy import toy_backend\n"
                 "registry.BACKENDS.append(toy_backend.SPEC)\n")


def toy_registered_env(env: Mapping[str, str], site: Path) -> dict[str, str]:
    """``env`` whose Python processes run the registry line (a sitecustomize.py in ``site``)."""
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(REGISTRY_LINE)
    out = dict(env)
    rest = out.get("PYTHONPATH") or str(REPO)
    out["PYTHONPATH"] = os.pathsep.join([str(site), rest])
    return out


@contextmanager
def toy_registered() -> Iterator[None]:
    """This process's registry with the same line run in it, restored afterwards."""
    before = list(registry.BACKENDS)
    exec(REGISTRY_LINE, {})  # the very text the children run, so both see one registry
    try:
        yield
    finally:
        registry.BACKENDS[:] = before
