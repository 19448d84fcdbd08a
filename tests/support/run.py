"""`gpudiag run` as a user runs it, with no daemon to ask (tests of the runner)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.support.host import run_gpudiag

# Nothing listens on the discard port: no daemon a developer runs can answer these tests.
NO_DAEMON = "http://127.0.0.1:9"


def gpudiag_run(args: list[str], env: dict[str, str], artifacts: Path, timeout: float = 60
                ) -> subprocess.CompletedProcess[str]:
    env = dict(env)
    env.setdefault("GPUDIAG_DAEMON_URL", NO_DAEMON)
    return run_gpudiag(["run", "--artifacts", str(artifacts), *args], env, timeout)


def run_folder(artifacts: Path) -> Path:
    """The one run folder (``STAMP-xxxxxxxx``) that a `gpudiag run --artifacts DIR` made in DIR."""
    runs = [p for p in artifacts.iterdir() if p.is_dir()]
    assert len(runs) == 1, f"{artifacts} holds {len(runs)} run folders: {runs}"
    return runs[0]
