"""preflight(): ask the local daemon first (short connect timeout), else run the probes inline.

The verdict says where it came from (``source: daemon|inline``) and how old it is (``age_s``).
The job's own CUDA_/NVIDIA_VISIBLE_DEVICES travel with the question, so the daemon answers for
what the job will see, not for what the daemon sees.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlencode, urlsplit

from gpudiag.core.limits import DEFAULT_PORT
from gpudiag.core.verdict import RecordError, Requirement, Verdict

DEFAULT_URL = f"http://127.0.0.1:{DEFAULT_PORT}"
CONNECT_TIMEOUT_S = 0.25


class DaemonUrlError(ValueError):
    """A daemon URL that is not http://HOST:PORT."""


@dataclass(frozen=True)
class DaemonAnswer:
    """Why the daemon was not used, when it was not (for logs and --verbose output)."""

    verdict: Verdict | None
    reason: str


def default_url(env: Mapping[str, str] | None = None) -> str:
    """GPUDIAG_DAEMON_URL, else the default loopback address."""
    environ = os.environ if env is None else env
    return environ.get("GPUDIAG_DAEMON_URL") or DEFAULT_URL


def _split(url: str) -> tuple[str, int, str]:
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
        parts = parts._replace(scheme="bad")
    if parts.scheme != "http" or not parts.hostname:
        raise DaemonUrlError(f"daemon URL {url!r} is not understood; accepted: "
                             f"http://HOST:PORT, e.g. {DEFAULT_URL}")
    return parts.hostname, port or DEFAULT_PORT, parts.path.rstrip("/")


def query_for(requirement: Requirement, env: Mapping[str, str],
              max_age_s: float | None = None) -> dict[str, str]:
    """The /v1/preflight parameters for a requirement and the job's visibility variables."""
    q = {"require": ",".join(b.spec() for b in requirement.backends), "visibility": "1"}
    if requirement.devices is not None:
        q["devices"] = ",".join(requirement.devices)
    # The node-health question (GET /v1/health) takes no counts or memory floors.
    if requirement.min_devices is not None and not requirement.node_health:
        q["min_devices"] = str(requirement.min_devices)
    if requirement.min_free_memory_bytes is not None and not requirement.node_health:
        q["min_free_memory"] = str(requirement.min_free_memory_bytes)
    if requirement.gpus is not None:
        q["gpus"] = str(requirement.gpus)
    if max_age_s is not None:
        q["max_age_s"] = f"{max_age_s:g}"
    for name in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
        if name in env:
            q[name.lower()] = env[name]
    return q


def ask_daemon(url: str, requirement: Requirement, *, env: Mapping[str, str] | None = None,
               connect_timeout_s: float = CONNECT_TIMEOUT_S, read_timeout_s: float = 60.0,
               max_age_s: float | None = None) -> DaemonAnswer:
    """The daemon's verdict, or None with the reason (not listening, not ready, bad answer)."""
    host, port, prefix = _split(url)
    environ = os.environ if env is None else env
    # The node-health question has its own endpoint; job readiness is /v1/preflight.
    endpoint = "/v1/health" if requirement.node_health else "/v1/preflight"
    path = f"{prefix}{endpoint}?{urlencode(query_for(requirement, environ, max_age_s))}"
    try:
        sock = socket.create_connection((host, port), timeout=connect_timeout_s)
    except OSError as e:
        return DaemonAnswer(None, f"no daemon at {url}: {e.strerror or e}")
    conn = http.client.HTTPConnection(host, port, timeout=read_timeout_s)
    sock.settimeout(read_timeout_s)
    conn.sock = sock
    try:
        conn.request("GET", path, headers={"Accept": "application/json"})
        resp = conn.getresponse()
        body = resp.read(64 * 2**20)
    except (OSError, http.client.HTTPException) as e:
        return DaemonAnswer(None, f"daemon at {url} did not answer: {e}")
    finally:
        conn.close()
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return DaemonAnswer(None, f"daemon at {url} answered {resp.status} without JSON")
    if resp.status != 200:
        err = data.get("error") if isinstance(data, dict) else None
        err = err if isinstance(err, dict) else {}
        return DaemonAnswer(None, f"daemon at {url} answered {resp.status} "
                            f"{err.get('code')}: {err.get('message')}")
    try:
        return DaemonAnswer(Verdict.from_record(data), "daemon")
    except RecordError as e:
        return DaemonAnswer(None, f"daemon at {url} sent an unusable verdict: {e}")


def preflight(requirement: Requirement, *, url: str | None = None, use_daemon: bool = True,
              env: Mapping[str, str] | None = None, timeout_s: float | None = None
              ) -> Verdict:
    """The daemon's verdict when one answers, else one from probes run here (source inline)."""
    if use_daemon:
        answer = ask_daemon(url or default_url(env), requirement, env=env,
                            read_timeout_s=min(60.0, timeout_s or 60.0))
        if answer.verdict is not None:
            return answer.verdict
    from gpudiag.engine.inline import preflight_inline

    return preflight_inline(requirement, env=env, timeout_s=timeout_s)
