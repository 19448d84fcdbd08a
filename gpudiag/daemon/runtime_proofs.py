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
    RuntimeFingerprint,
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
                     interpreter=interpreter_argv(runtime, archive))


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
        """The probe archive, built on first use in the daemon's folder for it."""
        with self._lock:
            if self._archive is None:
                folder = self._folder or Path(tempfile.mkdtemp(prefix="gpudiag-runtimes-"))
                self._archive = probe_archive(folder)
            return self._archive

    # -- fingerprints ------------------------------------------------------------------
    def refresh(self, name: str) -> set[str]:
        """Read ``name``'s fingerprint again; the backends whose id changed."""
        runtime = self.runtimes[name]
        if runtime.own:
            found = own_fingerprint(environment_backends(), self._daemon_env)
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
        if found.error is not None:
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
        """The runtimes whose fingerprint's folders or files differ now (stat calls only)."""
        with self._lock:
            known = dict(self._fingerprints)
        return [name for name, found in known.items() if found.changed()]

    def device_changed(self, epoch: tuple[object, ...]) -> bool:
        """Whether the device layer differs from the last NVML round's (the first is no
        change: every key is due at start anyway)."""
        with self._lock:
            before, self._epoch = self._epoch, epoch
        return before is not None and before != epoch

    def refused(self) -> dict[str, str]:
        """The runtimes refused now, with why (none yet: see import_path_problem)."""
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

