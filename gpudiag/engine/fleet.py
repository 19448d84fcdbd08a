"""The fleet question, answered from Prometheus: which nodes can run this requirement now?

Reads the daemons' own metrics (gpudiag_backend_ready, gpudiag_gpu_healthy,
gpudiag_gpu_occupancy, gpudiag_blocker, gpudiag_backend_last_proven_timestamp_seconds) through
Prometheus's HTTP query API with the standard library's HTTP client only. A node whose daemon
stopped answering (scrape down, stale or absent series, or older than ``max_age_s``) is
unknown: never ready.
"""

from __future__ import annotations

import base64
import json
import math
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import field
from pathlib import Path
from typing import Any

from gpudiag.core import registry
from gpudiag.core.catalog import layer_rank
from gpudiag.core.records import dataclass

# A job needs at least this many GPUs by default; cuda is the default requirement.
DEFAULT_JOB = "gpudiag"
DEFAULT_MAX_AGE_S = 120.0
# Nodes Prometheus scraped within this window are listed (a node gone longer is forgotten).
DEFAULT_WINDOW_S = 3600.0


class PrometheusError(Exception):
    """Prometheus could not be asked, or answered something that is not a query result."""


class FleetUsageError(ValueError):
    """A fleet question that cannot be asked as given (bad URL, token file, backend)."""


@dataclass(frozen=True)
class PrometheusAccess:
    """Where Prometheus is and how to reach it: basic auth or a bearer token, TLS, timeout."""

    url: str
    username: str | None = None
    password: str | None = None
    bearer_token: str | None = None
    ca_file: str | None = None
    verify_tls: bool = True
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise FleetUsageError(
                f"--prometheus {self.url!r} is not an http(s) URL: give e.g. "
                "http://prometheus.example:9090")
        if self.bearer_token is not None and self.username is not None:
            raise FleetUsageError("give either basic auth or a bearer token, not both")
        if self.timeout_s <= 0:
            raise FleetUsageError(f"timeout must be positive, got {self.timeout_s}")

    @staticmethod
    def read_token(path: str) -> str:
        """The bearer token in ``path`` (surrounding whitespace removed)."""
        try:
            token = Path(path).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise FleetUsageError(f"cannot read the bearer token file {path}: {e}") from e
        if not token:
            raise FleetUsageError(f"the bearer token file {path} is empty")
        return token


@dataclass(frozen=True)
class FleetQuery:
    """The question: requirement backends, GPUs needed, scrape job, how old is too old."""

    backends: tuple[str, ...] = ("cuda",)
    gpus: int = 1
    job: str = DEFAULT_JOB
    max_age_s: float = DEFAULT_MAX_AGE_S
    window_s: float = DEFAULT_WINDOW_S
    # Count only GPUs whose qualification passed within this many seconds (docs/qualify.md).
    qualified_within_s: float | None = None

    def __post_init__(self) -> None:
        known = registry.published()
        unknown = [b for b in self.backends if b not in known]
        if unknown or not self.backends:
            raise FleetUsageError(
                f"the fleet knows the backends {', '.join(known)}; got "
                f"{', '.join(unknown) or 'none'}")
        if self.gpus < 1:
            raise FleetUsageError(f"--gpus must be at least 1, got {self.gpus}")
        if self.max_age_s <= 0:
            raise FleetUsageError(f"--max-age must be positive, got {self.max_age_s}")
        if self.qualified_within_s is not None and not self.qualified_within_s >= 1:
            raise FleetUsageError(f"--qualified must be at least 1 second, got "
                                  f"{self.qualified_within_s}")
        if not self.job or '"' in self.job or "\\" in self.job:
            raise FleetUsageError(f"--job {self.job!r}: give the scrape job's plain name")

    def record(self) -> dict[str, Any]:
        return {"require": ",".join(self.backends), "gpus": self.gpus, "job": self.job,
                "max_age_s": self.max_age_s,
                **({} if self.qualified_within_s is None
                   else {"qualified_within_s": self.qualified_within_s})}


@dataclass(frozen=True)
class NodeAnswer:
    """One node's answer; ``state`` is ready, blocked or unknown (never ready)."""

    instance: str
    state: str
    gpus_ready_free: int | None
    gpu_validation_blocker: str | None
    age_s: float | None
    reason: str

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def record(self) -> dict[str, Any]:
        return {"instance": self.instance, "ready": self.ready, "state": self.state,
                "gpus_ready_free": self.gpus_ready_free,
                "gpu_validation_blocker": self.gpu_validation_blocker,
                "age_s": self.age_s, "reason": self.reason}


