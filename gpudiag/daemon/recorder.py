"""Writes verdict changes to the history and treats a failing store as a state, not a flood.

A full disk or an I/O error makes writes fail for minutes or hours. The recorder then logs
one line when writing starts failing (with SQLite's or the OS's cause) and one when it works
again, keeps the changes made meanwhile in memory (bounded: past the bound the oldest are
dropped, said once and counted), and writes them in order, with their own times, once the
store takes writes again. Its state is a frozen ``HistoryHealth`` that the exporter renders.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from gpudiag.core.records import dataclass
from gpudiag.core.verdict import Verdict
from gpudiag.daemon.store import HistoryError, HistoryStore, fingerprint

log = logging.getLogger("gpudiag.daemon.history")

MAX_PENDING = 256


class VerdictWriter(Protocol):
    """What the recorder needs of the store (the seam: tests pass a failing fake)."""

    @property
    def last_fingerprint(self) -> str | None: ...

    def record(self, verdict: Verdict, now: float | None = None) -> int | None: ...


@dataclass(frozen=True)
class HistoryHealth:
    """Whether the history takes writes, and what was kept back or lost meanwhile."""

    writable: bool
    write_errors: int
    pending: int
    dropped: int
    last_error: str | None
    damaged: tuple[str, ...] = ()  # damaged histories moved aside at start (file names)


@dataclass(frozen=True)
class Written:
    """One verdict change that reached the history, or is kept until it can."""

    verdict: Verdict
    history_id: int | None  # None: kept in memory until the history takes writes


class HistoryRecorder:
    """Feeds verdict changes to the store in order; a failing store never raises here."""

    def __init__(self, store: VerdictWriter | None, *, max_pending: int = MAX_PENDING,
                 clock: Callable[[], float] = time.time, damaged: tuple[str, ...] = (),
                 opener: Callable[[], VerdictWriter] | None = None,
                 open_error: HistoryError | None = None) -> None:
        """``store`` None: the history could not be opened (``open_error`` says why, e.g. a
        full disk at start); ``opener`` is retried with every write attempt until it works."""
        self._store = store
        self._opener = opener
        self._max_pending = max(1, max_pending)
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: deque[tuple[float, Verdict]] = deque()
        self._last_fp = store.last_fingerprint if store is not None else None
        self._writable = True
        self._errors = 0
        self._dropped = 0
        self._dropped_this_outage = 0
        self._dropped_span: tuple[str | None, str | None] = (None, None)
        self._last_error: str | None = None
        self._damaged = damaged
        if store is None:
            self._failed(open_error or HistoryError("the history is not open"))
        self._health = self._current()

    def record(self, verdict: Verdict, at: float | None = None) -> list[Written]:
        """Queue the verdict if it is a change (made at ``at``, default now), then write what
        is queued, oldest first."""
        fp = fingerprint(verdict)
        with self._lock:
            if fp == self._last_fp:
                if not self._pending:
                    return []
                new: list[Verdict] = []
            else:
                self._last_fp = fp
                self._pending.append((self._clock() if at is None else at, verdict))
                new = [verdict]
                self._bound()
            written = self._flush()
            self._health = self._current()
        ids = {id(v): row for v, row in written}
        out = [Written(v, row) for v, row in written]
        # A change that could not be written yet is still said (without a history id).
        out += [Written(v, None) for v in new if id(v) not in ids]
        return out

    def retry(self) -> list[Written]:
        """Try again to write what waits (nothing happens when nothing waits)."""
        with self._lock:
            if not self.waiting:
                return []
            written = self._flush()
            self._health = self._current()
        return [Written(v, row) for v, row in written]

    @property
    def waiting(self) -> bool:
        """True while changes wait for the history (or the history is not open yet)."""
        return bool(self._pending) or self._store is None

    def health(self) -> HistoryHealth:
        """The state after the latest write attempt, for /metrics.

        Lock-free on purpose: a scrape must never wait on a write stuck in the disk.
        """
        return self._health

    def _current(self) -> HistoryHealth:
        return HistoryHealth(self._writable, self._errors, len(self._pending), self._dropped,
                             self._last_error, self._damaged)

    def _bound(self) -> None:
        while len(self._pending) > self._max_pending:
            _, lost = self._pending.popleft()
            self._dropped += 1
            self._dropped_this_outage += 1
            self._dropped_span = (self._dropped_span[0] or lost.checked_at, lost.checked_at)
            if self._dropped_this_outage == 1:
                log.warning("history: more than %d verdict changes wait for the history; the "
                            "oldest are dropped (counted in gpudiag_history_dropped_total), "
                            "first the one checked at %s (%s)", self._max_pending,
                            lost.checked_at, lost.gpu_validation_blocker,
                            extra={"max_pending": self._max_pending,
                                   "dropped_checked_at": lost.checked_at})

    def _failed(self, e: HistoryError) -> None:
        self._errors += 1
        cause = str(e.__cause__ or e)
        self._last_error = cause
        if self._writable:
            self._writable = False
            # One line per outage, with the cause; no traceback for a full disk.
            log.error("history not writable: %s; verdict changes are kept in memory "
                      "(up to %d) and written when it is", cause, self._max_pending,
                      extra={"cause": cause, "error": str(e)})

    @property
    def store(self) -> VerdictWriter | None:
        """The open store (None until a history that could not be opened at start opens)."""
        return self._store

    def history_store(self) -> HistoryStore | None:
        """The open store as a HistoryStore, to read or keep more than verdicts (None until
        it opens, or when it is another writer: a test's)."""
        store = self._store
        return store if isinstance(store, HistoryStore) else None

    def _flush(self) -> list[tuple[Verdict, int]]:
        written: list[tuple[Verdict, int]] = []
        if self._store is None:
            try:
                if self._opener is None:
                    raise HistoryError("the history is not open")
                self._store = self._opener()
            except HistoryError as e:
                self._failed(e)
                return written
        while self._pending:
            ts, verdict = self._pending[0]
            try:
                row = self._store.record(verdict, now=ts)
            except HistoryError as e:
                self._failed(e)
                break
            self._pending.popleft()
            if row is not None:
                written.append((verdict, row))
        if not self._pending and not self._writable:
            self._writable = True
            first, last = self._dropped_span
            log.warning("history writable again: wrote %d verdict change(s) kept while it was "
                        "not%s", len(written),
                        f", {self._dropped_this_outage} dropped past the bound (checked at "
                        f"{first} .. {last}; the log above still has them)"
                        if self._dropped_this_outage else "",
                        extra={"written": len(written),
                               "dropped": self._dropped_this_outage})
            self._dropped_this_outage = 0
            self._dropped_span = (None, None)
        return written


@dataclass(frozen=True)
class _Task:
    """A write queued with ``RecorderThread.later``."""

    run: Callable[[], object]


class RecorderThread:
    """Runs the recorder on its own thread: a write stuck in a dying disk (D state, a hung
    NFS mount) must never hold up the scheduler's loop, its watchdog keep-alive or probes.

    ``submit`` only queues (bounded; a full queue drops and counts, as the recorder does);
    ``on_written`` gets the verdict and what ``record`` returned, on this thread, in order
    (the verdict None after a retry). While changes
    wait for the history, it retries every ``retry_s`` even when nothing new comes.
    """

    _STOP = object()

    def __init__(self, recorder: HistoryRecorder,
                 on_written: Callable[[Verdict | None, list[Written]], None],
                 max_queued: int = 4 * MAX_PENDING, retry_s: float = 1.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.recorder = recorder
        self._clock = clock
        self._retry_s = retry_s
        self._on_written = on_written
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_queued)
        self._last_fp: str | None = None
        self._submit_lock = threading.Lock()
        self.overflow = 0
        self._thread = threading.Thread(target=self._run, name="gpudiag-history", daemon=True)

    def start(self) -> None:
        """Start the writer thread."""
        self._thread.start()

    def submit(self, verdict: Verdict, wait_s: float = 1.0) -> None:
        """Queue a snapshot's verdict when it is a change (so the queue holds changes only),
        then wait up to ``wait_s`` for it to be written: on a healthy disk the change is in
        the history when the snapshot's listeners return, as when they wrote it themselves.
        """
        fp = fingerprint(verdict)
        done = threading.Event()
        with self._submit_lock:  # probe workers publish concurrently
            if fp == self._last_fp:
                return
            self._last_fp = fp
            try:
                # Stamped now: a change waiting behind a stuck write keeps its own time.
                self._queue.put_nowait((self._clock(), verdict, done))
            except queue.Full:
                self.overflow += 1
                if self.overflow == 1:
                    log.warning("history: the writer is stuck (a hung disk?); verdict changes "
                                "are dropped (counted in gpudiag_history_dropped_total) until "
                                "it moves again")
                return
        done.wait(wait_s)

    def later(self, task: Callable[[], object]) -> bool:
        """Run ``task`` on this thread, in order with the verdict changes (another write to
        the history that must not wait on the disk either); False when the queue is full."""
        try:
            self._queue.put_nowait(_Task(task))
        except queue.Full:
            return False
        return True

    def health(self) -> HistoryHealth:
        """The recorder's health, with what waits in (or overflowed) this thread's queue."""
        h = self.recorder.health()
        return replace(h, pending=h.pending + self._queue.qsize(),
                       dropped=h.dropped + self.overflow)

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Write what is queued and end the thread; False when a write is still stuck."""
        try:
            self._queue.put(self._STOP, timeout=timeout_s)
        except queue.Full:  # the writer is stuck
            return False
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self._retry_s if self.recorder.waiting
                                       else None)
            except queue.Empty:
                item = None
            if item is self._STOP:
                return
            try:
                if isinstance(item, _Task):
                    item.run()
                elif isinstance(item, tuple):
                    at, verdict, done = item
                    try:
                        self._on_written(verdict, self.recorder.record(verdict, at))
                    finally:
                        done.set()
                else:
                    # Kept changes were said when they were made; the callback still learns
                    # that the history moved (it may have opened late).
                    self._on_written(None, self.recorder.retry())
            except Exception:  # a bug of ours: said, and the writer goes on
                log.exception("history writer failed")
