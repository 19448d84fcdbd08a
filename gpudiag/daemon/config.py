"""The daemon's configuration: a TOML file, every key validated with a clear error.

Unknown keys are errors (a typo must not silently fall back to a default). Durations are
seconds and may be fractions so that tests can run the scheduler quickly.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import field, replace
from pathlib import Path
from typing import Any

from gpudiag.core import registry
from gpudiag.core.ascii_ints import ascii_int
from gpudiag.core.backend import BackendSpec
from gpudiag.core.fileio import RefusedFile, read_regular
from gpudiag.core.gpu_reset import GpuResetConfig
from gpudiag.core.job_watch import JobWatchPolicy
from gpudiag.core.limits import DEFAULT_PORT
from gpudiag.core.nvml_health import NvmlHealthPolicy
from gpudiag.core.qualify import ReferenceError, ReferenceModel, parse_reference_table
from gpudiag.core.qualify_score import Thresholds
from gpudiag.core.records import dataclass
from gpudiag.core.remediation_config import RemediationConfig as RemediationConfig
from gpudiag.core.requirement import RequirementError, parse_backends, parse_size
from gpudiag.core.runtime import OWN_RUNTIME, RUNTIME_NAME, Runtime
from gpudiag.core.settings import (
    Check,
    Choice,
    Count,
    Flag,
    Table,
    path,
    ratio,
    read_fields,
    read_section,
    seconds,
    setting,
)
from gpudiag.core.settings import ConfigError as ConfigError
from gpudiag.core.visibility import VISIBILITY_VARIABLES
from gpudiag.core.xids import (
    APPLICATION,
    DEFAULT_PROMOTIONS,
    PROMOTION_WINDOW_S,
    Promotion,
    XidRules,
    xid_entry,
)
from gpudiag.daemon.actuators import names as actuator_names
from gpudiag.engine.runtimes import (
    NOBODY,
    can_change_identity,
    import_path,
    python_problem,
    resolve_user,
)

DEFAULT_HOST = "127.0.0.1"
# Unassigned in Prometheus's default-port registry (9400 is dcgm-exporter, 9835 nvidia_gpu).
LOG_FORMATS = ("text", "json")
# sockaddr_un.sun_path is 108 bytes with the terminating NUL.
MAX_SOCKET_PATH = 107
# A config is a few KiB; a reference table a few hundred KiB. Anything larger (a /dev/zero,
# a runaway file) is refused before it is read into memory.
MAX_CONFIG_BYTES = 1 << 20
MAX_REFERENCE_BYTES = 8 << 20
LOG_LEVELS = ("debug", "info", "warning", "error")


def parse_socket(path: object, key: str = "socket") -> str:
    """An absolute unix socket path short enough for sockaddr_un, or "" for none."""
    if not isinstance(path, str):
        raise ConfigError(f"{key} = {path!r}: expected a path string such as "
                          "\"/run/gpudiag/gpudiag.sock\" (or \"\" for no socket)")
    if path == "":
        return path
    if not path.startswith("/") or "\0" in path:
        raise ConfigError(f"{key} {path!r} is not an absolute path; e.g. "
                          "/run/gpudiag/gpudiag.sock")
    if len(path.encode()) > MAX_SOCKET_PATH:
        raise ConfigError(f"{key} {path!r} is {len(path.encode())} bytes; a unix socket path "
                          f"may have at most {MAX_SOCKET_PATH}: choose a shorter one")
    return path


def parse_nfd_file(path: object, key: str = "nfd_features_file") -> str | None:
    """An absolute file path for the NFD feature file, or None for "" (none)."""
    if not isinstance(path, str):
        raise ConfigError(f"{key} = {path!r}: expected a path string such as "
                          "\"/etc/kubernetes/node-feature-discovery/features.d/gpudiag\"")
    if path == "":
        return None
    if not path.startswith("/") or "\0" in path or path.endswith("/"):
        raise ConfigError(f"{key} {path!r} is not an absolute file path; e.g. "
                          "/etc/kubernetes/node-feature-discovery/features.d/gpudiag")
    if Path(path).name.startswith("."):
        raise ConfigError(f"{key} {path!r}: node-feature-discovery skips hidden files; "
                          "give a name without a leading dot")
    return path


def _size(value: object, key: str) -> int:
    """Bytes, at least 4096: an integer or a size such as "64MiB"."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 4096:
        return value
    if isinstance(value, str):
        try:
            size = parse_size(value)
        except RequirementError as e:
            raise ConfigError(f"{key}: {e}") from e
        if size >= 4096:
            return size
    raise ConfigError(f"{key} = {value!r}: expected bytes (at least 4096) or a size such as "
                      "\"64MiB\"")


