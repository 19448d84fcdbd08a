"""gpudiag's pytest plugin: GPU tests that know why they cannot run, workers on distinct GPUs.

Registered through the ``pytest11`` entry point ``gpudiag`` (disable with ``-p no:gpudiag``).
A GPU test is one marked ``@pytest.mark.gpu(n=1, require="cuda")`` or asking for the
``gpu_verdict`` / ``gpu_devices`` fixtures. Nothing happens in a session without GPU tests:
this module imports only pytest and the standard library; ``.session`` (gpudiag's engine,
probes, admission) is imported only once collection found a GPU test. Then, in each process
that runs tests (each pytest-xdist worker; the xdist controller collects nothing), before the
first test runs: one verdict per distinct requirement, GPUs admitted under the same full-UUID
locks as ``gpudiag run`` and held until the session ends, and the exact child environment in
``os.environ``. docs/pytest.md has the details.
"""

from __future__ import annotations

import json
import os
from collections.abc import Generator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from gpudiag.core.environment import XLA_ALLOCATOR_CHOICES

if TYPE_CHECKING:
    from gpudiag.core.occupancy import Leaf
    from gpudiag.core.verdict import Verdict
    from gpudiag.pytest_plugin.session import GpuSession, GpuSpec, Outcome

MARKER = "gpu"
FIXTURES = ("gpu_verdict", "gpu_devices")
DEFAULT_TIMEOUT_S = 60.0
REQUIRED_ENV = "GPUDIAG_GPU_REQUIRED"

SESSION = pytest.StashKey["GpuSession"]()
SPEC = pytest.StashKey["GpuSpec"]()
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
    group.addoption("--gpu-xla-allocator", choices=XLA_ALLOCATOR_CHOICES, default=None,
                    help="platform (default): XLA_PYTHON_CLIENT_ALLOCATOR=platform for GPU "
                         "tests, memory given back (slower); keep: the session's own "
                         "allocator variables (preallocation stays off); ini "
                         "gpu_xla_allocator")
    parser.addini("gpu_xla_allocator", help="default of --gpu-xla-allocator",
                  default="platform")


def pytest_configure(config: pytest.Config) -> None:
    """Register the marker and check the timeout (no probe, no import of gpudiag's engine)."""
    _timeout(config)  # a wrong value is a usage error at once, not when GPU tests show up
    _xla_allocator(config)
    config.addinivalue_line(
        "markers", "gpu(n=1, require='cuda'): a GPU test: runs on n GPUs admitted by gpudiag "
        "for the requirement (CLI syntax, e.g. 'jax', 'cuda,jax', 'jax:cpu'), skips (or, "
        "with --gpu-required, fails) with gpudiag's blocker code when it cannot")


