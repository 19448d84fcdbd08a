"""Where a verdict comes from: the local daemon when one answers, else probes run here.

The one implementation of "ask the daemon, else run inline", used by ``gpudiag.preflight()``,
``gpudiag preflight`` and admission (``gpudiag run``, ``gpudiag.admit``). The verdict's
``source`` (daemon|inline) says which answered.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpudiag.core.deadlines import daemon_wait_s, fallback_timeouts
from gpudiag.core.records import dataclass
from gpudiag.core.verdict import Requirement, Verdict
from gpudiag.engine.client import DaemonAnswer, ask_daemon, default_url, prove_here
from gpudiag.engine.jobview import as_jobs as as_jobs
from gpudiag.engine.jobview import needs_job_python as needs_job_python

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (see gpudiag/__init__)
if TYPE_CHECKING:
    from gpudiag.core.probe_run import ProbeRun
    from gpudiag.engine.jobpython import JobPython


@dataclass(frozen=True)
class Routed:
    """A verdict, and the probe runs behind it when they ran here (None: the daemon answered)."""

    verdict: Verdict
    runs: Mapping[str, ProbeRun] | None = None
    daemon_reason: str | None = None  # why no daemon verdict was used, when one was asked
    daemon_refused: bool = False  # something answered, but not as the daemon's user
    daemon_untrusted: bool = False  # it answered what does not hold: said once already


def daemon_else_inline(requirement: Requirement, *, url: str | None = None,
                       use_daemon: bool = True, env: Mapping[str, str] | None = None,
                       timeout_s: float | None = None,
                       expected_gpus: int | None = None,
                       asked: DaemonAnswer | None = None,
                       python: JobPython | None = None) -> Routed:
    """The daemon's verdict when one answers, else one from probes run here and now.

    ``url`` defaults to $GPUDIAG_DAEMON_URL (in ``env``), else the loopback default; a URL
    that is not understood raises DaemonUrlError. ``timeout_s`` bounds the probes and the
    wait for the daemon alike. ``env`` is the job's environment (default: this process's):
    its visibility variables travel to the daemon and reach the probe children.
    ``expected_gpus`` is checked by probes run here (the daemon checks its own config key),
    so a count given here skips the daemon.
    ``asked``: the daemon's answer (or why there is none, and the time spent) that this call
    already got (the CLI's fast path): one deadline per call, so the daemon is not asked again.
    ``python``: the job's interpreter (engine/jobpython.py), found from ``env`` when None:
    the daemon is sent its fingerprint and JAX/IREE run here under it.
    """
    import os

    from gpudiag.engine import jobpython

    base = os.environ if env is None else env
    if python is None and needs_job_python(requirement):
        python = jobpython.find(base)
    answer = DaemonAnswer(None, "not asked")
    if asked is not None:
        answer = asked
    elif use_daemon and expected_gpus is None:
        answer = ask_daemon(url or default_url(env), requirement, env=env,
                            read_timeout_s=daemon_wait_s(timeout_s), python=python)
    if answer.verdict is not None:
        here = prove_here(answer.verdict)
        if not here:
            return Routed(as_jobs(answer.verdict, requirement, base, python))
        from gpudiag.core import registry

        return hybrid(answer.verdict, here, requirement, env=env, timeout_s=timeout_s,
                      timeouts=fallback_timeouts(registry.timeouts_s(), timeout_s,
                                                 answer.waited_s), python=python)
    # Only a fallback pays for the classifier and the probe engine (tens of ms to import):
    # a daemon-answered CLI call is mostly Python's start (docs/benchmarks.md).
    import socket

    from gpudiag.core import registry
    from gpudiag.core.classify import NodeFacts, classify
    from gpudiag.engine.inline import run_inline

    done = run_inline(requirement, env=env, timeout_s=timeout_s, timeouts=fallback_timeouts(
        registry.timeouts_s(), timeout_s, answer.waited_s), python=python)
    verdict = as_jobs(classify(done.runs, requirement, host=socket.gethostname(),
                               checked_at=done.checked_at, scope=done.scope,
                               facts=NodeFacts(expected_gpus=expected_gpus)),
                      requirement, base, python, done.runs)
    # Why no daemon verdict was used (not listening, refused peer) goes into the evidence.
    return Routed(answer.fallback(verdict), done.runs,
                  answer.reason if answer.reason != "not asked" else None, answer.refused,
                  answer.untrusted)


def hybrid(answer: Verdict, names: tuple[str, ...], requirement: Requirement, *,
           env: Mapping[str, str] | None, timeout_s: float | None,
           timeouts: Mapping[str, float] | None = None,
           python: JobPython | None = None) -> Routed:
    """The daemon's answer for the device layer, with ``names`` proven here, in the asker's
    environment, as the job will see them (docs/design-notes.md, "Whose environment is
    proven"): nvml and those backends' children only, under the busy-GPU round."""
    import os
    import socket
    from dataclasses import replace

    from gpudiag.core.classify import classify
    from gpudiag.core.hybrid import with_backends_of
    from gpudiag.engine import jobpython
    from gpudiag.engine.client import environment_ids
    from gpudiag.engine.inline import run_inline

    base = os.environ if env is None else env
    if python is None:
        python = jobpython.find(base)
    wanted = replace(requirement, backends=tuple(
        b for b in requirement.backends if b.name in names))
    done = run_inline(wanted, env=base, timeout_s=timeout_s, timeouts=timeouts,
                      only={"nvml", *names}, python=python)
    here = classify(done.runs, wanted, host=socket.gethostname(), checked_at=done.checked_at,
                    scope=done.scope)
    ids = environment_ids(wanted, base, python)
    proof = {n: {"where": "here", "fingerprint": ids.get(n), "interpreter": python.path,
                 "proven_at": done.checked_at} for n in names}
    verdict = with_backends_of(answer, here, names, proof=proof)
    verdict = as_jobs(verdict, requirement, base, python, done.runs)
    return Routed(verdict.with_source("hybrid", answer.age_s), done.runs)