def _requirement(requirement: object, key: str) -> str:
    """A requirement in the CLI's syntax (``cuda``, ``jax,iree``)."""
    try:
        if not isinstance(requirement, str):
            raise RequirementError(f"{requirement!r} is not a string")
        parse_backends(requirement)
    except RequirementError as e:
        raise ConfigError(f"{key}: {e}") from e
    return requirement


@dataclass(frozen=True)
class BackendConfig:
    """How one backend is scheduled."""

    enabled: bool
    interval_s: float
    deadline_s: float
    # The backend's own keys as written ([backends.nic] expect, ...), checked at load.
    settings: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class XidConfig:
    """The supervised NVML event watcher."""

    enabled: bool = setting(True, Flag())
    hold_s: float = setting(3600.0, seconds())
    gap_warning_s: float = setting(60.0, seconds())
    heartbeat_s: float = setting(1.0, seconds(maximum=60.0))
    telemetry_s: float = setting(5.0, seconds(maximum=3600.0))
    restart_backoff_max_s: float = setting(60.0, seconds(maximum=3600.0))
    # One finding, one log line and one history row per (GPU, XID) per this many seconds;
    # the counters count every event (docs/xids.md "Storms").
    storm_window_s: float = setting(300.0, seconds(1.0, 86400.0))
    # [xid.promote]: per application XID, occurrences within a window that make it block.
    rules: XidRules = field(default_factory=XidRules)


@dataclass(frozen=True)
class HistoryConfig:
    """Retention of the SQLite history."""

    retention_s: float = setting(30 * 86400.0, seconds(1.0, 3650 * 86400.0))
    max_bytes: int = setting(64 * 2**20, Check(_size))


@dataclass(frozen=True)
class QualificationConfig:
    """The quick tier on idle GPUs (docs/qualify.md): when, and how results are judged."""

    enabled: bool = setting(True, Flag())  # the off switch
    tier: str = setting("quick", Choice(("quick", "full", "sdc")))
    # FREE in every reading for this long before it is measured.
    idle_s: float = setting(900.0, seconds(maximum=7 * 86400.0))
    # A GPU qualified more recently than this is left alone.
    max_age_s: float = setting(86400.0, seconds(1.0))
    tick_s: float = setting(5.0, seconds(maximum=60.0))
    # POST /v1/qualify's bounds (docs/qualify.md "On demand"): a request's budget, its tier's
    # deadline times its GPUs, at most this many GPU-seconds (8 GPUs of the full tier; at
    # least one GPU of the shortest tier, 10 s: a smaller cap refuses every request), and at
    # most this many requests waiting at once (besides one per GPU, and the one running).
    max_request_gpu_s: float = setting(480.0, seconds(10.0, 86400.0))
    max_queued: int = setting(8, Count(1, 1024, "the most on-demand requests waiting at once, "
                                       "an integer from 1 to 1024"))
    thresholds: Thresholds = field(default_factory=Thresholds)
    # A site's own reference table (JSON, docs/qualify.md), read when the config is loaded.
    reference_file: str | None = setting(None, path("an absolute path to a JSON reference "
                                                    "table"))
    table: tuple[ReferenceModel, ...] | None = None


