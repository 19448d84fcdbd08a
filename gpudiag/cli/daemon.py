"""CLI commands of the daemon: ``gpudiag serve`` and ``gpudiag history``.

``serve`` parses its flags, then runs gpudiag.daemon.service (imported there: it brings
prometheus_client and the scheduler, which other commands do not need) and turns its errors
into exit codes.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from gpudiag.cli.commands import examples
from gpudiag.core.clock import rfc3339
from gpudiag.core.limits import DEFAULT_PORT, EXIT_FAILED, EXIT_USAGE
from gpudiag.core.records import dataclass
from gpudiag.core.redact import redact_text
from gpudiag.core.termsafe import terminal_safe
from gpudiag.daemon.config import ConfigError, DaemonConfig, exposure_warning, load_config
from gpudiag.daemon.effective import default_socket_path, effective_config

if TYPE_CHECKING:  # the store is imported where a command reads it (the CLI starts fast)
    from gpudiag.core.incident import Incident
    from gpudiag.daemon.store import ClearEntry, Episode, HistoryEntry, ResetEntry

_STD_ATTRS = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message",
                                                                         "asctime"}


class _Failed(click.ClickException):
    exit_code = EXIT_FAILED


class _Unusable(click.ClickException):
    """The state directory cannot be used, another daemon holds it, or the config names what
    cannot be used ([remediation]): exit 2."""

    exit_code = EXIT_USAGE


class JsonFormatter(logging.Formatter):
    """One JSON object per line (journald keeps it as MESSAGE), extras as fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": rfc3339(record.created),  # one time format: RFC 3339 UTC, milliseconds
            "level": record.levelname.lower(), "logger": record.name,
            "msg": record.getMessage()}
        for k, v in vars(record).items():
            if k not in _STD_ATTRS and not k.startswith("_"):
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    """``TIME LEVEL LOGGER: MESSAGE`` with TIME as every record writes it (RFC 3339 UTC, ms)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return rfc3339(record.created)


class _Redacting(logging.Formatter):
    """Any formatter's line with URL credentials cut out (core.redact): logs are records too."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        return redact_text(self.inner.format(record))


