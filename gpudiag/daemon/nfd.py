"""A node-feature-discovery local feature file (``features.d``): proven readiness as node labels.

NFD's local source turns each ``name=value`` line into the node label
``feature.node.kubernetes.io/name=value``, so pods select nodes by proven readiness
(``gpudiag.ready.jax=true``). The file is rewritten atomically (NFD never reads half a file;
its hidden temporary file is skipped) when the labels change, and before its
``# +expiry-time`` passes: labels of a daemon that stopped expire, so a dead daemon's node
does not keep claiming readiness.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from pathlib import Path

from gpudiag.core.fileio import atomic_write, write_error
from gpudiag.daemon.snapshot import Snapshot

log = logging.getLogger(__name__)

PREFIX = "gpudiag"
DEFAULT_EXPIRY_S = 600.0


def feature_labels(snap: Snapshot, incident: str | None = None) -> dict[str, str]:
    """The labels a snapshot proves: node readiness, per backend, and healthy GPUs; with an
    open incident, its id (``gpudiag.incident``, daemon/incidents.py)."""
    full = snap.full
    labels = {f"{PREFIX}.ready": "true" if snap.ready is not None and snap.ready.ready
              else "false"}
    for backend, ok in snap.backends_proven().items():
        labels[f"{PREFIX}.ready.{backend}"] = "true" if ok else "false"
    # Per runtime: a pod that runs in one job environment selects on its proof.
    for (runtime, backend), ok in snap.runtime_backends_proven().items():
        labels[f"{PREFIX}.ready.{backend}.{runtime}"] = "true" if ok else "false"
    healthy = sum(1 for d in full.devices if d.healthy) if full is not None else 0
    labels[f"{PREFIX}.gpus-healthy"] = str(healthy)
    if incident is not None:
        labels[f"{PREFIX}.incident"] = incident
    return labels


def render(labels: Mapping[str, str], expires_wall: float) -> str:
    """The file's text: a comment, NFD's expiry directive, one ``name=value`` per line."""
    expiry = datetime.fromtimestamp(expires_wall, tz=timezone.utc).strftime(
        "%Y-%m-%dT%H:%M:%SZ")
    lines = ["# Written by gpudiag serve (nfd_features_file); rewritten when readiness "
             "changes.", f"# +expiry-time={expiry}"]
    lines += [f"{name}={value}" for name, value in sorted(labels.items())]
    return "\n".join(lines) + "\n"


class NfdFeatureFile:
    """A snapshot listener that keeps ``path`` equal to the latest snapshot's labels."""

    def __init__(self, path: str | Path, expiry_s: float = DEFAULT_EXPIRY_S,
                 wall: Callable[[], float] = time.time,
                 incident: Callable[[Snapshot], str | None] | None = None) -> None:
        """``incident``: the open incident's id as of a snapshot (None: no such label)."""
        self.path = Path(path)
        self._incident = incident
        self._expiry_s = expiry_s
        self._wall = wall
        self._lock = threading.Lock()
        self._written: dict[str, str] | None = None
        self._written_wall = 0.0
        self._failing = False
        self.writes = 0

    def update(self, snap: Snapshot) -> bool:
        """Rewrite the file when its labels changed or half its lifetime passed."""
        if snap.full is None:
            return False  # nothing proven yet: no labels rather than false ones
        labels = feature_labels(snap, self._incident(snap) if self._incident else None)
        now = self._wall()
        with self._lock:
            if labels == self._written and now - self._written_wall < self._expiry_s / 2:
                return False
            try:
                atomic_write(self.path, render(labels, now + self._expiry_s))
            except OSError as e:
                if not self._failing:  # said once per failing stretch, not every snapshot
                    log.warning("nfd feature file: %s", write_error(self.path, e),
                                extra={"nfd_features_file": str(self.path)})
                self._failing = True
                return False
            if self._failing:
                log.info("nfd feature file written again", extra={
                    "nfd_features_file": str(self.path)})
            self._failing = False
            changed = labels != self._written
            self._written, self._written_wall = labels, now
            self.writes += 1
        if changed:
            log.info("nfd labels changed", extra={"nfd_labels": labels})
        return True
