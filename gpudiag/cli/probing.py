"""``gpudiag probe`` without click: its backend list, its question and its verdict.

The click command (``gpudiag.cli.commands.probe``) and the console entry's fast path
(``gpudiag.cli.entry``, for ``--format json|kv``) both call these, so both print the same
verdict; the fast path saves the probe's parent process the import of click.
"""

from __future__ import annotations

from gpudiag.core import registry
from gpudiag.core.requirement import parse_requirement
from gpudiag.core.verdict import Requirement, Verdict

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Collection

    from gpudiag.engine.forkclient import ForkServer
    from gpudiag.engine.jobpython import JobPython


class BackendListError(ValueError):
    """A ``--backend`` list that names no backend, or one gpudiag does not probe."""


def default_backends() -> str:
    """``--backend``'s default: every probe gpudiag has, in report order."""
    return ",".join(registry.probe_names())


def parse_backends(text: str) -> list[str]:
    """The probes a ``--backend`` list names (``jax:cpu`` keeps its platform)."""
    accepted = registry.probe_names()
    names = [b.strip().lower() for b in text.split(",") if b.strip()]
    bad = [b for b in names if b.split(":")[0] not in accepted]
    if not names or bad:
        raise BackendListError(f"--backend {text!r}: unknown backend(s) "
                               f"{', '.join(bad) or '(none)'}; accepted: a comma list of "
                               f"{', '.join(accepted)}")
    return names


def probe_requirement(names: list[str]) -> Requirement:
    """The node-health question over the requirable backends named (RequirementError if bad).

    A person at a shell asks what ``gpudiag health`` asks: is anything broken? GPUs that jobs
    use show as busy, not as blockers (job readiness is ``gpudiag preflight``).
    """
    specs = [n for n in names if n.split(":")[0] in registry.requirable()]
    if not specs:
        return Requirement(backends=(), min_devices=0, node_health=True)
    return parse_requirement(",".join(specs), node_health=True)


def probe_verdict(names: list[str], requirement: Requirement, *, timeout_s: float | None,
                  expected_gpus: int | None, python: JobPython | None = None,
                  named: bool = True, forker: ForkServer | None = None) -> Verdict:
    """Run the named probes here, each in its child, and classify what they saw.

    ``python``: the job's interpreter (engine/jobpython.py; found from this environment when
    None): JAX and IREE run under it. ``named``: the backends were asked for by name; else
    (``gpudiag probe``'s default list) one the job's environment lacks is not checked.
    ``forker``: a fork server the caller started for this run (``cli.ahead.nvml_ahead``,
    which asked for NVML's child already); it stays the caller's to close.
    """
    import contextlib
    import os
    import socket

    from gpudiag.core.environment import probe_environment
    from gpudiag.engine import jobpython

    only = {n.split(":")[0] for n in names}
    if python is None and any(registry.environment_dependent(n) for n in only):
        python = jobpython.find(os.environ)
    child_env = probe_environment(os.environ)
    with contextlib.ExitStack() as stack:
        if forker is None or not forker.serves(child_env):
            forker = stack.enter_context(_forker_ahead(only, requirement, python, child_env))
        from gpudiag.core.classify import NodeFacts, classify
        from gpudiag.engine.inline import run_inline
        from gpudiag.engine.jobview import as_jobs

        done = run_inline(requirement, timeout_s=timeout_s, only=only, forker=forker,
                          python=python)
    verdict = as_jobs(classify(done.runs, requirement, host=socket.gethostname(),
                               checked_at=done.checked_at, scope=done.scope,
                               facts=NodeFacts(expected_gpus=expected_gpus)),
                      requirement, os.environ, python, done.runs)
    return verdict if named or python is None else not_checked(verdict, python)


def _forker_ahead(only: Collection[str], requirement: Requirement, python: JobPython | None,
                  child_env: dict[str, str]) -> ForkServer:
    """The probe fork server, forked from this process now, before the classifier's and the
    engine's imports: its own (pynvml, the probe modules) run beside them. Probes run under
    another interpreter (the job's) are spawned, so it does not load them."""
    from gpudiag.engine.forkclient import ForkServer

    here = sorted(n for n in only
                  if python is None or python.own or not registry.environment_dependent(n))
    forker = ForkServer(child_env, probes=here, fork_here=True)
    if len(only) > 1:
        forker.start()
        if nvml_runs(requirement, only):
            # NVML's reading first (every other device probe waits for it): asked for
            # now, it runs while this process imports the classifier and the engine
            # (docs/benchmarks.md, "Probe overhead"); the run takes it.
            forker.ask_ahead("nvml", None, child_env)
    return forker


def nvml_runs(requirement: Requirement, only: Collection[str]) -> bool:
    """Whether an inline run of ``only`` runs the nvml probe (engine/inline.py): when named,
    or first, for any probe that touches a GPU (the busy-GPU round reads NVML first)."""
    from gpudiag.engine.plan import probes_for

    for name, options in probes_for(requirement, only=only):
        spec = registry.spec(name)
        if name == "nvml" or (spec is not None and spec.touches_gpu(options or {})):
            return True
    return False


def not_checked(verdict: Verdict, python: JobPython) -> Verdict:
    """A backend the job's environment does not have, when nobody asked for it by name:
    not checked (the warning backend_not_checked says how to check it), never a blocker.
    What gpudiag's own environment lacks is nobody's fault (docs/design-notes.md, "Whose
    environment is proven")."""
    from dataclasses import replace

    from gpudiag.core.verdict import Finding

    absent = [name for name, status in verdict.backends.items()
              if status.status == "not_installed" and registry.environment_dependent(name)]
    if not absent:
        return verdict
    warnings = [Finding.of(
        "backend_not_checked",
        f"{name} is not installed in the job's environment, {python.describe()}: not "
        f"checked. To check a job's environment give its interpreter (--python "
        f"/path/to/venv/bin/python, or activate the venv first); --backend {name} makes it "
        "required.", backend=name, warning=True) for name in absent]
    return replace(verdict,
                   blockers=tuple(b for b in verdict.blockers if b.backend not in absent),
                   warnings=(*verdict.warnings, *warnings))