@dataclass(frozen=True)
class FleetAnswer:
    """Every node Prometheus knows for the job, ready ones first."""

    query: FleetQuery
    prometheus: str
    evaluated_at: float | None  # None: Prometheus gave no usable time
    nodes: tuple[NodeAnswer, ...] = field(default_factory=tuple)

    @property
    def any_ready(self) -> bool:
        return any(n.ready for n in self.nodes)

    def record(self) -> dict[str, Any]:
        return {"query": {**self.query.record(), "prometheus": self.prometheus,
                          "evaluated_at": self.evaluated_at},
                "nodes": [n.record() for n in self.nodes]}


Sample = tuple[Mapping[str, str], float]


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urllib.parse.urlsplit(url)
    default = {"http": 80, "https": 443}.get(parts.scheme)
    try:
        port = parts.port or default
    except ValueError:
        port = None
    return parts.scheme, (parts.hostname or "").lower(), port


class _SameOriginCredentials(urllib.request.HTTPRedirectHandler):
    """Follows redirects, but the credentials only to the origin they were given for.

    urllib copies every header (Authorization included) onto the redirected request: a 302
    from Prometheus (or from whoever answers in its place) to another host would receive the
    bearer token or the basic-auth password.
    """

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str,
                         headers: Any, newurl: str) -> urllib.request.Request | None:
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and _origin(newurl) != _origin(req.full_url):
            for name in list(new.headers):
                if name.lower() in ("authorization", "proxy-authorization", "cookie"):
                    del new.headers[name]
        return new


def open_without_leaks(request: urllib.request.Request, *, timeout: float,
                       context: ssl.SSLContext | None) -> Any:
    """urlopen whose redirects never carry credentials to another origin."""
    handlers: list[urllib.request.BaseHandler] = [_SameOriginCredentials()]
    if context is not None:
        handlers.append(urllib.request.HTTPSHandler(context=context))
    return urllib.request.build_opener(*handlers).open(request, timeout=timeout)


class PrometheusClient:
    """Instant queries against ``/api/v1/query``; every failure becomes PrometheusError."""

    def __init__(self, access: PrometheusAccess,
                 opener: Callable[..., Any] = open_without_leaks) -> None:
        self._access = access
        self._open = opener
        self._context: ssl.SSLContext | None = None
        if access.url.startswith("https"):
            try:
                ctx = ssl.create_default_context(cafile=access.ca_file)
            except (OSError, ssl.SSLError) as e:
                raise FleetUsageError(f"--ca-file {access.ca_file}: cannot load it as a CA "
                                      f"bundle: {e}") from e
            if not access.verify_tls:
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            self._context = ctx

    def query(self, expr: str, at: float | None = None) -> list[Sample]:
        """The instant vector ``expr`` evaluates to (at ``at``, default now)."""
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        url = self._access.url.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode(params)
        request = urllib.request.Request(url, headers=self._headers())
        where = self._access.url
        try:
            with self._open(request, timeout=self._access.timeout_s,
                            context=self._context) as resp:
                body = resp.read()
        except urllib.error.HTTPError as e:
            detail = _error_text(e.read())
            hint = " (check --user/--password-file or --bearer-token-file)" \
                if e.code in (401, 403) else ""
            raise PrometheusError(f"Prometheus at {where} answered HTTP {e.code}"
                                  f"{hint}: {detail}") from e
        except (urllib.error.URLError, OSError, ssl.SSLError) as e:
            reason = getattr(e, "reason", e)
            raise PrometheusError(f"cannot reach Prometheus at {where}: {reason}") from e
        try:
            answer = json.loads(body)
            if answer.get("status") != "success":
                raise PrometheusError(f"Prometheus at {where} refused the query {expr!r}: "
                                      f"{answer.get('error', answer)}")
            data = answer["data"]
            if data["resultType"] != "vector":
                raise PrometheusError(f"Prometheus at {where} answered a {data['resultType']}"
                                      f" for {expr!r}, expected a vector")
            return [(dict(r["metric"]), float(r["value"][1])) for r in data["result"]]
        except (ValueError, KeyError, TypeError, AttributeError, IndexError,
                RecursionError) as e:
            raise PrometheusError(f"{where} did not answer like Prometheus's query API "
                                  f"({type(e).__name__}: {e}); is the URL right?") from e

    def _headers(self) -> dict[str, str]:
        a = self._access
        headers = {"Accept": "application/json"}
        if a.bearer_token is not None:
            headers["Authorization"] = f"Bearer {a.bearer_token}"
        elif a.username is not None:
            raw = f"{a.username}:{a.password or ''}".encode()
            headers["Authorization"] = "Basic " + base64.b64encode(raw).decode()
        return headers


