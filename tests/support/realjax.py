"""The real JAX CUDA stack for the real-stack test tier, installed once into .cache/ (not git).

``ensure_real_jax()`` makes ``.cache/real-jax/<jax version>/venv``: a virtual environment with
jax, jaxlib and ``jax-cuda12-plugin[with-cuda]`` at the version of the jax in the test venv
(NVIDIA's CUDA user-space wheels come with it: about 3.2 GB of wheels, 5.5 GB installed),
plus gpudiag's own runtime dependencies; gpudiag itself comes from this checkout through
PYTHONPATH, so one cache (``GPUDIAG_REAL_JAX_CACHE``) can serve every checkout. It is built
in a temporary folder and renamed into place, so a half-made venv is never used.
``python -m tests.support.realjax`` installs it ahead of the tests and prints its path; the tier
itself installs it when missing.

Knob: ``GPUDIAG_REAL_JAX`` = ``0`` (skip the tier, with that reason), ``require`` (a stack
that cannot be installed fails the tier instead of skipping it), unset (install, skip with
pip's own words when the wheels cannot be fetched). ``GPUDIAG_REAL_JAX_CACHE`` moves the cache.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CACHE = ROOT / ".cache" / "real-jax"
STAMP = ".gpudiag-real-jax-complete"


class StackUnavailable(Exception):
    """The real stack could not be installed; the message says why (pip's last lines)."""


@dataclass(frozen=True)
class RealJax:
    """An installed real JAX CUDA stack."""

    venv: Path
    python: Path
    version: str
    install_s: float | None  # None when it came from the cache

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """``base`` with this checkout's gpudiag importable by the cached venv's python."""
        env = dict(base)
        old = env.get("PYTHONPATH")
        env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{old}" if old else str(ROOT)
        env["GPUDIAG_JOB_PYTHON"] = str(self.python)  # the job runs in that venv
        return env


def jax_version() -> str:
    """The version of the jax installed next to these tests (the one the suite tests)."""
    return importlib.metadata.version("jax")


def runtime_dependencies() -> list[str]:
    """gpudiag's runtime dependencies, read from pyproject.toml (one list, never a copy), so
    the CLI runs in the cached venv too."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10 gets tomli from the project's dependencies
        import tomli as tomllib  # type: ignore[import-not-found,unused-ignore]  # not on 3.11+

    with open(ROOT / "pyproject.toml", "rb") as fh:
        deps = tomllib.load(fh)["project"]["dependencies"]
    return [str(d) for d in deps if "python_version" not in str(d)]


def requirements(version: str) -> list[str]:
    """What pip installs into the cached venv."""
    return [f"jax=={version}", f"jaxlib=={version}", f"jax-cuda12-plugin[with-cuda]=={version}",
            *runtime_dependencies()]


def _current(venv: Path, version: str, timeout_s: float) -> bool:
    """Whether a cached venv is complete; one made with other requirements (gpudiag gained a
    dependency) is topped up in place, which takes seconds, not a new 3.2 GB install."""
    stamp = venv / STAMP
    if not stamp.is_file() or not (venv / "bin" / "python").exists():
        return False
    wanted = " ".join(requirements(version))
    if stamp.read_text(encoding="utf-8").splitlines()[:1] == [wanted]:
        return True
    pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                          "--disable-pip-version-check", *requirements(version)],
                         capture_output=True, text=True, timeout=timeout_s, check=False)
    if pip.returncode != 0:
        return False
    stamp.write_text(f"{wanted}\ntopped_up=1\n", encoding="utf-8")
    return True


def cache_dir() -> Path:
    """Where the cached venvs live."""
    return Path(os.environ.get("GPUDIAG_REAL_JAX_CACHE") or DEFAULT_CACHE)


def _tail(text: str, lines: int = 8) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def ensure_real_jax(version: str | None = None, cache: Path | None = None,
                    timeout_s: float = 1800) -> RealJax:
    """The cached stack, installed first if missing; StackUnavailable when pip cannot."""
    version = version or jax_version()
    base = (cache or cache_dir()) / version
    venv = base / "venv"
    python = venv / "bin" / "python"
    base.mkdir(parents=True, exist_ok=True)
    # One installer at a time (two test sessions would each fetch 3.2 GB); the later one
    # finds the stamp once it gets the lock.
    with open(base / ".lock", "w", encoding="utf-8") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _current(venv, version, timeout_s):
            return RealJax(venv, python, version, None)
        # What a killed installer left (a half-made venv is gigabytes).
        for stale in [venv, *base.glob("venv.tmp-*")]:
            shutil.rmtree(stale, ignore_errors=True)
        return _install(venv, version, timeout_s)


def _install(venv: Path, version: str, timeout_s: float) -> RealJax:
    """Builds the venv next to ``venv`` and renames it into place once pip succeeded."""
    tmp = venv.with_name(f"venv.tmp-{os.getpid()}")
    started = time.monotonic()
    try:
        # The base interpreter of the test venv: the same Python the suite runs on.
        subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv",
                        str(tmp)], check=True, capture_output=True, text=True, timeout=300)
        pip = subprocess.run(
            [str(tmp / "bin" / "python"), "-m", "pip", "install", "-q",
             "--disable-pip-version-check", *requirements(version)],
            capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise StackUnavailable(f"installing into {tmp} failed: {e}") from e
    if pip.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise StackUnavailable(
            f"pip could not install {' '.join(requirements(version))} (exit "
            f"{pip.returncode}):\n{_tail(pip.stderr or pip.stdout)}")
    elapsed = round(time.monotonic() - started, 1)
    (tmp / STAMP).write_text(f"{' '.join(requirements(version))}\ninstall_s={elapsed}\n",
                             encoding="utf-8")
    tmp.rename(venv)
    return RealJax(venv, venv / "bin" / "python", version, elapsed)


def main() -> int:
    """``python -m tests.support.realjax``: install the stack (if missing) and print where it is."""
    try:
        stack = ensure_real_jax()
    except StackUnavailable as e:
        print(f"real JAX stack unavailable: {e}", file=sys.stderr)
        return 1
    how = "cached" if stack.install_s is None else f"installed in {stack.install_s} s"
    print(f"{stack.venv} (jax {stack.version}, {how})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
