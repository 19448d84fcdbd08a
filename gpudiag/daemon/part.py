"""A daemon part: one feature the daemon carries, and what the core gives it.

The daemon is a small core (config, state dir, history, XID watcher, scheduler, HTTP app,
listeners: daemon/service.py) and a list of parts (daemon/parts/__init__.py, read the way the
backend registry is). The core names no part: it builds each one in list order with a
``PartContext``, registers what the part declares (its collectors, HTTP routes, /v1/health
evidence and the events it listens to), starts the parts after the scheduler and stops them in
reverse order (docs/design-notes.md, "Daemon parts").

A part declares:
- ``name`` and ``section``: its name, and the key of its frozen config dataclass in
  ``DaemonConfig`` (validated by daemon/config.py as before; None: it has none of its own),
  ``config_keys`` the top-level keys it reads besides, ``metrics`` its metric families;
- ``build(context)``: make its objects (the config may leave it off: then it declares nothing);
- ``start()`` / ``stop(deadline)``: its threads; ``stop`` is safe before ``start`` and
  returns by ``deadline`` (time.monotonic());
- ``listens()``: snapshots, XIDs, clears, ticks;
- ``collectors()``, ``routes()``, ``evidence()``: /metrics, HTTP, /v1/health.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from gpudiag.core.limits import EXIT_FAILED, EXIT_USAGE
from gpudiag.core.records import dataclass

log = logging.getLogger("gpudiag.daemon")

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from gpudiag.core.findings import XidEvent
    from gpudiag.daemon.config import DaemonConfig
    from gpudiag.daemon.recorder import HistoryRecorder, RecorderThread
    from gpudiag.daemon.scheduler import Scheduler
    from gpudiag.daemon.snapshot import Snapshot
    from gpudiag.daemon.store import HistoryStore
    from gpudiag.daemon.watcher import XidWatcher

# An HTTP route's handler: the query's parameters and the WSGI environ (peer credentials,
# body) -> (status, JSON payload); it raises daemon.app.ApiError for a 4xx/5xx envelope.
Handler = Callable[[Mapping[str, str], Mapping[str, Any]], tuple[int, Any]]
# /v1/health evidence: (version, object); the version moves when the object does.
Evidence = Callable[[], tuple[int, dict[str, Any]]]


class StartError(Exception):
    """The daemon cannot start; ``exit_code`` is what ``gpudiag serve`` exits with."""

    exit_code = EXIT_FAILED


class ConfigUnusable(StartError):
    """A part's config section cannot be acted on (a usage error, like a bad config)."""

    exit_code = EXIT_USAGE


@dataclass(frozen=True)
class Cleared:
    """An applied ``gpudiag clear`` (or the daemon's own, after a reboot healed a hold)."""

    gpu: str | None        # None: every GPU
    at_wall: float         # up to when the XIDs were released
    no_repair: bool        # nothing was repaired: what it cleared was a false blocker
    by_person: bool


@dataclass(frozen=True)
class Route:
    """One HTTP endpoint a part serves."""

    methods: tuple[str, ...]
    handler: Handler


@dataclass(frozen=True)
class Listens:
    """The core's events a part takes; None: not this one."""

    snapshots: Callable[[Snapshot], None] | None = None
    xids: Callable[[XidEvent], object] | None = None
    # Each applied clear; what it returns (the codes it cleared) is kept with the clear.
    clears: Callable[[Cleared], Sequence[str]] | None = None
    ticks: Callable[[], object] | None = None  # the scheduler's tick (inboxes)


class Part(Protocol):
    """One feature of the daemon (see the module docstring)."""

    @property
    def name(self) -> str: ...

    @property
    def section(self) -> str | None: ...

    @property
    def config_keys(self) -> tuple[str, ...]: ...

    @property
    def metrics(self) -> tuple[str, ...]: ...

    def build(self, context: PartContext) -> None: ...

    def start(self) -> None: ...

    def stop(self, deadline: float) -> None: ...

    def listens(self) -> Listens: ...

    def collectors(self) -> Sequence[Collector]: ...

    def routes(self) -> Mapping[str, Route]: ...

    def evidence(self) -> Mapping[str, Evidence]: ...


class BasePart:
    """A part that declares nothing: subclasses override what they have."""

    name = ""
    section: str | None = None
    # Top-level config keys it reads besides its section (e.g. nfd_features_file).
    config_keys: tuple[str, ...] = ()
    # The metric families its collectors render (docs/reference.md documents each).
    metrics: tuple[str, ...] = ()

    def build(self, context: PartContext) -> None:
        """Make the part's objects from the context."""

    def start(self) -> None:
        """Start the part's threads."""

    def stop(self, deadline: float) -> None:
        """Stop them by ``deadline`` (safe before ``start``)."""

    def listens(self) -> Listens:
        """The events it takes."""
        return Listens()

    def collectors(self) -> Sequence[Collector]:
        """Its /metrics collectors."""
        return ()

    def routes(self) -> Mapping[str, Route]:
        """Its HTTP endpoints."""
        return {}

    def evidence(self) -> Mapping[str, Evidence]:
        """Its objects in /v1/health's evidence."""
        return {}


P = TypeVar("P")


@dataclass
class PartContext:
    """What the core built before the parts, and the parts built so far (in list order)."""

    cfg: DaemonConfig
    state_dir: Path
    env: Mapping[str, str]
    scheduler: Scheduler
    watcher: XidWatcher
    recorder: HistoryRecorder
    writer: RecorderThread
    lock_dir: Path
    # Announces an applied clear to every part that listens to clears (the core's fan-out,
    # complete once every part is built); the codes they cleared.
    announce_clear: Callable[[Cleared], list[str]] = lambda cleared: []
    built: list[Part] = field(default_factory=list)

    def store(self) -> HistoryStore | None:
        """The history as it is now (it may open late): None while it cannot be written."""
        return self.recorder.history_store()

    def part(self, kind: type[P]) -> P:
        """The built part of class ``kind`` (built earlier in the list: a programming error
        otherwise)."""
        for part in self.built:
            if isinstance(part, kind):
                return part
        raise LookupError(f"part {kind.__name__} is not built before this one")


def each_logged(calls: Sequence[Callable[[], object]]) -> None:
    """Call each in turn; one that fails is logged and the others still run."""
    for call in calls:  # e.g. one failing inbox must not stop the other
        try:
            call()
        except Exception:  # a bug of ours: said, and the loop goes on
            log.exception("polling %s failed", getattr(call, "__qualname__", call))
