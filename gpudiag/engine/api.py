"""The public preflight API: ``gpudiag.preflight()``, the local daemon first, else inline."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from gpudiag.core.requirement import parse_requirement
from gpudiag.core.verdict import Requirement, Verdict
from gpudiag.engine.jobpython import JobPython, checked, this_process
from gpudiag.engine.route import daemon_else_inline


def preflight(require: str | Requirement = "cuda", *, devices: str | None = None,
              min_devices: int | None = None, min_free_memory: str | int | None = None,
              env: Mapping[str, str] | None = None, timeout_s: float | None = None,
              daemon_url: str | None = None, use_daemon: bool = True,
              gpus: int | None = None, python: str | None = None) -> Verdict:
    """The verdict for a requirement (Python API): the local daemon first, else inline probes.

    ``require`` uses the CLI syntax (``"cuda,jax"``, ``"jax:cpu"``, ``"iree:local-task"``).
    ``env`` is the environment the job would run with (default: this process's); its
    visibility variables travel to the daemon. The verdict's ``source`` says which answered.
    ``gpus=N`` asks job readiness on N GPUs: ready when at least N visible GPUs are healthy
    and FREE (the verdict names them); a fault on another GPU is then only a warning.
    ``python``: the job's interpreter; default this one (the caller runs in the job).
    """
    requirement = require if isinstance(require, Requirement) else parse_requirement(
        require, devices=devices, min_devices=min_devices, min_free_memory=min_free_memory,
        gpus=gpus)
    return daemon_else_inline(requirement, url=daemon_url, use_daemon=use_daemon, env=env,
                              timeout_s=timeout_s, python=_job_python(python)).verdict


def _job_python(path: str | None) -> JobPython:
    """The API's job interpreter: ``path`` (checked: ValueError naming it), else this one."""
    if path is None:
        return this_process()
    return JobPython(checked(path, "python="), "--python")


def node_health(require: str | Requirement = "cuda", *, env: Mapping[str, str] | None = None,
                timeout_s: float | None = None, daemon_url: str | None = None,
                use_daemon: bool = True, python: str | None = None) -> Verdict:
    """Is anything on this node broken (Python API)? Busy GPUs are healthy in use.

    The question a Slurm HealthCheckProgram or node-problem-detector asks; ``ready`` is true
    when nothing is broken. Job readiness is ``preflight()``.
    """
    requirement = require if isinstance(require, Requirement) else parse_requirement(
        require, node_health=True)
    if not requirement.node_health:
        requirement = replace(requirement, node_health=True, gpus=None)
    return daemon_else_inline(requirement, url=daemon_url, use_daemon=use_daemon, env=env,
                              timeout_s=timeout_s, python=_job_python(python)).verdict
