"""A GPU's NVLink domain, from the topology the nvml probe read: the GPUs whose work a reset
of it would end (the GPU reset rung, core.gpu_reset). Pure: no I/O.

The nvml child reads, for each GPU and each active NVLink link, where the link ends
(core.observations.NvLinkEnd: the remote device type, a GPU peer or an NVSwitch, and its PCI
bus id). The domain of a GPU is then:
- itself alone when it has no NVLink, or no active link;
- the connected component of the GPUs joined by direct GPU-GPU links;
- with every GPU whose links end at an NVSwitch, when one of the component's do: all GPUs
  behind a switch share one fabric (on an HGX H100/H200 baseboard, every GPU of the node);
- the whole node when the topology that would decide it cannot be read (the remote calls
  unsupported or failing, a link's end neither a GPU of this node nor a switch): never a
  smaller domain than the reading proves. A GPU whose ends are unread may sit behind the
  switch, so a fabric domain with such a GPU on the node is the whole node too.

The answer says how it was found (``basis``, ``why``): the rung's evidence and log lines.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from gpudiag.core.observations import NvLinkEnd
from gpudiag.core.records import dataclass

# How a domain was found (NvlinkDomain.basis).
NO_NVLINK = "no_nvlink"            # the GPU has no NVLink: itself alone
NO_ACTIVE_LINK = "no_active_link"  # NVLink, none of its links active: itself alone
GPU_LINKS = "gpu_links"            # the GPUs joined by direct GPU-GPU links
NVSWITCH = "nvswitch"              # every GPU behind the NVSwitch fabric (and any linked)
WHOLE_NODE = "whole_node"          # the topology could not be read: every GPU of the node
BASES = (NO_NVLINK, NO_ACTIVE_LINK, GPU_LINKS, NVSWITCH, WHOLE_NODE)

_SWITCH = "\0switch"  # the fabric, as one node of the graph (no UUID looks like it)


class LinkedGpu(Protocol):
    """What the domain needs of a GPU (core.gpu_reset.ResetGpu is one)."""

    @property
    def pci_bus_id(self) -> str | None: ...

    @property
    def nvlink(self) -> bool: ...  # it has NVLink links, in any state

    @property
    def ends(self) -> Sequence[NvLinkEnd] | None: ...  # its active links' ends; None: unread

    @property
    def unread(self) -> str: ...  # why ``ends`` is None


@dataclass(frozen=True)
class NvlinkDomain:
    """The GPUs that must be idle for ``gpus[0]`` to be reset, itself first, and how that
    was found (``basis`` one of BASES; ``why`` says it for the evidence and the log)."""

    gpus: tuple[str, ...]
    basis: str
    why: str

    def evidence(self) -> dict[str, object]:
        return {"gpus": list(self.gpus), "basis": self.basis, "why": self.why}


def bus_key(bus_id: str | None) -> str | None:
    """A PCI bus id in one spelling: NVML's ``00000000:18:00.0`` and ``0000:18:00.0`` alike."""
    if not bus_id:
        return None
    text = bus_id.strip().lower()
    dom, sep, rest = text.rpartition(":")
    head, _, bus = dom.rpartition(":") if sep else ("", "", "")
    try:
        return f"{int(head or '0', 16):x}:{int(bus, 16):02x}:{rest}"
    except ValueError:
        return text


def _edges(uuid: str, gpu: LinkedGpu, by_bus: Mapping[str, str]
           ) -> tuple[set[str], str | None]:
    """The GPUs and the fabric (_SWITCH) that ``uuid``'s active links reach, or why that is
    unknown."""
    if gpu.ends is None:
        return set(), gpu.unread or "where its links end was not read"
    out: set[str] = set()
    for end in gpu.ends:
        if end.device_type == "switch":
            out.add(_SWITCH)
            continue
        if end.device_type == "ibmnpu":  # a CPU's NVLink (POWER9): it joins no GPU
            continue
        peer = by_bus.get(bus_key(end.pci_bus_id) or "")
        if peer is None:
            return set(), (f"link {end.link} ends at {end.pci_bus_id or 'no PCI bus id'} "
                           f"({end.device_type or 'type not said'}), neither a GPU this "
                           "reading names nor an NVSwitch")
        if peer != uuid:
            out.add(peer)
    return out, None


def nvlink_domain(uuid: str, gpus: Mapping[str, LinkedGpu]) -> NvlinkDomain:
    """``uuid``'s NVLink domain among the node's GPUs ``gpus`` (module docstring)."""
    own = gpus.get(uuid)
    if own is None or not own.nvlink:
        return NvlinkDomain((uuid,), NO_NVLINK, f"GPU {uuid} has no NVLink: its own domain")
    by_bus = {k: u for u, g in gpus.items() if (k := bus_key(g.pci_bus_id)) is not None}
    graph: dict[str, set[str]] = {_SWITCH: set()}
    unknown: dict[str, str] = {}
    for u, g in gpus.items():
        graph.setdefault(u, set())
        if not g.nvlink:
            continue
        reached, why = _edges(u, g, by_bus)
        if why is not None:
            unknown[u] = why
            graph[_SWITCH].add(u)  # it may sit behind the switch
            graph[u].add(_SWITCH)
        for v in reached:
            graph[u].add(v)
            graph.setdefault(v, set()).add(u)
    seen, todo = {uuid}, [uuid]
    while todo:
        for v in graph[todo.pop()] - seen:
            seen.add(v)
            todo.append(v)
    members = sorted(u for u in seen if u not in (uuid, _SWITCH))
    unread = sorted(u for u in seen if u in unknown)
    if unread:
        first = unread[0]
        return NvlinkDomain(
            (uuid, *sorted(u for u in gpus if u != uuid)), WHOLE_NODE,
            f"the NVLink topology could not be read (GPU {first}: {unknown[first]}): the "
            "whole node is taken as the domain")
    if _SWITCH in seen:
        return NvlinkDomain((uuid, *members), NVSWITCH,
                            f"behind the NVSwitch fabric with {len(members)} other GPU(s)")
    if not members:
        return NvlinkDomain((uuid,), NO_ACTIVE_LINK if not own.ends else GPU_LINKS,
                            f"GPU {uuid} has no active NVLink link to another GPU: its own "
                            "domain")
    return NvlinkDomain((uuid, *members), GPU_LINKS,
                        f"joined by direct NVLink links to {', '.join(members)}")
