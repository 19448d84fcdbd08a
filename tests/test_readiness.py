"""Occupancy and the two questions (core.readiness): pure rules, table-driven."""

from __future__ import annotations

from gpudiag.core.findings import Findings
from gpudiag.core.readiness import BUSY, FREE, UNKNOWN, GpuOccupancy, ProbeScope, settle
from gpudiag.core.requirement import parse_requirement
from gpudiag.core.verdict import DeviceInfo, Requirement

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


def test_a_gpu_backend_without_a_free_gpu_is_not_proven_for_a_job() -> None:
    f = Findings()
    scope = ProbeScope(occupancy={}, backend_gpu={"jax": None})
    settle(f, [], parse_requirement("jax"), scope, checked_at=NOW)
    assert [b.code for b in f.blockers] == ["devices_busy"]