def _error_text(body: bytes) -> str:
    try:
        return str(json.loads(body).get("error") or body[:200].decode(errors="replace"))
    except (ValueError, AttributeError):
        return body[:200].decode(errors="replace").strip() or "(no body)"


def fleet_queries(q: FleetQuery) -> dict[str, str]:
    """The PromQL the answer is built from (docs/fleet.md shows the same)."""
    job = f'job="{q.job}"'
    backends = "|".join(q.backends)
    return {
        "seen": f"last_over_time(up{{{job}}}[{int(q.window_s)}s])",
        "up": f"up{{{job}}}",
        "scraped": f"timestamp(gpudiag_ready{{{job}}})",
        "backend_ready": f'gpudiag_backend_ready{{{job},backend=~"{backends}"}}',
        "free": (f"count by (instance) ((gpudiag_gpu_healthy{{{job}}} == 1) and on "
                 f"(instance, uuid) (gpudiag_gpu_occupancy{{{job},state=\"free\"}} == 1))"),
        "busy": f'count by (instance) (gpudiag_gpu_occupancy{{{job},state="busy"}} == 1)',
        "blockers": f"gpudiag_blocker{{{job}}} == 1",
        "proven": (f'gpudiag_backend_last_proven_timestamp_seconds{{{job},'
                   f'backend=~"{backends}"}}'),
        "now": "vector(time())",
        **({} if q.qualified_within_s is None else {"qualified": (
            f"count by (instance) ((gpudiag_gpu_healthy{{{job}}} == 1) and on (instance, uuid) "
            f"(gpudiag_gpu_occupancy{{{job},state=\"free\"}} == 1) and on (instance, uuid) "
            f"(gpudiag_gpu_qualification_outcome{{{job},code=\"none\"}} == 1) and on "
            f"(instance, uuid) ((time() - gpudiag_gpu_qualification_last_timestamp_seconds"
            f"{{{job}}}) <= {q.qualified_within_s:g}))")}),
    }


def ask_fleet(query: FleetQuery, client: PrometheusClient, url: str = "") -> FleetAnswer:
    """Every node of the scrape job: can it run ``query`` now, and if not, why."""
    exprs = fleet_queries(query)
    now_samples = client.query(exprs["now"])
    now = now_samples[0][1] if now_samples else math.nan
    if not math.isfinite(now):
        # Without Prometheus's own time no sample's age is known: nothing can be fresh.
        got = {name: client.query(expr) for name, expr in exprs.items() if name != "now"}
    else:
        got = {name: client.query(expr, now) for name, expr in exprs.items() if name != "now"}

    def per_instance(name: str) -> dict[str, float]:
        return {labels.get("instance", ""): value for labels, value in got[name]}

    instances = sorted({labels.get("instance", "") for labels, _ in got["seen"]}
                       | set(per_instance("scraped")))
    up, scraped = per_instance("up"), per_instance("scraped")
    free, busy = per_instance("free"), per_instance("busy")
    ready_by: dict[str, dict[str, float]] = {}
    for labels, value in got["backend_ready"]:
        ready_by.setdefault(labels.get("instance", ""), {})[labels.get("backend", "")] = value
    proven_by: dict[str, dict[str, float]] = {}
    for labels, value in got["proven"]:
        proven_by.setdefault(labels.get("instance", ""), {})[labels.get("backend", "")] = value
    blockers: dict[str, list[tuple[str, str]]] = {}
    for labels, _ in got["blockers"]:
        blockers.setdefault(labels.get("instance", ""), []).append(
            (labels.get("code", ""), labels.get("layer", "")))
    nodes = [_judge(query, i, now, up.get(i), scraped.get(i), ready_by.get(i, {}),
                    free.get(i, 0.0), busy.get(i, 0.0), blockers.get(i, []),
                    proven_by.get(i, {})) for i in instances if i]
    if query.qualified_within_s is not None:
        qualified = per_instance("qualified")
        nodes = [_qualified(query, n, int(qualified.get(n.instance, 0))) for n in nodes]
    order = {"ready": 0, "blocked": 1, "unknown": 2}
    nodes.sort(key=lambda n: (order[n.state], n.instance))
    return FleetAnswer(query, url, now if math.isfinite(now) else None, tuple(nodes))


