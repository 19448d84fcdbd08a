"""The busy-GPU guard (engine.guard): which GPUs the active probes may touch, and the locks."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpudiag.core.readiness import BUSY, FREE, UNKNOWN, GpuOccupancy
from gpudiag.engine import guard
from gpudiag.engine.guard import claim_free, rotated, touches_gpu
from gpudiag.engine.locks import holders, release, try_lock

UUIDS = [f"GPU-f00d{i:04x}-0000-4000-8000-00000000{i:04x}" for i in range(4)]


def _occ(*states: str) -> dict[str, GpuOccupancy]:
    return {UUIDS[i]: GpuOccupancy(UUIDS[i], s) for i, s in enumerate(states)}


def test_only_free_gpus_are_claimed_and_unknown_never(tmp_path: Path) -> None:
    with claim_free(_occ(FREE, BUSY, UNKNOWN, FREE), UUIDS, lock_dir=tmp_path) as claim:
        assert claim.claimed == (UUIDS[0], UUIDS[3])
        assert claim.left_alone == {UUIDS[1]: BUSY, UUIDS[2]: UNKNOWN}


def test_probe_busy_gpus_claims_busy_but_never_unknown(tmp_path: Path) -> None:
    with claim_free(_occ(BUSY, UNKNOWN), UUIDS[:2], lock_dir=tmp_path,
                    probe_busy=True) as claim:
        assert claim.claimed == (UUIDS[0],)


def test_a_gpu_locked_by_someone_else_is_left_alone(tmp_path: Path) -> None:
    other = try_lock(tmp_path, UUIDS[0])  # a `gpudiag run` job's lock
    assert other is not None
    try:
        with claim_free(_occ(FREE, FREE), UUIDS[:2], lock_dir=tmp_path) as claim:
            assert claim.claimed == (UUIDS[1],)
            assert claim.left_alone == {UUIDS[0]: "locked"}
    finally:
        release([other])


def test_locks_are_held_while_claimed_and_released_after(tmp_path: Path) -> None:
    with claim_free(_occ(FREE), UUIDS[:1], lock_dir=tmp_path):
        assert try_lock(tmp_path, UUIDS[0]) is None  # a job cannot take it meanwhile
    again = try_lock(tmp_path, UUIDS[0])
    assert again is not None
    release([again])


def test_jax_and_iree_hold_one_lock_not_every_free_gpu(tmp_path: Path) -> None:
    with claim_free(_occ(FREE, FREE, FREE), UUIDS[:3], lock_dir=tmp_path, limit=1) as claim:
        assert claim.claimed == (UUIDS[0],)
        free = [try_lock(tmp_path, u) for u in UUIDS[1:3]]
        assert all(lk is not None for lk in free)  # the others stay free for jobs
        release([lk for lk in free if lk is not None])


def test_keep_only_releases_the_locks_the_backend_probe_does_not_need(tmp_path: Path) -> None:
    with claim_free(_occ(FREE, FREE, FREE), UUIDS[:3], lock_dir=tmp_path) as claim:
        claim.keep_only(UUIDS[0])
        assert try_lock(tmp_path, UUIDS[0]) is None
        freed = [try_lock(tmp_path, u) for u in UUIDS[1:3]]
        assert all(lk is not None for lk in freed)
        release([lk for lk in freed if lk is not None])


def test_rounds_rotate_over_the_gpus() -> None:
    assert [rotated(UUIDS[:3], r)[0] for r in range(4)] == [UUIDS[0], UUIDS[1], UUIDS[2],
                                                            UUIDS[0]]
    assert rotated([], 5) == []


def test_which_probes_touch_a_gpu() -> None:
    assert touches_gpu("cuda", None)
    assert touches_gpu("jax", {"platform": "gpu"}) and not touches_gpu("jax", {"platform": "cpu"})
    assert touches_gpu("iree", {"drivers": ["cuda"]})
    assert not touches_gpu("iree", {"drivers": ["local-task"]})
    assert not touches_gpu("nvml", None) and not touches_gpu("host", None)


def test_a_gpu_another_probe_is_proving_is_left_alone_but_not_busy(tmp_path: Path) -> None:
    probing = try_lock(tmp_path, UUIDS[0], purpose="probe")  # another preflight, a moment
    assert probing is not None
    try:
        with claim_free(_occ(FREE, FREE), UUIDS[:2], lock_dir=tmp_path) as claim:
            assert claim.claimed == (UUIDS[1],)
            assert claim.left_alone == {UUIDS[0]: "probing"}
    finally:
        release([probing])


def test_a_sibling_probe_letting_go_between_the_try_and_the_look_is_not_called_locked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The race CI met: a sibling's exclusive probe lock is released after our try failed
    and before the kernel's table was read (no holder then): try again, never "locked"."""
    sibling = try_lock(tmp_path, UUIDS[0], purpose="probe")
    assert sibling is not None
    looked: list[str] = []

    def letting_go(lock_dir: Path, uuid: str, table: object = None) -> object:
        if not looked:
            release([sibling])  # it lets go right after our try
        looked.append(uuid)
        return holders(lock_dir, uuid)

    monkeypatch.setattr(guard, "holders", letting_go)
    with claim_free(_occ(FREE), UUIDS[:1], lock_dir=tmp_path, exclusive=UUIDS[:1],
                    sibling_wait_s=5.0) as claim:
        assert claim.claimed == (UUIDS[0],), claim.left_alone
    assert len(looked) == 1  # once ours, nothing else to name: the O(1) test said free
