"""The work of gpudiag's pytest plugin, imported only once a session has GPU tests.

One verdict per distinct requirement (the daemon first, inline otherwise), one admission under
the same full-UUID locks as ``gpudiag run`` (waiting for FREE GPUs up to a timeout, then
``devices_busy``), held until the session ends, and the exact child environment set in
``os.environ``. The hooks live in ``gpudiag.pytest_plugin``, which imports nothing of this.
"""

from __future__ import annotations

import ast
import os
import sys
import time
from dataclasses import field, replace
from pathlib import Path
from typing import Any

import pytest

from gpudiag.core.attribution import Attribution, Window
from gpudiag.core.environment import gpudiag_variables
from gpudiag.core.limits import MAX_DEVICES
from gpudiag.core.occupancy import Leaf
from gpudiag.core.records import dataclass
from gpudiag.core.requirement import RequirementError, parse_requirement
from gpudiag.core.verdict import Finding, Requirement, Verdict
from gpudiag.engine.client import DaemonUrlError, default_url
from gpudiag.engine.jobpython import this_process
from gpudiag.engine.locks import default_lock_dir
from gpudiag.pytest_plugin import FIXTURES
from gpudiag.runner.admission import (
    Admission,
    AdmissionError,
    Admitter,
    Observation,
    preflight_for_admission,
)
from gpudiag.runner.attribution import LATE_EVENT_WAIT_S, GpuEvents, gpus_of

DEFAULT_REQUIRE = "cuda"


def _gpus(leaves: tuple[Leaf, ...]) -> list[str]:
    return gpus_of([{"uuid": lf.uuid, "parent_uuid": lf.parent_uuid} for lf in leaves])


# Refusals that another worker or job ending can lift: a worker waits for these.
WAITABLE = frozenset({"devices_busy", "lock_timeout", "admission_changed"})
RETRY_S = 0.5


@dataclass(frozen=True)
class GpuSpec:
    """What one GPU test asks for: ``n`` GPUs for ``require`` (``error``: the marker is wrong)."""

    key: str  # the requirement in normalized CLI syntax
    n: int
    error: str | None = None


@dataclass(frozen=True)
class Outcome:
    """The verdict for one requirement, and the GPUs a test of it may use."""

    key: str
    n: int
    verdict: Verdict
    uuids: tuple[str, ...] = ()