def _count(value: float) -> int | None:
    """A GPU count from a sample; None when it is no count (NaN, Inf, negative, fractional)."""
    if not math.isfinite(value) or value < 0 or value != int(value):
        return None
    return int(value)


def _judge(q: FleetQuery, instance: str, now: float, up: float | None, scraped: float | None,
           backend_ready: Mapping[str, float], free_value: float, busy_value: float,
           blockers: Sequence[tuple[str, str]], proven: Mapping[str, float]) -> NodeAnswer:
    """One node's answer from its series (the rule of docs/fleet.md).

    Every number is checked before it is believed: a NaN, an Inf or a missing value makes
    the node unknown, never ready (NaN compares false, so an unchecked staleness test passes).
    """
    if up is None or up != 1.0 or scraped is None:
        why = "the daemon does not answer Prometheus's scrape" if up == 0.0 else \
            "no current gpudiag series (the daemon stopped answering or is not scraped)"
        return NodeAnswer(instance, "unknown", None, None, None, why)
    if not math.isfinite(now):
        return NodeAnswer(instance, "unknown", None, None, None,
                          "Prometheus gave no usable current time (vector(time())), so no "
                          "sample's age is known")
    free, busy = _count(free_value), _count(busy_value)
    ready_values = [backend_ready[b] for b in q.backends if b in backend_ready]
    if (not math.isfinite(scraped) or free is None or busy is None
            or not all(math.isfinite(v) for v in ready_values)):
        return NodeAnswer(instance, "unknown", None, None, None,
                          "its gpudiag series hold values that are no numbers (NaN/Inf) "
                          "or no counts")
    stale_s = now - scraped
    if stale_s > q.max_age_s:
        return NodeAnswer(instance, "unknown", None, None, None,
                          f"the newest sample is {stale_s:.0f} s old (more than "
                          f"{q.max_age_s:g} s)")
    walls = [proven.get(b) for b in q.backends]
    age = None if any(w is None or not math.isfinite(w) for w in walls) else \
        round(max(0.0, now - min(w for w in walls if w is not None)), 3)
    primary = min(blockers, key=lambda cl: layer_rank(cl[1]))[0] if blockers else None
    not_proven = [b for b in q.backends if backend_ready.get(b) != 1.0]
    if not_proven:
        unproven = f"{', '.join(not_proven)} not proven on this node now"
        # The reason is the code's when there is one (gpu_lost, not "jax not proven"): the
        # unproven backend is its consequence.
        return NodeAnswer(instance, "blocked", 0, primary, age,
                          f"{primary}: {_summary(primary)} ({unproven})" if primary
                          else unproven)
    if free >= q.gpus:
        return NodeAnswer(instance, "ready", free, "none", age,
                          f"{free} healthy free GPU(s), {q.gpus} needed")
    if primary is not None:
        code = primary
    else:
        code = "devices_busy" if busy else "insufficient_devices"
    return NodeAnswer(instance, "blocked", free, code, age,
                      f"{free} healthy free GPU(s), {q.gpus} needed ({busy} busy)")


def _summary(code: str) -> str:
    """The catalog's one line for a code; the code itself for one this version lacks."""
    from gpudiag.core.catalog import BLOCKERS

    found = BLOCKERS.get(code)
    return found.summary.rstrip(".") if found is not None else "a blocker of this node"


def _qualified(q: FleetQuery, node: NodeAnswer, qualified: int) -> NodeAnswer:
    """A ready node stays ready only with N free GPUs that passed qualification lately."""
    if not node.ready or qualified >= q.gpus:
        return node
    return NodeAnswer(node.instance, "blocked", node.gpus_ready_free, None, node.age_s,
                      f"{qualified} of the free GPU(s) passed qualification within "
                      f"{q.qualified_within_s:g} s, {q.gpus} needed")
