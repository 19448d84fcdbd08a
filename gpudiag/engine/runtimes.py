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

import io
import json
import os
import stat
import subprocess
import time
import zipfile
from collections.abc import Mapping
from dataclasses import field
from pathlib import Path
from typing import Any

from gpudiag.core.environment import probe_environment
from gpudiag.core.fileio import atomic_write
from gpudiag.core.records import dataclass
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


NOBODY = 65534  # a root daemon's runtime children run as this unless `user` names another
# Asked with -I -S: no site code and no .pth runs. A venv's prefix is what site.venv()
# would make it (read here without site.venv(), which would process the .pth files).
_PATH_QUERY = """
import json, os, site, sys
exe_dir = os.path.dirname(os.path.abspath(sys.executable))
cfgs = [os.path.join(d, 'pyvenv.cfg') for d in (exe_dir, os.path.dirname(exe_dir))]
cfg = next((c for c in cfgs if os.path.isfile(c)), None)
sites, venv = site.getsitepackages(), None
if cfg:
    venv, system = os.path.dirname(cfg), 'true'
    with open(cfg, encoding='utf-8') as fh:
        for line in fh:
            key, sep, value = line.partition('=')
            if sep and key.strip().lower() == 'include-system-site-packages':
                system = value.strip().lower()
    ver = 'python%d.%d' % sys.version_info[:2]
    sites = [os.path.join(venv, d, ver, 'site-packages')
             for d in dict.fromkeys([sys.platlibdir, 'lib'])] + (
        sites if system == 'true' else [])
print(json.dumps({'path': sys.path, 'site': sites, 'prefix': venv or sys.prefix}))
"""
_CUSTOMIZE = ("sitecustomize.py", "usercustomize.py")


def resolve_user(text: str) -> tuple[int, int]:
    """``name-or-uid`` -> (uid, gid): a name from the passwd database, or a number (its
    passwd entry's group when it has one, else the same number); ValueError when neither."""
    import pwd

    if text.isascii() and text.isdigit():
        uid = int(text)
        if uid > 0xFFFFFFFE:
            raise ValueError(f"{text} is not a uid")
        try:
            return uid, pwd.getpwuid(uid).pw_gid
        except KeyError:
            return uid, uid
    try:
        entry = pwd.getpwnam(text)
    except KeyError:
        raise ValueError(f"no user {text!r} in the passwd database") from None
    return entry.pw_uid, entry.pw_gid


def can_change_identity() -> bool:
    """Whether this process may start children as another uid (root, or CAP_SETUID and
    CAP_SETGID in its effective set)."""
    if os.geteuid() == 0:
        return True
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as fh:
            caps = next((int(line.split()[1], 16) for line in fh
                         if line.startswith("CapEff:")), 0)
    except (OSError, ValueError):
        return False
    return bool(caps & (1 << 7)) and bool(caps & (1 << 6))  # CAP_SETUID, CAP_SETGID


@dataclass(frozen=True)
class ImportPath:
    """What checking a runtime's import path found: the first place another user may write
    (None: none), and what was looked at (path, mode, uid) to notice a change cheaply."""

    problem: str | None
    looked: tuple[tuple[str, int, int], ...] = ()
    unread: str | None = None  # why the interpreter could not say it (nothing checked)

    def changed(self) -> bool:
        """Whether an owner or a mode of what was looked at differs now (a stat each)."""
        for path, mode, uid in self.looked:
            try:
                st = os.stat(path)
            except OSError:
                return True
            if (st.st_mode, st.st_uid) != (mode, uid):
                return True
        return False