def setup_logging(fmt: str, level: str) -> None:
    """Structured logs to stderr; JSON for journald collectors, text for people."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Redacting(JsonFormatter() if fmt == "json" else TextFormatter()))
    root = logging.getLogger("gpudiag")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def default_state_dir() -> Path:
    """$GPUDIAG_STATE_DIR, $STATE_DIRECTORY (systemd), /var/lib/gpudiag for root, else
    ~/.local/state/gpudiag."""
    from gpudiag.engine.statedir import default_state_dir as default

    return default()


def _load(path: str | None, listen: str | None, socket_path: str | None) -> DaemonConfig:
    """The config file with the --listen/--socket flags applied (ConfigError)."""
    cfg = load_config(path)
    cfg = cfg.with_listen(listen) if listen else cfg
    return cfg.with_socket(socket_path) if socket_path is not None else cfg


def _config(path: str | None, listen: str | None, socket_path: str | None) -> DaemonConfig:
    try:
        return _load(path, listen, socket_path)
    except ConfigError as e:
        # One line and exit 2 (a config refused: a FIFO, /dev/zero, bad TOML), no usage text.
        raise _Unusable(str(e)) from e


def _check_remediation_node(cfg: DaemonConfig) -> None:
    """--check-config with [remediation] on: the node name must be a node Slurm knows."""
    from gpudiag.daemon.remediation import check_node_once

    ok, text = check_node_once(cfg.remediation)
    click.echo(f"# remediation: {text}")
    if not ok:
        raise click.exceptions.Exit(EXIT_USAGE)


def _check_reset_tool(cfg: DaemonConfig) -> None:
    """--check-config with [gpu_reset] on: a tool the daemon would refuse to run (the rung
    would stay off) is exit 2, named."""
    from gpudiag.daemon.slurmctl import check_executable

    unsafe = check_executable(cfg.gpu_reset.nvidia_smi)
    if unsafe is None:
        click.echo(f"# gpu_reset: {cfg.gpu_reset.nvidia_smi} may be run")
        return
    click.echo(f"# gpu_reset: {unsafe}: the daemon would keep the GPU reset rung off")
    click.echo(f"gpudiag serve: [gpu_reset] nvidia_smi: {unsafe}; give the absolute path of "
               "NVIDIA's nvidia-smi, an executable file only its owner can write", err=True)
    raise click.exceptions.Exit(EXIT_USAGE)


@click.command(short_help="Run the daemon: probes, XID watcher, /metrics, preflight API.",
               epilog=examples(
                   "gpudiag serve                                 # 127.0.0.1:9477",
                   "gpudiag serve --config /etc/gpudiag/gpudiag.toml --check-config",
                   "gpudiag serve --listen 0.0.0.0:9477 --state-dir /var/lib/gpudiag",
                   "curl -s localhost:9477/v1/preflight?gpus=1 | jq .ready"))
@click.option("--listen", metavar="HOST:PORT",
              help=f"Address to serve on.  [default: the config's, else "
              f"127.0.0.1:{DEFAULT_PORT}]")
@click.option("--socket", "socket_path", metavar="PATH",
              help="Unix socket for preflight and control; \"\" for none.  [default: the "
              "config's, else $RUNTIME_DIRECTORY/gpudiag.sock under systemd]")
@click.option("--config", "config_path", metavar="PATH", type=click.Path(dir_okay=False),
              help="TOML config file (see docs/daemon.md).")
@click.option("--state-dir", metavar="DIR", type=click.Path(file_okay=False),
              help="Where the history database lives.  [default: $STATE_DIRECTORY, "
              "/var/lib/gpudiag as root, else ~/.local/state/gpudiag]")
@click.option("--check-config", is_flag=True,
              help="Validate the config, print the effective configuration, and exit.")
@click.option("--log-format", type=click.Choice(["text", "json"]),
              help="Log format on stderr.  [default: the config's, else text]")
def serve(listen: str | None, socket_path: str | None, config_path: str | None,
          state_dir: str | None, check_config: bool, log_format: str | None) -> None:
    """Run the daemon: periodic probes, XID watcher, /metrics and the preflight API."""
    cfg = _config(config_path, listen, socket_path)
    exposed = exposure_warning(cfg)
    if check_config:
        if exposed is not None:
            click.echo(f"gpudiag serve: warning: {exposed}", err=True)
        click.echo(f"config OK: listen {cfg.listen_host}:{cfg.listen_port}"
                   f"{' (read-only)' if cfg.tcp_read_only else ''}, socket "
                   f"{default_socket_path(cfg) or 'none'}, backends "
                   f"{', '.join(cfg.enabled_backends) or 'none'}, default requirement "
                   f"{cfg.default_requirement}")
        click.echo(f"# effective configuration ({config_path or 'built-in defaults'}, "
                   "after --listen/--socket), as TOML:")
        for line in effective_config(cfg, state_dir or str(default_state_dir())):
            click.echo(line)
        if cfg.gpu_reset.enabled:
            _check_reset_tool(cfg)
        if cfg.remediation.mode != "off":
            _check_remediation_node(cfg)
        return
    setup_logging(log_format or cfg.log_format, cfg.log_level)
    if exposed is not None:
        logging.getLogger("gpudiag.daemon").warning(exposed)
    _run(cfg, Path(state_dir) if state_dir else default_state_dir(), config_path,
         reload=partial(_load, config_path, listen, socket_path))
    # Everything is stopped and closed. Leave now rather than at interpreter exit, which
    # joins every thread pool's workers: one stuck in a request or a probe would hold the
    # exit for as long as it is stuck (docs/daemon.md: exit within SHUTDOWN_LIMIT_S).
    logging.shutdown()
    sys.stdout.flush()
    os._exit(0)


def _run(cfg: DaemonConfig, state_dir: Path, config_path: str | None,
         reload: Callable[[], DaemonConfig]) -> None:
    """Serve until SIGTERM/SIGINT; the service's errors as the CLI's exit codes."""
    from gpudiag.daemon.service import CannotListen, DaemonService, StartError, StateDirUnusable

    try:
        failed = DaemonService(cfg, state_dir, config_path, reload).serve_forever()
    except CannotListen as e:
        raise click.UsageError(str(e)) from e
    except StateDirUnusable as e:
        raise _Unusable(str(e)) from e
    except StartError as e:
        if e.exit_code == EXIT_USAGE:  # e.g. [remediation] names a node Slurm lacks
            raise _Unusable(str(e)) from e
        raise _Failed(str(e)) from e
    if failed:
        raise _Failed(failed)


_SINCE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([smhdw]?)\s*$")
_SINCE_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_since(text: str) -> float:
    """``90``, ``30m``, ``1h``, ``2d`` -> seconds."""
    m = _SINCE_RE.match(text)
    if not m:
        raise click.UsageError(f"--since {text!r} is not a duration; accepted: seconds or a "
                               "number with s, m, h, d or w (e.g. 1h, 30m, 2d)")
    return float(m.group(1)) * _SINCE_UNITS[m.group(2)]


def _gpu_history(folder: Path, serial: str | None, worst: int | None, since: float | None,
                 limit: int, as_json: bool) -> None:
    """``--serial`` (one GPU's history) or ``--worst`` (the repeat offenders)."""
    from gpudiag.daemon.store import HistoryError, HistoryStore, default_path

    path = default_path(folder)
    if not path.is_file():
        raise _Unusable(f"no history at {path}: pass the --state-dir the daemon uses")
    try:
        store = HistoryStore(path, readonly=True)
        try:
            if worst is not None:
                offenders = store.worst(worst, since=since)
                data: dict[str, Any] = {"worst": [o.record() for o in offenders]}
            else:
                data = {"serial": serial,
                        "identities": [i.record() for i in store.identities(serial=serial)],
                        "episodes": [e.record() for e in store.episodes(
                            since=since, limit=limit, serial=serial)],
                        "xids": [x.record() for x in store.xids(since=since, limit=limit,
                                                                serial=serial)],
                        "clears": [c.record() for c in store.clears(
                            since=since, limit=limit, serial=serial)]}
            known = ([] if worst is not None or data["identities"]
                     else sorted({i.serial for i in store.identities()}))
        finally:
            store.close()
    except HistoryError as e:
        raise _Failed(str(e)) from e
    if worst is None and not data["identities"]:
        # No such GPU is a wrong question, not an empty answer: say what is known.
        raise _Unusable(f"no GPU with serial {serial!r} in the history at {path}; serials "
                        f"known: {', '.join(known[:20]) or 'none yet'}"
                        f"{' ...' if len(known) > 20 else ''} (nvidia-smi -q: Serial Number)")
    if as_json:
        click.echo(json.dumps(data, indent=2))
    elif worst is not None:
        _say_worst(data["worst"])
    else:
        _say_serial(data)


def _say_worst(rows: list[dict[str, Any]]) -> None:
    if not rows:
        click.echo("no incidents on any GPU with a known serial")
    for r in rows:
        click.echo(f"{r['serial']:<16} {r['incidents']:>4} incident(s)  last {_when(r['last'])}"
                   f"  {','.join(r['codes'])}  ({', '.join(r['uuids'])})")


def _say_serial(data: dict[str, Any]) -> None:
    click.echo(f"GPU serial {data['serial']}:")
    for i in data["identities"]:
        click.echo(f"  slot {i['gpu_index']}  {i['uuid']}  {i['pci_bus_id'] or '-'}  "
                   f"{_when(i['first_seen'])} .. {_when(i['last_seen'])}")
    for ep in data["episodes"]:
        end = "ongoing" if ep["ended"] is None else _when(ep["ended"])
        click.echo(f"{_when(ep['started'])} .. {end}  {ep['code']}  {ep['device']}: "
                   f"{ep['message']}")
    for x in data["xids"]:
        click.echo(f"{_when(x['ts'])}  XID {x['xid']}  GPU {x['gpu_index']} {x['uuid']}")
    for c in data["clears"]:
        click.echo(f"{_when(c['ts'])}  cleared by uid {c['uid']}"
                   f"{' (no repair)' if c['no_repair'] else ''}: {c['reason'] or '-'}")


def _when(ts: float) -> str:
    return rfc3339(ts)


@click.command(short_help="Show the daemon's verdict changes and blocker episodes.",
               epilog=examples(
                   "gpudiag history                     # the last 50 changes",
                   "gpudiag history --since 1h --blocked",
                   "gpudiag history --state-dir /var/lib/gpudiag --format json | jq .episodes",
                   "gpudiag history --serial 1650000000003   # one GPU, whatever its slot",
                   "gpudiag history --worst 10 --since 30d   # the repeat offenders"))
@click.option("--state-dir", metavar="DIR", type=click.Path(file_okay=False),
              help="The daemon's state dir.  [default: as for `gpudiag serve`]")
@click.option("--since", "since_text", metavar="DURATION",
              help="Only changes in the last DURATION (e.g. 1h, 30m, 2d).")
@click.option("--blocked", is_flag=True, help="Only verdicts that were blocked.")
@click.option("--limit", type=click.IntRange(1, 100000), default=50, show_default=True,
              metavar="N", help="At most this many verdict changes and episodes.")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default=None,
              help="Output format: text for people, json (verdicts, episodes, clears).  "
              "[default: text]")
