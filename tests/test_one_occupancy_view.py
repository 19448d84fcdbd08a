"""Whether a GPU is busy is put together in one place (engine/occupancy_view.py): NVML's
processes, the sibling rule and the kernel's lock answer. The probe round, the scheduler,
qualification and admission call it; no other module composes those facts itself."""

from __future__ import annotations

import ast
import os
from pathlib import Path
from typing import Any

import pytest

from gpudiag.core.decode import decode
from gpudiag.core.observations import NvmlObservation
from gpudiag.core.readiness import BUSY, FREE, UNKNOWN
from gpudiag.engine.locks import JOB_LOCKED, release, try_lock
from gpudiag.engine.occupancy_view import lock_answers, occupancy_view

PACKAGE = Path(__file__).resolve().parent.parent / "gpudiag"
VIEW = "engine/occupancy_view.py"
# The pieces of the view: who calls them composes occupancy itself.
PIECES = {"occupancy_from_nvml", "not_foreign", "_not_foreign", "_by_nvml", "_with_locks",
          "holds_probe_mark"}
# "Is this lock held?" for occupancy. Besides the view, engine/locks.py asks it to name
# holders and to wait, and the claim (engine/guard.py) to take a lock: neither reads
# occupancy.
LOCK_QUESTION = "lock_state"
LOCK_QUESTION_ALSO = {"engine/locks.py", "engine/guard.py"}
CALLERS = {"engine/round.py", "daemon/scheduler.py", "engine/qualify.py",
           "runner/admission.py"}


def _modules() -> dict[str, ast.Module]:
    return {p.relative_to(PACKAGE).as_posix(): ast.parse(p.read_text())
            for p in PACKAGE.rglob("*.py")}


def _called(tree: ast.Module) -> set[str]:
    return {name for node in ast.walk(tree) if isinstance(node, ast.Call)
            and isinstance(name := getattr(node.func, "id", getattr(node.func, "attr", None)),
                           str)}


def _imported(tree: ast.Module) -> set[tuple[str, str]]:
    return {(node.module or "", alias.name) for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) for alias in node.names}


def test_no_module_but_the_view_composes_occupancy_from_its_pieces() -> None:
    offenders = {path: sorted(_called(tree) & PIECES) for path, tree in _modules().items()
                 if path not in {VIEW, "engine/locks.py"} and _called(tree) & PIECES}
    assert offenders == {}, f"call engine/occupancy_view.py instead: {offenders}"


def test_only_the_view_asks_whether_a_lock_is_held_for_occupancy() -> None:
    askers = {path for path, tree in _modules().items() if LOCK_QUESTION in _called(tree)}
    assert askers <= {VIEW, *LOCK_QUESTION_ALSO}, askers - {VIEW, *LOCK_QUESTION_ALSO}
    assert VIEW in askers


def test_only_the_view_applies_the_leaf_rule_to_a_reading_it_publishes() -> None:
    """core.occupancy's per-leaf rule is the view's first fact (admission's leaves take it
    through core.occupancy.leaves_from_nvml, their own schedulable shape)."""
    users = {path for path, tree in _modules().items()
             if ("gpudiag.core.occupancy", "occupancy") in _imported(tree)}
    assert users == {VIEW}


def test_the_probe_round_the_scheduler_qualification_and_admission_call_the_view() -> None:
    modules = _modules()
    callers = {path for path, tree in modules.items()
               if any(module == "gpudiag.engine.occupancy_view"
                      for module, _ in _imported(tree))}
    assert CALLERS <= callers, CALLERS - callers


UUID0 = "GPU-f00d0000-0000-4000-8000-000000000000"
UUID1 = "GPU-f00d0001-0000-4000-8000-000000000001"
UUID2 = "GPU-f00d0002-0000-4000-8000-000000000002"


def _reading(*processes: list[dict[str, Any]] | None) -> NvmlObservation:
    devices = [{"index": i, "ok": True, "uuid": u, "processes": p,
                "memory": {"free_bytes": 10, "total_bytes": 20}}
               for i, (u, p) in enumerate(zip((UUID0, UUID1, UUID2), processes, strict=False))]
    nvml: NvmlObservation = decode(NvmlObservation, {"ok": True, "devices": devices})
    return nvml


def test_one_reading_gives_each_gpu_its_state_and_why_from_processes_and_locks(
        tmp_path: Path) -> None:
    foreign = [{"pid": 1, "used_memory_bytes": 5}]  # init: never our process tree
    ours = [{"pid": os.getpid(), "used_memory_bytes": 5}]
    nvml = _reading(foreign, ours, [])
    job = try_lock(tmp_path, UUID2, purpose="job")
    assert job is not None
    try:
        view = occupancy_view(nvml, lock_dir=tmp_path)
        unlocked = occupancy_view(nvml, lock_dir=tmp_path, locks=False)
    finally:
        release([job])
    assert view.gpus[UUID0].state == BUSY and view.gpus[UUID0].pids == (1,)
    assert view.gpus[UUID1].state == FREE  # this process is nobody else
    assert view.gpus[UUID2].state == BUSY and view.gpus[UUID2].why == JOB_LOCKED
    assert view.by_nvml[UUID2].state == FREE  # NVML's word, where a fresh look starts
    assert unlocked.gpus[UUID2].state == FREE  # the caller's claim answers the locks


def test_an_unreadable_reading_makes_no_gpu_free(tmp_path: Path) -> None:
    nvml = _reading(None)  # processes could not be listed
    assert occupancy_view(nvml, lock_dir=tmp_path).gpus[UUID0].state == UNKNOWN
    assert occupancy_view(None, lock_dir=tmp_path).gpus == {}


@pytest.mark.parametrize("purpose, shared", [("job", False), ("qualify", True)])
def test_the_kernel_says_which_locks_are_held_and_which_cannot_be_checked(
        tmp_path: Path, purpose: str, shared: bool) -> None:
    held = try_lock(tmp_path, UUID0, purpose=purpose, shared=shared)
    assert held is not None
    os.mkfifo(tmp_path / f"{UUID2}.lock")  # planted in the shared folder
    try:
        answers = lock_answers(tmp_path, [UUID0, UUID1, UUID2])
    finally:
        release([held])
    assert set(answers.held) == {UUID0} and set(answers.unusable) == {UUID2}
