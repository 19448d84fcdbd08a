"""The occupancy rule in core: typed NVML device or MIG instance -> FREE, BUSY or UNKNOWN."""

from __future__ import annotations

from typing import Any

import pytest

from gpudiag.core.decode import decode
from gpudiag.core.observations import NvmlObservation
from gpudiag.core.occupancy import BUSY, FREE, UNKNOWN, leaves_from_nvml, occupancy

UUID = "GPU-f00d0000-0000-4000-8000-000000000000"
MIG = "MIG-f00d0000-0000-4000-8000-000000000001"


def device(**changes: Any) -> Any:
    raw = {"index": 0, "ok": True, "uuid": UUID, "memory": {"free_bytes": 10, "total_bytes": 20},
           "processes": [], **changes}
    return decode(NvmlObservation, {"ok": True, "devices": [raw]}).devices[0]


@pytest.mark.parametrize("changes, state, why", [
    ({}, FREE, None),
    ({"processes": [{"pid": 77, "used_memory_bytes": 5}]}, BUSY, "pids 77"),
    ({"processes": [{"used_memory_bytes": 5}]}, BUSY, "1 compute process(es) of others"),
    ({"ok": False, "error": {"code": 15, "name": "GPU_IS_LOST"}}, UNKNOWN, "could not be read"),
    ({"uuid": "GPU-f00d"}, UNKNOWN, "full UUID"),
    ({"memory": None}, UNKNOWN, "memory"),
    ({"processes": None}, UNKNOWN, "compute processes could not be listed"),
])
def test_occupancy_of_a_gpu(changes: dict[str, Any], state: str, why: str | None) -> None:
    occ = occupancy(device(**changes))
    assert occ.state == state and occ.free == (state == FREE)
    assert (occ.reason is None) if why is None else (why in str(occ.reason))


def test_our_own_processes_do_not_make_a_gpu_busy() -> None:
    dev = device(processes=[{"pid": 10}, {"pid": 11}])
    assert occupancy(dev, ours={10, 11}).state == FREE
    mixed = occupancy(dev, ours={10})
    assert mixed.state == BUSY and mixed.pids == (11,)


def test_unknown_is_never_free_whatever_is_ours() -> None:
    for changes in ({"processes": None}, {"memory": None}, {"ok": False}):
        assert occupancy(device(**changes), ours={1, 2, 3}).state == UNKNOWN


def test_mig_instances_are_the_leaves_and_inherit_an_unreadable_parent() -> None:
    mig = {"enabled": True, "instances": [
        {"slot": 0, "uuid": MIG, "memory": {"free_bytes": 1, "total_bytes": 2},
         "processes": [{"pid": 5}]}]}
    leaves = leaves_from_nvml(decode(NvmlObservation, {"ok": True, "devices": [
        {"index": 0, "ok": True, "uuid": UUID, "mig": mig}]}))
    assert [(lf.uuid, lf.kind, lf.parent_uuid, lf.occupancy, lf.pids) for lf in leaves] == [
        (MIG, "mig", UUID, BUSY, (5,))]
    lost = leaves_from_nvml(decode(NvmlObservation, {"ok": True, "devices": [
        {"index": 0, "ok": False, "uuid": UUID, "mig": mig}]}))
    assert lost[0].occupancy == UNKNOWN
    empty = leaves_from_nvml(decode(NvmlObservation, {"ok": True, "devices": [
        {"index": 0, "ok": True, "uuid": UUID, "mig": {"enabled": True, "instances": []}}]}))
    assert empty[0].occupancy == UNKNOWN and empty[0].uuid is None