@click.option("--json", "as_json", is_flag=True, help="Same as --format json.")
@click.option("--serial", metavar="SERIAL",
              help="One GPU's own history by its board serial (nvidia-smi -q: Serial Number), "
                   "across reboots, slot moves and UUIDs: its slots, episodes, XIDs, clears.")
@click.option("--worst", type=click.IntRange(1, 100000), metavar="N",
              help="The N GPUs (by serial) with the most incidents (blocker episodes opened "
                   "at distinct times).")
def history(state_dir: str | None, since_text: str | None, blocked: bool, limit: int,
            fmt: str | None, as_json: bool, serial: str | None, worst: int | None) -> None:
    """Show the daemon's verdict changes and blocker episodes (works while it runs)."""
    if as_json and fmt not in (None, "json"):
        raise click.UsageError(f"--json and --format {fmt} disagree; give one of them")
    if serial is not None and worst is not None:
        raise click.UsageError("give one of --serial SERIAL or --worst N")
    as_json = as_json or fmt == "json"
    if serial is not None or worst is not None:
        since = time.time() - parse_since(since_text) if since_text else None
        _gpu_history(Path(state_dir) if state_dir else default_state_dir(), serial, worst,
                     since, limit, as_json)
        return
    from gpudiag.daemon.statedir import damaged_histories
    from gpudiag.daemon.store import HistoryError, HistoryStore, default_path

    since = time.time() - parse_since(since_text) if since_text else None
    folder = Path(state_dir) if state_dir else default_state_dir()
    path = default_path(folder)
    damaged = damaged_histories(folder)
    if not path.is_file() and not damaged:
        # No daemon ever ran with this state dir (or it uses another one): a usage problem.
        raise _Unusable(f"no history at {path}: no daemon has used this state dir; start one "
                        "(`gpudiag serve`) or pass the --state-dir it uses (`gpudiag serve "
                        "--check-config` prints it)")
    try:
        store = HistoryStore(path, readonly=True)
        try:
            read = _HistoryRead(store.verdicts(since=since, blocked=blocked, limit=limit),
                                store.episodes(since=since, limit=limit),
                                store.clears(since=since, limit=limit),
                                store.incidents(since=since, limit=limit),
                                store.resets(since=since, limit=limit))
        finally:
            store.close()
    except HistoryError as e:
        raise _Failed(str(e)) from e
    if as_json:
        click.echo(json.dumps({**read.record(), "damaged": [str(folder / n) for n in damaged]},
                              indent=2))
        return
    for name in damaged:
        # Earlier history lives on in that file (readable with sqlite3 if not too damaged).
        click.echo(f"note: a damaged history was moved aside to {folder / name}; the history "
                   "below starts after it", err=True)
    _print_history(read, bool(since_text))


