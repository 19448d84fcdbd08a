"""One busy-GPU round (issue 39): the daemon's scheduler and inline runs share engine/round.py.

Given the same occupancy (a GPU busy with another user's process, one locked by a job, one
lost, one whose MIG instance is busy), the daemon's policy (one backend per call, rotating)
and an inline run (every active probe at once) choose and prove the same GPUs. The NVML
reading is the real nvml probe's on the fake driver; the children it would start are
recorded instead of run.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from gpudiag.core.environment import probe_environment
from gpudiag.core.probe_run import ProbeRun
from gpudiag.engine.isolation import run_probe
from gpudiag.engine.locks import LockInfo, release, try_lock
from gpudiag.engine.round import Request, RoundPolicy, RoundResult, prove_round
from tests.support.host import EnvFactory

ROOT = Path(__file__).resolve().parents[1]
FOREIGN_PID = 1  # init: never this test's process tree, never a gpudiag probe


class Recorder:
    """A Runner that records each child it is asked for (name, options, pinned variables)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Mapping[str, Any] | None, Mapping[str, str]]] = []

    def __call__(self, requests: Sequence[Request], pinned: Mapping[str, Mapping[str, str]]
                 ) -> dict[str, ProbeRun]:
        out = {}
        for name, options in requests:
            self.calls.append((name, options, dict(pinned.get(name, {}))))
            out[name] = ProbeRun(name, None, 0.0, error="recorded, not run")
        return out

    def gpus_of(self, name: str) -> list[str]:
        """The GPUs the child ``name`` was pointed at (contexts_on, or visibility)."""
        for probe, options, pinned in self.calls:
            if probe == name:
                if options and "contexts_on" in options:
                    return list(options["contexts_on"])
                vis = pinned.get("CUDA_VISIBLE_DEVICES")
                return vis.split(",") if vis else []
        raise AssertionError(f"{name} was not run")


@pytest.fixture
def node(gpu_env: EnvFactory, tmp_path: Path) -> Iterator[tuple[ProbeRun, Path, list[str]]]:
    """Six fake GPUs: 0 busy (another user's process), 1 locked by a job, 2 lost, 3 with a
    busy MIG instance, 4 and 5 free."""
    env = gpu_env(FAKE_NVML_DEVICE_COUNT=6, FAKE_NVML_MIG="3:2",
                  FAKE_NVML_PROCESSES=f"0:{FOREIGN_PID}:100,3.1:{FOREIGN_PID}:100",
                  FAKE_NVML_DEVICE_ERRORS="2:15")
    nvml = run_probe("nvml", env=probe_environment(env), timeout_s=30)
    assert nvml.ok and nvml.nvml is not None, nvml.error
    uuids = [d.uuid or "" for d in nvml.nvml.devices]
    locks = tmp_path / "locks"
    job: LockInfo | None = try_lock(locks, uuids[1], purpose="job", shared=False)
    assert job is not None
    try:
        yield nvml, locks, uuids
    finally:
        release([job])


def _round(nvml: ProbeRun, locks: Path, active: Sequence[Request], policy: RoundPolicy
           ) -> tuple[RoundResult, Recorder]:
    recorder = Recorder()
    done = prove_round(nvml, active, visibility_env={}, lock_dir=locks, run=recorder,
                       policy=policy)
    return done, recorder


ACTIVE: list[Request] = [("cuda", None), ("jax", {"platform": "gpu"})]


def test_the_daemons_round_and_an_inline_run_choose_and_prove_the_same_gpus(
        node: tuple[ProbeRun, Path, list[str]]) -> None:
    nvml, locks, uuids = node
    inline, inline_runs = _round(nvml, locks, ACTIVE, RoundPolicy())
    daemon: dict[str, tuple[RoundResult, Recorder]] = {
        name: _round(nvml, locks, [(name, options)], RoundPolicy(sibling_wait_s=5.0))
        for name, options in ACTIVE}
    free = [uuids[4], uuids[5]]
    assert inline_runs.gpus_of("cuda") == daemon["cuda"][1].gpus_of("cuda") == free
    assert inline_runs.gpus_of("jax") == daemon["jax"][1].gpus_of("jax") == [uuids[4]]
    states = {u: o.state for u, o in inline.occupancy.items()}
    assert states == {u: o.state for u, o in daemon["cuda"][0].occupancy.items()}
    assert (states[uuids[0]], states[uuids[1]], states[uuids[3]]) == ("busy", "busy", "busy")
    assert inline.occupancy[uuids[1]].why == "locked by a gpudiag run job"
    assert uuids[2] not in states or states[uuids[2]] != "free"  # lost: never free
    assert inline.probed == daemon["cuda"][0].probed == frozenset(free)
    assert inline.backend_gpu == daemon["jax"][0].backend_gpu == {"jax": uuids[4]}


def test_rotation_is_a_parameter_moving_the_one_gpu_backends_over_the_free_gpus(
        node: tuple[ProbeRun, Path, list[str]]) -> None:
    nvml, locks, uuids = node
    chosen = [_round(nvml, locks, [ACTIVE[1]], RoundPolicy(rotation=k))[1].gpus_of("jax")
              for k in range(6)]
    # Over rounds every free GPU proves JAX; a busy, locked or lost one never does.
    assert {g for gpus in chosen for g in gpus} == {uuids[4], uuids[5]}


def test_no_free_gpu_reads_only_what_needs_none(node: tuple[ProbeRun, Path, list[str]]
                                                ) -> None:
    nvml, locks, uuids = node
    held = [lk for lk in (try_lock(locks, u, purpose="job", shared=False)
                          for u in (uuids[4], uuids[5])) if lk is not None]
    try:
        done, recorder = _round(nvml, locks, ACTIVE, RoundPolicy())
    finally:
        release(held)
    assert recorder.gpus_of("cuda") == []
    name, options, pinned = next(c for c in recorder.calls if c[0] == "jax")
    assert options is not None and "no free GPU" in options["static"] and pinned == {}
    assert done.backend_gpu == {"jax": None}


def _calls_of(module: Path, function: str) -> int:
    tree = ast.parse(module.read_text())
    return sum(1 for node in ast.walk(tree) if isinstance(node, ast.Call)
               and getattr(node.func, "id", getattr(node.func, "attr", None)) == function)


def test_the_safety_rule_lives_in_one_place() -> None:
    """Only engine/round.py claims GPUs for probes (qualification claims one GPU itself, for
    its own measurement; the reset rung its GPU's NVLink domain, exclusively, for a reset),
    and both the scheduler and inline runs go through it."""
    package = ROOT / "gpudiag"
    claims = {p.relative_to(package).as_posix() for p in package.rglob("*.py")
              if _calls_of(p, "claim_free")}
    assert claims == {"engine/round.py", "engine/qualify.py", "daemon/gpu_reset.py"}
    assert _calls_of(package / "engine" / "inline.py", "prove_round") == 1
    assert _calls_of(package / "daemon" / "scheduler.py", "prove_round") == 1
