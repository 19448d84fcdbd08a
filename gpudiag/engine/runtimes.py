"""Running probes in a runtime's interpreter: the probe archive, its argv, its fingerprint.

A runtime's Python (a venv, a conda env) has no gpudiag installed, and gpudiag never
installs into or writes into a job's environment. So the daemon ships its probe code to that
interpreter as a zip archive it builds in its own state directory (``probe_archive``): the
``gpudiag`` package (pure Python; only the probes' own imports, the backend's packages,
come from the runtime) and a ``__main__`` that runs a probe or prints the fingerprint. The
child runs ``PYTHON -s ARCHIVE NAME [OPTIONS]``: ``-s`` keeps the daemon user's own site
folder out; the runtime's PYTHONPATH, if its config sets one, still applies, as it would for
the job.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import tempfile
import time
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpudiag.core.environment import probe_environment
from gpudiag.core.runtime import Runtime
from gpudiag.core.version import __version__

ARCHIVE_MAIN = '''"""gpudiag probe archive: ``python ARCHIVE NAME [OPTIONS]`` or ``fingerprint``."""
import sys

if len(sys.argv) > 1 and sys.argv[1] == "fingerprint":
    from gpudiag.engine.fingerprint import main

    sys.exit(main(sys.argv[2:]))
from gpudiag.probes.__main__ import main

sys.exit(main(sys.argv[1:]))
'''
# What a runtime's child never inherits from the daemon's own environment: its Python's
# search path belongs to the daemon (a runtime's config sets its own when it needs one).
_DAEMON_ONLY = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "VIRTUAL_ENV")
FINGERPRINT_TIMEOUT_S = 10.0
FAILED_RETRY_S = 300.0


def python_problem(path: str, *, trusted_uids: frozenset[int] = frozenset({0})) -> str | None:
    """Why ``path`` cannot be a runtime's interpreter (None: it can).

    It must exist, be an executable regular file (through its links), and neither it nor any
    folder above it (of the link and of its target) may be writable by a user the daemon does
    not trust: whoever can replace it runs code as the daemon.
    """
    if not path.startswith("/"):
        return f"{path!r} is not an absolute path"
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except OSError as e:
        return f"{path} does not exist or cannot be read: {e.strerror or e}"
    if not stat.S_ISREG(st.st_mode) or not os.access(real, os.X_OK):
        return f"{path} is not an executable file"
    uids = trusted_uids | {os.geteuid()}
    for item in dict.fromkeys([real, *_parents(real), *_parents(os.path.abspath(path))]):
        try:
            ist = os.stat(item)
        except OSError as e:
            return f"cannot check {item}: {e.strerror or e}"
        writable = ist.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        sticky_dir = stat.S_ISDIR(ist.st_mode) and ist.st_mode & stat.S_ISVTX
        if ist.st_uid not in uids or (writable and not sticky_dir):
            return (f"{item} may be written by another user (owner uid {ist.st_uid}, mode "
                    f"{stat.filemode(ist.st_mode)}): whoever can replace {path} would run "
                    "code as the daemon; use an interpreter in a folder only root can write")
    return None


def _parents(path: str) -> list[str]:
    out = []
    folder = os.path.dirname(path)
    while True:
        out.append(folder)
        parent = os.path.dirname(folder)
        if parent == folder:
            return out
        folder = parent


def source_tag() -> str:
    """A short digest of the gpudiag package's sources (names, sizes, mtimes): an archive
    named by it is never stale, even for an editable install whose version stays put."""
    from gpudiag.engine.fingerprint import _digest

    package = Path(__file__).resolve().parents[1]
    facts = []
    for source in sorted(package.rglob("*.py")):
        if "__pycache__" not in source.parts:
            st = source.stat()
            facts.append([source.relative_to(package).as_posix(), st.st_size, st.st_mtime_ns])
    return _digest(facts)[:12]


def probe_archive(folder: Path, *, tag: str | None = None) -> Path:
    """The probe archive for this gpudiag version (and ``tag``, engine.runtimes.source_tag)
    in ``folder`` (built once, atomically)."""
    suffix = f"-{tag}" if tag else ""
    target = folder / f"gpudiag-probes-{__version__}{suffix}.pyz"
    if target.is_file() and not target.is_symlink():
        return target
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    package = Path(__file__).resolve().parents[1]  # the gpudiag package folder
    fd, tmp = tempfile.mkstemp(prefix=".probes-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh, zipfile.ZipFile(fh, "w", zipfile.ZIP_DEFLATED) as zf:
            zf.writestr("__main__.py", ARCHIVE_MAIN)
            for source in sorted(package.rglob("*.py")):
                if "__pycache__" not in source.parts:
                    zf.write(source, f"gpudiag/{source.relative_to(package).as_posix()}")
        os.chmod(tmp, 0o644)  # the runtime's interpreter reads it as the daemon's user
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return target


def runtime_environment(runtime: Runtime, daemon_env: Mapping[str, str]) -> dict[str, str]:
    """A runtime child's environment: the daemon's probe environment without its Python
    search path, the runtime's own variables over it."""
    base = {k: v for k, v in daemon_env.items() if k not in _DAEMON_ONLY}
    return probe_environment({**base, **runtime.env})