def import_path(runtime: Runtime, *, trusted_uids: frozenset[int] = frozenset({0}),
                timeout_s: float = 5.0) -> ImportPath:
    """Whether another user may write what ``runtime``'s interpreter imports from: its real
    ``sys.path`` as that interpreter reports it (asked with ``-I -S``, so that no ``.pth``
    and no site code runs for the asking, and as the runtime's own identity), its
    ``pyvenv.cfg``, every ``.pth`` file and the folders it adds, ``sitecustomize.py`` and
    ``usercustomize.py``, the runtime's ``PYTHONPATH``, each with every folder above it; and
    the entries directly in each search-path folder (a package another user may write).
    Whoever may write there runs code in the runtime's probe children."""
    assert runtime.python is not None
    try:
        done = subprocess.run(  # noqa: S603 - fixed argv, no shell
            [runtime.python, "-I", "-S", "-c", _PATH_QUERY], env={"PATH": "/usr/bin:/bin"},
            capture_output=True, timeout=timeout_s, stdin=subprocess.DEVNULL,
            start_new_session=True, check=False, **_identity_args(runtime.identity))
        said = json.loads(done.stdout.decode(errors="replace").strip().splitlines()[-1])
        paths = [str(p) for p in said["path"] if isinstance(p, str)]
        sites = [str(p) for p in said["site"] if isinstance(p, str)]
        prefix = str(said["prefix"])
    except subprocess.TimeoutExpired:
        # Nothing ran (no site, no .pth): a hung or broken interpreter is that runtime's
        # probe_timeout or probe_crashed when its children run, not a refusal.
        return ImportPath(None, unread=f"{runtime.python} did not say its import path "
                          f"within {timeout_s:g} s")
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        return ImportPath(None, unread=f"{runtime.python} could not say its import path"
                          f"{_as_whom(runtime)}: {e}")
    extra = [p for p in runtime.env.get("PYTHONPATH", "").split(":") if p]
    folders = [*paths, *sites, *(os.path.abspath(p) for p in extra)]
    files: list[str] = []
    venv_cfg = os.path.join(prefix, "pyvenv.cfg")
    if os.path.isfile(venv_cfg):
        files.append(venv_cfg)
    for site_dir in sites:
        for pth in sorted(_entries(site_dir, ".pth")):
            files.append(pth)
            folders += _pth_targets(site_dir, pth)
    for folder in list(folders):
        files += [os.path.join(folder, n) for n in _CUSTOMIZE
                  if os.path.exists(os.path.join(folder, n))]
    uids = trusted_uids | {os.geteuid()}
    looked: dict[str, tuple[str, int, int]] = {}
    problem = None
    for item in [*folders, *files]:
        if not os.path.exists(item):
            continue
        real = os.path.realpath(item)
        for path in dict.fromkeys([real, *_parents(real), *_parents(os.path.abspath(item))]):
            found = _check(path, uids, looked)
            problem = problem or found
    for folder in folders:  # what is directly in each folder: a package, a module
        for entry in _entries(folder, ""):
            try:
                st = os.lstat(entry)
            except OSError:
                continue
            if not stat.S_ISLNK(st.st_mode) and _writable_by_others(st, uids):
                problem = problem or _said(entry, st)
    if problem is not None:
        problem = (f"{problem}: code there would run in runtime {runtime.name}'s probe "
                   "children; make it writable by its owner only (root, or the runtime's "
                   "user)")
    return ImportPath(problem, tuple(looked.values()))


def _identity_args(identity: tuple[int, int] | None) -> dict[str, Any]:
    from gpudiag.engine.isolation import as_identity

    return as_identity(identity)


def _as_whom(runtime: Runtime) -> str:
    return "" if runtime.identity is None else f" as uid {runtime.identity[0]}"


def _entries(folder: str, suffix: str) -> list[str]:
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return [os.path.join(folder, n) for n in names if n.endswith(suffix)]


def _pth_targets(site_dir: str, pth: str) -> list[str]:
    """The folders a ``.pth`` file adds (its ``import`` lines run code: the file itself and
    the folders they import from are checked)."""
    try:
        with open(pth, encoding="utf-8", errors="replace") as fh:
            lines = fh.read(1 << 20).splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        line = line.rstrip()
        if not line or line.startswith(("#", "import ", "import\t")):
            continue
        out.append(os.path.join(site_dir, line))
    return out


def _writable_by_others(st: os.stat_result, uids: frozenset[int]) -> bool:
    writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    sticky_dir = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
    return st.st_uid not in uids or bool(writable and not sticky_dir)


def _said(path: str, st: os.stat_result) -> str:
    return (f"{path} may be written by another user (owner uid {st.st_uid}, mode "
            f"{stat.filemode(st.st_mode)})")


def _check(path: str, uids: frozenset[int],
           looked: dict[str, tuple[str, int, int]]) -> str | None:
    if path in looked:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    looked[path] = (path, st.st_mode, st.st_uid)
    return _said(path, st) if _writable_by_others(st, uids) else None


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
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("__main__.py", ARCHIVE_MAIN)
        for source in sorted(package.rglob("*.py")):
            if "__pycache__" not in source.parts:
                zf.write(source, f"gpudiag/{source.relative_to(package).as_posix()}")
    # 0644: the runtime's interpreter reads it as the runtime's user.
    atomic_write(target, archive.getvalue(), 0o644)
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
    """A runtime's fingerprint, from its own interpreter, as its own identity (a child:
    never raises)."""
    argv = [*interpreter_argv(runtime, archive), "fingerprint"]
    try:
        done = subprocess.run(argv, env=dict(env), capture_output=True, timeout=timeout_s,  # noqa: S603
                              stdin=subprocess.DEVNULL, start_new_session=True, check=False,
                              **_identity_args(runtime.identity))
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
