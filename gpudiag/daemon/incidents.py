"""The node's open incident, one id for every consumer (core.incident says what one is).

A snapshot listener: each published snapshot's node-health verdict opens, joins or closes the
incident. The open one is kept in the state dir (``incident.json``), so that a restart in the
middle of an incident (its XIDs are held across restarts) carries the same id on. Each opening
and closing is one log line and one history row (``incidents``); the id reaches
``gpudiag_incident_open{incident,code,gpu}`` (and through it the alerts' annotations),
/v1/health's ``evidence.incident`` (and through it NPD's condition message), and the NFD
label ``gpudiag.incident``.

``id_for(snap)`` answers for a given snapshot whoever asks first (the NFD writer is another
listener of the same snapshot): the tracker moves on once per snapshot, in any order.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gpudiag.core.fileio import RefusedFile, atomic_write, read_regular
from gpudiag.core.incident import Incident, advance, broken
from gpudiag.daemon.snapshot import Snapshot
from gpudiag.daemon.store import HistoryError, HistoryStore

log = logging.getLogger("gpudiag.daemon.incidents")
STATE_FILE = "incident.json"


class IncidentTracker:
    """Opens, joins and closes the node's incident from the snapshots (module docstring)."""

    def __init__(self, state_dir: Path, store: Callable[[], HistoryStore | None], *,
                 wall: Callable[[], float] = time.time) -> None:
        """``store``: the history as it is now (it may open late)."""
        self._path = state_dir / STATE_FILE
        self._store = store
        self._wall = wall
        self._lock = threading.Lock()
        self._seen: Snapshot | None = None
        self._current = self._load()
        self._opened = 0
        self._version = 1
        self._rows: queue.SimpleQueue[Incident] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None

    # -- the listeners' side -------------------------------------------------------------
    def offer(self, snap: Snapshot) -> None:
        """The scheduler's listener."""
        self.id_for(snap)

    def id_for(self, snap: Snapshot) -> str | None:
        """The open incident's id as of ``snap`` (moving on to it first if it is new)."""
        with self._lock:
            if snap is not self._seen and snap.ready is not None:
                self._seen = snap
                self._move(advance(self._current, broken(snap.ready), self._wall()))
            return self._current.id if self._current is not None else None

    def current(self) -> Incident | None:
        with self._lock:
            return self._current

    def evidence(self) -> tuple[int, dict[str, Any]]:
        """/v1/health's ``incident`` evidence (``open`` false when none is), with its version."""
        with self._lock:
            inc, version = self._current, self._version
        return version, ({"open": True, **inc.record()} if inc is not None else {"open": False})

    def collector(self) -> IncidentCollector:
        return IncidentCollector(self)

    # -- moving on -----------------------------------------------------------------------
    def _move(self, new: Incident | None) -> None:
        old = self._current
        if new == old:
            return
        self._current = new
        self._version += 1
        self._keep(new)
        if old is not None and (new is None or new.id != old.id):
            closed = Incident(old.id, old.started_wall, old.code, old.gpu, old.codes,
                              self._wall())
            log.info("incident %s closed after %.1f s (%s)", old.id,
                     (closed.ended_wall or old.started_wall) - old.started_wall,
                     ", ".join(old.codes),
                     extra={"incident": old.id, "codes": list(old.codes)})
            self._record(closed)
        if new is not None and (old is None or new.id != old.id):
            self._opened += 1
            log.warning("incident %s opened: %s on %s", new.id, new.code, new.gpu or "the node",
                        extra={"incident": new.id, "code": new.code, "uuid": new.gpu})
        elif new is not None and old is not None:
            log.info("incident %s: %s joined (its reason stays %s)", new.id,
                     ", ".join(c for c in new.codes if c not in old.codes), new.code,
                     extra={"incident": new.id, "codes": list(new.codes)})
        if new is not None:
            self._record(new)

    def _record(self, inc: Incident) -> None:
        """To the history on the tracker's own writer thread, in order: a history write
        stuck in the disk never holds up the thread that publishes snapshots (the state
        file, written here, is what a restart needs)."""
        self._rows.put(inc)
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_rows, name="incident-history",
                                            daemon=True)
            self._writer.start()

    def _write_rows(self) -> None:
        while True:
            self._write(self._rows.get())

    def _write(self, inc: Incident) -> None:
        history = self._store()
        if history is None:
            return
        try:
            history.record_incident(inc)
        except HistoryError as e:
            log.warning("incident %s not recorded in the history: %s", inc.id, e,
                        extra={"incident": inc.id})

    def _keep(self, inc: Incident | None) -> None:
        try:
            if inc is None:
                self._path.unlink(missing_ok=True)
            else:
                atomic_write(self._path, json.dumps(inc.record()), mode=0o600)
        except OSError as e:
            log.error("incident: cannot keep %s (%s): a restart would give the open incident "
                      "a new id", self._path, e)

    def _load(self) -> Incident | None:
        try:
            raw, _st = read_regular(self._path, 1 << 16)
            return Incident.from_record(json.loads(raw))
        except RefusedFile as e:
            if isinstance(e.__cause__, FileNotFoundError):
                return None
            error: Exception = e
        except (ValueError, TypeError, AttributeError) as e:
            error = e
        log.error("incident: %s unreadable (%s): the next fault opens a new incident",
                  self._path, error)
        with contextlib.suppress(OSError):
            os.unlink(self._path)
        return None

    @property
    def opened(self) -> int:
        """Incidents opened since the start (the counter's value)."""
        with self._lock:
            return self._opened


class IncidentCollector:
    """gpudiag_incident_*: the open incident, read on each scrape."""

    def __init__(self, tracker: IncidentTracker) -> None:
        self._tracker = tracker

    def collect(self) -> Iterator[Metric]:
        inc = self._tracker.current()
        open_ = GaugeMetricFamily(
            "gpudiag_incident_open", "1 while an incident is open: its id, its reason (the "
            "first fault's code) and GPU; the alerts' annotations name it.",
            labels=["incident", "code", "gpu"])
        started = GaugeMetricFamily(
            "gpudiag_incident_started_timestamp_seconds",
            "When the open incident started (it never moves while it is open).",
            labels=["incident"])
        if inc is not None:
            open_.add_metric([inc.id, inc.code, inc.gpu or ""], 1.0)
            started.add_metric([inc.id], inc.started_wall)
        yield open_
        yield started
        yield CounterMetricFamily("gpudiag_incidents_opened",
                                  "Incidents opened since the daemon started.",
                                  value=self._tracker.opened)
