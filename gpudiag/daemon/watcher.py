"""Supervises the XID watcher child: reads its JSON lines, restarts it with backoff.

The watcher is never silently gone: while it is down (dead, silent past its heartbeat limit,
or backing off before a restart) the gap is counted, shows in metrics, and past the
configured limit becomes the ``xid_watcher_gap`` warning in verdicts.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import IO, Any

from gpudiag.core.findings import XidEvent
from gpudiag.core.observations import WatcherLine, parse_watcher_line
from gpudiag.core.probe_run import bounded_tail
from gpudiag.core.xids import SOURCE_URL as XID_SOURCE_URL
from gpudiag.core.xids import xid_entry
from gpudiag.daemon.config import XidConfig
from gpudiag.daemon.snapshot import WatcherState, XidCount

log = logging.getLogger("gpudiag.daemon.watcher")
MAX_RECENT = 1000
MAX_WINDOWS = 4096  # open storm windows kept; past it, closed ones are dropped
LINE_LIMIT = 1 << 20


def watcher_argv(config: XidConfig) -> list[str]:
    """The child's argv: no shell, options as one JSON argument."""
    options = {"heartbeat_s": config.heartbeat_s, "telemetry_s": config.telemetry_s}
    return [sys.executable, "-m", "gpudiag.probes.xid_watch", json.dumps(options)]


def _bounded(recent: tuple[XidEvent, ...]) -> tuple[XidEvent, ...]:
    """At most MAX_RECENT held XIDs; past it the oldest that block nothing go first, so
    that a flood of application XIDs never pushes a held fatal one out."""
    excess = len(recent) - MAX_RECENT
    if excess <= 0:
        return recent
    blocking = {x for x in recent if (e := xid_entry(x.xid)) is not None
                and e.severity == "blocker"}
    drop = {id(x) for x in [x for x in recent if x not in blocking][:excess]}
    kept = tuple(x for x in recent if id(x) not in drop)
    return kept[-MAX_RECENT:]