@dataclass
class GpuSession:
    """This process's verdicts, its admission (locks held until the session ends) and env."""

    required: bool
    timeout_s: float
    xla_allocator: str = "platform"  # "keep": the session's own allocator variables
    wanted: dict[str, int] = field(default_factory=dict)  # requirement -> most GPUs asked
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    admission: Admission | None = None
    saved_env: dict[str, str | None] = field(default_factory=dict)
    environment: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    gpu_events: GpuEvents | None = None  # GPU events while the tests run (failure attribution)
    # Verdicts already asked for, by (requirement, needs GPUs): never asked twice.
    verdicts: dict[tuple[str, bool], Verdict] = field(default_factory=dict)

    def ensure(self, wanted: dict[str, int]) -> None:
        """Cover ``wanted`` too: verdicts for new requirements, a bigger admission if needed.

        Runs while tests are collected, before any runs: admitting again (after putting the
        environment back, so that the new admission sees the caller's visibility) is safe.
        """
        merged = {k: max(self.wanted.get(k, 0), wanted.get(k, 0))
                  for k in (*self.wanted, *wanted)}
        if merged == self.wanted:
            return
        self.release()
        self.wanted, self.outcomes, self.environment, self.notes = merged, {}, {}, []
        env = dict(os.environ)
        firsts: dict[str, Observation | None] = {}
        for key, n in merged.items():
            cached = self.verdicts.get((key, n > 0))
            first = None
            if cached is None:
                cached, first = _verdict(key, n, env)
                self.verdicts[(key, n > 0)] = cached
            self.outcomes[key] = Outcome(key, n, cached)
            firsts[key] = first
        deadline = time.monotonic() + self.timeout_s
        # The most GPUs first: one admission serves every requirement (a test uses the first
        # n of its GPUs).
        for key in sorted((k for k, n in merged.items() if n > 0), key=lambda k: -merged[k]):
            oc = self.outcomes[key]
            if self.admission is None:
                self.outcomes[key] = _admit_outcome(self, oc, env, firsts[key], deadline)
            else:
                self.outcomes[key] = _within(oc, self.admission)
        _apply_environment(self)
        self._watch(env)

    def _watch(self, env: dict[str, str]) -> None:
        """Gather the admitted GPUs' events while the tests run: the daemon's history when
        it gave the verdicts, else a watcher of the session's own (as `gpudiag run` does)."""
        if self.admission is None:
            return
        daemon = None
        if any(oc.verdict.source in ("daemon", "hybrid") for oc in self.outcomes.values()):
            try:
                daemon = default_url(env)
            except DaemonUrlError:
                daemon = None
        self.gpu_events = GpuEvents.begin(_gpus(self.admission.leaves), env, daemon,
                                          [lk.fd for lk in self.admission.locks])

    def failure_attribution(self, n: int, start: float, stop: float) -> Attribution | None:
        """Who failed a GPU test that ran on the first ``n`` GPUs from ``start`` to ``stop``."""
        if self.gpu_events is None or self.admission is None:
            return None
        time.sleep(LATE_EVENT_WAIT_S)  # the XID of a GPU that failed the test may trail it
        window = Window(start, stop, frozenset(_gpus(self.admission.leaves[:n])))
        return self.gpu_events.attribute(1, window)

    def release(self) -> None:
        """Drop the GPU locks and put back the environment this session changed."""
        if self.gpu_events is not None:
            self.gpu_events.close()
            self.gpu_events = None
        if self.admission is not None:
            self.admission.release()
            self.admission = None
        for key, value in self.saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self.saved_env = {}

    def leaves(self, n: int) -> tuple[Leaf, ...]:
        """The first ``n`` admitted leaves."""
        return self.admission.leaves[:n] if self.admission is not None else ()

    def lines(self) -> list[str]:
        """One line per requirement: code, source, age and admitted UUIDs."""
        out = []
        for oc in self.outcomes.values():
            v = oc.verdict
            state = "ready" if v.ready else f"BLOCKED {v.gpu_validation_blocker}"
            line = (f"gpudiag: gpu(n={oc.n}, require={oc.key!r}): {state} "
                    f"(source {v.source}, age {v.age_s:.1f} s)")
            if v.ready:
                line += f"; GPUs {','.join(oc.uuids) or '(none: CPU only)'}"
            elif v.primary is not None:
                line += f": {v.primary.message} Remediation: {v.primary.remediation}"
            out.append(line)
        if self.environment:
            shown = ", ".join(f"{k}={v!r}" for k, v in sorted(self.environment.items()))
            out.append(f"gpudiag: environment set: {shown}")
        return out + self.notes


def spec_of(mark: pytest.Mark | None) -> GpuSpec:
    """What a GPU test's marker asks for (``error`` when the marker is wrong; None: defaults)."""
    return spec_from(tuple(mark.args) if mark is not None else (),
                     dict(mark.kwargs) if mark is not None else {})