@dataclass(frozen=True)
class DaemonConfig:
    """Everything ``gpudiag serve`` can be told."""

    listen_host: str = DEFAULT_HOST
    listen_port: int = DEFAULT_PORT
    default_requirement: str = setting("cuda", Check(_requirement))
    preflight_wait_s: float = setting(20.0, seconds(maximum=600.0))
    jitter_ratio: float = setting(0.1, ratio(), at="scheduler.jitter_ratio")
    backoff_max_s: float = setting(600.0, seconds(maximum=86400.0), at="scheduler.backoff_max_s")
    tick_s: float = setting(0.5, seconds(maximum=5.0), at="scheduler.tick_s")
    # docs/design-notes.md "Busy GPUs": active probes skip GPUs other processes use. A site
    # that wants its busy GPUs probed anyway (a context costs a job memory, and fails in
    # exclusive mode) says so here.
    probe_busy_gpus: bool = setting(False, Flag(), at="scheduler.probe_busy_gpus")
    backends: Mapping[str, BackendConfig] = field(default_factory=lambda: {
        s.name: BackendConfig(s.enabled, s.interval_s, s.timeout_s)
        for s in registry.specs()})
    xid: XidConfig = field(default_factory=XidConfig)
    history: HistoryConfig = field(default_factory=HistoryConfig)
    log_format: str = setting("text", Choice(LOG_FORMATS), at="log.format")
    log_level: str = setting("info", Choice(LOG_LEVELS), at="log.level")
    # The unix socket for preflight and control: None means the default (the systemd
    # runtime directory's gpudiag.sock when there is one), "" means none.
    socket_path: str | None = setting(None, Check(parse_socket), at="socket")
    # TCP answers only the monitoring endpoints (/metrics, /healthz, /readyz, /v1/history).
    tcp_read_only: bool = setting(False, Flag())
    # NVIDIA GPUs this node must show; None: PCI decides.
    expected_gpus: int | None = setting(None, Count(
        1, 1024, "the number of NVIDIA GPUs this node must show, an integer from 1 to 1024 "
        "(leave it out to compare the PCI bus with NVML only)"))
    # [nvml]: expected_nvlinks and the clock-event dwell time (core.nvml_health).
    nvml: NvmlHealthPolicy = field(default_factory=NvmlHealthPolicy)
    # Kubernetes: a node-feature-discovery local feature file (features.d) to keep current;
    # None writes none. Its labels expire after nfd_expiry_s unless the daemon rewrites it.
    nfd_features_file: str | None = setting(None, Check(parse_nfd_file))
    nfd_expiry_s: float = setting(600.0, seconds(10.0, 7 * 86400.0))
    qualification: QualificationConfig = field(default_factory=QualificationConfig)
    # [runtimes.NAME]: the job environments this node serves (core.runtime); the daemon's own
    # (``gpudiag``) is always there, first.
    runtimes: tuple[Runtime, ...] = (Runtime(OWN_RUNTIME),)
    remediation: RemediationConfig = field(default_factory=RemediationConfig)
    # [jobs]: the job watch over the attested runs (core.job_watch, daemon/job_watch.py).
    jobs: JobWatchPolicy = field(default_factory=JobWatchPolicy)
    # [gpu_reset]: the reset rung, off by default (core.gpu_reset, daemon/gpu_reset.py).
    gpu_reset: GpuResetConfig = field(default_factory=GpuResetConfig)

    @property
    def enabled_backends(self) -> tuple[str, ...]:
        return tuple(n for n in registry.probe_names()
                     if n in self.backends and self.backends[n].enabled)

    def with_listen(self, text: str) -> DaemonConfig:
        """A copy listening on ``HOST:PORT`` (the --listen flag wins over the file)."""
        host, port = parse_listen(text, "--listen")
        return replace(self, listen_host=host, listen_port=port)

    def with_socket(self, path: str) -> DaemonConfig:
        """A copy serving on the unix socket ``path`` (the --socket flag wins over the file)."""
        return replace(self, socket_path=parse_socket(path, "--socket"))


def exposure_warning(cfg: DaemonConfig) -> str | None:
    """What to say when the TCP listener is reachable from other hosts and not read-only:
    anyone who reaches it may then start probes and qualifications (POST)."""
    import ipaddress

    host = cfg.listen_host.strip("[]")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False  # a host name: it may resolve to any interface
    if loopback or cfg.tcp_read_only:
        return None
    return (f"listening on {cfg.listen_host}:{cfg.listen_port}, not loopback, without "
            "tcp_read_only: anyone who can reach this port can start probes and "
            "qualifications (POST /v1/probe, /v1/qualify); set tcp_read_only = true for a "
            "scrape-only listener, or listen on 127.0.0.1 (docs/daemon.md)")


