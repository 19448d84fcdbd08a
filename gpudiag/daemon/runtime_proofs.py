"""The runtimes the daemon proves, and when their proofs are made again (proof on change).

docs/design-notes.md, "Whose environment is proven". Each configured runtime's
environment-dependent backends (JAX, IREE) are scheduled as probe keys of that runtime and
run under its interpreter from the probe archive (engine/runtimes.py). A runtime's backends
are proven again when its fingerprint changes (a package installed or removed: the folders
its fingerprint read are looked at after every NVML round, a few stat calls, and only a
change costs a child that reads it again), when the device layer changes (a GPU appears or
is lost, the driver is reloaded, an XID, a clear), and otherwise at their interval, which is
now a maximum age.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpudiag.core import registry
from gpudiag.core.probe_run import ProbeRun
from gpudiag.core.runtime import OWN_RUNTIME, Runtime
from gpudiag.engine.isolation import run_probe
from gpudiag.engine.runtimes import (
    ImportPath,
    RuntimeFingerprint,
    import_path,
    interpreter_argv,
    own_fingerprint,
    probe_archive,
    read_fingerprint,
    runtime_environment,
)

log = logging.getLogger("gpudiag.daemon.runtimes")


def environment_backends() -> dict[str, Any]:
    """Each registered backend proven in a job's environment, with its declaration."""
    return {s.name: s.environment for s in registry.specs() if s.environment is not None}


def run_in_runtime(runtime: Runtime, archive: Path, backend: str, env: Mapping[str, str],
                   timeout_s: float, options: Mapping[str, Any] | None) -> ProbeRun:
    """The real runner of a runtime's probe: a child of its interpreter (no fork server)."""
    return run_probe(backend, env=env, timeout_s=timeout_s, options=options,
                     interpreter=interpreter_argv(runtime, archive),
                     identity=runtime.identity)


