"""Live reload (SIGHUP, ``systemctl reload``): re-read the config and apply what can change.

Intervals, enabled backends, deadlines, thresholds (XID hold and gap warning, expected GPUs),
the default requirement, the preflight wait, scheduler tuning and the log level apply at
once; the sockets, listener, history and in-memory results stay. What only a restart can
change (the listen address, socket, history store, XID watcher process, NFD file, log
format) is named in the log line. An invalid file keeps the running config, logs one line
and counts ``gpudiag_config_reload_failures_total``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import replace

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gpudiag.core.records import dataclass
from gpudiag.daemon.collectors import StateCollector
from gpudiag.daemon.config import ConfigError, DaemonConfig, XidConfig
from gpudiag.daemon.scheduler import Scheduler
from gpudiag.daemon.sdnotify import Notifier

log = logging.getLogger("gpudiag.daemon.reload")

# DaemonConfig fields read once at start: a change waits for a restart.
RESTART_ONLY = ("listen_host", "listen_port", "socket_path", "tcp_read_only", "history",
                "nfd_features_file", "nfd_expiry_s", "log_format",
                "remediation",  # the actor and its node check are built at start
                "jobs")  # the job watch keeps its policy (its runs' holds stay consistent)
# XidConfig fields of the watcher process itself (hold_s, gap_warning_s, storm_window_s and
# [xid.promote] apply live).
XID_RESTART_ONLY = ("enabled", "heartbeat_s", "telemetry_s", "restart_backoff_max_s")


def restart_only_changes(old: DaemonConfig, new: DaemonConfig) -> list[str]:
    """The settings that differ between ``old`` and ``new`` but apply only at a restart."""
    changed = [name for name in RESTART_ONLY if getattr(old, name) != getattr(new, name)]
    changed += [f"xid.{name}" for name in XID_RESTART_ONLY
                if getattr(old.xid, name) != getattr(new.xid, name)]
    return changed


def live_changes(old: DaemonConfig, new: DaemonConfig) -> list[str]:
    """The settings a reload changes now, as ``key old -> new`` (for the log line)."""
    out: list[str] = []
    for name in ("default_requirement", "preflight_wait_s", "jitter_ratio", "backoff_max_s",
                 "tick_s", "probe_busy_gpus", "expected_gpus", "log_level"):
        if getattr(old, name) != getattr(new, name):
            out.append(f"{name} {getattr(old, name)!r} -> {getattr(new, name)!r}")
    for name in ("hold_s", "gap_warning_s", "storm_window_s"):
        if getattr(old.xid, name) != getattr(new.xid, name):
            out.append(f"xid.{name} {getattr(old.xid, name)!r} -> {getattr(new.xid, name)!r}")
    before, after = old.xid.rules.promotions, new.xid.rules.promotions
    for xid in sorted({*before, *after}):
        if before.get(xid) != after.get(xid):
            out.append(f"xid.promote.{xid} {before.get(xid)!r} -> {after.get(xid)!r}")
    for backend, b in new.backends.items():
        a = old.backends[backend]
        for name in ("enabled", "interval_s", "deadline_s"):
            if getattr(a, name) != getattr(b, name):
                out.append(f"backends.{backend}.{name} {getattr(a, name)!r} -> "
                           f"{getattr(b, name)!r}")
    return out


@dataclass(frozen=True)
class ReloadState:
    """Counters for /metrics."""

    reloads: int = 0
    failures: int = 0
    last_ok: bool = True


class Reloader:
    """Re-reads the config on request and applies it to the running daemon."""

    def __init__(self, scheduler: Scheduler, load: Callable[[], DaemonConfig], *,
                 retune_xid: Callable[[XidConfig], None] | None = None,
                 notifier: Notifier | None = None,
                 set_log_level: Callable[[str], None] | None = None) -> None:
        self._scheduler = scheduler
        self._load = load
        self._retune_xid = retune_xid
        self._notifier = notifier or Notifier(env={})
        self._set_log_level = set_log_level
        self._lock = threading.Lock()
        self._state = ReloadState()

    def state(self) -> ReloadState:
        return self._state

    def reload(self) -> bool:
        """Re-read and apply; False (the running config kept) when the file is unusable."""
        with self._lock:
            # systemd shows "reloading" until READY=1 comes back (Type=notify).
            self._notifier.notify("RELOADING=1")
            try:
                return self._reload_locked()
            finally:
                self._notifier.ready()

    def _reload_locked(self) -> bool:
        old = self._scheduler.config
        try:
            new = self._load()
        except ConfigError as e:
            self._state = replace(self._state, failures=self._state.failures + 1,
                                  last_ok=False)
            log.error("reload failed, still running the previous config: %s", e,
                      extra={"reload": "failed"})
            self._notifier.status(f"reload failed: {e}"[:200])
            return False
        # What cannot change live keeps its running value, so the scheduler sees one
        # consistent config; the log line says what waits for a restart.
        later = restart_only_changes(old, new)
        applied = replace(new, **{n: getattr(old, n) for n in RESTART_ONLY},
                          xid=replace(new.xid, **{n: getattr(old.xid, n)
                                                  for n in XID_RESTART_ONLY}))
        changes = live_changes(old, applied)
        self._scheduler.reconfigure(applied)
        if self._retune_xid is not None:
            self._retune_xid(applied.xid)
        if self._set_log_level is not None and applied.log_level != old.log_level:
            self._set_log_level(applied.log_level)
        self._state = replace(self._state, reloads=self._state.reloads + 1, last_ok=True)
        log.info("config reloaded: %s%s", "; ".join(changes) or "no change",
                 f" (needs a restart: {', '.join(later)})" if later else "",
                 extra={"reload": "ok", "changes": changes, "restart_needed": later})
        return True


class ReloadCollector(StateCollector[ReloadState]):
    """gpudiag_config_reloads_total, gpudiag_config_reload_failures_total and the last
    reload's outcome."""

    def render(self, state: ReloadState) -> Iterable[Metric]:
        """The reload counters and the last outcome."""
        return (
            CounterMetricFamily("gpudiag_config_reloads",
                                "Config reloads applied (SIGHUP, systemctl reload).",
                                value=state.reloads),
            CounterMetricFamily(
                "gpudiag_config_reload_failures",
                "Config reloads refused (invalid file); the running config was kept.",
                value=state.failures),
            GaugeMetricFamily("gpudiag_config_last_reload_successful",
                              "0 when the last reload was refused, else 1.",
                              value=1.0 if state.last_ok else 0.0),
        )


class LockDirCollector(StateCollector[bool]):
    """gpudiag_lock_dir_shared: 1 when the daemon's probes lock GPUs in the folder jobs use."""

    def __init__(self, shared: bool) -> None:
        super().__init__(lambda: shared)

    def render(self, state: bool) -> Iterable[Metric]:
        """The one gauge."""
        yield GaugeMetricFamily(
            "gpudiag_lock_dir_shared",
            "1 when the daemon locks GPUs in the shared lock folder (/run/gpudiag/locks or "
            "GPUDIAG_LOCK_DIR), 0 when it fell back to a private one that jobs do not see.",
            value=1.0 if state else 0.0)
