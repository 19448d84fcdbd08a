"""Holds survive restarts: the XIDs a daemon held are held again by the next one it starts.

An XID is an event, not a state NVML can be asked about again: a daemon that forgot its held
XIDs at a restart would answer "none" for a GPU that fell off the bus a minute before. So
each XID is written to the history as it arrives (on the history's writer thread: a hung
disk never stops the watcher), and at start every XID still within ``xid.hold_s`` that no
later ``gpudiag clear`` released is handed back to the watcher, where it expires and clears
like any other. Blocker episodes that an XID opened and that were still open when the
daemon stopped are read back too (a history from before XIDs were kept has only those).
Every other blocker is observed again by the first round, and until then the daemon has no
answer (503), never "none".

What the history could give back is said in every verdict (``evidence.history``): a
missing, damaged or unreadable history means holds from before the start are unknown.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from pathlib import Path

from gpudiag.core.clock import rfc3339
from gpudiag.core.environment import is_full_uuid
from gpudiag.core.findings import XidEvent
from gpudiag.core.records import dataclass
from gpudiag.daemon.recorder import HistoryRecorder, RecorderThread
from gpudiag.daemon.snapshot import HistoryState
from gpudiag.daemon.statedir import damaged_histories
from gpudiag.daemon.store import HistoryError, HistoryStore, default_path
from gpudiag.daemon.watcher import XidWatcher

log = logging.getLogger("gpudiag.daemon.holds")
MAX_PENDING_XIDS = 4096

# How classify words the blockers an XID makes ("GPU 3: XID 79 (fallen off the bus)",
# "GPU 0: critical XID 48 (...)"); tests/test_holds.py reads them from classify itself.
XID_MESSAGE = re.compile(r"^GPU ([0-9]+): (?:critical )?XID ([0-9]+) ")
_XID_MESSAGE = XID_MESSAGE


@dataclass(frozen=True)
class HistoryAtStart:
    """The history's files as found before the daemon opened (or moved aside) anything."""

    existed: bool
    damaged: frozenset[str]

    @classmethod
    def look(cls, state_dir: Path) -> HistoryAtStart:
        """What is there now: a non-empty history file, and damaged ones moved aside before."""
        path = default_path(state_dir)
        try:
            existed = path.is_file() and path.stat().st_size > 0
        except OSError:
            existed = False
        return cls(existed, frozenset(damaged_histories(state_dir)))


def held_xids(store: HistoryStore, since: float) -> list[XidEvent]:
    """The XIDs to hold again: kept ones since ``since``, and open XID episodes not cleared."""
    events = store.held_xids(since)
    for ep in store.open_episodes():
        m = _XID_MESSAGE.match(ep.message)
        if m is None or ep.started < since:
            continue
        uuid = ep.device if ep.device and is_full_uuid(ep.device) else None
        xid = int(m.group(2))
        if any(e.xid == xid and e.uuid == uuid for e in events):
            continue  # a kept XID says it, with the XID's own time
        if store.cleared_after(ep.started, uuid):
            continue
        events.append(XidEvent(xid, int(m.group(1)), uuid, ep.started))
    return events


def restore_holds(before: HistoryAtStart, recorder: HistoryRecorder, watcher: XidWatcher, *,
                  hold_s: float, now: float | None = None) -> HistoryState:
    """Hand the held XIDs of the history back to the watcher; what the history could say."""
    wall = time.time() if now is None else now
    started_at = rfc3339(wall)
    unknown = "XID holds from before this start are not known"
    store = recorder.store
    if not isinstance(store, HistoryStore):
        cause = recorder.health().last_error or "not open"
        log.warning("%s: the history could not be opened at start (%s)", unknown, cause)
        return HistoryState("unreadable", f"the history could not be opened at start "
                            f"({cause}): {unknown}", 0, started_at)
    try:
        events = held_xids(store, wall - hold_s)
    except HistoryError as e:
        log.warning("%s: the history could not be read at start (%s)", unknown, e)
        return HistoryState("unreadable", f"the history could not be read at start ({e}): "
                            f"{unknown}", 0, started_at)
    rearmed = watcher.rearm(events)
    for x in events:
        log.warning("XID %d on GPU %s (%s) at %s held again from the history, until `gpudiag "
                    "clear` or %s", x.xid, x.device_index, x.uuid, rfc3339(x.timestamp),
                    rfc3339(x.timestamp + hold_s),
                    extra={"xid": x.xid, "gpu": x.device_index, "uuid": x.uuid})
    moved = sorted(set(recorder.health().damaged) - before.damaged)
    if moved:
        return HistoryState("damaged", f"the history was damaged and moved aside to "
                            f"{moved[-1]} at start: {unknown}", rearmed, started_at)
    if not before.existed:
        log.info("%s: no history at start (a first start, or it was removed)", unknown)
        return HistoryState("missing", f"no history at start (a first start, or the file "
                            f"was removed): {unknown}", rearmed, started_at)
    return HistoryState("ok", None, rearmed, started_at)


class XidKeeper:
    """The watcher's ``on_xid``: queues each XID for the history without ever blocking.

    XIDs wait in a bounded list and are written in one commit per turn of the history's
    writer thread, so an XID storm costs one fsync per batch, not one per XID. What cannot be
    kept (no writable history, a stuck writer, past the bound) is logged once per outage.
    """

    def __init__(self, writer: RecorderThread, max_pending: int = MAX_PENDING_XIDS) -> None:
        self._writer = writer
        self._max_pending = max_pending
        self._lock = threading.Lock()
        self._pending: list[XidEvent] = []
        self._queued = False  # a flush is queued on the writer thread
        self._failing = False

    def __call__(self, event: XidEvent) -> None:
        with self._lock:
            if len(self._pending) >= self._max_pending:
                self._lost(event, f"more than {self._max_pending} XIDs wait for the history")
                return
            self._pending.append(event)
            if self._queued:
                return
            self._queued = self._writer.later(self._flush)
            if not self._queued:
                self._pending.clear()
                self._lost(event, "the history writer is stuck")

    def _flush(self) -> None:
        with self._lock:
            events, self._pending, self._queued = self._pending, [], False
        store = self._writer.recorder.store
        try:
            if not isinstance(store, HistoryStore):
                raise HistoryError("the history is not writable")
            store.record_xids(events)
        except HistoryError as e:
            with self._lock:
                self._lost(events[-1], str(e))
            return
        with self._lock:
            if self._failing:
                log.warning("XIDs are kept in the history again")
            self._failing = False

    def _lost(self, event: XidEvent, why: str) -> None:
        """Said once per outage (the caller holds the lock)."""
        if self._failing:
            return
        self._failing = True
        log.warning("XID %d on GPU %s not kept in the history (%s): a restart within its "
                    "hold would not hold it again; said once until XIDs are kept again",
                    event.xid, event.device_index, why,
                    extra={"xid": event.xid, "gpu": event.device_index, "uuid": event.uuid})