def parse_listen(text: str, key: str = "listen") -> tuple[str, int]:
    """``127.0.0.1:9477``, ``[::1]:9477`` or ``:9477`` -> (host, port)."""
    forms = "accepted: HOST:PORT, e.g. 127.0.0.1:9477 or [::1]:9477 (port 0 picks a free one)"
    if not isinstance(text, str) or ":" not in text:
        raise ConfigError(f"{key} {text!r} is not HOST:PORT; {forms}")
    host, _, port_text = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    host = host or DEFAULT_HOST
    port = ascii_int(port_text, strip=False)
    if port is None or port > 65535:
        raise ConfigError(f"{key} {text!r}: port {port_text!r} is not 0-65535; {forms}")
    return host, port


def _qualification(t: Table) -> QualificationConfig:
    cfg = read_section(t, QualificationConfig, thresholds=Thresholds(
        **read_fields(t, Thresholds)))
    if cfg.reference_file is None:
        return cfg
    key, file = t.key("reference_file"), cfg.reference_file
    try:
        raw, _ = read_regular(file, MAX_REFERENCE_BYTES, follow=True)
        return replace(cfg, table=parse_reference_table(json.loads(raw.decode("utf-8"))))
    except RefusedFile as e:
        raise ConfigError(f"{key}: cannot read {file}: {e}") from e
    except (ValueError, ReferenceError, RecursionError) as e:
        raise ConfigError(f"{key}: {file}: {e}") from e


def _backends(t: Table) -> dict[str, BackendConfig]:
    backends: dict[str, BackendConfig] = {}
    for s in registry.specs():
        b = t.table(s.name)
        backends[s.name] = BackendConfig(
            enabled=b.read("enabled", Flag(), s.enabled),
            interval_s=b.read("interval_s", seconds(), s.interval_s),
            deadline_s=b.read("deadline_s", seconds(maximum=3600.0), s.timeout_s),
            settings=_settings(s, b))
        b.finish()
    t.finish()
    return backends


def _settings(spec: BackendSpec, b: Table) -> dict[str, Any]:
    """A backend's own keys (``BackendSpec.settings_keys``), checked by its spec."""
    own = {k: b.get(k) for k in spec.settings_keys if b.raw.get(k) is not None}
    try:
        spec.settings_checked(own)
    except ValueError as e:
        raise ConfigError(f"{b.where}.{e}") from e
    return own


# The variable a probe child reads its backend's own settings from (JSON, by backend name).
SETTINGS_VARIABLE = "GPUDIAG_BACKEND_SETTINGS"


def backend_settings_json(cfg: DaemonConfig) -> str:
    """Every backend's own settings as one JSON object (SETTINGS_VARIABLE's value)."""
    return json.dumps({name: dict(b.settings) for name, b in sorted(cfg.backends.items())
                       if b.settings}, sort_keys=True)


def _xid(x: Table) -> XidConfig:
    return read_section(x, XidConfig, rules=XidRules(_promotions(x.table("promote"))))


def _promotions(t: Table) -> dict[int, Promotion]:
    """``[xid.promote]``: ``13 = {count = 5, window_s = 3600}`` per application XID; a count
    of 0 turns the catalog's promotion of that XID off."""
    promotions = dict(DEFAULT_PROMOTIONS)
    for key in list(t.raw):
        entry = xid_entry(int(key)) if key.isascii() and key.isdigit() else None
        if entry is None or entry.code != APPLICATION or not entry.solo:
            raise ConfigError(f"{t.key(key)}: expected the number of an application-class "
                              f"XID that stands alone (13, 31, 43, ...; 45 only follows "
                              f"another XID)")
        rule = t.table(key)
        count = rule.read("count", Count(0, 1_000_000, "a count from 0 (off) to 1000000"))
        if count is None:
            raise ConfigError(f"{rule.key('count')} is required")
        window = rule.read("window_s", seconds(1.0, 30 * 86400.0), PROMOTION_WINDOW_S)
        rule.finish()
        promotions[entry.xid] = Promotion(count, window)  # 0: kept, so the file says "off"
    t.finish()
    return promotions


MAX_RUNTIMES = 16
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


