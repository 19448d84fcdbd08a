"""The job's interpreter: found, never assumed to be gpudiag's own, and asked for its fingerprint.

A verdict about JAX or IREE is about the environment the job runs in (docs/design-notes.md,
"Whose environment is proven"). gpudiag is usually installed in a venv of its own
(``/opt/gpudiag``), so the interpreter running this CLI is the job's only when the job runs
it. The job's interpreter is, in order (``find``):

1. ``--python PATH`` (``explicit``), else ``$GPUDIAG_JOB_PYTHON``;
2. for ``gpudiag run -- CMD``: CMD's interpreter when CMD is a Python (its argv[0], or a
   script whose ``#!`` line names one);
3. inside the job (the Python API, the pytest plugin): this interpreter (``sys.executable``);
4. the job's active environment: ``$VIRTUAL_ENV/bin/python``, ``$CONDA_PREFIX/bin/python``,
   then the first ``python3`` on the job's ``PATH``;
5. none: the job has no Python, so no Python backend is installed for it.

Its fingerprint (engine/fingerprint.py) is computed **by that interpreter**: in this process
when it is this interpreter, else in a child running the probe archive (engine/runtimes.py),
cached by the interpreter's path, the inputs that decide the reading and the stat of every
folder it read, so a daemon-answered call asks the child once per change of the environment
(docs/benchmarks.md). A child that hangs or fails is never replaced by this interpreter's
reading: the ids it yields match no proof, so the backend is proven in the job's interpreter
itself, whose own deadline then decides.

Kept free of ``dataclasses`` and ``typing`` at run time: the daemon-answered CLI call uses it.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # typing stays off the CLI's fast path
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from typing import Any

    from gpudiag.core.fingerprint_inputs import EnvironmentDecl

JOB_PYTHON_VARIABLE = "GPUDIAG_JOB_PYTHON"
FINGERPRINT_TIMEOUT_S = 10.0
_CACHE_VERSION = 1


class JobPythonError(ValueError):
    """An explicit job interpreter (``--python``, ``$GPUDIAG_JOB_PYTHON``) that is no Python."""


class JobPython:
    """The job's interpreter: its path as found (a venv's ``bin/python`` is a link: the
    link's folder decides the venv, so it is not resolved) and how it was found."""

    __slots__ = ("path", "chosen_by")

    def __init__(self, path: str | None, chosen_by: str) -> None:
        self.path, self.chosen_by = path, chosen_by

    def __repr__(self) -> str:
        return f"JobPython({self.path!r}, {self.chosen_by!r})"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, JobPython) and self.path == other.path
                and self.chosen_by == other.chosen_by)

    def __hash__(self) -> int:
        return hash((self.path, self.chosen_by))

    @property
    def own(self) -> bool:
        """Whether it is the interpreter running this process (same file, same venv)."""
        return self.path is not None and same_interpreter(self.path, sys.executable)

    def record(self) -> dict[str, str | None]:
        """``evidence.job_python``: ``{path, chosen_by}``."""
        return {"path": self.path, "chosen_by": self.chosen_by}

    def describe(self) -> str:
        """``/venv/bin/python (chosen by VIRTUAL_ENV)``, for messages."""
        if self.path is None:
            return "no Python (none given with --python, no VIRTUAL_ENV, CONDA_PREFIX or " \
                   "python3 on the job's PATH)"
        return f"{self.path} (chosen by {self.chosen_by})"


def this_process() -> JobPython:
    """This interpreter, as the job's: the Python API and the pytest plugin run in the job."""
    return JobPython(sys.executable, "sys.executable")


def _venv_root(path: str) -> str | None:
    """The venv folder an interpreter path belongs to (``pyvenv.cfg`` beside or above its
    folder, without resolving the link), or None for a base interpreter."""
    folder = os.path.dirname(os.path.abspath(path))
    for root in (folder, os.path.dirname(folder)):
        if os.path.isfile(os.path.join(root, "pyvenv.cfg")):
            return os.path.realpath(root)
    return None


def same_interpreter(a: str, b: str) -> bool:
    """Whether two interpreter paths start the same Python: the same file and the same venv."""
    try:
        if not os.path.samefile(a, b):
            return False
    except OSError:
        return False
    return _venv_root(a) == _venv_root(b)


