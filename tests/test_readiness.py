"""Occupancy and the two questions (core.readiness): pure rules, table-driven."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpudiag.core.findings import Findings
from gpudiag.core.readiness import (
    BUSY,
    FREE,
    UNKNOWN,
    GpuOccupancy,
    ProbeScope,
    require_proof,
    settle,
)
from gpudiag.core.requirement import parse_requirement
from gpudiag.core.verdict import UNPROVEN, BackendStatus, DeviceInfo, Requirement

UUIDS = [f"GPU-f00d{i:04x}-0000-4000-8000-00000000{i:04x}" for i in range(3)]
NOW = "2026-11-30T12:00:00.000Z"


def _devices(n: int = 2) -> list[DeviceInfo]:
    return [DeviceInfo(index=i, uuid=UUIDS[i], name="NVIDIA H200", pci_bus_id=None,
                       memory_total_bytes=1, memory_free_bytes=1) for i in range(n)]


def _scope(*states: str, probed: tuple[str, ...] = ()) -> ProbeScope:
    occ = {UUIDS[i]: GpuOccupancy(UUIDS[i], s, (4242,) if s == BUSY else ())
           for i, s in enumerate(states)}
    return ProbeScope(occupancy=occ, probed=frozenset(probed))


def _settle(f: Findings, req: Requirement, scope: ProbeScope, n: int = 2
            ) -> tuple[DeviceInfo, ...]:
    return settle(f, _devices(n), req, scope, checked_at=NOW)


def test_gpus_one_is_ready_on_the_free_gpu_and_names_it() -> None:
    f = Findings()
    f.block("cuda_devices_unavailable", "46", backend="cuda", device=UUIDS[0])
    devs = _settle(f, Requirement(gpus=1), _scope(BUSY, FREE, probed=(UUIDS[1],)))
    assert f.blockers == []  # 46 on a GPU others use is occupancy, not a fault
    assert [d.selected for d in devs] == [False, True]
    assert [d.occupancy for d in devs] == [BUSY, FREE]
    assert devs[1].last_proven_at == NOW and devs[0].last_proven_at is None


def test_gpus_two_with_one_busy_is_devices_busy() -> None:
    f = Findings()
    _settle(f, Requirement(gpus=2), _scope(BUSY, FREE))
    assert [b.code for b in f.blockers] == ["devices_busy"]


def test_gpus_with_unknown_shortfall_is_device_state_unknown() -> None:
    f = Findings()
    _settle(f, Requirement(gpus=2), _scope(UNKNOWN, FREE))
    assert [b.code for b in f.blockers] == ["device_state_unknown"]


def test_fault_outside_the_chosen_gpus_is_a_warning() -> None:
    f = Findings()
    f.block("gpu_lost", "GPU 0: lost", backend="nvml", device=UUIDS[0])
    devs = _settle(f, Requirement(gpus=1), _scope(FREE, FREE))
    assert f.blockers == []
    assert [w.code for w in f.warnings] == ["gpu_fault_outside_selection"]
    assert UUIDS[0] in f.warnings[0].message and "gpu_lost" in f.warnings[0].message
    assert [d.selected for d in devs] == [False, True] and devs[0].healthy is False


def test_too_few_healthy_gpus_keeps_the_fault_as_primary() -> None:
    f = Findings()
    f.block("gpu_lost", "GPU 0: lost", backend="nvml", device=UUIDS[0])
    _settle(f, Requirement(gpus=2), _scope(FREE, FREE))
    assert [b.code for b in f.blockers] == ["gpu_lost", "insufficient_devices"]


def test_without_gpus_every_visible_gpu_must_be_free() -> None:
    f = Findings()
    _settle(f, Requirement(), _scope(BUSY, FREE))
    assert [b.code for b in f.blockers] == ["devices_busy"]
    assert "4242" in f.blockers[0].message


def test_node_health_busy_gpus_are_healthy_in_use() -> None:
    f = Findings()
    f.block("cuda_out_of_memory", "2", backend="cuda", device=UUIDS[0])
    devs = _settle(f, Requirement(node_health=True), _scope(BUSY, BUSY))
    assert f.blockers == []
    assert all(d.healthy for d in devs)


def test_node_health_keeps_a_real_fault() -> None:
    f = Findings()
    f.block("gpu_lost", "GPU 1: lost", backend="nvml", device=UUIDS[1])
    _settle(f, Requirement(node_health=True), _scope(BUSY, FREE))
    assert [b.code for b in f.blockers] == ["gpu_lost"]


def test_out_of_memory_without_other_processes_stays_a_fault() -> None:
    f = Findings()
    f.block("cuda_out_of_memory", "2", backend="cuda", device=UUIDS[0])
    _settle(f, Requirement(node_health=True), _scope(FREE, FREE))
    assert [b.code for b in f.blockers] == ["cuda_out_of_memory"]


@pytest.mark.parametrize("node_health", [False, True])
def test_an_unproven_gpu_backend_is_never_ready_whatever_the_question(node_health: bool) -> None:
    f = Findings()
    requirement = replace(parse_requirement("cuda,jax"), node_health=node_health)
    backends = {"cuda": BackendStatus("ok", 0.1),
                "jax": BackendStatus(UNPROVEN, 0.5, {}, {"reason": "no free GPU (8 locked)"})}
    require_proof(f, requirement, backends)
    assert [(b.code, b.backend) for b in f.blockers] == [("backend_unproven", "jax")]
    message = f.blockers[0].message
    assert "no free GPU (8 locked)" in message
    assert ("nothing known is broken" in message) is node_health


def test_a_proven_backend_adds_nothing() -> None:
    f = Findings()
    require_proof(f, parse_requirement("jax"), {"jax": BackendStatus("ok", 0.5)})
    assert f.blockers == []


def test_job_readiness_names_the_gpu_a_backend_was_proven_on_first() -> None:
    f = Findings()
    devices = _devices(3)
    scope = ProbeScope(occupancy={u: GpuOccupancy(u, FREE) for u in UUIDS},
                       backend_gpu={"jax": UUIDS[1]})
    chosen = settle(f, devices, replace(parse_requirement("jax"), gpus=1), scope,
                    checked_at=NOW)
    assert [d.uuid for d in chosen if d.selected] == [UUIDS[1]]