def _environment_backends() -> tuple[str, ...]:
    """The backends proven in a job's environment (their spec declares one)."""
    return tuple(s.name for s in registry.specs() if s.environment is not None and s.requirable)


def _runtime_require(r: Table) -> tuple[str, ...] | None:
    value = r.get("require")
    if value is None:
        return None
    allowed = _environment_backends()
    names: list[str] | None = None
    if isinstance(value, str):
        names = [n.strip().lower() for n in value.split(",")]
    elif isinstance(value, list) and all(isinstance(n, str) for n in value):
        names = [n.strip().lower() for n in value]
    hint = (f"expected a comma list of {', '.join(allowed)}, each with a platform where the "
            "runtime's jobs use another (jax:cpu for a runtime that serves CPU jobs, "
            "iree:local-task) (\"\" for none), or an array of them")
    if names is None:
        raise ConfigError(f"{r.key('require')} = {value!r}: {hint}")
    out: list[str] = []
    for name in (n for n in names if n):
        try:
            entries = parse_backends(name)
        except RequirementError as e:
            raise ConfigError(f"{r.key('require')} = {value!r}: {e}; {hint}") from None
        entry = entries[0]
        if entry.name not in allowed:
            raise ConfigError(f"{r.key('require')} = {value!r}: {entry.name} is not proven "
                              f"in a job's environment; {hint}")
        if any(o.partition(":")[0] == entry.name for o in out):
            raise ConfigError(f"{r.key('require')} = {value!r}: {entry.name} is named twice "
                              "(a runtime serves one platform of a backend)")
        out.append(entry.spec())
    return tuple(out)


def _runtime_env(r: Table) -> dict[str, str]:
    value = r.get("env")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{r.key('env')} must be a table of strings, e.g. "
                          "env = { LD_LIBRARY_PATH = \"/usr/local/cuda/compat\" }")
    out: dict[str, str] = {}
    for key, text in value.items():
        if not _ENV_NAME.fullmatch(key) or not isinstance(text, str) or "\0" in text:
            raise ConfigError(f"{r.key('env')}.{key} = {text!r}: expected a variable name "
                              "and a string value")
        if key in VISIBILITY_VARIABLES:
            raise ConfigError(f"{r.key('env')}.{key}: the visibility variables are set by "
                              "the probe round itself (each probe is pointed at the GPUs it "
                              "may touch); leave them out")
        out[key] = text
    return out


def _runtime(name: str, r: Table) -> Runtime:
    require = _runtime_require(r)
    if name == OWN_RUNTIME:
        for key in ("python", "env"):
            if r.get(key) not in (None, {}):
                raise ConfigError(f"{r.key(key)}: [runtimes.{OWN_RUNTIME}] is the daemon's "
                                  "own environment (its interpreter and the unit's variables)"
                                  "; only its require may be set")
        r.finish()
        return Runtime(OWN_RUNTIME, require=require)
    python = r.get("python")
    if not isinstance(python, str) or not python:
        raise ConfigError(f"{r.key('python')} = {python!r}: expected the absolute path of the "
                          "job environment's interpreter, e.g. \"/opt/venvs/train/bin/python\"")
    problem = python_problem(python)
    if problem is not None:
        raise ConfigError(f"{r.key('python')}: {problem}")
    env = _runtime_env(r)
    user, identity = _runtime_user(r)
    r.finish()
    runtime = Runtime(name, python=python, env=env, require=require, user=user,
                      uid=identity[0] if identity else None,
                      gid=identity[1] if identity else None)
    # Defence in depth (docs/security.md): what the interpreter imports from is no more
    # another user's to write than the interpreter itself.
    trusted = frozenset({0} | ({identity[0]} if user is not None and identity else set()))
    found = import_path(runtime, trusted_uids=trusted)
    if found.problem is not None:
        raise ConfigError(f"runtimes.{name}: {found.problem}")
    return runtime