def interpreter_argv(runtime: Runtime, archive: Path) -> list[str]:
    """The start of a runtime child's argv: its interpreter running the probe archive."""
    assert runtime.python is not None, "the daemon's own runtime runs its probes directly"
    return [runtime.python, "-s", str(archive)]


@dataclass(frozen=True)
class RuntimeFingerprint:
    """What a runtime's interpreter said of its environment (engine/fingerprint.py's JSON)."""

    ids: Mapping[str, str]           # backend -> fingerprint id
    installed: frozenset[str]        # backends whose distribution is installed there
    interpreter: Mapping[str, str]
    watch: tuple[tuple[Any, ...], ...]  # (path, inode, size, mtime_ns) to look at for change
    error: str | None = None
    read_at: float = field(default_factory=time.monotonic)  # when it was read (monotonic)

    @classmethod
    def of(cls, data: Mapping[str, Any]) -> RuntimeFingerprint:
        """Read fingerprint.fingerprints()'s JSON; ValueError when it is not that."""
        backends = data.get("backends")
        if not isinstance(backends, dict):
            raise ValueError("no backends object")
        ids, installed = {}, set()
        for name, entry in backends.items():
            if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
                raise ValueError(f"backend {name!r} has no id")
            ids[str(name)] = entry["id"]
            if entry.get("installed") is True:
                installed.add(str(name))
        watch = tuple(tuple(w) for w in data.get("watch") or () if isinstance(w, list))
        interp = data.get("interpreter")
        said = {str(k): str(v) for k, v in interp.items()} if isinstance(interp, dict) else {}
        return cls(ids, frozenset(installed), said, watch)

    @classmethod
    def failed(cls, why: str) -> RuntimeFingerprint:
        return cls({}, frozenset(), {}, (), why)

    def changed(self, now: float | None = None) -> bool:
        """Whether anything it watches differs now (a package installed, removed, rebuilt);
        a reading that failed is read again after FAILED_RETRY_S (a hung interpreter costs
        its timeout once per that, not every NVML round)."""
        if self.error is not None:
            return (time.monotonic() if now is None else now) - self.read_at > FAILED_RETRY_S
        for path, *before in self.watch:
            try:
                st = os.stat(path)
            except OSError:
                return True
            if [st.st_ino, st.st_size, st.st_mtime_ns] != list(before):
                return True
        return False


def own_fingerprint(names: Mapping[str, Any], env: Mapping[str, str]) -> RuntimeFingerprint:
    """The daemon's own environment's fingerprint, read in this process (no import of any
    backend: engine/fingerprint.py reads folders)."""
    from gpudiag.engine.fingerprint import fingerprints

    return RuntimeFingerprint.of(fingerprints(names, env))


def read_fingerprint(runtime: Runtime, archive: Path, env: Mapping[str, str],
                     timeout_s: float = FINGERPRINT_TIMEOUT_S) -> RuntimeFingerprint:
    """A runtime's fingerprint, from its own interpreter (a child: never raises)."""
    argv = [*interpreter_argv(runtime, archive), "fingerprint"]
    try:
        done = subprocess.run(argv, env=dict(env), capture_output=True, timeout=timeout_s,  # noqa: S603
                              stdin=subprocess.DEVNULL, start_new_session=True, check=False)
    except subprocess.TimeoutExpired:
        return RuntimeFingerprint.failed(f"{runtime.python} did not print its fingerprint "
                                         f"within {timeout_s:g} s")
    except OSError as e:
        return RuntimeFingerprint.failed(f"{runtime.python} could not start: {e.strerror or e}")
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or [""]
        return RuntimeFingerprint.failed(f"{runtime.python} exited {done.returncode} reading "
                                         f"its fingerprint: {tail[0][:300]}")
    try:
        lines = done.stdout.decode(errors="replace").strip().splitlines()
        return RuntimeFingerprint.of(json.loads(lines[-1]))
    except (ValueError, IndexError, RecursionError) as e:
        return RuntimeFingerprint.failed(f"{runtime.python} printed no fingerprint: {e}")