class XidWatcher:
    """Runs and restarts the watcher child; ``state()`` is what snapshots show."""

    def __init__(self, config: XidConfig, env: Mapping[str, str], *,
                 on_change: Callable[[], None] | None = None,
                 on_xid: Callable[[XidEvent], None] | None = None,
                 argv: list[str] | None = None, wall: Callable[[], float] = time.time) -> None:
        """``on_xid`` gets each XID as it arrives (the daemon keeps it in its history, so that
        a restart holds it again); it must not block (the child's pipe is read here)."""
        self.config = config
        self._env = dict(env)
        self._argv = argv or watcher_argv(config)
        self._on_change = on_change or (lambda: None)
        self._on_xid = on_xid or (lambda event: None)
        self._wall = wall
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._counts: dict[tuple[int | None, str | None, int], XidCount] = {}
        self._counts_dirty = False  # xid_counts is rebuilt when state() is read, not per XID
        # (GPU, UUID, XID) -> when its storm window opened (docs/xids.md "Storms").
        self._windows: dict[tuple[int | None, str | None, int], float] = {}
        # (GPU, UUID) -> when a line last spoke for its XIDs that block nothing.
        self._said: dict[tuple[int | None, str | None], float] = {}
        self._unknown_logged: set[int] = set()
        self._state = WatcherState(enabled=config.enabled,
                                   down_since_wall=wall() if config.enabled else None)

    def state(self) -> WatcherState:
        """The current state, with XIDs older than the hold time dropped."""
        with self._lock:
            now = self._wall()
            recent = tuple(x for x in self._state.recent if now - x.timestamp
                           <= self.config.hold_s)
            if recent != self._state.recent:
                self._state = replace(self._state, recent=recent)
            if self._counts_dirty:
                self._counts_dirty = False
                self._state = replace(self._state, xid_counts=tuple(sorted(
                    self._counts.values(), key=lambda c: (-1 if c.gpu is None else c.gpu,
                                                          c.xid, c.uuid or ""))))
            return self._state

    def retune(self, config: XidConfig) -> None:
        """Apply a reloaded hold time and gap warning (the watcher process keeps running)."""
        with self._lock:
            self.config = replace(self.config, hold_s=config.hold_s,
                                  gap_warning_s=config.gap_warning_s,
                                  storm_window_s=config.storm_window_s, rules=config.rules)

    def clear(self, uuid: str | None, before_wall: float) -> int:
        """Release held XIDs of GPU ``uuid`` (None: all) seen at or before ``before_wall``.

        What ``gpudiag clear`` does after a repair; counters stay (they are history), and an
        XID that arrives later holds its GPU again. Returns how many were released.
        """
        with self._lock:
            keep = tuple(x for x in self._state.recent if x.timestamp > before_wall
                         or (uuid is not None and x.uuid != uuid))
            released = len(self._state.recent) - len(keep)
            self._state = replace(self._state, recent=keep)
            # A storm window the clear ended: the next XID on that GPU is held again at once.
            self._windows = {k: t for k, t in self._windows.items()
                             if t > before_wall or (uuid is not None and k[1] != uuid)}
            self._said = {k: t for k, t in self._said.items()
                          if t > before_wall or (uuid is not None and k[1] != uuid)}
        if released:
            self._on_change()
        return released

    def rearm(self, events: Sequence[XidEvent]) -> int:
        """Hold again the XIDs a previous run of the daemon saw (read from the history at
        start); they expire and clear like any other. Returns how many were added."""
        with self._lock:
            known = set(self._state.recent)
            added = [e for e in events if e not in known]
            recent = tuple(sorted((*self._state.recent, *added), key=lambda x: x.timestamp))
            self._state = replace(self._state, recent=recent[-MAX_RECENT:])
        if added:
            self._on_change()
        return len(added)

    def start(self) -> None:
        if not self.config.enabled:
            return
        self._thread = threading.Thread(target=self._supervise, name="xid-watcher",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._kill()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _kill(self) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def _update(self, **changes: Any) -> None:
        with self._lock:
            self._state = replace(self._state, **changes)
        self._on_change()

    def _went_down(self, error: str) -> None:
        with self._lock:
            st = self._state
            down = st.down_since_wall if st.down_since_wall is not None else self._wall()
            self._state = replace(st, running=False, down_since_wall=down, last_error=error)
        self._on_change()

    def _came_up(self) -> None:
        with self._lock:
            st = self._state
            closed = st.gap_seconds_closed + st.gap_s(self._wall())
            self._state = replace(st, running=True, down_since_wall=None,
                                  gap_seconds_closed=closed)
        self._on_change()

    def _supervise(self) -> None:
        backoff = 0.5
        first = True
        last_error: str | None = None
        while not self._stop.is_set():
            if not first:
                with self._lock:
                    self._state = replace(self._state, restarts=self._state.restarts + 1)
            first = False
            started = time.monotonic()
            error = self._run_once()
            if self._stop.is_set():
                break
            self._went_down(error)
            # Once per kind of failure, not once per restart: a GPU-less host would
            # otherwise log a line a minute forever.
            level = logging.WARNING if error != last_error else logging.DEBUG
            last_error = error
            log.log(level, "XID watcher down: %s; restarting in %.1f s", error, backoff,
                    extra={"error": error, "backoff_s": backoff})
            # A child that ran well for a while earns a fresh, short backoff.
            if time.monotonic() - started > 10 * backoff:
                backoff = 0.5
            if self._stop.wait(backoff):
                break
            backoff = min(backoff * 2, self.config.restart_backoff_max_s)

    def _run_once(self) -> str:
        """Run one child until it dies or goes silent; returns why it stopped."""
        try:
            proc = subprocess.Popen(  # noqa: S603 - fixed argv, no shell
                self._argv, env=self._env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, start_new_session=True, close_fds=True)
        except OSError as e:
            return f"could not start the watcher child: {e}"
        self._proc = proc
        assert proc.stdout is not None and proc.stderr is not None
        stderr = bytearray()
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ, "out")
        sel.register(proc.stderr, selectors.EVENT_READ, "err")
        silence_limit = max(3 * self.config.heartbeat_s, 2.0) + self.config.telemetry_s
        last_line = time.monotonic()
        buf = b""
        reason = "the watcher child exited"
        open_streams = 2
        try:
            while open_streams and not self._stop.is_set():
                silent_s = time.monotonic() - last_line
                if silent_s > silence_limit:
                    reason = f"the watcher child was silent for more than {silence_limit:g} s"
                    break
                # Sleeps until a line (an XID, a heartbeat) or the silence limit: every line
                # is handled as it arrives, and stop() kills the child, whose end wakes this.
                for key, _ in sel.select(timeout=silence_limit - silent_s + 0.01):
                    stream: IO[bytes] = key.fileobj  # type: ignore[assignment]
                    chunk = os.read(stream.fileno(), 65536)
                    if not chunk:
                        sel.unregister(stream)
                        open_streams -= 1
                        continue
                    if key.data == "err":
                        stderr += chunk
                        del stderr[:-4096]
                        continue
                    buf += chunk
                    *lines, buf = buf.split(b"\n")
                    if len(buf) > LINE_LIMIT:
                        buf = b""
                    for line in lines:
                        last_line = time.monotonic()
                        err = self._handle(line)
                        if err is not None:
                            reason = err
        finally:
            sel.close()
            self._kill()
            code = proc.wait()
            proc.stdout.close()
            proc.stderr.close()
            self._proc = None
        tail = bounded_tail(bytes(stderr), 512).strip()
        detail = f" (exit status {code})" + (f"; stderr: {tail}" if tail else "")
        return reason + detail

    def _handle(self, line: bytes) -> str | None:
        msg = parse_watcher_line(line)  # typed once, here, where the line arrives
        if msg is None:
            return None  # a library printed to stdout; not ours
        if msg.kind == "hello":
            self._came_up()
            log.info("XID watcher watching %d GPU(s)", msg.device_count)
        elif msg.kind == "xid":
            self._xid(msg)
        elif msg.kind == "telemetry":
            # Only well-formed readings reach the exporter; a bad one is dropped, not fatal.
            wall = msg.ts if msg.ts is not None else self._wall()
            self._update(telemetry=dict(msg.telemetry), telemetry_wall=wall)
        elif msg.kind == "error":
            return str(msg.message)
        return None

    def _xid(self, msg: WatcherLine) -> None:
        if msg.xid is None:
            return
        xid, gpu, uuid = msg.xid, msg.device_index, msg.uuid
        ts = self._wall()
        key = (gpu, uuid, xid)
        with self._lock:
            # Every event is counted; only the first of its (GPU, XID) window is a finding,
            # a log line and a history row: a storm of thousands is one event, and the
            # loop is not woken per XID (the counters reach the next snapshot).
            opened = self._windows.get(key)
            folded = opened is not None and 0 <= ts - opened < self.config.storm_window_s
            old = self._counts.get(key)
            self._counts[key] = XidCount(gpu, uuid, xid, (old.count if old else 0) + 1, ts,
                                         (old.folded if old else 0) + int(folded))
            self._counts_dirty = True
            if folded:
                return
            if len(self._windows) >= MAX_WINDOWS:
                self._windows = {k: t for k, t in self._windows.items()
                                 if ts - t < self.config.storm_window_s}
            self._windows[key] = ts
            entry = xid_entry(xid)
            blocking = entry is not None and entry.severity == "blocker"
            quiet = False
            if not blocking:
                said = self._said.get((gpu, uuid))
                quiet = said is None or not 0 <= ts - said < self.config.storm_window_s
                if quiet:
                    self._said[(gpu, uuid)] = ts
            event = XidEvent(xid=xid, device_index=gpu, uuid=uuid, timestamp=ts,
                             fault_ts=msg.ts)
            self._state = replace(self._state, recent=_bounded((*self._state.recent, event)))
        # One line per GPU per storm: a blocking XID always gets its own (once per window);
        # the first XID that blocks nothing speaks for the others on its GPU in its window.
        level = logging.WARNING if (blocking or quiet) else logging.DEBUG
        log.log(level, "XID %d on GPU %s (%s)%s", xid, gpu, uuid,
                "" if blocking else f"; XIDs that block nothing on this GPU are counted, not "
                f"logged, for {self.config.storm_window_s:g} s",
                extra={"xid": xid, "gpu": gpu, "uuid": uuid,
                       "storm_window_s": self.config.storm_window_s})
        if xid_entry(xid) is None and xid not in self._unknown_logged:
            # Counted and held like any XID (never dropped), but it maps to no code: say so
            # once per XID, so that a newer driver's XIDs get into the catalog.
            self._unknown_logged.add(xid)
            log.warning("XID %d is not in NVIDIA's XID catalog as gpudiag knows it (%s): "
                        "counted, not classified", xid, XID_SOURCE_URL,
                        extra={"xid": xid, "unknown_xid": True})
        # Handed over before the scheduler is woken: what waits for the XID's verdict (the
        # time-to-detect histogram) is waiting before that verdict can be made.
        try:
            self._on_xid(event)
        except Exception:  # keeping it is best effort; watching must go on
            log.exception("could not hand XID %d over to the history", xid)
        self._on_change()
