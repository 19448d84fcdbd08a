"""gpudiag's pytest plugin: GPU tests that know why they cannot run, workers on distinct GPUs.

Registered through the ``pytest11`` entry point ``gpudiag`` (disable with ``-p no:gpudiag``).
A GPU test is one marked ``@pytest.mark.gpu(n=1, require="cuda")`` or asking for the
``gpu_verdict`` / ``gpu_devices`` fixtures. Nothing happens in a session without GPU tests:
this module imports only pytest and the standard library, and gpudiag's engine is imported,
probes run and GPUs admitted only once collection found a GPU test. Then, in each process
that runs tests (each pytest-xdist worker; never the xdist controller): one verdict per
distinct requirement (the daemon first, inline otherwise), one admission under the same
full-UUID locks as ``gpudiag run`` held until the session ends, and the exact child
environment set in ``os.environ`` before any test runs. docs/pytest.md has the details.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from gpudiag.core.occupancy import Leaf
    from gpudiag.core.verdict import Requirement, Verdict
    from gpudiag.runner.admission import Admission, Observation

MARKER = "gpu"
FIXTURES = ("gpu_verdict", "gpu_devices")
DEFAULT_REQUIRE = "cuda"
DEFAULT_TIMEOUT_S = 60.0
REQUIRED_ENV = "GPUDIAG_GPU_REQUIRED"
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
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    admission: Admission | None = None
    saved_env: dict[str, str | None] = field(default_factory=dict)
    environment: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def release(self) -> None:
        """Drop the GPU locks and put back the environment this session changed."""
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


SESSION = pytest.StashKey[GpuSession]()
SPEC = pytest.StashKey[GpuSpec]()
WORKER_LINES = pytest.StashKey[list[str]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    """The plugin's options: --gpu-required and --gpu-timeout."""
    group = parser.getgroup("gpudiag", "GPU tests (gpudiag)")
    group.addoption("--gpu-required", action="store_true", default=None,
                    help="GPU tests that cannot run fail with gpudiag's blocker record "
                         f"instead of skipping (also {REQUIRED_ENV}=1): for GPU CI runners")
    group.addoption("--gpu-timeout", type=float, default=None, metavar="SECONDS",
                    help="how long a worker waits for FREE GPUs before its GPU tests are "
                         "blocked as devices_busy (default: ini gpu_timeout, "
                         f"{DEFAULT_TIMEOUT_S:g})")
    parser.addini("gpu_timeout", help="default of --gpu-timeout (seconds)",
                  default=str(DEFAULT_TIMEOUT_S))


def pytest_configure(config: pytest.Config) -> None:
    """Register the marker (no probe, no import of gpudiag's engine)."""
    config.addinivalue_line(
        "markers", "gpu(n=1, require='cuda'): a GPU test: runs on n GPUs admitted by gpudiag "
        "for the requirement (CLI syntax, e.g. 'jax', 'cuda,jax', 'jax:cpu'), skips (or, "
        "with --gpu-required, fails) with gpudiag's blocker code when it cannot")