def _required(config: pytest.Config) -> bool:
    if config.getoption("gpu_required"):
        return True
    return os.environ.get(REQUIRED_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _xla_allocator(config: pytest.Config) -> str:
    value = config.getoption("gpu_xla_allocator") or config.getini("gpu_xla_allocator")
    if value not in XLA_ALLOCATOR_CHOICES:
        raise pytest.UsageError(f"gpu_xla_allocator = {value!r}: one of "
                                f"{', '.join(XLA_ALLOCATOR_CHOICES)}")
    return str(value)


def _timeout(config: pytest.Config) -> float:
    value = config.getoption("gpu_timeout")
    raw = value if value is not None else config.getini("gpu_timeout")
    try:
        timeout = float(raw)
    except (TypeError, ValueError):
        raise pytest.UsageError(f"gpu_timeout = {raw!r} is not a number of seconds; "
                                "set e.g. --gpu-timeout 60") from None
    if not 0 <= timeout <= 86400:
        raise pytest.UsageError(f"--gpu-timeout {timeout:g} must be between 0 and 86400 s")
    return timeout


def _is_gpu_test(item: pytest.Item) -> bool:
    if item.get_closest_marker(MARKER) is not None:
        return True
    names = getattr(item, "fixturenames", ())
    return any(f in names for f in FIXTURES)


def _session(config: pytest.Config) -> GpuSession:
    gs = config.stash.get(SESSION, None)
    if gs is None:
        from gpudiag.pytest_plugin.session import GpuSession

        gs = GpuSession(required=_required(config), timeout_s=_timeout(config),
                        xla_allocator=_xla_allocator(config))
        config.stash[SESSION] = gs
    return gs


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> None:
    """Before a test module is imported: when its source declares GPU tests, start now.

    So the GPUs are admitted and the environment set before the module (and any framework
    it imports) is loaded. A plain substring test keeps this free for other modules.
    """
    try:
        text = module_path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    if "mark.gpu" not in text and not any(f in text for f in FIXTURES):
        return None
    if parent.config.getoption("collectonly"):
        return None  # --collect-only: nothing runs, so nothing is admitted
    from gpudiag.pytest_plugin.session import scan_source

    wanted = scan_source(text)
    if wanted:
        _session(parent.config).ensure(wanted)
    return None  # pytest makes the Module as usual


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    """After collection, before any test runs: every GPU test's verdict, GPUs, environment."""
    gpu_items = [item for item in items if _is_gpu_test(item)]
    if not gpu_items or config.getoption("collectonly"):
        gs = config.stash.get(SESSION, None)
        if gs is not None:  # GPU tests seen in a source were all deselected: let go
            gs.release()
            del config.stash[SESSION]
        return  # a session without GPU tests: nothing at all happens
    from gpudiag.pytest_plugin.session import spec_of

    wanted: dict[str, int] = {}
    for item in gpu_items:
        spec = spec_of(item.get_closest_marker(MARKER))
        item.stash[SPEC] = spec
        if spec.error is None:
            wanted[spec.key] = max(wanted.get(spec.key, 0), spec.n)
    gs = _session(config)
    gs.ensure(wanted)  # nothing to do when the sources showed it all
    for item in gpu_items:
        _mark(item, gs)


def _outcome(item: pytest.Item) -> tuple[GpuSpec, Outcome | None, GpuSession] | None:
    spec = item.stash.get(SPEC, None)
    gs = item.config.stash.get(SESSION, None)
    if spec is None or gs is None:
        return None
    return spec, gs.outcomes.get(spec.key), gs


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A GPU test with a wrong marker errors, naming what is wrong and the right form."""
    outcome = _outcome(item)
    if outcome is not None and (outcome[0].error is not None or outcome[1] is None):
        pytest.fail(outcome[0].error or "gpu marker: no verdict", pytrace=False)


def _mark(item: pytest.Item, gs: GpuSession) -> None:
    """Record the verdict on a GPU test (JUnit properties); mark it skipped when blocked."""
    outcome = _outcome(item)
    if outcome is None:
        return
    spec, oc, _gs = outcome
    if spec.error is not None or oc is None:
        # A usage error of the test's author, not a verdict: no blocker code is made up.
        item.user_properties.append(("gpu_marker_error", spec.error or "no verdict"))
        return
    item.user_properties.extend([
        ("gpu_validation_blocker", oc.verdict.gpu_validation_blocker),
        ("gpu_uuids", ",".join(oc.uuids[:spec.n])),
        ("gpu_verdict_source", oc.verdict.source),
        ("gpu_verdict_age_s", f"{oc.verdict.age_s:.1f}")])
    if not oc.verdict.ready and not gs.required:
        # A skip marker, so that the report points at the test, not at this plugin.
        item.add_marker(pytest.mark.skip(reason=skip_reason(oc.verdict)))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    """With --gpu-required, a GPU test that cannot run fails with the blocker record."""
    outcome = _outcome(item)
    if outcome is None:
        return
    _spec, oc, gs = outcome
    if oc is not None and not oc.verdict.ready and gs.required:
        pytest.fail(failure_message(oc), pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Generator[None, Any, None]:
    """A failed GPU test says who failed it: hardware, software, application or unknown."""
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    found = _outcome(item) if report.when == "call" and report.failed else None
    if found is None or found[1] is None or not found[1].verdict.ready:
        return  # a test that could not run failed for its blocker, said already
    spec, _oc, gs = found
    attribution = gs.failure_attribution(spec.n, call.start, call.stop)
    if attribution is None:
        return
    line = attribution.kv()
    # JUnit XML takes a test's properties from its teardown report, made from the item's.
    item.user_properties.append(("gpu_failure_attribution", line))
    text = [f"gpu_failure_attribution={line}"]
    text += [f"  {e['at']} {e['gpu'] or 'node'}: {e['message'] or e['code']} ({e['source']})"
             for e in attribution.record()["events"]]
    text += [f"  missing: {m}" for m in attribution.missing]
    report.sections.append(("gpudiag: who failed this GPU test", "\n".join(text)))


def skip_reason(verdict: Verdict) -> str:
    """The skip reason: the blocker code, what is wrong and the remediation."""
    primary = verdict.primary
    if primary is None:
        return f"gpudiag: {verdict.gpu_validation_blocker}"
    return f"gpudiag: {primary.code}: {primary.message} Remediation: {primary.remediation}"


def failure_message(oc: Outcome) -> str:
    """The failure under --gpu-required: the reason and the blocker record."""
    v = oc.verdict
    record: dict[str, Any] = {
        "gpu_validation_blocker": v.gpu_validation_blocker,
        "blockers": [b.record() for b in v.blockers],
        "requirement": oc.key, "gpus": oc.n, "source": v.source,
        "age_s": round(v.age_s, 3), "checked_at": v.checked_at, "host": v.host}
    return (f"GPU test cannot run (--gpu-required / {REQUIRED_ENV}=1): "
            f"{skip_reason(v)}\n{json.dumps(record, indent=2)}")


def pytest_report_collectionfinish(config: pytest.Config) -> list[str]:
    """The verdicts at the top of the run (after 'collected N items'); not under -q, where
    pytest prints no header either: the summary's gpudiag section says them once."""
    gs = config.stash.get(SESSION, None)
    if gs is None or config.get_verbosity() < 0:
        return []
    return gs.lines()


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
