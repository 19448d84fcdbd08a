"""The fingerprint of a job's environment, per backend: what decides how its backend comes up.

An answer is about the asker's environment (docs/design-notes.md, "Whose environment is
proven"). Every client sends the daemon, per environment-dependent backend it requires, the
id of its environment: the interpreter (real path, prefix, version), the distributions and
modules the backend's ``EnvironmentDecl`` names as found on the search path (names,
versions, and their files' path, inode, size and mtime: reinstalling changes the id), and the
values of the variables it names (a secret-looking name counts as set, never by its value).
The daemon answers the backend layer only from a proof made in an environment with the same
id (a configured runtime, or its own), else the client proves that backend itself.

Read from the file system without importing any backend (no metadata parsing: the names and
versions are in the folder names), and with the standard library alone: the daemon-answered
CLI call computes it first thing (docs/benchmarks.md), and a runtime's interpreter, which has
no gpudiag installed, runs it from the probe archive (gpudiag.engine.runtimes).
"""

from __future__ import annotations

import fnmatch
import json
import os
import sys

from gpudiag.core.fingerprint_inputs import PREALLOCATION_OFF, EnvironmentDecl
from gpudiag.core.visibility import VISIBILITY_VARIABLES

TYPE_CHECKING = False  # typing stays off the CLI's fast path
if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping
    from typing import Any

# A fingerprint id: 16 hex digits (64 bits of BLAKE2b). It names an environment; it is no
# secret and no proof of anything: a caller that claims another's id fools only itself.
ID_DIGITS = 16
_SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH")
_DIST_SUFFIXES = (".dist-info", ".egg-info")


def _digest(value: object) -> str:
    try:  # the bare module: hashlib's import loads OpenSSL (3-4 ms a CLI call)
        from _blake2 import blake2b
    except ImportError:  # pragma: no cover - an interpreter built without it
        from hashlib import blake2b
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return blake2b(text.encode(), digest_size=ID_DIGITS // 2).hexdigest()


def normalized(name: str) -> str:
    """A distribution's name as the patterns spell it: lower case, ``_`` for ``-`` and ``.``."""
    return name.lower().replace("-", "_").replace(".", "_")


def search_path(env: Mapping[str, str]) -> list[str]:
    """The folders a Python child started with ``env`` imports from: its PYTHONPATH's entries,
    then this interpreter's own path (without this process's PYTHONPATH and script folder)."""
    own = {p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    wanted = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return wanted + [p for p in sys.path[1:] if p and p not in own and p not in wanted]


def _stat(path: str) -> list[int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_ino, st.st_size, st.st_mtime_ns]


def scan(paths: Iterable[str], decls: Iterable[EnvironmentDecl]) -> dict[str, Any]:
    """The declared distributions and modules found on ``paths``, and the folders to watch.

    ``distributions``: [normalized name, version, metadata file, inode, size, mtime_ns];
    ``modules``: [module, path, inode, size, mtime_ns]; ``watch``: [folder, inode, size,
    mtime_ns] of every folder read (a package installed or removed changes its mtime).
    """
    wanted = list(decls)
    dist_patterns = {p for d in wanted for p in d.distributions}
    module_names = {m for d in wanted for m in d.modules}
    dists: list[list[Any]] = []
    modules: list[list[Any]] = []
    watch: list[list[Any]] = []
    for folder in dict.fromkeys(paths):
        try:
            names = os.listdir(folder)
        except OSError:  # a zip, a missing folder: nothing a backend is installed from
            continue
        st = _stat(folder)
        if st is not None:
            watch.append([folder, *st])
        for entry in names:
            if entry.endswith(_DIST_SUFFIXES):
                _dist(folder, entry, dist_patterns, dists)
            else:
                module = entry[:-3] if entry.endswith(".py") else entry.split(".", 1)[0]
                if module in module_names:
                    found = _stat(os.path.join(folder, entry))
                    if found is not None:
                        modules.append([module, os.path.join(folder, entry), *found])
    return {"distributions": dists, "modules": modules, "watch": watch}


def _dist(folder: str, entry: str, patterns: set[str], out: list[list[Any]]) -> None:
    stem = entry.rsplit(".", 1)[0]
    name, _, version = stem.partition("-")
    key = normalized(name)
    if not any(fnmatch.fnmatchcase(key, p) for p in patterns):
        return
    path = os.path.join(folder, entry)
    meta = os.path.join(path, "METADATA" if entry.endswith(".dist-info") else "PKG-INFO")
    st = _stat(meta) or _stat(path)
    if st is not None:
        out.append([key, version.split("-", 1)[0], meta, *st])


def _variables(env: Mapping[str, str], patterns: Iterable[str]) -> dict[str, str]:
    names = tuple(patterns)
    out = {}
    for key in sorted(env):
        if key in VISIBILITY_VARIABLES or not any(fnmatch.fnmatchcase(key, p) for p in names):
            continue
        secret = any(w in key.upper() for w in _SECRET_WORDS)
        out[key] = "<set>" if secret else env[key]
    return out


def interpreter() -> dict[str, str]:
    """This interpreter: its real path, its prefix (a venv's folder) and its version."""
    return {"executable": os.path.realpath(sys.executable),
            "prefix": os.path.realpath(sys.prefix),
            "version": ".".join(map(str, sys.version_info[:3]))}


def fingerprints(decls: Mapping[str, EnvironmentDecl], env: Mapping[str, str],
                 paths: Iterable[str] | None = None) -> dict[str, Any]:
    """Per backend of ``decls``: its fingerprint id, whether it is installed, what it found.

    ``{"interpreter": {...}, "backends": {name: {"id", "installed", "distributions"}},
    "watch": [...]}``: the JSON a runtime's interpreter prints and the daemon reads back.
    """
    # What a probe child started with ``env`` sees (core.environment.probe_environment).
    env = {**PREALLOCATION_OFF, **env}
    found = scan(search_path(env) if paths is None else paths, decls.values())
    interp = interpreter()
    backends: dict[str, Any] = {}
    for name, decl in decls.items():
        dists = [d for d in found["distributions"]
                 if any(fnmatch.fnmatchcase(d[0], p) for p in decl.distributions)]
        mods = [m for m in found["modules"] if m[0] in decl.modules]
        variables = _variables(env, decl.variables)
        backends[name] = {
            "id": _digest([interp, sorted(dists), sorted(mods), variables]),
            "installed": any(d[0] == decl.installed_by for d in dists),
            "distributions": {d[0]: d[1] for d in sorted(dists)},
        }
    return {"interpreter": interp, "backends": backends, "watch": found["watch"]}


def fingerprint_ids(decls: Mapping[str, EnvironmentDecl], env: Mapping[str, str]
                    ) -> dict[str, str]:
    """The fingerprint id per backend of ``decls`` (what a client sends as ``fingerprint=``)."""
    if not decls:
        return {}
    return {name: str(entry["id"]) for name, entry in fingerprints(decls, env)["backends"].items()}


def query_value(ids: Mapping[str, str]) -> str:
    """The ``fingerprint`` parameter of a question: ``jax:ID,iree:ID`` (name order)."""
    return ",".join(f"{name}:{ids[name]}" for name in sorted(ids))


def main(argv: list[str]) -> int:
    """``fingerprint [NAMES...]``: this environment's fingerprints as one JSON line (run by
    the daemon in a runtime's interpreter, from the probe archive)."""
    from gpudiag.core import registry

    decls = {s.name: s.environment for s in registry.specs()
             if s.environment is not None and (not argv or s.name in argv)}
    print(json.dumps(fingerprints(decls, os.environ)))
    return 0