def _required(config: pytest.Config) -> bool:
    if config.getoption("gpu_required"):
        return True
    return os.environ.get(REQUIRED_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _timeout(config: pytest.Config) -> float:
    value = config.getoption("gpu_timeout")
    raw = value if value is not None else config.getini("gpu_timeout")
    try:
        timeout = float(raw)
    except (TypeError, ValueError):
        raise pytest.UsageError(f"gpu_timeout {raw!r} is not a number of seconds; "
                                "set e.g. --gpu-timeout 60") from None
    if timeout < 0:
        raise pytest.UsageError(f"--gpu-timeout {timeout:g} must not be negative")
    return timeout


def _is_gpu_test(item: pytest.Item) -> bool:
    if item.get_closest_marker(MARKER) is not None:
        return True
    names = getattr(item, "fixturenames", ())
    return any(f in names for f in FIXTURES)


def spec_of(item: pytest.Item) -> GpuSpec:
    """The requirement and GPU count a GPU test asks for (an error when the marker is wrong)."""
    from gpudiag.core.limits import MAX_DEVICES
    from gpudiag.core.requirement import RequirementError, parse_requirement

    mark = item.get_closest_marker(MARKER)
    args = tuple(mark.args) if mark is not None else ()
    kwargs = dict(mark.kwargs) if mark is not None else {}
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
    return GpuSpec(key, n_raw)


def _key(requirement: Requirement) -> str:
    return ",".join(b.spec() for b in requirement.backends)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    """After collection, before any test runs: verdicts, admission and environment."""
    gpu_items = [item for item in items if _is_gpu_test(item)]
    if not gpu_items or SESSION in config.stash:
        return  # a session without GPU tests: nothing at all happens
    wanted: dict[str, int] = {}
    for item in gpu_items:
        spec = spec_of(item)
        item.stash[SPEC] = spec
        if spec.error is None:
            wanted[spec.key] = max(wanted.get(spec.key, 0), spec.n)
    gpu_session = start_session(wanted, required=_required(config), timeout_s=_timeout(config))
    config.stash[SESSION] = gpu_session


def start_session(wanted: dict[str, int], *, required: bool, timeout_s: float) -> GpuSession:
    """One verdict per requirement, one admission for the most GPUs asked, then os.environ."""
    from gpudiag.core.requirement import parse_requirement
    from gpudiag.engine.client import DaemonUrlError, default_url
    from gpudiag.runner.admission import preflight_for_admission

    gs = GpuSession(required)
    env = dict(os.environ)
    firsts: dict[str, Observation | None] = {}
    for key, n in wanted.items():
        try:
            verdict, first = preflight_for_admission(parse_requirement(key), n, env,
                                                     daemon_url=default_url(env))
        except DaemonUrlError as e:
            raise pytest.UsageError(f"gpudiag: {e}; fix GPUDIAG_DAEMON_URL "
                                    "(unix:PATH or http://HOST:PORT) or unset it") from e
        gs.outcomes[key] = Outcome(key, n, verdict)
        firsts[key] = first
    deadline = time.monotonic() + timeout_s
    # The most GPUs first: one admission serves every requirement (a test uses the first n).
    for key in sorted((k for k, n in wanted.items() if n > 0), key=lambda k: -wanted[k]):
        oc = gs.outcomes[key]
        if gs.admission is None:
            gs.outcomes[key] = _admit_outcome(gs, oc, env, firsts[key], deadline, timeout_s)
        else:
            gs.outcomes[key] = _within(oc, gs.admission)
    _apply_environment(gs)
    return gs


def _admit_outcome(gs: GpuSession, oc: Outcome, env: dict[str, str],
                   first: Observation | None, deadline: float, timeout_s: float) -> Outcome:
    """Admit ``oc.n`` GPUs, waiting for FREE ones until ``deadline`` (then devices_busy)."""
    from pathlib import Path

    from gpudiag.engine.locks import default_lock_dir
    from gpudiag.runner.admission import AdmissionError, Admitter

    lock_dir = Path(default_lock_dir(env))
    while True:
        remaining = max(0.0, deadline - time.monotonic())
        admitter = Admitter(env=env, lock_dir=lock_dir, gpus=oc.n, lock_timeout_s=remaining)
        try:
            gs.admission = admitter.admit(oc.verdict, first)
        except AdmissionError as e:
            code = e.verdict.gpu_validation_blocker
            if code in WAITABLE and time.monotonic() < deadline:
                first = None  # observe afresh: another worker or job may have ended
                time.sleep(min(RETRY_S, remaining))
                continue
            return replace(oc, verdict=_as_devices_busy(e.verdict, timeout_s)
                           if code in WAITABLE else e.verdict)
        return replace(oc, verdict=gs.admission.verdict, uuids=gs.admission.uuids)


def _as_devices_busy(verdict: Verdict, timeout_s: float) -> Verdict:
    """A worker that waited in vain for FREE GPUs is blocked as devices_busy."""
    from gpudiag.core.verdict import Finding

    blockers = tuple(
        Finding.of("devices_busy", f"waited {timeout_s:g} s (--gpu-timeout) for FREE GPUs no "
                   f"other job or worker holds: {b.code}: {b.message}",
                   backend=b.backend, device=b.device)
        if b.code in WAITABLE else b for b in verdict.blockers)
    return replace(verdict, blockers=blockers)


def _within(oc: Outcome, admission: Admission) -> Outcome:
    """A requirement judged on GPUs already admitted: faults on other GPUs are warnings."""
    from gpudiag.core.verdict import Finding

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
    from gpudiag.core.environment import gpudiag_variables

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
    gs.environment = gpudiag_variables(uuids, jax_platforms)
    for key, value in gs.environment.items():
        gs.saved_env.setdefault(key, os.environ.get(key))
        os.environ[key] = value
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


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Record the verdict on the test (JUnit properties); skip it when it cannot run."""
    outcome = _outcome(item)
    if outcome is None:
        return
    spec, oc, gs = outcome
    item.user_properties.append(("gpu_validation_blocker",
                                 "marker_invalid" if spec.error else
                                 oc.verdict.gpu_validation_blocker if oc else "none"))
    item.user_properties.append(("gpu_uuids", ",".join(oc.uuids[:spec.n]) if oc else ""))
    if oc is not None:
        item.user_properties.append(("gpu_verdict_source", oc.verdict.source))
    if spec.error is not None:
        pytest.fail(spec.error, pytrace=False)
    if oc is not None and not oc.verdict.ready and not gs.required:
        pytest.skip(_skip_reason(oc.verdict))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    """With --gpu-required, a GPU test that cannot run fails with the blocker record."""
    outcome = _outcome(item)
    if outcome is None:
        return
    _spec, oc, gs = outcome
    if oc is not None and not oc.verdict.ready and gs.required:
        pytest.fail(_failure_message(oc), pytrace=False)


def _outcome(item: pytest.Item) -> tuple[GpuSpec, Outcome | None, GpuSession] | None:
    spec = item.stash.get(SPEC, None)
    gs = item.config.stash.get(SESSION, None)
    if spec is None or gs is None:
        return None
    return spec, gs.outcomes.get(spec.key), gs


def _skip_reason(verdict: Verdict) -> str:
    primary = verdict.primary
    if primary is None:
        return f"gpudiag: {verdict.gpu_validation_blocker}"
    return (f"gpudiag: {primary.code}: {primary.message} Remediation: {primary.remediation}")


def _failure_message(oc: Outcome) -> str:
    v = oc.verdict
    record: dict[str, Any] = {
        "gpu_validation_blocker": v.gpu_validation_blocker,
        "blockers": [b.record() for b in v.blockers],
        "requirement": oc.key, "gpus": oc.n, "source": v.source,
        "age_s": round(v.age_s, 3), "checked_at": v.checked_at, "host": v.host}
    return (f"GPU test cannot run (--gpu-required / {REQUIRED_ENV}=1): "
            f"{_skip_reason(v)}\n{json.dumps(record, indent=2)}")


def pytest_report_collectionfinish(config: pytest.Config) -> list[str]:
    """The verdicts at the top of the run (after 'collected N items')."""
    gs = config.stash.get(SESSION, None)
    return gs.lines() if gs is not None else []


def pytest_sessionfinish(session: pytest.Session) -> None:
    """An xdist worker hands its verdict lines to the controller."""
    gs = session.config.stash.get(SESSION, None)
    workeroutput = getattr(session.config, "workeroutput", None)
    if gs is not None and isinstance(workeroutput, dict):
        workeroutput["gpudiag"] = gs.lines()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """The xdist controller collects each worker's verdict lines."""
    lines = getattr(node, "workeroutput", {}).get("gpudiag")
    if lines:
        worker = getattr(getattr(node, "gateway", None), "id", "worker")
        node.config.stash.setdefault(WORKER_LINES, []).extend(
            f"[{worker}] {line}" for line in lines)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """The verdicts again at the end (each worker's under xdist)."""
    gs = config.stash.get(SESSION, None)
    lines = gs.lines() if gs is not None else config.stash.get(WORKER_LINES, [])
    if lines:
        terminalreporter.section("gpudiag")
        for line in lines:
            terminalreporter.write_line(line)


def pytest_unconfigure(config: pytest.Config) -> None:
    """The GPU locks are held until here; the environment is put back."""
    gs = config.stash.get(SESSION, None)
    if gs is not None:
        gs.release()


@pytest.fixture
def gpu_verdict(request: pytest.FixtureRequest) -> Verdict:
    """The gpudiag verdict for this test's requirement (after admission)."""
    outcome = _outcome(request.node) if isinstance(request.node, pytest.Item) else None
    if outcome is None or outcome[1] is None:
        pytest.fail("gpu_verdict: this test has no valid @pytest.mark.gpu(...)", pytrace=False)
    return outcome[1].verdict


@pytest.fixture
def gpu_devices(request: pytest.FixtureRequest) -> tuple[Leaf, ...]:
    """The GPUs admitted to this test (its first n), as gpudiag leaves with full UUIDs."""
    outcome = _outcome(request.node) if isinstance(request.node, pytest.Item) else None
    if outcome is None or outcome[1] is None:
        pytest.fail("gpu_devices: this test has no valid @pytest.mark.gpu(...)", pytrace=False)
    spec, oc, gs = outcome
    return gs.leaves(spec.n) if oc is not None and oc.verdict.ready else ()
