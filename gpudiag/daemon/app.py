"""The daemon's HTTP API: a plain WSGI app (tests call it without a socket) and a server.

Handlers read the latest snapshot; only /v1/preflight and /v1/health past max_age_s (or a
probe that never ran) wait for probes, and then on the scheduler's worker threads with a
bounded wait; the transport runs them (and /v1/history) on its slow pool. Every
error is ``{"error": {"code": ..., "message": ...}}``; bad input is a 4xx, never a 500.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any
from urllib.parse import parse_qsl

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gpudiag.core import registry
from gpudiag.core.ascii_ints import ascii_int
from gpudiag.core.limits import IREE_DRIVERS, MAX_DEVICES
from gpudiag.core.records import dataclass
from gpudiag.core.requirement import RequirementError, parse_requirement
from gpudiag.core.verdict import Requirement
from gpudiag.daemon.answers import EncodedAnswer
from gpudiag.daemon.envelope import error_response, json_response, status_line
from gpudiag.daemon.exporter import SnapshotCollector
from gpudiag.daemon.httpserver import MAX_BODY_BYTES as MAX_BODY_BYTES  # one limit, both layers
from gpudiag.daemon.httpserver import HttpServer
from gpudiag.daemon.httpserver import start as start_http
from gpudiag.daemon.part import Evidence, Handler, Route
from gpudiag.daemon.runtime_health import runtime_section
from gpudiag.daemon.scheduler import Scheduler, scheduled_options
from gpudiag.daemon.snapshot import ProbeKey, keys_for, proofs_for, verdict_for
from gpudiag.daemon.store import HistoryError, HistoryStore

log = logging.getLogger("gpudiag.daemon.app")

MAX_URL_BYTES = 4096
MAX_PARAMS = 16
HISTORY_MAX_LIMIT = 1000
PREFLIGHT_PARAMS = ("require", "devices", "min_devices", "min_free_memory", "max_age_s",
                    "wait_s", "cuda_visible_devices", "nvidia_visible_devices", "visibility",
                    "gpus", "fingerprint")
# The node-health question takes no GPU count and no memory floor: is anything broken?
HEALTH_PARAMS = ("require", "devices", "max_age_s", "wait_s", "cuda_visible_devices",
                 "nvidia_visible_devices", "visibility", "fingerprint")
# fingerprint=BACKEND:ID,...: the asker's environment per backend (engine/fingerprint.py).
_FINGERPRINT = re.compile(r"[a-z][a-z0-9_]{0,31}:[0-9a-f]{16}")
MAX_FINGERPRINT_BYTES = 512
StartResponse = Callable[..., Any]
# The endpoints whose answer may be at hand (a snapshot's cached, encoded verdict): the
# transport asks ``answer_now`` on its selector thread first, and runs on its pool only what
# needs a probe, a wait or a classification (docs/design-notes.md, "HTTP server").
NOW_PATHS = frozenset({"/v1/preflight", "/v1/health"})


class _NotNow(Exception):
    """The answer needs a probe, a wait or a classification: not on the selector thread."""


@dataclass(frozen=True)
class _Question:
    """A preflight or health question as its query string asks it (parsed once per query)."""

    requirement: Requirement
    keys: tuple[ProbeKey, ...]
    max_age: float | None
    wait: float
    visibility: tuple[str | None, str | None] | None
    # The asker's fingerprint ids per backend (None: it sent none, e.g. curl).
    fingerprint: tuple[tuple[str, str], ...] | None = None


@dataclass(frozen=True)
class ApiError(Exception):
    """An HTTP error answered with the JSON envelope."""

    status: int
    code: str
    message: str
    retry_after_s: float | None = None


def _seconds(params: Mapping[str, str], name: str, maximum: float) -> float | None:
    raw = params.get(name)
    if raw is None:
        return None
    try:
        # ASCII only: float() also takes Unicode digits ("٣"), which no client means.
        value = float(raw) if raw.isascii() else math.nan
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or value > maximum:
        raise ApiError(400, "bad_parameter",
                       f"{name}={raw!r} is not a number of seconds from 0 to {maximum:g}")
    return value


def _int(params: Mapping[str, str], name: str, lo: int, hi: int) -> int | None:
    raw = params.get(name)
    if raw is None:
        return None
    value = ascii_int(raw)
    if value is None or not lo <= value <= hi:
        raise ApiError(400, "bad_parameter", f"{name}={raw!r} is not an integer from {lo} "
                       f"to {hi} (ASCII digits)")
    return value


def _fingerprint(params: Mapping[str, str]) -> tuple[tuple[str, str], ...] | None:
    """``fingerprint=jax:ID,iree:ID`` as sorted (backend, id) pairs; 400 when malformed."""
    raw = params.get("fingerprint")
    if raw is None:
        return None
    parts = raw.split(",") if raw else []
    if len(raw) > MAX_FINGERPRINT_BYTES or not all(_FINGERPRINT.fullmatch(p) for p in parts):
        raise ApiError(400, "bad_fingerprint",
                       f"fingerprint={raw[:80]!r}: expected BACKEND:ID pairs, comma-separated "
                       f"(ID 16 hex digits; at most {MAX_FINGERPRINT_BYTES} bytes), as "
                       "`gpudiag fingerprint --query` prints them")
    pairs = dict(p.split(":", 1) for p in parts)
    if len(pairs) != len(parts):
        raise ApiError(400, "bad_fingerprint", f"fingerprint={raw[:80]!r} names a backend twice")
    return tuple(sorted(pairs.items()))


def only_params(params: Mapping[str, str], allowed: Iterable[str]) -> None:
    """400 for a parameter the endpoint does not take."""
    allowed = tuple(allowed)
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ApiError(400, "unknown_parameter",
                       f"unknown parameter(s) {', '.join(unknown)}; accepted: "
                       f"{', '.join(allowed) or 'none'}")


def _flag(params: Mapping[str, str], name: str) -> bool:
    raw = params.get(name)
    if raw is None:
        return False
    if raw.lower() in ("1", "true", "yes"):
        return True
    if raw.lower() in ("0", "false", "no", ""):
        return False
    raise ApiError(400, "bad_parameter", f"{name}={raw!r}: accepted 1/0, true/false")


# IREE drivers a request over HTTP may name: the one rule of core.limits, as for the CLI.
HTTP_IREE_DRIVERS = IREE_DRIVERS


def _check_http_keys(keys: Iterable[ProbeKey]) -> None:
    """400 for probe options an HTTP caller may not invent (unknown or repeated drivers)."""
    for key in keys:
        if key.backend != "iree":
            continue
        drivers = list((key.options_dict() or {}).get("drivers") or [])
        bad = [d for d in drivers if d not in HTTP_IREE_DRIVERS]
        if bad or len(set(drivers)) != len(drivers):
            raise ApiError(400, "bad_requirement",
                           f"IREE drivers {drivers!r}: over HTTP each of "
                           f"{', '.join(HTTP_IREE_DRIVERS)} at most once")


@dataclass(frozen=True)
class ProbeRateLimit:
    """How often clients may make the daemon start a probe (per backend): a token bucket.

    Only runs that a request starts count (POST /v1/probe, and /v1/preflight past
    max_age_s); joining a run in flight and the scheduled runs are free.
    """

    burst: int = 10
    refill_s: float = 2.0


class ProbeBuckets:
    """Token buckets per backend for on-demand probe runs."""

    def __init__(self, limit: ProbeRateLimit, clock: Callable[[], float]) -> None:
        self.limit = limit
        self._clock = clock
        self._lock = threading.Lock()
        self._tokens: dict[str, tuple[float, float]] = {}  # backend -> (tokens, at)

    def take(self, backends: Iterable[str]) -> float:
        """Take one token for each backend, all or none; 0.0, or seconds until possible."""
        now = self._clock()
        names = list(dict.fromkeys(backends))
        with self._lock:
            levels = {}
            for name in names:
                tokens, at = self._tokens.get(name, (float(self.limit.burst), now))
                levels[name] = min(float(self.limit.burst),
                                   tokens + (now - at) / self.limit.refill_s)
            short = [n for n in names if levels[n] < 1.0]
            if short:
                return max((1.0 - levels[n]) * self.limit.refill_s for n in short)
            for name in names:
                self._tokens[name] = (levels[name] - 1.0, now)
            return 0.0


class DaemonApp:
    """The WSGI application of ``gpudiag serve``."""

    def __init__(self, scheduler: Scheduler, store: HistoryStore | None = None, *,
                 probe_limit: ProbeRateLimit | None = None,
                 history_error: Callable[[], str | None] | None = None) -> None:
        self.scheduler = scheduler
        self.store = store
        # A part's object in /v1/health's evidence, by name: (version, object); the version
        # moves when the object does (e.g. "runs": the job watch, daemon/job_watch.py).
        self.health_evidence: dict[str, Evidence] = {}
        # Why the daemon's history is not open (e.g. the disk was full at start); None: it
        # keeps none at all. /v1/history says which, and why.
        self.history_error = history_error
        self.probe_limit = probe_limit or ProbeRateLimit()
        self._buckets = ProbeBuckets(self.probe_limit, scheduler.clock.monotonic)
        # Answers per (snapshot, requirement, visibility), classified and encoded once: a
        # snapshot never changes.
        # The last element: the health evidence's versions (node health only; () otherwise).
        self._cache: dict[tuple[int, Requirement, tuple[str | None, str | None] | None,
                                tuple[tuple[str, str], ...] | None, tuple[int, ...]],
                          EncodedAnswer] = {}
        self._metrics_cache: tuple[tuple[int, int], bytes] | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SnapshotCollector(scheduler.snapshot, wall=scheduler.clock.time))
        # Questions per (path, query) of the config they were parsed under: parsing is pure,
        # and a job runner asks the same few questions over and over.
        self._asking: dict[str, Callable[[Mapping[str, str]], _Question]] = {
            "/v1/preflight": self._preflight_question, "/v1/health": self._health_question}
        self._questions: tuple[object, dict[tuple[str, str], _Question]] = (None, {})
        # None: a question (self._asking), answered by _answer. The parts add theirs
        # (add_route: e.g. POST /v1/qualify, /v1/runs/begin).
        self._routes: dict[str, tuple[tuple[str, ...], Handler | None]] = {
            "/metrics": (("GET", "HEAD"), _params_only(self._metrics)),
            "/v1/preflight": (("GET",), None),
            "/v1/health": (("GET",), None),
            "/v1/probe": (("POST",), _params_only(self._probe)),
            "/v1/history": (("GET",), _params_only(self._history)),
            "/healthz": (("GET", "HEAD"), _params_only(self._healthz)),
            "/readyz": (("GET", "HEAD"), _params_only(self._readyz)),
        }

    def add_route(self, path: str, route: Route) -> None:
        """Serve a part's endpoint (before the listeners start)."""
        if path in self._routes:
            raise ValueError(f"two handlers for {path}")
        self._routes[path] = (route.methods, route.handler)

    def __call__(self, environ: Mapping[str, Any], start_response: StartResponse
                 ) -> Iterable[bytes]:
        answer = self._respond(environ, start_response, at_hand=False)
        assert answer is not None  # only answer_now may decline
        return answer

    def answer_now(self, environ: Mapping[str, Any], start_response: StartResponse
                   ) -> Iterable[bytes] | None:
        """The same answer as ``__call__`` when nothing stands between (no probe to start or
        wait for, the verdict classified and encoded already), else None: ask ``__call__``.

        The transport calls this on its selector thread; it never takes a lock a probe holds.
        """
        if environ.get("PATH_INFO") not in NOW_PATHS:
            return None
        return self._respond(environ, start_response, at_hand=True)

    def _respond(self, environ: Mapping[str, Any], start_response: StartResponse,
                 at_hand: bool) -> Iterable[bytes] | None:
        started = time.perf_counter()
        try:
            status, headers, body = self._dispatch(environ, at_hand)
        except _NotNow:
            return None
        except ApiError as e:
            status, headers, body = error_response(e.status, e.code, e.message,
                                                   e.retry_after_s)
        except Exception:  # a bug of ours: still the envelope, never a traceback page
            log.exception("request failed: %s %s", environ.get("REQUEST_METHOD"),
                          environ.get("PATH_INFO"))
            status, headers, body = error_response(
                500, "internal", "gpudiag failed to answer; see the daemon log")
        # How long the daemon itself took, apart from the network and the client.
        headers.append(("Server-Timing",
                        f"app;dur={(time.perf_counter() - started) * 1000:.2f}"))
        start_response(status, headers)
        return [b"" if environ.get("REQUEST_METHOD") == "HEAD" else body]

    def _dispatch(self, environ: Mapping[str, Any], at_hand: bool = False
                  ) -> tuple[str, list[tuple[str, str]], bytes]:
        path = str(environ.get("PATH_INFO") or "/")
        query = str(environ.get("QUERY_STRING") or "")
        method = str(environ.get("REQUEST_METHOD") or "GET")
        if len(path) + len(query) > MAX_URL_BYTES:
            raise ApiError(414, "uri_too_long",
                           f"the URL is {len(path) + len(query)} bytes; the limit is "
                           f"{MAX_URL_BYTES}")
        length_text = str(environ.get("CONTENT_LENGTH") or "0").strip() or "0"
        length = ascii_int(length_text)
        if length is None:
            raise ApiError(400, "bad_request", f"Content-Length {length_text!r} is not a number")
        if length > MAX_BODY_BYTES:
            raise ApiError(413, "body_too_large",
                           f"a {length_text} byte body; the limit is {MAX_BODY_BYTES} "
                           "(parameters go in the query string)")
        route = self._routes.get(path)
        if route is None:
            raise ApiError(404, "not_found", f"no endpoint {path!r}; endpoints: "
                           f"{', '.join(self._routes)}")
        methods, handler = route
        if method not in methods:
            raise ApiError(405, "method_not_allowed",
                           f"{method} {path}: accepted {', '.join(methods)}")
        if handler is None:
            status, payload = self._answer(self._question(path, query), at_hand)
        else:
            status, payload = handler(self._params(query), environ)
        if path == "/metrics":
            data = payload
            return status_line(200), [("Content-Type", CONTENT_TYPE_LATEST),
                              ("Content-Length", str(len(data)))], data
        return json_response(status, payload)

    def _params(self, query: str) -> dict[str, str]:
        try:
            pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=False,
                              max_num_fields=MAX_PARAMS)
        except ValueError:
            raise ApiError(400, "too_many_parameters",
                           f"more than {MAX_PARAMS} query parameters") from None
        params: dict[str, str] = {}
        for k, v in pairs:
            if k in params:
                raise ApiError(400, "bad_parameter", f"parameter {k!r} is given twice")
            params[k] = v
        return params

    _only = staticmethod(only_params)

    # -- handlers -----------------------------------------------------------------------
    def _metrics(self, params: Mapping[str, str]) -> tuple[int, Any]:
        self._only(params, ())
        # Rendered at most once per snapshot and second: a snapshot never changes, and the
        # only time-derived series (snapshot age, watcher gap) move in whole seconds anyway.
        key = (self.scheduler.snapshot().seq, int(self.scheduler.clock.time()))
        cached = self._metrics_cache
        if cached is not None and cached[0] == key:
            return 200, cached[1]
        text = generate_latest(self.registry)
        self._metrics_cache = (key, text)
        return 200, text

    def _question(self, path: str, query: str) -> _Question:
        """The question ``path?query`` asks, parsed once per config; ApiError when it is bad."""
        cfg, questions = self._questions
        if cfg is not self.scheduler.config:  # reloaded: defaults may have changed
            cfg, questions = self._questions = (self.scheduler.config, {})
        question = questions.get((path, query))
        if question is None:
            question = self._asking[path](self._params(query))
            if len(questions) >= 256:
                questions.clear()
            questions[(path, query)] = question
        return question

    def _preflight_question(self, params: Mapping[str, str]) -> _Question:
        self._only(params, PREFLIGHT_PARAMS)
        cfg = self.scheduler.config
        min_devices = _int(params, "min_devices", 0, MAX_DEVICES)
        gpus = _int(params, "gpus", 1, MAX_DEVICES)
        try:
            requirement = parse_requirement(
                params.get("require", cfg.default_requirement),
                devices=params.get("devices"), min_devices=min_devices,
                min_free_memory=params.get("min_free_memory"), gpus=gpus)
        except RequirementError as e:
            raise ApiError(400, "bad_requirement", str(e)) from e
        return self._asked(requirement, params)

    def _health_question(self, params: Mapping[str, str]) -> _Question:
        """The node-health question: is anything on this node broken? 200 either way."""
        self._only(params, HEALTH_PARAMS)
        try:
            requirement = parse_requirement(
                params.get("require", self.scheduler.config.default_requirement),
                devices=params.get("devices"), node_health=True)
        except RequirementError as e:
            raise ApiError(400, "bad_requirement", str(e)) from e
        return self._asked(requirement, params)

    def _asked(self, requirement: Requirement, params: Mapping[str, str]) -> _Question:
        """The rest of a question: how fresh, how long to wait, whose visibility."""
        cfg = self.scheduler.config
        max_age = _seconds(params, "max_age_s", 86400.0)
        wait = _seconds(params, "wait_s", cfg.preflight_wait_s)
        wait = cfg.preflight_wait_s if wait is None else wait
        visibility = None
        if _flag(params, "visibility"):
            visibility = (params.get("cuda_visible_devices"),
                          params.get("nvidia_visible_devices"))
        keys = keys_for(requirement)
        _check_http_keys(keys)
        return _Question(requirement, keys, max_age, wait, visibility, _fingerprint(params))

    def _answer(self, question: _Question, at_hand: bool = False) -> tuple[int, Any]:
        """The verdict's answer; ``at_hand``: _NotNow unless it is at hand without any wait."""
        requirement, max_age = question.requirement, question.max_age
        wait, visibility = question.wait, question.visibility
        fingerprint = None if question.fingerprint is None else dict(question.fingerprint)
        # Which runtime's results answer the environment-dependent backends (or none: the
        # asker proves them itself), as the snapshot's runtimes say.
        proofs = proofs_for(self.scheduler.snapshot(), requirement, fingerprint, question.keys)
        keys = proofs.keys
        results = self.scheduler.snapshot().results
        now_wall = self.scheduler.clock.time()
        # A run this request would start (result missing, or older than max_age_s) is
        # on-demand work: rate-limited per backend.
        stale = [k for k in keys if k not in results or (
            max_age is not None and now_wall - results[k].started_wall > max_age)]
        if at_hand:
            if stale:
                raise _NotNow
            fresh = True  # what ensure_fresh answers when nothing is stale
        else:
            try:
                self._limit(stale, "max_age_s" if max_age is not None else "GET /v1/preflight")
            except ApiError:
                if any(k not in results for k in keys):
                    raise
                # Past the budget with results at hand: the snapshot's verdict, marked
                # "fresh": false with its age_s, as when the probes outrun wait_s.
                fresh = False
            else:
                fresh = self.scheduler.ensure_fresh(keys, max_age, wait)
        snap = self.scheduler.snapshot()
        now = self.scheduler.clock.time()
        parts = {name: source() for name, source in self.health_evidence.items()} \
            if requirement.node_health else {}
        cache_key = (snap.seq, requirement, visibility, question.fingerprint,
                     tuple(v for v, _ in parts.values()))
        answer = self._cache.get(cache_key)
        if answer is None:
            if at_hand:  # classifying and encoding takes milliseconds: the pool does it
                raise _NotNow
            verdict = verdict_for(snap, requirement, now_wall=now,
                                  policy=self.scheduler.policy, visibility=visibility,
                                  proofs=proofs_for(snap, requirement, fingerprint,
                                                    question.keys))
            if verdict is None:
                missing = [k.backend for k in keys if k not in snap.results]
                raise ApiError(503, "not_ready",
                               f"no result yet for {', '.join(missing)}; probes still running "
                               f"after {wait:g} s (retry, or raise wait_s)")
            if requirement.node_health and snap.full is not None:
                # What nobody configured is said on every node-health answer, with how.
                unchecked = [w for w in snap.full.warnings if w.code == "backend_not_checked"
                             and w not in verdict.warnings]
                verdict = replace(verdict, warnings=(*verdict.warnings, *unchecked))
                # Each runtime's promise, reported as its own (never the node's blockers).
                section = runtime_section(snap)
                if section:
                    verdict = replace(verdict, evidence={**verdict.evidence,
                                                         "runtimes": section})
            if parts:
                verdict = replace(verdict, evidence={**verdict.evidence, **{
                    name: shown for name, (_, shown) in parts.items()}})
            answer = EncodedAnswer.of(verdict, "daemon")
            if len(self._cache) >= 256:
                self._cache.clear()
            self._cache[cache_key] = answer
        # Classified and encoded once per snapshot; only the age and freshness move on.
        oldest = min((snap.results[k].started_wall for k in keys if k in snap.results),
                     default=now)
        return 200, answer.body(max(0.0, now - oldest), fresh)

    def _probe(self, params: Mapping[str, str]) -> tuple[int, Any]:
        self._only(params, ("backend",))
        enabled = self.scheduler.config.enabled_backends
        text = params.get("backend")
        names = [n.strip().lower() for n in text.split(",")] if text else list(enabled)
        bad = [n for n in names if n not in registry.probe_names()]
        if not names or bad:
            raise ApiError(400, "bad_backend", f"backend={text!r}: unknown {', '.join(bad)}; "
                           f"accepted: a comma list of {', '.join(registry.probe_names())}")
        keys = [ProbeKey.of(n, scheduled_options(n)) for n in dict.fromkeys(names)]
        self._limit(keys, "POST /v1/probe")
        self.scheduler.trigger(keys)
        return 202, {"accepted": [k.backend for k in keys],
                     "status": "running; GET /v1/preflight or /metrics for the result"}

    def _limit(self, keys: Iterable[ProbeKey], what: str) -> None:
        """429 when the keys that would start a run have used up their on-demand budget."""
        starting = [k.backend for k in keys if not self.scheduler.running(k)]
        if not starting:
            return
        retry = self._buckets.take(starting)
        if retry > 0:
            lim = self.probe_limit
            raise ApiError(429, "rate_limited",
                           f"{what}: on-demand runs of {', '.join(starting)} are limited to "
                           f"{lim.burst} at once and then one per {lim.refill_s:g} s per "
                           f"backend; retry in {retry:.1f} s (the scheduled results stay "
                           "available without max_age_s)", retry_after_s=retry)

    def _history(self, params: Mapping[str, str]) -> tuple[int, Any]:
        self._only(params, ("limit", "blocked", "since_s"))
        limit = _int(params, "limit", 1, HISTORY_MAX_LIMIT) or 50
        blocked = _flag(params, "blocked")
        since_s = _seconds(params, "since_s", 3650 * 86400.0)
        if self.store is None:
            if self.history_error is not None:
                raise ApiError(503, "history_unavailable",
                               "the history could not be opened: "
                               f"{self.history_error() or 'not opened yet'}; verdict changes "
                               "are kept in memory and written once it opens (retried every "
                               "second while changes wait)")
            raise ApiError(503, "no_history", "this daemon keeps no history (no --state-dir)")
        since = None if since_s is None else self.scheduler.clock.time() - since_s
        try:
            entries = self.store.verdicts(since=since, blocked=blocked, limit=limit)
            episodes = self.store.episodes(since=since, limit=limit)
            clears = self.store.clears(since=since, limit=limit)
            xids = self.store.xids(since=since, limit=limit)
            incidents = self.store.incidents(since=since, limit=limit)
            resets = self.store.resets(since=since, limit=limit)
        except HistoryError as e:
            raise ApiError(503, "history_unavailable", str(e)) from e
        return 200, {"verdicts": [e.record() for e in entries],
                     "episodes": [e.record() for e in episodes],
                     "clears": [c.record() for c in clears],
                     "xids": [x.record() for x in xids],
                     "incidents": [i.record() for i in incidents],
                     "resets": [r.record() for r in resets]}

    def _healthz(self, params: Mapping[str, str]) -> tuple[int, Any]:
        self._only(params, ())
        if not self.scheduler.alive():
            raise ApiError(503, "loop_stalled", "the scheduler loop has not run recently")
        return 200, {"status": "ok"}

    def _readyz(self, params: Mapping[str, str]) -> tuple[int, Any]:
        self._only(params, ())
        snap = self.scheduler.snapshot()
        if not snap.round_complete:
            pending = [k.backend for k in snap.scheduled if k not in snap.results]
            raise ApiError(503, "first_round_pending",
                           f"waiting for the first run of {', '.join(pending)}")
        return 200, {"status": "ready", "seq": snap.seq}


def _params_only(handler: Callable[[Mapping[str, str]], tuple[int, Any]]) -> Handler:
    """A handler that needs the query's parameters alone."""
    def handle(params: Mapping[str, str], environ: Mapping[str, Any]) -> tuple[int, Any]:
        return handler(params)
    return handle


def serve(app: DaemonApp, host: str, port: int, **options: Any
          ) -> tuple[HttpServer, threading.Thread]:
    """Bind ``host:port`` and serve in a background thread; returns the server and thread.

    The transport (gpudiag.daemon.httpserver) reads request heads on one selector thread and runs
    complete requests on bounded worker pools: slow or abusive clients cannot exhaust threads.
    """
    return start_http(app, host, port, **options)