class RuntimeProofs:
    """The runtimes, their child environments and fingerprints, and what changed."""

    def __init__(self, runtimes: tuple[Runtime, ...], daemon_env: Mapping[str, str],
                 folder: Path | None = None) -> None:
        self.runtimes = {r.name: r for r in runtimes} or {OWN_RUNTIME: Runtime(OWN_RUNTIME)}
        self._daemon_env = dict(daemon_env)
        self._envs = {r.name: runtime_environment(r, daemon_env) for r in runtimes if not r.own}
        self._folder = folder
        self._archive: Path | None = None
        self._lock = threading.Lock()
        self._fingerprints: dict[str, RuntimeFingerprint] = {}
        self._epoch: tuple[object, ...] | None = None
        self._refused: dict[str, str] = {}
        self._paths: dict[str, ImportPath] = {}
        for runtime in self.others():
            if runtime.identity is None or runtime.identity[0] == os.geteuid():
                # Said once at start: the import-path rule is then the only barrier.
                log.warning("runtime %s: its children run as this daemon's own uid %d and "
                            "could write what it keeps (its state directory); set "
                            "[runtimes.%s] user = ... with a daemon that may change uid "
                            "(docs/security.md, \"Who can run code where\")",
                            runtime.name, os.geteuid(), runtime.name,
                            extra={"runtime": runtime.name})

    # -- reading -----------------------------------------------------------------------
    def others(self) -> list[Runtime]:
        """The configured runtimes besides the daemon's own."""
        return [r for r in self.runtimes.values() if not r.own]

    def env_of(self, runtime: str) -> Mapping[str, str]:
        """A runtime's child environment (not for the own runtime: the scheduler's)."""
        return self._envs[runtime]

    def fingerprints(self) -> dict[str, RuntimeFingerprint]:
        with self._lock:
            return dict(self._fingerprints)

    def archive(self) -> Path:
        """The probe archive, built on first use in the daemon's folder for it; in a folder
        of its own that other users may read (and only the daemon write) when a runtime's
        children run as another user: the state directory is closed to them."""
        with self._lock:
            if self._archive is None:
                folder = self._folder
                if folder is None or any(r.identity is not None for r in self.others()):
                    folder = Path(tempfile.mkdtemp(prefix="gpudiag-runtimes-"))
                    folder.chmod(0o755)
                self._archive = probe_archive(folder)
            return self._archive

    # -- fingerprints ------------------------------------------------------------------
    def refresh(self, name: str) -> set[str]:
        """Read ``name``'s fingerprint again; the backends whose id changed. A runtime whose
        import path another user may now write is refused first (nothing of it runs): its
        fingerprint reads failed, so no job matches it, and the scheduler drops its proofs."""
        runtime = self.runtimes[name]
        refused = None if runtime.own else self._check(runtime)
        if runtime.own:
            found = own_fingerprint(environment_backends(), self._daemon_env)
        elif refused is not None:
            found = RuntimeFingerprint.failed(f"refused: {refused}")
        else:
            try:
                archive = self.archive()
            except OSError as e:
                found = RuntimeFingerprint.failed(f"the probe archive could not be built: {e}")
            else:
                found = read_fingerprint(runtime, archive, self._envs[name])
        with self._lock:
            before = self._fingerprints.get(name)
            self._fingerprints[name] = found
        if found.error is not None and refused is None:
            log.warning("runtime %s: %s", name, found.error)
        if before is None:
            return set(found.ids)
        return {b for b in set(found.ids) | set(before.ids)
                if found.ids.get(b) != before.ids.get(b)} | (
            set(found.ids) if (found.error is None) != (before.error is None) else set())

    def ensure(self, name: str) -> None:
        """Read ``name``'s fingerprint once (before its first probe)."""
        with self._lock:
            known = name in self._fingerprints
        if not known:
            self.refresh(name)

    def changed_runtimes(self) -> list[str]:
        """The runtimes whose fingerprint's folders or files differ now, or an owner or a
        mode on their import path (stat calls only)."""
        with self._lock:
            known = dict(self._fingerprints)
            paths = dict(self._paths)
        return [name for name, found in known.items()
                if found.changed() or (name in paths and paths[name].changed())]

    def _check(self, runtime: Runtime) -> str | None:
        """Check ``runtime``'s import path now (a child of its interpreter, ``-I -S``, as its
        own identity); remember what was looked at; say a refusal or its end once."""
        trusted = frozenset({0} | ({runtime.uid} if runtime.user is not None
                                   and runtime.uid is not None else set()))
        found = import_path(runtime, trusted_uids=trusted)
        with self._lock:
            self._paths[runtime.name] = found
            before = self._refused.get(runtime.name)
            if found.problem is None:
                self._refused.pop(runtime.name, None)
            else:
                self._refused[runtime.name] = found.problem
        if found.problem is not None and before != found.problem:
            log.error("runtime %s refused, its proofs dropped: %s", runtime.name,
                      found.problem, extra={"runtime": runtime.name, "refused": True})
        elif found.problem is None and before is not None:
            log.warning("runtime %s no longer refused: its import path is closed to other "
                        "users again", runtime.name, extra={"runtime": runtime.name})
        return found.problem

    def device_changed(self, epoch: tuple[object, ...]) -> bool:
        """Whether the device layer differs from the last NVML round's (the first is no
        change: every key is due at start anyway)."""
        with self._lock:
            before, self._epoch = self._epoch, epoch
        return before is not None and before != epoch

    def refused(self) -> dict[str, str]:
        """The runtimes refused now, with why (engine/runtimes.import_path)."""
        with self._lock:
            return dict(self._refused)

    def installed(self, name: str) -> frozenset[str]:
        """The backends installed in runtime ``name``, as its fingerprint last said."""
        with self._lock:
            found = self._fingerprints.get(name)
        return found.installed if found is not None else frozenset()


def device_epoch(nvml_obs: Any, xid_total: int) -> tuple[object, ...]:
    """What, changed, makes every runtime's proof stale: the driver, the GPUs, the XIDs."""
    if nvml_obs is None:
        return ("no nvml", xid_total)
    return (getattr(nvml_obs, "driver_version", None),
            tuple(d.uuid for d in getattr(nvml_obs, "devices", ())), xid_total)

