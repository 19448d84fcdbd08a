"""A verdict as the job's: one rule for the daemon's, the hybrid and the inline answer.

Apart from ``engine.route`` (which re-exports it) so that ``gpudiag probe``, which makes its
verdict here, does not import the daemon client (``engine.client``, ``engine.wire``: about
4 ms of a CLI's probe run, docs/benchmarks.md "Probe overhead").
"""

from __future__ import annotations

from collections.abc import Mapping

from gpudiag.core.verdict import Requirement, Verdict

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (see gpudiag/__init__)
if TYPE_CHECKING:
    from gpudiag.core.probe_run import ProbeRun
    from gpudiag.engine.jobpython import JobPython


def needs_job_python(requirement: Requirement) -> bool:
    """Whether a requirement names a backend proven in the job's environment (JAX, IREE)."""
    from gpudiag.core import registry

    return any(registry.environment_dependent(b.name) for b in requirement.backends)


def as_jobs(verdict: Verdict, requirement: Requirement, env: Mapping[str, str],
            python: JobPython | None, runs: Mapping[str, ProbeRun] | None = None) -> Verdict:
    """The verdict as the job's: which interpreter was the job's and why
    (``evidence.job_python``, when an environment-dependent backend was asked), and
    ``preallocation_disabled`` from the job's environment (core.environment.job_preallocation,
    the one rule for every path: daemon, hybrid and inline)."""
    from dataclasses import replace

    from gpudiag.core.environment import job_preallocation

    evidence = dict(verdict.evidence)
    if python is not None and needs_job_python(requirement):
        evidence["job_python"] = python.record()
    jax_run = (runs or {}).get("jax")  # a JAX child run here read it as the job sees it
    jax_obs = jax_run.jax if jax_run is not None and jax_run.ok else None
    prealloc = job_preallocation(env, jax_obs.preallocation_disabled if jax_obs else None)
    return replace(verdict, evidence=evidence, preallocation_disabled=prealloc)