def _looks_like_python(path: str) -> bool:
    """A file named like a CPython interpreter (``python``, ``python3``, ``python3.11``)."""
    import re

    pattern = re.compile(r"python[0-9]*(\.[0-9]+)?[a-z]?")
    return any(pattern.fullmatch(os.path.basename(p)) for p in (path, os.path.realpath(path)))


def checked(path: str, source: str) -> str:
    """``path`` as a job interpreter given by ``source`` (``--python``, a variable); else
    JobPythonError naming it and what to give instead."""
    hint = "give the job's interpreter, e.g. /path/to/venv/bin/python"
    if not path:
        raise JobPythonError(f"{source} is empty: {hint}")
    full = os.path.abspath(os.path.expanduser(path))
    try:
        os.stat(full)
    except OSError as e:  # missing, or a folder above it this user may not search
        raise JobPythonError(f"{source} {path}: {e.strerror or e}; {hint}") from None
    if not os.path.isfile(full) or not os.access(full, os.X_OK):
        raise JobPythonError(f"{source} {path}: not an executable file; {hint}")
    if not _looks_like_python(full):
        raise JobPythonError(f"{source} {path}: not a Python interpreter (its name is not "
                             f"python, python3 or python3.N); {hint}")
    return full


def _which(name: str, env: Mapping[str, str]) -> str | None:
    """The first executable ``name`` on ``env``'s PATH (the job's, not this process's)."""
    if "/" in name:
        full = os.path.abspath(name)
        return full if os.path.isfile(full) and os.access(full, os.X_OK) else None
    for folder in env.get("PATH", "").split(os.pathsep):
        if not folder:
            continue
        candidate = os.path.join(folder, name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return os.path.abspath(candidate)
    return None


def command_python(argv: Sequence[str], env: Mapping[str, str]) -> str | None:
    """The Python a command runs under, when it is a Python (``python3 train.py``) or a
    script whose ``#!`` line names one (``#!/usr/bin/env python3``); else None."""
    if not argv:
        return None
    found = _which(argv[0], env)
    if found is None:
        return None
    if _looks_like_python(found):
        return found
    try:
        fd = os.open(found, os.O_RDONLY | os.O_NONBLOCK)
        try:
            head = os.read(fd, 256)
        finally:
            os.close(fd)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    words = head[2:].split(b"\n", 1)[0].decode(errors="replace").split()
    if words and os.path.basename(words[0]) == "env":
        words = [w for w in words[1:] if not w.startswith("-")]  # env -S, env -i
        interp = _which(words[0], env) if words else None
    else:
        interp = words[0] if words and os.path.isfile(words[0]) else None
    return interp if interp is not None and _looks_like_python(interp) else None


def find(env: Mapping[str, str], *, explicit: str | None = None,
         command: Sequence[str] | None = None, inside_job: bool = False) -> JobPython:
    """The job's interpreter (the module's order); JobPythonError for a bad explicit one."""
    if explicit is not None:
        return JobPython(checked(explicit, "--python"), "--python")
    named = env.get(JOB_PYTHON_VARIABLE)
    if named:
        return JobPython(checked(named, JOB_PYTHON_VARIABLE), JOB_PYTHON_VARIABLE)
    if command:
        found = command_python(command, env)
        if found is not None:
            return JobPython(found, "command")
    if inside_job:
        return this_process()
    for variable in ("VIRTUAL_ENV", "CONDA_PREFIX"):
        prefix = env.get(variable)
        if prefix:
            for name in ("python", "python3"):
                candidate = os.path.join(prefix, "bin", name)
                if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
                    return JobPython(os.path.abspath(candidate), variable)
    on_path = _which("python3", env)
    if on_path is not None:
        return JobPython(on_path, "PATH")
    return JobPython(None, "none")


# ---- the fingerprint, by the job's interpreter ------------------------------------------


def fingerprints(decls: Mapping[str, EnvironmentDecl], env: Mapping[str, str],
                 python: JobPython, *, timeout_s: float = FINGERPRINT_TIMEOUT_S
                 ) -> dict[str, Any]:
    """engine/fingerprint.fingerprints()'s reading, made by the job's interpreter.

    With no interpreter every backend is not installed; a reading that failed carries
    ``error`` and ids that match no proof (never this interpreter's reading instead).
    """
    from gpudiag.engine import fingerprint

    if not decls:
        return {"interpreter": {}, "backends": {}, "watch": []}
    if python.path is None:
        return _unreadable(decls, "none", None)
    if python.own:
        return fingerprint.fingerprints(decls, env)
    key = _cache_key(decls, env, python.path)
    folder = cache_dir()
    if folder is not None:
        hit = _cached(folder, key)
        if hit is not None:
            return hit
    reading = _ask(decls, env, python.path, timeout_s, folder)
    if folder is not None and "error" not in reading:
        _store(folder, key, python.path, reading)
    return reading


def fingerprint_ids(decls: Mapping[str, EnvironmentDecl], env: Mapping[str, str],
                    python: JobPython) -> dict[str, str]:
    """The job's fingerprint id per backend of ``decls`` (the ``fingerprint=`` parameter)."""
    if not decls:
        return {}
    found = fingerprints(decls, env, python)
    return {name: str(entry["id"]) for name, entry in found["backends"].items()}


def _unreadable(decls: Mapping[str, EnvironmentDecl], why: str, error: str | None
                ) -> dict[str, Any]:
    """A reading that matches no proof: ids no environment can have (``none``: no Python;
    ``unreadable``: the interpreter did not say)."""
    from gpudiag.engine.fingerprint import _digest

    # An id of the usual shape (the daemon checks it), from inputs no reading is made of.
    backends = {name: {"id": _digest(["no reading", why, name]), "installed": False,
                       "distributions": {}} for name in decls}
    out: dict[str, Any] = {"interpreter": {}, "backends": backends, "watch": []}
    if error is not None:
        out["error"] = error
    return out


def _relevant(decls: Mapping[str, EnvironmentDecl], env: Mapping[str, str]) -> dict[str, str]:
    """The variables a reading depends on: the search path and each declaration's patterns."""
    patterns = [p for d in decls.values() for p in d.variables]
    return {k: v for k, v in sorted(env.items())
            if k in ("PYTHONPATH", "PYTHONHOME", "PYTHONNOUSERSITE", "PYTHONUSERBASE", "HOME")
            or any(name_matches(k, p) for p in patterns)}


def name_matches(name: str, pattern: str) -> bool:
    """``fnmatch.fnmatchcase(name, pattern)``, without compiling a regular expression for
    the declarations' usual patterns (a name, or a prefix and ``*``): the daemon-answered
    call reads its cache key on every call, and each compiled pattern cost it ~0.1 ms."""
    prefix = pattern.endswith("*")
    head = pattern[:-1] if prefix else pattern
    if any(c in head for c in "*?["):
        import fnmatch

        return fnmatch.fnmatchcase(name, pattern)
    return name.startswith(head) if prefix else name == pattern


def _cache_key(decls: Mapping[str, EnvironmentDecl], env: Mapping[str, str], path: str
               ) -> str:
    from gpudiag.engine.fingerprint import _digest

    return _digest([_CACHE_VERSION, path, sorted(decls), _relevant(decls, env)])


def cache_dir() -> str | None:
    """This user's private cache folder for readings and the probe archive
    (``$XDG_CACHE_HOME/gpudiag``, else ``~/.cache/gpudiag``), made 0700; None when it cannot
    be one only this user can write (then nothing is cached)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    if not os.path.isabs(base):
        return None
    return _private(os.path.join(base, "gpudiag"))


def _private(folder: str) -> str | None:
    """``folder``, made 0700 if missing, when only this user can write it; else None."""
    import stat

    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        st = os.lstat(folder)
    except OSError:
        return None
    if (not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid()
            or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)):
        return None  # planted by someone else, or shared: never read back from it
    return folder


def _entry_path(folder: str, key: str) -> str:
    return os.path.join(folder, f"fingerprint-{key}.json")


def _stats(path: str) -> list[int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


def _interpreter_facts(path: str) -> list[Any]:
    """What says the interpreter itself is unchanged: its file and its venv's pyvenv.cfg."""
    root = _venv_root(path)
    return [_stats(path), _stats(os.path.join(root, "pyvenv.cfg")) if root else None]


def _cached(folder: str, key: str) -> dict[str, Any] | None:
    """The stored reading when nothing it was read from changed since; else None."""
    import json
    import stat

    try:
        fd = os.open(_entry_path(folder, key), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size > 1 << 20:
            return None
        with os.fdopen(os.dup(fd), "rb") as fh:
            entry = json.loads(fh.read())
    except (OSError, ValueError, RecursionError):
        return None
    finally:
        os.close(fd)
    if not isinstance(entry, dict) or entry.get("key") != key:
        return None
    path, reading = entry.get("python"), entry.get("reading")
    if not isinstance(path, str) or not isinstance(reading, dict):
        return None
    if entry.get("facts") != _interpreter_facts(path):
        return None
    for item in reading.get("watch") or ():
        if not isinstance(item, list) or not item or not isinstance(item[0], str):
            return None
        now = _stats(item[0])
        if now is None or now[1:] != item[1:]:
            return None
    return reading


def _store(folder: str, key: str, path: str, reading: Mapping[str, Any]) -> None:
    """Keep a reading (atomically; a failure to keep it costs only the next call's child)."""
    import json

    from gpudiag.core.fileio import atomic_write

    entry = {"key": key, "python": path, "facts": _interpreter_facts(path), "reading": reading}
    try:
        atomic_write(_entry_path(folder, key), json.dumps(entry).encode(), mode=0o600)
    except OSError:
        pass


def probe_archive(folder: str | None) -> str:
    """The probe archive a job's interpreter runs (engine/runtimes.probe_archive), named by
    the package's sources so an edited gpudiag is never run from a stale archive; in this
    user's cache, else in a private temporary folder."""
    import tempfile
    from pathlib import Path

    from gpudiag.engine.runtimes import probe_archive as build
    from gpudiag.engine.runtimes import source_tag

    if folder is None:  # no private cache (a home nobody has): one private folder per user
        folder = _private(os.path.join(tempfile.gettempdir(), f"gpudiag-probes-{os.geteuid()}"))
    target = folder if folder is not None else tempfile.mkdtemp(prefix="gpudiag-probes-")
    return str(build(Path(target), tag=source_tag()))


def probe_interpreter(python: JobPython) -> list[str] | None:
    """The start of the argv that runs a probe in the job's interpreter (its Python and the
    probe archive); None when it is this interpreter (the probe runs as ``-m``).

    A job with no Python at all imports nothing: its probe runs the archive in this
    interpreter without any site folder or environment (``-I -S``: standard library only),
    so JAX and IREE read not installed, as they are for that job, and are never proven in
    gpudiag's own environment instead."""
    if python.own:
        return None
    if python.path is None:
        return [sys.executable, "-I", "-S", probe_archive(cache_dir())]
    return [python.path, probe_archive(cache_dir())]


def _ask(decls: Mapping[str, EnvironmentDecl], env: Mapping[str, str], path: str,
         timeout_s: float, folder: str | None) -> dict[str, Any]:
    """The reading printed by the job's interpreter (a child: never raises)."""
    import json
    import subprocess

    argv = [path, probe_archive(folder), "fingerprint", *sorted(decls)]
    try:
        done = subprocess.run(argv, env=dict(env), capture_output=True,  # noqa: S603
                              timeout=timeout_s, stdin=subprocess.DEVNULL,
                              start_new_session=True, check=False)
    except subprocess.TimeoutExpired:
        return _unreadable(decls, "unreadable", f"{path} did not print its fingerprint "
                           f"within {timeout_s:g} s")
    except OSError as e:
        return _unreadable(decls, "unreadable", f"{path} could not start: {e.strerror or e}")
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or [""]
        return _unreadable(decls, "unreadable", f"{path} exited {done.returncode} reading "
                           f"its fingerprint: {tail[0][:300]}")
    try:
        reading = json.loads(done.stdout.decode(errors="replace").strip().splitlines()[-1])
    except (ValueError, IndexError, RecursionError) as e:
        return _unreadable(decls, "unreadable", f"{path} printed no fingerprint: {e}")
    if not isinstance(reading, dict) or not isinstance(reading.get("backends"), dict):
        return _unreadable(decls, "unreadable", f"{path} printed no fingerprint object")
    for name in decls:
        entry = reading["backends"].get(name)
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
            return _unreadable(decls, "unreadable", f"{path}'s fingerprint has no {name}")
    return reading
