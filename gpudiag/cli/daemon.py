"""CLI commands of the daemon: ``gpudiag serve`` and ``gpudiag history``.

Heavy imports (prometheus_client, the scheduler) happen inside ``serve`` so that other
commands start fast.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import click

from gpudiag.core.limits import DEFAULT_PORT, EXIT_FAILED
from gpudiag.daemon.config import ConfigError, DaemonConfig, load_config

_STD_ATTRS = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message",
                                                                         "asctime"}


class _Failed(click.ClickException):
    exit_code = EXIT_FAILED


class JsonFormatter(logging.Formatter):
    """One JSON object per line (journald keeps it as MESSAGE), extras as fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created).astimezone().isoformat(
                timespec="milliseconds"),
            "level": record.levelname.lower(), "logger": record.name,
            "msg": record.getMessage()}
        for k, v in vars(record).items():
            if k not in _STD_ATTRS and not k.startswith("_"):
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(fmt: str, level: str) -> None:
    """Structured logs to stderr; JSON for journald collectors, text for people."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("gpudiag")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def default_state_dir() -> Path:
    """$STATE_DIRECTORY (systemd), /var/lib/gpudiag for root, else ~/.local/state/gpudiag."""
    if os.environ.get("STATE_DIRECTORY"):
        return Path(os.environ["STATE_DIRECTORY"].split(":")[0])
    if os.geteuid() == 0:
        return Path("/var/lib/gpudiag")
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "gpudiag"


def _config(path: str | None, listen: str | None) -> DaemonConfig:
    try:
        cfg = load_config(path)
        return cfg.with_listen(listen) if listen else cfg
    except ConfigError as e:
        raise click.UsageError(str(e)) from e


@click.command()
@click.option("--listen", metavar="HOST:PORT",
              help=f"Address to serve on (default 127.0.0.1:{DEFAULT_PORT}, or the config's).")
@click.option("--config", "config_path", metavar="PATH", type=click.Path(dir_okay=False),
              help="TOML config file (see docs/daemon.md).")
@click.option("--state-dir", metavar="DIR", type=click.Path(file_okay=False),
              help="Where the history database lives (default $STATE_DIRECTORY, "
              "/var/lib/gpudiag as root, else ~/.local/state/gpudiag).")
@click.option("--check-config", is_flag=True, help="Validate the config, print it, and exit.")
@click.option("--log-format", type=click.Choice(["text", "json"]),
              help="Log format on stderr (default: the config's, text).")
def serve(listen: str | None, config_path: str | None, state_dir: str | None,
          check_config: bool, log_format: str | None) -> None:
    """Run the daemon: periodic probes, XID watcher, /metrics and the preflight API."""
    cfg = _config(config_path, listen)
    if check_config:
        click.echo(f"config OK: listen {cfg.listen_host}:{cfg.listen_port}, backends "
                   f"{', '.join(cfg.enabled_backends) or 'none'}, default requirement "
                   f"{cfg.default_requirement}")
        return
    setup_logging(log_format or cfg.log_format, cfg.log_level)
    run_daemon(cfg, Path(state_dir) if state_dir else default_state_dir(), config_path)


def run_daemon(cfg: DaemonConfig, state_dir: Path, config_path: str | None = None) -> None:
    """Start everything, serve until SIGTERM/SIGINT, stop everything."""
    from gpudiag.core.environment import probe_environment
    from gpudiag.daemon.app import DaemonApp
    from gpudiag.daemon.app import serve as http_serve
    from gpudiag.daemon.scheduler import Scheduler
    from gpudiag.daemon.sdnotify import Notifier
    from gpudiag.daemon.snapshot import Snapshot
    from gpudiag.daemon.store import HistoryError, HistoryStore, default_path
    from gpudiag.daemon.watcher import XidWatcher
    from gpudiag.engine.processes import kill_child_groups

    log = logging.getLogger("gpudiag.daemon")
    # Answers are short and latency is what callers wait on: hand the GIL over sooner than
    # CPython's 5 ms default when a request thread wakes up beside a busy one.
    sys.setswitchinterval(0.0005)
    try:
        store = HistoryStore(default_path(state_dir), retention_s=cfg.history.retention_s,
                             max_bytes=cfg.history.max_bytes)
    except (HistoryError, OSError) as e:
        raise _Failed(f"cannot use --state-dir {state_dir}: {e}") from e
    notifier = Notifier()
    wake: list[Any] = []
    watcher = XidWatcher(cfg.xid, probe_environment(os.environ),
                         on_change=lambda: wake[0]() if wake else None)
    scheduler = Scheduler(cfg, notifier=notifier, watcher=watcher)
    wake.append(scheduler.wake)

    def record(snap: Snapshot) -> None:
        if snap.full is None:
            return
        row = store.record(snap.full)
        if row is not None:
            log.info("verdict changed: %s", snap.full.gpu_validation_blocker,
                     extra={"history_id": row, "ready": snap.full.ready,
                            "blockers": sorted({b.code for b in snap.full.blockers}),
                            "warnings": sorted({w.code for w in snap.full.warnings})})

    scheduler.on_snapshot(record)
    app = DaemonApp(scheduler, store)
    try:
        httpd, _thread = http_serve(app, cfg.listen_host, cfg.listen_port)
    except OSError as e:
        raise click.UsageError(f"cannot listen on {cfg.listen_host}:{cfg.listen_port}: "
                               f"{e.strerror or e}") from e
    host, port = str(httpd.server_address[0]), int(httpd.server_address[1])
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    def on_hup(*_: Any) -> None:
        # A reload must not kill the daemon (SIGHUP's default); settings apply on restart.
        try:
            load_config(config_path)
            verdict = "the file is valid"
        except ConfigError as e:
            verdict = f"the file is invalid: {e}"
        log.warning("SIGHUP: live reload is not supported; restart to apply the config (%s)",
                    verdict)

    signal.signal(signal.SIGHUP, on_hup)
    watcher.start()
    scheduler.start()
    url = f"http://{host if ':' not in str(host) else f'[{host}]'}:{port}"
    log.info("listening on %s", url, extra={"url": url, "state_dir": str(state_dir),
                                            "backends": list(cfg.enabled_backends)})
    notifier.ready(f"serving on {url}")
    stop.wait()
    log.info("stopping")
    notifier.stopping()
    httpd.shutdown()
    scheduler.stop()
    watcher.stop()
    # A probe child still running (even hung in the driver) must not hold the exit up to
    # its deadline, nor outlive the daemon: kill each child's process group.
    killed = kill_child_groups()
    if killed:
        log.info("killed %d running probe child(ren) on the way out", killed)
    scheduler.drain()
    store.close()


_SINCE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([smhdw]?)\s*$")
_SINCE_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_since(text: str) -> float:
    """``90``, ``30m``, ``1h``, ``2d`` -> seconds."""
    m = _SINCE_RE.match(text)
    if not m:
        raise click.UsageError(f"--since {text!r} is not a duration; accepted: seconds or a "
                               "number with s, m, h, d or w (e.g. 1h, 30m, 2d)")
    return float(m.group(1)) * _SINCE_UNITS[m.group(2)]


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts).astimezone().isoformat(timespec="seconds")


@click.command()
@click.option("--state-dir", metavar="DIR", type=click.Path(file_okay=False),
              help="The daemon's state dir (default as for `gpudiag serve`).")
@click.option("--since", "since_text", metavar="DURATION",
              help="Only changes in the last DURATION (e.g. 1h, 30m, 2d).")
@click.option("--blocked", is_flag=True, help="Only verdicts that were blocked.")
@click.option("--limit", type=click.IntRange(1, 100000), default=50, show_default=True,
              help="At most this many verdict changes and episodes.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def history(state_dir: str | None, since_text: str | None, blocked: bool, limit: int,
            as_json: bool) -> None:
    """Show the daemon's verdict changes and blocker episodes (works while it runs)."""
    from gpudiag.daemon.store import HistoryError, HistoryStore, default_path

    since = time.time() - parse_since(since_text) if since_text else None
    path = default_path(Path(state_dir) if state_dir else default_state_dir())
    try:
        store = HistoryStore(path, readonly=True)
        try:
            entries = store.verdicts(since=since, blocked=blocked, limit=limit)
            episodes = store.episodes(since=since, limit=limit)
        finally:
            store.close()
    except HistoryError as e:
        raise _Failed(str(e)) from e
    if as_json:
        click.echo(json.dumps({"verdicts": [v.record() for v in entries],
                               "episodes": [ep.record() for ep in episodes]}, indent=2))
        return
    if not entries:
        click.echo("no verdict changes" + (" in that time" if since_text else ""))
    for entry in entries:
        extra = f"  warnings: {','.join(entry.warnings)}" if entry.warnings else ""
        click.echo(f"{_when(entry.ts)}  {entry.gpu_validation_blocker:<26} "
                   f"blockers: {','.join(entry.blockers) or '-'}{extra}")
    if episodes:
        click.echo("\nblocker episodes:")
    for ep in episodes:
        end = "ongoing" if ep.ended is None else _when(ep.ended)
        where = "/".join(x for x in (ep.backend, ep.device) if x) or "-"
        click.echo(f"{_when(ep.started)} .. {end}  {ep.code}  {where}: {ep.message}")