def spec_from(args: tuple[Any, ...], kwargs: dict[str, Any]) -> GpuSpec:
    """What ``gpu(*args, **kwargs)`` asks for (``error`` when the arguments are wrong)."""
    kwargs = dict(kwargs)
    n_raw = kwargs.pop("n", args[0] if args else None)
    require = kwargs.pop("require", args[1] if len(args) > 1 else DEFAULT_REQUIRE)
    usage = "use @pytest.mark.gpu(n=1, require='cuda')"
    if kwargs or len(args) > 2:
        return GpuSpec(str(require), 0, f"gpu marker: unknown arguments {sorted(kwargs)} "
                       f"or too many positional ones; {usage}")
    if not isinstance(require, str):
        return GpuSpec(str(require), 0, f"gpu marker: require={require!r} must be a string "
                       f"in the CLI's syntax; {usage}")
    try:
        requirement = parse_requirement(require)
    except RequirementError as e:
        return GpuSpec(require, 0, f"gpu marker: require={require!r}: {e}; {usage}")
    key = _key(requirement)
    if n_raw is None:
        return GpuSpec(key, 1 if requirement.needs_gpu else 0)
    if isinstance(n_raw, bool) or not isinstance(n_raw, int) or not 0 <= n_raw <= MAX_DEVICES:
        return GpuSpec(key, 0, f"gpu marker: n={n_raw!r} must be a whole number of GPUs "
                       f"between 0 and {MAX_DEVICES}; {usage}")
    if n_raw == 0 and requirement.needs_gpu:
        return GpuSpec(key, 0, f"gpu marker: n=0 but require={require!r} needs a GPU; ask "
                       "for n>=1, or a CPU requirement such as 'jax:cpu'")
    return GpuSpec(key, n_raw)


def _key(requirement: Requirement) -> str:
    return ",".join(b.spec() for b in requirement.backends)


def _verdict(key: str, n: int, env: dict[str, str]) -> tuple[Verdict, Observation | None]:
    """The verdict for one requirement: the daemon first, else probes run here."""
    try:
        # The plugin runs in the job: its interpreter is the job's (engine/jobpython.py).
        return preflight_for_admission(parse_requirement(key), n, env,
                                       daemon_url=default_url(env), python=this_process())
    except DaemonUrlError as e:
        raise pytest.UsageError(f"gpudiag: {e}; fix GPUDIAG_DAEMON_URL "
                                "(unix:PATH or http://HOST:PORT) or unset it") from e


def scan_source(text: str) -> dict[str, int]:
    """The GPU tests a test module's source declares, read before the module is imported.

    Only markers with literal arguments (and tests asking for the fixtures) are seen; the
    rest are found after collection. Never raises: a source that does not parse is left to
    pytest to report.
    """
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError):
        return {}
    wanted: dict[str, int] = {}

    def add(spec: GpuSpec) -> None:
        if spec.error is None:
            wanted[spec.key] = max(wanted.get(spec.key, 0), spec.n)

    marked = uses_fixture = False
    called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _is_gpu_mark(node.func):
            marked = True
            try:
                args = tuple(ast.literal_eval(a) for a in node.args)
                kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
            except (ValueError, TypeError, SyntaxError, RecursionError):
                continue  # not literal: seen after collection
            add(spec_from(args, kwargs))
        elif isinstance(node, ast.Attribute) and _is_gpu_mark(node):
            marked = True
            if id(node) not in called:
                add(spec_from((), {}))  # a bare @pytest.mark.gpu
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and any(
                a.arg in FIXTURES for a in node.args.args):
            uses_fixture = True
    if uses_fixture and not marked:
        # A test asking for a fixture without a marker gets the defaults; with markers in
        # the module (on it, on a class), which one applies is left to collection.
        add(spec_from((), {}))
    return wanted


def _is_gpu_mark(node: ast.expr) -> bool:
    """``mark.gpu`` or ``pytest.mark.gpu``."""
    if not (isinstance(node, ast.Attribute) and node.attr == "gpu"):
        return False
    owner = node.value
    return (isinstance(owner, ast.Name) and owner.id == "mark") or (
        isinstance(owner, ast.Attribute) and owner.attr == "mark")


