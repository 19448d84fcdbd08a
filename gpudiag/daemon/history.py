"""The daemon's history as one piece of the core: what the state directory held before this
start, the store (opened late when the disk is full at start), its writer thread, the XID
keeper, the holds handed back to the watcher, and a log line for each kept verdict change.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpudiag.core.findings import XidEvent
from gpudiag.core.verdict import Verdict, change_summary
from gpudiag.daemon.config import HistoryConfig
from gpudiag.daemon.exporter import HistoryCollector
from gpudiag.daemon.holds import HistoryAtStart, XidKeeper, restore_holds
from gpudiag.daemon.recorder import RecorderThread, Written
from gpudiag.daemon.snapshot import HistoryState, Snapshot
from gpudiag.daemon.statedir import start_history
from gpudiag.daemon.store import HistoryStore
from gpudiag.daemon.watcher import XidWatcher

log = logging.getLogger("gpudiag.daemon")


class DaemonHistory:
    """Opened by ``DaemonService.start()`` once it holds the state directory's lock."""

    def __init__(self, state_dir: Path, cfg: HistoryConfig) -> None:
        self.before = HistoryAtStart.look(state_dir)  # before a damaged one is moved aside
        self.recorder = start_history(state_dir, retention_s=cfg.retention_s,
                                      max_bytes=cfg.max_bytes)
        self.writer = RecorderThread(self.recorder, self._written)
        self.keeper = XidKeeper(self.writer)  # the watcher's XIDs, kept for a restart
        self._verdicts = VerdictLog()
        self._opened: Callable[[HistoryStore], None] | None = None

    def store(self) -> HistoryStore | None:
        """The store as it is now (None: not writable yet, or none at all)."""
        return self.recorder.history_store()

    def restore_holds(self, watcher: XidWatcher, hold_s: float) -> HistoryState:
        """Hand the history's held XIDs back to the watcher; what the history could say."""
        return restore_holds(self.before, self.recorder, watcher, hold_s=hold_s)

    def keep_xid(self, event: XidEvent) -> None:
        """Queue an XID for the history (never blocks)."""
        self.keeper(event)

    def record(self, snap: Snapshot) -> None:
        """The scheduler's snapshot listener: each full verdict to the writer."""
        if snap.full is not None:
            self.writer.submit(snap.full)

    def collector(self) -> HistoryCollector:
        return HistoryCollector(self.writer.health)

    def last_error(self) -> str | None:
        return self.writer.health().last_error

    def when_opened(self, callback: Callable[[HistoryStore], None]) -> None:
        """Call ``callback`` with the store on each write once it is open (it may open late)."""
        self._opened = callback

    def close(self) -> None:
        """Close the store (the writer stopped, or never started)."""
        store = self.store()
        if store is not None:
            store.close()

    def _written(self, verdict: Verdict | None, changes: list[Written]) -> None:
        """The writer's report: a history opened late is handed on; each kept change said."""
        store = self.store()
        if self._opened is not None and store is not None:
            self._opened(store)
        self._verdicts.say(verdict, changes)


class VerdictLog:
    """Says each kept verdict change in one log line: which GPU, which code came or went."""

    def __init__(self) -> None:
        self._logged: Verdict | None = None  # the verdict of the last "verdict changed" line
        self._last_uuids: dict[int, str] = {}  # each GPU index's last UUID: a lost GPU has none

    def say(self, verdict: Verdict | None, changes: list[Written]) -> None:
        """Log the changes that belong to ``verdict`` (None: a retry; said when made)."""
        for change in changes:
            if verdict is None or change.verdict is not verdict:
                continue  # a kept change, said when it was made
            where: dict[str, Any] = ({"history_id": change.history_id}
                                     if change.history_id is not None
                                     else {"history_pending": True})
            self._last_uuids.update((d.index, d.uuid) for d in verdict.devices if d.uuid)
            log.info("verdict changed: %s (%s)", verdict.gpu_validation_blocker,
                     change_summary(self._logged, verdict, self._last_uuids),
                     extra={**where, "ready": verdict.ready,
                            "blockers": sorted({b.code for b in verdict.blockers}),
                            "warnings": sorted({w.code for w in verdict.warnings})})
            self._logged = verdict
