"""Issue 52's leftover: the GPU reset rung's NVLink domain read from the real topology.

The pure rule (core.nvlink_domain), then the nvml probe over the fake driver (where each
active link ends: FAKE_NVML_NVLINK_PEERS, an NVSwitch by default, the remote calls
unsupported), then a real `gpudiag serve` whose reset of a GPU proceeds or is refused by its
domain, with the fake nvidia-smi's log showing every reset made.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpudiag.core.environment import probe_environment
from gpudiag.core.gpu_reset import DOMAIN_BUSY, ResetGpu
from gpudiag.core.nvlink_domain import (
    BASES,
    GPU_LINKS,
    NO_ACTIVE_LINK,
    NO_NVLINK,
    NVSWITCH,
    WHOLE_NODE,
    bus_key,
    nvlink_domain,
)
from gpudiag.core.observations import NvLinkEnd
from gpudiag.engine.isolation import run_probe
from tests.fakes.build import FakeDriver
from tests.fakes.jobs import FakeJobs
from tests.support.daemon import (
    Daemon,
    host_env,
    metric_samples,
    wait_for,
)
from tests.support.reset_rung import (
    ResetNode,
    reset_node,
    smi_resets,
    start_reset_daemon,
)

U = [f"GPU-f00d000{i}-0000-4000-8000-00000000000{i}" for i in range(4)]
BUS = [f"00000000:{0x18 + i:02X}:00.0" for i in range(4)]
SWITCH_BUS = "00000000:C0:00.0"


def _gpu(i: int, *ends: tuple[str | None, str], nvlink: bool = True, unread: str = "",
         read: bool = True) -> ResetGpu:
    links = tuple(NvLinkEnd(n, kind, bus) for n, (kind, bus) in enumerate(ends))
    return ResetGpu(U[i], BUS[i], "free", nvlink, ends=links if read else None, unread=unread)


def _node(*gpus: ResetGpu) -> dict[str, ResetGpu]:
    return {g.uuid: g for g in gpus}


# -- the rule --------------------------------------------------------------------------------
def test_every_basis_is_documented_where_the_evidence_is() -> None:
    reference = (Path(__file__).resolve().parent.parent / "docs" / "reference.md").read_text()
    said = reference.split("The NVLink domain (`core/nvlink_domain.py`)", 1)[1][:800]
    assert [b for b in BASES if f"`{b}`" not in said] == []


def test_pci_bus_ids_compare_in_either_of_nvmls_spellings() -> None:
    assert bus_key("00000000:1A:00.0") == bus_key("0000:1a:00.0") == "0:1a:00.0"
    assert bus_key(None) is None and bus_key("odd") == "odd"


def test_two_pairs_of_linked_gpus_are_two_domains() -> None:
    node = _node(_gpu(0, ("gpu", BUS[1]), ("gpu", BUS[1])), _gpu(1, ("gpu", BUS[0])),
                 _gpu(2, ("gpu", BUS[3])), _gpu(3, ("gpu", BUS[2])))
    d = nvlink_domain(U[3], node)
    assert d.gpus == (U[3], U[2]) and d.basis == GPU_LINKS and U[2] in d.why
    assert nvlink_domain(U[0], node).gpus == (U[0], U[1])


def test_a_chain_of_direct_links_is_one_domain_and_a_driver_without_the_type_call_is_read_by_bus(
) -> None:
    # 0-1, 1-2: one component; the type not said, the bus id names the peer GPU.
    node = _node(_gpu(0, (None, BUS[1])), _gpu(1, (None, BUS[0]), (None, BUS[2])),
                 _gpu(2, (None, BUS[1])), _gpu(3, nvlink=False))
    assert nvlink_domain(U[0], node).gpus == (U[0], U[1], U[2])
    assert nvlink_domain(U[3], node).basis == NO_NVLINK


def test_every_gpu_behind_the_nvswitch_fabric_is_one_domain() -> None:
    node = _node(*(_gpu(i, ("switch", SWITCH_BUS)) for i in range(3)), _gpu(3, nvlink=False))
    d = nvlink_domain(U[1], node)
    assert d.gpus == (U[1], U[0], U[2]) and d.basis == NVSWITCH


def test_a_gpu_with_no_active_link_is_its_own_domain() -> None:
    node = _node(_gpu(0), _gpu(1, ("switch", SWITCH_BUS)), _gpu(2, ("switch", SWITCH_BUS)))
    d = nvlink_domain(U[0], node)
    assert d.gpus == (U[0],) and d.basis == NO_ACTIVE_LINK


@pytest.mark.parametrize("node", [
    # its own ends unread
    _node(_gpu(0, read=False, unread="link 0: NVML_ERROR_NOT_SUPPORTED: Not Supported"),
          _gpu(1, ("gpu", BUS[0])), _gpu(2), _gpu(3, nvlink=False)),
    # a peer's ends unread: the component is unknown past it
    _node(_gpu(0, ("gpu", BUS[1])), _gpu(1, read=False, unread="link 0: NVML_ERROR_UNKNOWN"),
          _gpu(2), _gpu(3, nvlink=False)),
    # behind the switch, with a GPU of the node whose ends are unread (it may be there too)
    _node(_gpu(0, ("switch", SWITCH_BUS)), _gpu(1, ("switch", SWITCH_BUS)),
          _gpu(2, read=False, unread="not read"), _gpu(3, nvlink=False)),
    # a link ending at neither a GPU of this node nor a switch
    _node(_gpu(0, ("gpu", "00000000:99:00.0")), _gpu(1), _gpu(2), _gpu(3, nvlink=False)),
], ids=["own", "peer", "switch", "stranger"])
def test_a_topology_that_cannot_be_read_is_the_whole_node_with_the_reason(
        node: dict[str, ResetGpu]) -> None:
    d = nvlink_domain(U[0], node)
    assert d.gpus == (U[0], U[1], U[2], U[3]) and d.basis == WHOLE_NODE
    assert "could not be read" in d.why and "GPU-" in d.why


def test_an_unread_gpu_elsewhere_does_not_widen_a_proven_pair() -> None:
    node = _node(_gpu(0, ("gpu", BUS[1])), _gpu(1, ("gpu", BUS[0])),
                 _gpu(2, read=False, unread="not read"), _gpu(3, ("gpu", BUS[2])))
    assert nvlink_domain(U[0], node).gpus == (U[0], U[1])
    # GPU 3's link ends at GPU 2, whose own links are unknown: the whole node.
    assert nvlink_domain(U[3], node).basis == WHOLE_NODE


# -- the probe over the fake driver --------------------------------------------------------------
def _probe(fakes: FakeDriver, tmp: Path, **knobs: str | int) -> list[Any]:
    env = host_env(fakes, tmp, gpus=4, FAKE_NVML_DEVICE_COUNT=4, **knobs)
    run = run_probe("nvml", env=probe_environment(env), timeout_s=60)
    assert run.nvml is not None and run.nvml.ok
    return [d.nvlinks for d in run.nvml.devices]


def test_the_probe_reads_where_each_active_link_ends(fakes: FakeDriver, tmp_path: Path) -> None:
    links = _probe(fakes, tmp_path, FAKE_NVML_NVLINKS="0:2,1:2,2:4,3:4",
                   FAKE_NVML_NVLINK_PEERS="0:1,1:0,2:switch", FAKE_NVML_NVLINK_DOWN="2:1")
    assert links[0].remotes == (NvLinkEnd(0, "gpu", BUS[1]), NvLinkEnd(1, "gpu", BUS[1]))
    # An NVSwitch, named so or by default; an inactive link has no end.
    assert [(e.link, e.device_type) for e in links[2].remotes] == [
        (0, "switch"), (2, "switch"), (3, "switch")]
    assert links[2].remotes[0].pci_bus_id == SWITCH_BUS
    assert {e.device_type for e in links[3].remotes} == {"switch"}
    assert all(li.remote_error is None for li in links)


def test_the_probe_says_why_the_ends_are_unread_and_reads_bus_ids_without_the_type_call(
        fakes: FakeDriver, tmp_path: Path) -> None:
    knobs: dict[str, str | int] = {"FAKE_NVML_NVLINKS": "0:2,1:2",
                                   "FAKE_NVML_NVLINK_PEERS": "0:1,1:0"}
    unread = _probe(fakes, tmp_path / "a", FAKE_NVML_UNSUPPORTED="nvlink_remote", **knobs)
    assert unread[0].active == (0, 1) and unread[0].remotes is None
    assert "NVML_ERROR_NOT_SUPPORTED" in unread[0].remote_error
    old = _probe(fakes, tmp_path / "b", FAKE_NVML_UNSUPPORTED="nvlink_remote_type", **knobs)
    assert old[1].remotes == (NvLinkEnd(0, None, BUS[0]), NvLinkEnd(1, None, BUS[0]))


# -- a real daemon on the fakes ------------------------------------------------------------------
PAIRS: dict[str, str | int] = {"FAKE_NVML_DEVICE_COUNT": 4,
                               "FAKE_NVML_NVLINKS": "0:4,1:4,2:4,3:4",
                               "FAKE_NVML_NVLINK_PEERS": "0:1,1:0,2:3,3:2"}


@pytest.fixture
def node(fakes: FakeDriver, tmp_path: Path) -> ResetNode:
    return reset_node(fakes, tmp_path, gpus=4)


def _resets(node: ResetNode) -> list[list[str]]:
    return [c["argv"] for c in smi_resets(node)]


def _domains(daemon: Daemon) -> dict[str, Any]:
    status, body = daemon.get("/v1/health")
    assert status == 200 and isinstance(body, dict), body
    domains = body["evidence"]["gpu_reset"]["domains"]
    assert isinstance(domains, dict)
    return domains


def _left_alone(daemon: Daemon) -> dict[str, float]:
    return {lab["reason"]: v for lab, v in metric_samples(
        daemon, "gpudiag_gpu_reset_left_alone_total")}


def _one_busy_gpu_and_two_faulty(node: ResetNode, knobs: dict[str, str | int],
                                 faulty: str) -> tuple[Daemon, FakeJobs]:
    """GPU 0 runs a job; the GPUs ``faulty`` (``1:48,3:48``) get a reset XID."""
    jobs = FakeJobs(node.state_file, knobs=knobs)
    jobs.__enter__()
    try:
        daemon = start_reset_daemon(node, knobs)
    except BaseException:
        jobs.__exit__(None, None, None)
        raise
    jobs.set_knobs(**knobs)  # the start rewrote the file: own it again
    jobs.start(0, memory_mib=4096)
    jobs.set_knobs(FAKE_NVML_XIDS=faulty)
    return daemon, jobs


def test_two_pairs_the_idle_pair_is_reset_and_the_busy_gpus_partner_is_not(
        node: ResetNode) -> None:
    daemon, jobs = _one_busy_gpu_and_two_faulty(node, PAIRS, "1:48,3:48")
    try:
        wait_for(lambda: _resets(node), 30, interval=0.2)
        wait_for(lambda: _left_alone(daemon)[DOMAIN_BUSY] == 1, 30, interval=0.2)
        assert _resets(node) == [["-r", "-i", BUS[3]]]  # GPU 3 (its partner 2 idle) only
        domains = _domains(daemon)
        assert domains[U[1]] == {"gpus": [U[1], U[0]], "basis": GPU_LINKS,
                                 "why": f"joined by direct NVLink links to {U[0]}"}
        assert any(f"left alone: GPU {U[1]} shares its NVLink domain" in line
                   for line in daemon.lines)
        assert any(f"resetting GPU {U[3]}" in line and "NVLink links to " + U[2] in line
                   for line in daemon.lines)
    finally:
        try:
            assert daemon.stop() == 0
        finally:
            jobs.__exit__(None, None, None)


@pytest.mark.parametrize(("knobs", "basis", "said"), [
    ({"FAKE_NVML_DEVICE_COUNT": 4, "FAKE_NVML_NVLINKS": "0:4,1:4,2:4,3:4",
      "FAKE_NVML_NVLINK_PEERS": "0:switch"}, NVSWITCH, "behind the NVSwitch fabric"),
    ({**PAIRS, "FAKE_NVML_UNSUPPORTED": "nvlink_remote"}, WHOLE_NODE,
     "NVML_ERROR_NOT_SUPPORTED"),
], ids=["nvswitch", "unsupported"])
def test_a_fabric_or_an_unread_topology_is_one_domain_of_the_whole_node(
        node: ResetNode, knobs: dict[str, str | int], basis: str, said: str) -> None:
    daemon, jobs = _one_busy_gpu_and_two_faulty(node, knobs, "3:48")
    try:
        wait_for(lambda: _left_alone(daemon)[DOMAIN_BUSY] == 1, 30, interval=0.2)
        domain = _domains(daemon)[U[3]]
        assert domain["gpus"] == [U[3], U[0], U[1], U[2]] and domain["basis"] == basis
        assert said in domain["why"]
        assert _resets(node) == []
    finally:
        try:
            assert daemon.stop() == 0
        finally:
            jobs.__exit__(None, None, None)