def _runtime_user(r: Table) -> tuple[str | None, tuple[int, int] | None]:
    """``user`` as written and the (uid, gid) the runtime's children run as (None: the
    daemon's own). A root daemon runs a runtime without ``user`` as nobody (65534)."""
    value = r.get("user")
    if value is None:
        if os.geteuid() != 0:
            return None, None  # cannot change identity unasked for: the daemon's own
        return None, (NOBODY, _nobody_gid())
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value or "\0" in value:
        raise ConfigError(f"{r.key('user')} = {value!r}: expected a user name or a uid, "
                          "e.g. user = \"train\"")
    try:
        identity = resolve_user(value)
    except ValueError as e:
        raise ConfigError(f"{r.key('user')} = {value!r}: {e}") from None
    if identity != (os.geteuid(), os.getegid()) and not can_change_identity():
        raise ConfigError(f"{r.key('user')} = {value!r}: this daemon (uid {os.geteuid()}) "
                          "cannot start children as another user: it needs root or "
                          "CAP_SETUID and CAP_SETGID (docs/security.md, \"Who can run code "
                          "where\")")
    return value, identity


def _nobody_gid() -> int:
    try:
        return resolve_user(str(NOBODY))[1]
    except ValueError:
        return NOBODY


def _runtimes(t: Table) -> tuple[Runtime, ...]:
    names = sorted(t.raw)
    if len(names) > MAX_RUNTIMES:
        raise ConfigError(f"runtimes: {len(names)} runtimes; at most {MAX_RUNTIMES}")
    runtimes: dict[str, Runtime] = {OWN_RUNTIME: Runtime(OWN_RUNTIME)}
    for name in names:
        if not RUNTIME_NAME.fullmatch(name):
            raise ConfigError(f"runtimes.{name}: a runtime's name is 1-32 of a-z, 0-9, "
                              "'_', '.', '-' (starting with a letter or digit)")
        runtimes[name] = _runtime(name, t.table(name))
    t.finish()
    return tuple(runtimes.values())


def _remediation(t: Table) -> RemediationConfig:
    # The platforms are registered at run time (daemon/actuators.py), not in core.
    platform = t.read("scheduler", Choice(actuator_names()), RemediationConfig.scheduler)
    return read_section(t, RemediationConfig, scheduler=platform)


def from_mapping(raw: Mapping[str, Any]) -> DaemonConfig:
    """Validate a parsed TOML document into a DaemonConfig."""
    top = Table(raw, "")
    listen = top.get("listen")
    host, port = (DEFAULT_HOST, DEFAULT_PORT) if listen is None else parse_listen(listen)
    placed: dict[str, Any] = {}
    for name in ("scheduler", "log"):  # DaemonConfig's own settings kept in these tables
        sub = top.table(name)
        placed |= read_fields(sub, DaemonConfig, name)
        sub.finish()
    return read_section(
        top, DaemonConfig, listen_host=host, listen_port=port,
        backends=_backends(top.table("backends")), xid=_xid(top.table("xid")),
        history=read_section(top.table("history"), HistoryConfig),
        nvml=read_section(top.table("nvml"), NvmlHealthPolicy),
        qualification=_qualification(top.table("qualification")),
        runtimes=_runtimes(top.table("runtimes")),
        remediation=_remediation(top.table("remediation")),
        jobs=read_section(top.table("jobs"), JobWatchPolicy),
        gpu_reset=read_section(top.table("gpu_reset"), GpuResetConfig), **placed)


def load_config(path: str | Path | None) -> DaemonConfig:
    """Read and validate a TOML config file; ``None`` gives the defaults."""
    if path is None:
        return DaemonConfig()
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on 3.10 only
        import tomli as tomllib  # type: ignore[import-not-found,unused-ignore]
    try:
        # A regular file, opened without blocking (a FIFO would hang --check-config and
        # SIGHUP) and read within MAX_CONFIG_BYTES (/dev/zero would exhaust memory).
        data, _ = read_regular(path, MAX_CONFIG_BYTES, follow=True)
        raw = tomllib.loads(data.decode("utf-8"))
    except RefusedFile as e:
        raise ConfigError(f"cannot read config {path}: {e}") from e
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config {path} is not valid TOML: {e}") from e
    except RecursionError as e:  # arrays or tables nested thousands deep
        raise ConfigError(f"config {path} is nested too deeply to be a gpudiag config (the "
                          "file has at most two levels of tables)") from e
    try:
        return from_mapping(raw)
    except ConfigError as e:
        raise ConfigError(f"config {path}: {e}") from e
