"""The daemon client: ask the local daemon for a verdict (short connect timeout).

engine/route.py falls back to inline probes when no daemon answers. The verdict says where it
came from (``source: daemon``) and how old it is (``age_s``).
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
    if requirement.min_devices is not None:
        q["min_devices"] = str(requirement.min_devices)
    if requirement.min_free_memory_bytes is not None:
        q["min_free_memory"] = str(requirement.min_free_memory_bytes)
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
    path = f"{prefix}/v1/preflight?{urlencode(query_for(requirement, environ, max_age_s))}"
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
