"""The daemon client: ask the local daemon for a verdict (short connect timeout).

engine/route.py falls back to inline probes when no daemon answers. The verdict says where it
came from (``source: daemon``) and how old it is (``age_s``).
The job's own CUDA_/NVIDIA_VISIBLE_DEVICES travel with the question, so the daemon answers for
what the job will see, not for what the daemon sees.

The wire itself (the URL, who may answer, one GET as bytes) is ``gpudiag.engine.wire``: an
answer on the unix socket is trusted only from a peer running as the daemon's user.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace

from gpudiag.core.records import dataclass
from gpudiag.core.verdict import RecordError, Requirement, Verdict
from gpudiag.engine import wire
from gpudiag.engine.answercheck import Question, check_answer, fingerprint_of, untrusted
from gpudiag.engine.fingerprint import query_value
from gpudiag.engine.wire import CONNECT_TIMEOUT_S
from gpudiag.engine.wire import DEFAULT_SOCKET as DEFAULT_SOCKET
from gpudiag.engine.wire import DEFAULT_URL as DEFAULT_URL
from gpudiag.engine.wire import DaemonUrlError as DaemonUrlError
from gpudiag.engine.wire import DaemonUserError as DaemonUserError
from gpudiag.engine.wire import default_url as default_url
from gpudiag.engine.wire import parse_daemon_url as parse_daemon_url
from gpudiag.engine.wire import query_string as query_string

# typing.TYPE_CHECKING without importing typing (the daemon-answered CLI call never needs it).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from gpudiag.engine.jobpython import JobPython


@dataclass(frozen=True)
class DaemonAnswer:
    """Why the daemon was not used, when it was not (for logs and --verbose output)."""

    verdict: Verdict | None
    reason: str
    url: str = ""
    refused: bool = False  # something answered, but not as the daemon's user
    # It answered, but not the question asked or not consistently (engine/answercheck.py):
    # the reason is said on stderr and the answer made here.
    untrusted: bool = False
    waited_s: float = 0.0  # how long the asking took: the fallback gets the rest of the call

    def fallback(self, verdict: Verdict) -> Verdict:
        """The inline verdict with why the daemon was not used in its evidence."""
        if self.verdict is not None or not self.url:
            return verdict
        note = {"url": self.url, "used": False, "refused": self.refused, "reason": self.reason}
        return replace(verdict, evidence={**verdict.evidence, "daemon": note})


def query_for(requirement: Requirement, env: Mapping[str, str],
              max_age_s: float | None = None, python: JobPython | None = None
              ) -> dict[str, str]:
    """The /v1/preflight parameters for a requirement and the job's visibility variables
    (``python``: the job's interpreter, engine/jobpython.py; found from ``env`` if None)."""
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
    q.update(wire.visibility_params(env))
    ids = environment_ids(requirement, env, python)
    if ids:
        q["fingerprint"] = query_value(ids)
    return q


def environment_ids(requirement: Requirement, env: Mapping[str, str],
                    python: JobPython | None = None) -> dict[str, str]:
    """The job's fingerprint id per environment-dependent backend it requires, read by the
    job's interpreter (the daemon answers those only from a proof made in an environment
    with the same id)."""
    from gpudiag.core import registry
    from gpudiag.engine import jobpython

    decls = {}
    for b in requirement.backends:
        spec = registry.spec(b.name)
        if spec is not None and spec.environment is not None:
            decls[b.name] = spec.environment
    if not decls:
        return {}
    return jobpython.fingerprint_ids(decls, env, python or jobpython.find(env))


def prove_here(verdict: Verdict) -> tuple[str, ...]:
    """The backends a daemon's answer leaves to the asker to prove in its own environment."""
    proof = verdict.evidence.get("proof")
    if not isinstance(proof, dict):
        return ()
    return tuple(name for name, entry in proof.items()
                 if isinstance(entry, dict) and entry.get("where") == "prove_here")


@dataclass(frozen=True)
class DaemonReply:
    """One JSON answer of the daemon: the status and body, or None with why there is none."""

    status: int | None
    data: Any  # the parsed JSON body
    why: str
    refused: bool = False


def daemon_get(url: str, endpoint: str, params: Mapping[str, str], *,
               env: Mapping[str, str] | None = None,
               connect_timeout_s: float = CONNECT_TIMEOUT_S,
               read_timeout_s: float = 60.0) -> DaemonReply:
    """GET ``endpoint?params`` of the daemon at ``url`` and read its JSON answer
    (``gpudiag.engine.wire.get``: on a unix socket only from the daemon's user)."""
    status, body, why, refused = wire.get(
        url, endpoint, params, env=os.environ if env is None else env,
        connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s)
    return reply_of(url, status, body, why, refused)


def daemon_post(url: str, endpoint: str, params: Mapping[str, str], *, body: bytes = b"",
                env: Mapping[str, str] | None = None,
                connect_timeout_s: float = CONNECT_TIMEOUT_S,
                read_timeout_s: float = 10.0, fds: Sequence[int] = ()) -> DaemonReply:
    """POST to ``endpoint?params`` of the daemon at ``url`` and read its JSON answer (on a
    unix socket only from the daemon's user, as ``daemon_get``); ``fds`` are passed with it
    (SCM_RIGHTS, unix socket only)."""
    status, data, why, refused = wire.request(
        url, "POST", endpoint, params, env=os.environ if env is None else env, body=body,
        connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s, fds=fds)
    return reply_of(url, status, data, why, refused)


def reply_of(url: str, status: int | None, body: bytes, why: str, refused: bool
             ) -> DaemonReply:
    """``wire.get``'s raw reply read as JSON, with why it is unusable when it is."""
    if status is None:
        return DaemonReply(None, None, why, refused)
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return DaemonReply(None, None, f"daemon at {url} answered {status} without JSON")
    if status != 200:
        err = data.get("error") if isinstance(data, dict) else None
        err = err if isinstance(err, dict) else {}
        return DaemonReply(status, data, f"daemon at {url} answered {status} "
                           f"{err.get('code')}: {err.get('message')}")
    return DaemonReply(status, data, "daemon")


def ask_daemon(url: str, requirement: Requirement, *, env: Mapping[str, str] | None = None,
               connect_timeout_s: float = CONNECT_TIMEOUT_S, read_timeout_s: float = 60.0,
               max_age_s: float | None = None, say: bool = True,
               python: JobPython | None = None) -> DaemonAnswer:
    """The daemon's verdict, or None with the reason (not listening, not ready, bad answer).

    An answer that is not a consistent answer to this question (engine/answercheck.py) is
    not used: said on stderr (unless ``say`` is false: the caller asks again and says it).
    """
    import time

    environ = os.environ if env is None else env
    # The node-health question has its own endpoint; job readiness is /v1/preflight.
    endpoint = "/v1/health" if requirement.node_health else "/v1/preflight"
    query = query_for(requirement, environ, max_age_s, python)
    started = time.monotonic()
    reply = daemon_get(url, endpoint, query, env=environ,
                       connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s)
    return answer_of(url, reply, time.monotonic() - started,
                     question_of(requirement, query.get("fingerprint")), say=say)


def answer_of(url: str, reply: DaemonReply, waited_s: float, question: Question | None,
              *, say: bool = True) -> DaemonAnswer:
    """The daemon's verdict in a reply, or None with why (the CLI's fast path reads its own
    reply and hands this to the click path, which then never asks again). An answer that
    does not hold for ``question`` is not used (engine/answercheck.py), and said."""
    if reply.status != 200:
        return DaemonAnswer(None, reply.why, url, reply.refused, waited_s=waited_s)
    problem = check_answer(reply.data, question) if question is not None else None
    if problem is not None:
        if say:
            say_untrusted(url, problem)
        return DaemonAnswer(None, f"daemon at {url} gave an answer that does not hold: "
                            f"{problem}", url, untrusted=True, waited_s=waited_s)
    try:
        return DaemonAnswer(Verdict.from_record(reply.data), "daemon", url, waited_s=waited_s)
    except RecordError as e:
        return DaemonAnswer(None, f"daemon at {url} sent an unusable verdict: {e}", url,
                            waited_s=waited_s)


def question_of(requirement: Requirement, fingerprint: str | None = None) -> Question:
    """What ``query_for`` asks, as engine/answercheck compares it with the answer
    (``fingerprint``: the parameter sent, whose proofs the answer must be about)."""
    health = requirement.node_health
    return Question(tuple(b.spec() for b in requirement.backends), devices=requirement.devices,
                    gpus=requirement.gpus,
                    min_devices=None if health else requirement.min_devices,
                    min_free_memory_bytes=None if health else requirement.min_free_memory_bytes,
                    question=requirement.question,
                    extra={"fingerprint": fingerprint_of(fingerprint)})


def say_untrusted(url: str, problem: str) -> None:
    """One stderr line: the daemon's answer is not used (fail closed: probes run here)."""
    import sys

    print(untrusted(url, problem), file=sys.stderr)
