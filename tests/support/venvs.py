"""Job environments for tests: real venvs made in a second, with or without JAX.

A venv is made with ``python -m venv --without-pip`` and a ``.pth`` file: one "with JAX"
sees this suite's site-packages (CPU-only JAX and everything else), one "without JAX" sees
only the few packages gpudiag's CLI and probes import (through a folder of links), so JAX
and IREE are not installed there, as in an environment made without gpudiag's extras.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# What gpudiag itself imports (its required dependencies) and what those import.
CLI_PACKAGES = ("click", "prometheus_client", "pynvml.py", "h11", "psutil")


def _site_packages(venv: Path) -> Path:
    found = sorted((venv / "lib").glob("python3*/site-packages"))
    assert found, f"no site-packages in {venv}"
    return found[0]


def own_site_packages() -> Path:
    """This suite's site-packages (the .venv's)."""
    return Path(sysconfig.get_paths()["purelib"])


def make_venv(root: Path, *, with_jax: bool) -> Path:
    """A venv at ``root``; returns its python (a real interpreter of its own prefix)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True,
                   capture_output=True, timeout=120)
    site = _site_packages(root)
    source = own_site_packages()
    if with_jax:
        lines = [str(REPO), str(source)]
    else:
        deps = root / "gpudiag-deps"
        deps.mkdir()
        for name in CLI_PACKAGES:
            (deps / name).symlink_to(source / name)
        lines = [str(REPO), str(deps)]
    (site / "gpudiag-tests.pth").write_text("\n".join(lines) + "\n")
    return root / "bin" / "python"


def install_fake_distribution(venv_python: Path, name: str, version: str = "1.0") -> Path:
    """A distribution's metadata folder in the venv's own site-packages (what pip leaves)."""
    site = _site_packages(venv_python.parent.parent)
    folder = site / f"{name}-{version}.dist-info"
    folder.mkdir()
    (folder / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return folder