def _admit_outcome(gs: GpuSession, oc: Outcome, env: dict[str, str],
                   first: Observation | None, deadline: float) -> Outcome:
    """Admit ``oc.n`` GPUs, waiting for FREE ones until ``deadline`` (then devices_busy)."""

    lock_dir = Path(default_lock_dir(env))
    while True:
        remaining = max(0.0, deadline - time.monotonic())
        admitter = Admitter(env=env, lock_dir=lock_dir, gpus=oc.n, lock_timeout_s=remaining,
                            python=this_process())
        try:
            gs.admission = admitter.admit(oc.verdict, first)
        except AdmissionError as e:
            code = e.verdict.gpu_validation_blocker
            if code in WAITABLE and time.monotonic() < deadline:
                first = None  # observe afresh: another worker or job may have ended
                time.sleep(min(RETRY_S, remaining))
                continue
            return replace(oc, verdict=_as_devices_busy(e.verdict, gs.timeout_s)
                           if code in WAITABLE else e.verdict)
        return replace(oc, verdict=gs.admission.verdict, uuids=gs.admission.uuids)


def _as_devices_busy(verdict: Verdict, timeout_s: float) -> Verdict:
    """A worker that waited in vain for FREE GPUs is blocked as devices_busy."""

    blockers = tuple(
        Finding.of("devices_busy", f"waited {timeout_s:g} s (--gpu-timeout) for FREE GPUs no "
                   f"other job or worker holds: {b.code}: {b.message}",
                   backend=b.backend, device=b.device)
        if b.code in WAITABLE else b for b in verdict.blockers)
    return replace(verdict, blockers=blockers)


def _within(oc: Outcome, admission: Admission) -> Outcome:
    """A requirement judged on GPUs already admitted: faults on other GPUs are warnings."""

    uuids = admission.uuids[:oc.n]
    outside = [b for b in oc.verdict.blockers if b.device and b.device not in uuids]
    if not outside:
        return replace(oc, uuids=uuids if oc.verdict.ready else ())
    kept = tuple(b for b in oc.verdict.blockers if b not in outside)
    moved = tuple(Finding.of("gpu_fault_outside_selection",
                             f"{b.code} on {b.device}, which the tests do not use: {b.message}",
                             backend=b.backend, device=b.device, warning=True) for b in outside)
    verdict = replace(oc.verdict, blockers=kept, warnings=(*oc.verdict.warnings, *moved))
    return replace(oc, verdict=verdict, uuids=uuids if verdict.ready else ())


def _apply_environment(gs: GpuSession) -> None:
    """Set the exact child environment in os.environ (nothing when no requirement is ready)."""
    ready = [oc for oc in gs.outcomes.values() if oc.verdict.ready]
    if not ready:
        return
    platforms = []
    for oc in ready:
        jax = oc.verdict.requirement.backend("jax")
        if jax is not None:
            platforms.append("cpu" if jax.platform == "cpu" else "cuda")
    # JAX on the GPU comes first and fails loudly; CPU-only tests of a mixed session keep CPU.
    jax_platforms = ",".join(p for p in ("cuda", "cpu") if p in platforms) or None
    uuids = gs.admission.uuids if gs.admission is not None else ()
    gs.environment = gpudiag_variables(uuids, jax_platforms, gs.xla_allocator)
    for key, value in gs.environment.items():
        gs.saved_env.setdefault(key, os.environ.get(key))
        os.environ[key] = value
    bridge = sys.modules.get("jax._src.xla_bridge")
    if getattr(bridge, "_backends", None):
        # CUDA reads the visibility variables once, when JAX's backends start: these started
        # during collection (a test module used JAX at import), before the GPUs were admitted.
        gs.notes.append("gpudiag: WARNING: JAX's backends were already started during "
                        "collection (a test module used JAX devices at import), before "
                        "gpudiag set the environment; they may use GPUs not admitted to this "
                        "worker: move device use into tests or fixtures")
    jax_module = sys.modules.get("jax")
    if jax_platforms is not None and jax_module is not None:
        # A test module imported jax during collection: its config read JAX_PLATFORMS then.
        # Backends start on first use, so updating the config now still takes effect.
        try:
            jax_module.config.update("jax_platforms", jax_platforms)
        except Exception as e:  # any failure is reported, never raised
            gs.notes.append(f"gpudiag: could not set jax_platforms={jax_platforms!r} in the "
                            f"already imported jax ({type(e).__name__}: {e}); import jax "
                            "inside tests or fixtures")