@dataclass(frozen=True)
class _HistoryRead:
    """What `gpudiag history` read of the store, in its window."""

    verdicts: Sequence[HistoryEntry]
    episodes: Sequence[Episode]
    clears: Sequence[ClearEntry]
    incidents: Sequence[Incident]
    resets: Sequence[ResetEntry]

    def record(self) -> dict[str, list[dict[str, Any]]]:
        return {name: [row.record() for row in getattr(self, name)]
                for name in ("verdicts", "episodes", "clears", "incidents", "resets")}


def _print_history(read: _HistoryRead, windowed: bool) -> None:
    """`gpudiag history`'s text: verdict changes, blocker episodes, applied clears,
    incidents and the reset rung's resets."""
    entries, episodes, clears = read.verdicts, read.episodes, read.clears
    incidents, resets = read.incidents, read.resets
    if not entries:
        click.echo("no verdict changes" + (" in that time" if windowed else ""))
    for entry in entries:
        extra = f"  warnings: {','.join(entry.warnings)}" if entry.warnings else ""
        click.echo(terminal_safe(f"{_when(entry.ts)}  {entry.gpu_validation_blocker:<26} "
                                 f"blockers: {','.join(entry.blockers) or '-'}{extra}",
                                 one_line=True))
    if episodes:
        click.echo("\nblocker episodes:")
    for ep in episodes:
        end = "ongoing" if ep.ended is None else _when(ep.ended)
        where = "/".join(x for x in (ep.backend, ep.device) if x) or "-"
        # Messages come from probes (their stderr) and records: no control character
        # reaches the terminal (core/termsafe).
        click.echo(terminal_safe(f"{_when(ep.started)} .. {end}  {ep.code}  {where}: "
                                 f"{ep.message}", one_line=True))
    if clears:
        click.echo("\nclears (gpudiag clear):")
    for c in clears:
        click.echo(terminal_safe(f"{_when(c.ts)}  {c.gpu or 'all GPUs'}  by uid {c.uid}: "
                                 f"{c.reason or '(no reason)'}; {c.released} held XID(s) "
                                 "released", one_line=True))
    if incidents:
        click.echo("\nincidents:")
    for inc in incidents:
        end = "open" if inc.ended_wall is None else _when(inc.ended_wall)
        click.echo(terminal_safe(f"{_when(inc.started_wall)} .. {end}  {inc.id}  {inc.code} "
                                 f"on {inc.gpu or 'the node'} ({','.join(inc.codes)})",
                                 one_line=True))
    if resets:
        click.echo("\nGPU resets (the reset rung):")
    for r in resets:
        click.echo(terminal_safe(f"{_when(r.ts)}  {r.gpu}  {r.outcome}: {r.detail}",
                                 one_line=True))
