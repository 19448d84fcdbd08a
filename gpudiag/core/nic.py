"""The node's network ports, as sysfs shows them: the nic backend's records, policy and memory.

Pure: the probe child (gpudiag.probes.nic_probe) reads the files, this module says what they
mean. A port is named ``HCA/PORT`` for an InfiniBand (or RoCE) port under
``class/infiniband`` and by its interface name for a netdev under ``class/net``.

Which ports count (docs/reference.md, "nic"): with ``[backends.nic] expect`` exactly the
ports named; without it, a port that has been up since this boot (the daemon's memory,
``NicMemory``). A port never up since boot (never cabled) and a plain Ethernet netdev
without RDMA (the management NIC) never block unless ``expect`` names them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import field, replace
from typing import Any

from gpudiag.core.records import dataclass

# The InfiniBand counters whose growth means a sick link (the kernel's sysfs-class-infiniband
# ABI, ``ports/N/counters``): symbol errors, link downs, receive errors, link integrity.
ERROR_COUNTERS: tuple[str, ...] = (
    "symbol_error", "link_downed", "port_rcv_errors", "local_link_integrity_errors",
    "link_error_recovery", "excessive_buffer_overrun_errors",
)
# The state files say "4: ACTIVE" and "5: LinkUp": the number is the contract, the word
# is display (Documentation/ABI/stable/sysfs-class-infiniband).
IB_ACTIVE, IB_LINK_UP, IB_POLLING, IB_DISABLED = 4, 5, 2, 3
_STATE_RE = re.compile(r"^\s*([0-9]+)\s*:\s*(.*?)\s*$")
# "400 Gb/sec (4X NDR)", "100 Gb/sec (4X EDR)", "2.5 Gb/sec (1X SDR)"
_RATE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*Gb/sec\s*(?:\((.*)\))?\s*$")

_POLICY_KEYS = ("expect", "min_rate_gbps", "flap_transitions", "flap_window_s",
                "errors_hold_s")


class NicPolicyError(ValueError):
    """A ``[backends.nic]`` setting that cannot be used; the message names the key."""


@dataclass(frozen=True)
class NicPolicy:
    """``[backends.nic]``: which ports are expected and when one is degraded or flapping."""

    expect: tuple[str, ...] | None = None   # None: every port up since this boot
    min_rate_gbps: float | None = None      # configured: below it is a blocker
    flap_transitions: int = 6               # link changes (down or up) within the window
    flap_window_s: float = 600.0
    errors_hold_s: float = 600.0            # an error counter's growth warns this long

    def record(self) -> dict[str, Any]:
        return {"expect": list(self.expect) if self.expect is not None else None,
                "min_rate_gbps": self.min_rate_gbps,
                "flap_transitions": self.flap_transitions,
                "flap_window_s": self.flap_window_s, "errors_hold_s": self.errors_hold_s}


def policy_keys() -> tuple[str, ...]:
    """The keys ``[backends.nic]`` takes besides enabled, interval_s and deadline_s."""
    return _POLICY_KEYS


def parse_policy(raw: Mapping[str, Any]) -> NicPolicy:
    """``[backends.nic]``'s own keys as a NicPolicy; NicPolicyError names a bad one."""
    expect = raw.get("expect")
    if expect is not None and (not isinstance(expect, list) or not all(
            isinstance(p, str) and p.strip() for p in expect)):
        raise NicPolicyError(f"expect = {expect!r}: expected a list of port names "
                             "(\"mlx5_0/1\" for an HCA's port, \"eth2\" for a netdev)")
    rate = raw.get("min_rate_gbps")
    if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float))
                             or not math.isfinite(rate) or rate <= 0):
        raise NicPolicyError(f"min_rate_gbps = {rate!r}: expected a positive number (Gb/s)")
    flaps = raw.get("flap_transitions", 6)
    if isinstance(flaps, bool) or not isinstance(flaps, int) or not 2 <= flaps <= 1000:
        raise NicPolicyError(f"flap_transitions = {flaps!r}: expected an integer from 2 "
                             "to 1000")
    seconds = {}
    for key, default in (("flap_window_s", 600.0), ("errors_hold_s", 600.0)):
        value = raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                1 <= value <= 7 * 86400):
            raise NicPolicyError(f"{key} = {value!r}: expected seconds from 1 to 604800")
        seconds[key] = float(value)
    return NicPolicy(
        expect=tuple(p.strip() for p in expect) if expect is not None else None,
        min_rate_gbps=float(rate) if rate is not None else None,
        flap_transitions=flaps, **seconds)


@dataclass(frozen=True)
class NicPort:
    """One port as sysfs shows it (``kind``: ``ib`` under class/infiniband, ``net``)."""

    name: str
    kind: str
    up: bool
    state: str | None = None          # IB "4: ACTIVE"; netdev operstate "up"
    phys_state: str | None = None     # IB "5: LinkUp"; netdev carrier "1"/"0"
    rate_gbps: float | None = None    # IB rate; netdev speed (Mb/s) / 1000
    rate_text: str | None = None      # "400 Gb/sec (4X NDR)"
    link_layer: str | None = None     # InfiniBand | Ethernet (RoCE)
    cabled: bool = True               # IB phys_state not Polling/Disabled
    rdma: bool = True                 # an IB port or a netdev of an RDMA device
    fw_ver: str | None = None
    hca_type: str | None = None       # the HCA's model (``hca_type``: "MT4129")
    pci_bus_id: str | None = None     # the PCI function behind it (sysfs ``device`` link)
    numa_node: int | None = None
    carrier_changes: int | None = None
    netdev: str | None = None         # an HCA port's netdev (RoCE), an ib port's ipoib
    counters: Mapping[str, int] = field(default_factory=dict)
    # Each NVIDIA GPU on the PCI bus (its sysfs bus id) -> how near this port is to it
    # (``affinity``: PIX, PXB, PHB, NODE, SYS, as `nvidia-smi topo -m` names them).
    gpus: Mapping[str, str] = field(default_factory=dict)


def affinity(port_path: Sequence[str], port_numa: int | None, gpu_path: Sequence[str],
             gpu_numa: int | None) -> str:
    """How near a port's PCI function is to a GPU's, from their sysfs device paths
    (``["pci0000:00", "0000:00:01.0", "0000:01:00.0", ...]``, root first) and NUMA nodes:
    nearest first PIX (one PCIe switch between them), PXB (several bridges), PHB (the same
    host bridge), NODE (the same NUMA node), SYS (across the SMP interconnect), as
    ``nvidia-smi topo -m`` says them."""
    common = 0
    for a, b in zip(port_path, gpu_path, strict=False):
        if a != b:
            break
        common += 1
    if common >= 2:  # below a root port: a PCIe switch (or a chain of them) they share
        below = max(len(port_path) - common, len(gpu_path) - common)
        return "PIX" if below <= 2 else "PXB"
    if common == 1:  # the same host bridge, different root ports
        return "PHB"
    if port_numa is not None and port_numa == gpu_numa:
        return "NODE"
    return "SYS"


@dataclass(frozen=True)
class Growth:
    """An error counter's growth between two reads, and the wall time of the later one."""

    delta: int
    at_wall: float


@dataclass(frozen=True)
class NicMemory:
    """What the daemon remembers across reads since this boot (gpudiag.daemon.scheduler)."""

    boot_id: str | None = None
    seen_up: tuple[str, ...] = ()
    last_up: Mapping[str, bool] = field(default_factory=dict)
    # Wall times of each port's link changes within the flap window.
    transitions: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    last_counters: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    # port -> counter -> its last growth and when (kept for errors_hold_s)
    rising: Mapping[str, Mapping[str, Growth]] = field(default_factory=dict)
    carrier_changes: Mapping[str, int] = field(default_factory=dict)
    now_wall: float = 0.0

    def record(self) -> dict[str, Any]:
        return {"boot_id": self.boot_id, "seen_up": list(self.seen_up),
                "last_up": dict(self.last_up),
                "transitions": {k: list(v) for k, v in self.transitions.items()},
                "last_counters": {k: dict(v) for k, v in self.last_counters.items()},
                "rising": {k: {c: {"delta": g.delta, "at_wall": g.at_wall}
                                 for c, g in v.items()}
                           for k, v in self.rising.items()},
                "carrier_changes": dict(self.carrier_changes), "now_wall": self.now_wall}


@dataclass(frozen=True)
class NicObservation:
    """What the nic probe saw (and its JSON's schema)."""

    ok: bool = True
    boot_id: str | None = None
    ports: tuple[NicPort, ...] = ()
    policy: NicPolicy = field(default_factory=NicPolicy)
    sysfs_root: str | None = None
    error: str | None = None
    # Set by the daemon (never the child): its memory since this boot, for the classifier.
    memory: NicMemory | None = None


def parse_state(text: str | None) -> tuple[int | None, str]:
    """``"4: ACTIVE"`` as (4, "ACTIVE"); (None, text) when it has no number."""
    if text is None:
        return None, ""
    found = _STATE_RE.match(text)
    if found is None:
        return None, text.strip()
    return int(found.group(1)), found.group(2)


def parse_rate(text: str | None) -> float | None:
    """``"400 Gb/sec (4X NDR)"`` as 400.0; None when unreadable."""
    found = _RATE_RE.match(text or "")
    return float(found.group(1)) if found is not None else None


def ib_up(state: str | None, phys_state: str | None) -> bool:
    """An IB port is up when ACTIVE (4) and LinkUp (5)."""
    return parse_state(state)[0] == IB_ACTIVE and parse_state(phys_state)[0] == IB_LINK_UP


def ib_cabled(phys_state: str | None) -> bool:
    """Polling (2: no peer, an empty cage) and Disabled (3) say no cable has trained."""
    return parse_state(phys_state)[0] not in (IB_POLLING, IB_DISABLED)


def _changes(port: NicPort, memory: NicMemory, was_up: bool | None) -> int:
    """Link changes since the last read: the kernel's counters when it keeps them (a netdev's
    carrier_changes, an IB port's link_downed, twice: down and up again), else what two reads
    saw; a counter that went back (a reset) counts only the change the reads saw."""
    seen = 1 if was_up is not None and was_up != port.up else 0
    if port.kind == "net" and port.carrier_changes is not None:
        before = memory.carrier_changes.get(port.name)
        if before is not None and port.carrier_changes >= before:
            return max(seen, port.carrier_changes - before)
        return seen
    downed = port.counters.get("link_downed")
    before_c = memory.last_counters.get(port.name, {}).get("link_downed")
    if downed is not None and before_c is not None and downed >= before_c:
        return max(seen, 2 * (downed - before_c) - (0 if port.up else 1))
    return seen


def advance(memory: NicMemory | None, obs: NicObservation, now_wall: float) -> NicMemory:
    """The memory after one more read; a new boot (another boot id) starts it afresh."""
    if memory is None or memory.boot_id != obs.boot_id:
        memory = NicMemory(boot_id=obs.boot_id)
    policy = obs.policy
    seen = set(memory.seen_up)
    last_up, transitions = dict(memory.last_up), dict(memory.transitions)
    counters, rising = dict(memory.last_counters), dict(memory.rising)
    carrier = dict(memory.carrier_changes)
    for port in obs.ports:
        if port.up:
            seen.add(port.name)
        n = _changes(port, memory, memory.last_up.get(port.name))
        kept = tuple(t for t in transitions.get(port.name, ())
                     if now_wall - t <= policy.flap_window_s)
        transitions[port.name] = kept + (now_wall,) * n
        last_up[port.name] = port.up
        before = memory.last_counters.get(port.name, {})
        grew = dict(rising.get(port.name, {}))
        for name, value in port.counters.items():
            old = before.get(name)
            if old is not None and value > old and name in ERROR_COUNTERS:
                grew[name] = Growth(value - old, now_wall)
        # A counter that went back was reset (perfquery -R, a driver reload): a new baseline.
        rising[port.name] = {k: g for k, g in grew.items()
                             if now_wall - g.at_wall <= policy.errors_hold_s}
        counters[port.name] = dict(port.counters)
        if port.carrier_changes is not None:
            carrier[port.name] = port.carrier_changes
    return NicMemory(boot_id=obs.boot_id, seen_up=tuple(sorted(seen)), last_up=last_up,
                     transitions={k: v for k, v in transitions.items() if v},
                     last_counters=counters, rising={k: v for k, v in rising.items() if v},
                     carrier_changes=carrier, now_wall=now_wall)


@dataclass(frozen=True)
class NicFinding:
    """One finding about a port: a catalog code, blocker or warning, and why."""

    code: str
    port: str
    message: str
    blocker: bool


def expected_ports(obs: NicObservation) -> tuple[str, ...]:
    """The ports whose faults count: ``expect``, else the RDMA ports up since this boot."""
    if obs.policy.expect is not None:
        return obs.policy.expect
    seen = set(obs.memory.seen_up) if obs.memory is not None else set()
    return tuple(p.name for p in obs.ports if p.rdma and (p.up or p.name in seen))


def _down_reason(port: NicPort) -> str:
    if port.kind == "ib":
        why = {IB_POLLING: " (Polling: no peer has trained; an empty cage or a pulled cable)",
               IB_DISABLED: " (Disabled: shut down administratively)"}
        return (f"state {port.state or '?'}, phys_state {port.phys_state or '?'}"
                + why.get(parse_state(port.phys_state)[0] or 0, ""))
    return f"operstate {port.state or '?'}, carrier {port.phys_state or '?'}"


def assess(obs: NicObservation) -> tuple[NicFinding, ...]:
    """Every finding about the expected ports, in port order."""
    by_name = {p.name: p for p in obs.ports}
    policy, memory = obs.policy, obs.memory
    out: list[NicFinding] = []
    expected = expected_ports(obs)
    # Peers: the expected ports up of the same kind and link layer (IB with IB, netdevs
    # with netdevs): a 100 Gb/s management-class netdev is no slower peer of an NDR port.
    best: dict[tuple[str, str | None], float] = {}
    for n in expected:
        p = by_name.get(n)
        if p is not None and p.up and p.rate_gbps is not None:
            key = (p.kind, p.link_layer)
            best[key] = max(best.get(key, 0.0), p.rate_gbps)
    for name in expected:
        port = by_name.get(name)
        if port is None:
            out.append(NicFinding("nic_link_down", name, f"expected port {name} is not on "
                                  "this node (no such HCA port or netdev in sysfs)", True))
            continue
        if not port.up:
            out.append(NicFinding("nic_link_down", name,
                                  f"port {name} is down: {_down_reason(port)}", True))
        elif port.rate_gbps is not None:
            floor = policy.min_rate_gbps
            if floor is not None and port.rate_gbps < floor:
                out.append(NicFinding("nic_link_degraded", name, f"port {name} runs at "
                                      f"{port.rate_gbps:g} Gb/s, below min_rate_gbps "
                                      f"{floor:g}", True))
            elif port.rate_gbps < (peak := best.get((port.kind, port.link_layer), 0.0)):
                out.append(NicFinding("nic_link_degraded", name, f"port {name} runs at "
                                      f"{port.rate_gbps:g} Gb/s, below its peers' "
                                      f"{peak:g} Gb/s", False))
        if memory is None:
            continue
        flips = len(memory.transitions.get(name, ()))
        if flips >= policy.flap_transitions:
            out.append(NicFinding("nic_link_flapping", name, f"port {name} changed link "
                                  f"state {flips} times in {policy.flap_window_s:g} s "
                                  f"(limit {policy.flap_transitions})", True))
        grew = memory.rising.get(name, {})
        if grew:
            said = ", ".join(f"{c} +{g.delta}" for c, g in sorted(grew.items()))
            out.append(NicFinding("nic_errors_rising", name, f"port {name}'s error counters "
                                  f"grew: {said}", False))
    return tuple(out) + drift(obs.ports)


def drift(ports: Sequence[NicPort]) -> tuple[NicFinding, ...]:
    """``nic_config_drift``: an HCA whose firmware differs from the majority of the node's
    HCAs of its model (a tie names no majority, so nothing)."""
    hcas: dict[str, tuple[str | None, str]] = {}
    for p in ports:
        if p.kind == "ib" and p.fw_ver:
            hcas.setdefault(p.name.split("/", 1)[0], (p.hca_type, p.fw_ver))
    out: list[NicFinding] = []
    for model in sorted({m or "" for m, _ in hcas.values()}):
        group = {h: fw for h, (m, fw) in hcas.items() if (m or "") == model}
        counts: dict[str, int] = {}
        for fw in group.values():
            counts[fw] = counts.get(fw, 0) + 1
        ranked = sorted(counts.items(), key=lambda kv: -kv[1])
        if len(ranked) < 2 or ranked[0][1] == ranked[1][1]:
            continue
        majority = ranked[0][0]
        of = f"{model} HCAs" if model else "HCAs"
        out += [NicFinding("nic_config_drift", hca, f"HCA {hca}: fw_ver {fw}, the node's other "
                           f"{of} run {majority} ({ranked[0][1]} of {len(group)})", False)
                for hca, fw in sorted(group.items()) if fw != majority]
    return tuple(out)


# The link codes that make a port a poor one for a GPU's traffic (not errors_rising: a
# counter climbing still carries the job's traffic, nor config drift).
LINK_TROUBLE = frozenset({"nic_link_down", "nic_link_flapping", "nic_link_degraded"})
# Nearest first, as `nvidia-smi topo -m` orders them (core.nic.affinity).
AFFINITY_ORDER = ("PIX", "PXB", "PHB", "NODE", "SYS")


def gpu_nics(obs: NicObservation) -> dict[str, tuple[str, ...]]:
    """Each GPU (its sysfs PCI address) -> its NICs: the expected ports nearest to it."""
    expected = set(expected_ports(obs))
    near: dict[str, list[tuple[int, str]]] = {}
    for p in obs.ports:
        if p.name in expected:
            for bus, how in p.gpus.items():
                rank = AFFINITY_ORDER.index(how) if how in AFFINITY_ORDER else len(AFFINITY_ORDER)
                near.setdefault(bus, []).append((rank, p.name))
    return {bus: tuple(sorted(n for r, n in ports if r == min(r for r, _ in ports)))
            for bus, ports in near.items()}


def gpus_nic_trouble(obs: NicObservation) -> dict[str, tuple[str, ...]]:
    """Each GPU (sysfs PCI address) whose NICs include one down, flapping or degraded ->
    those ports (job readiness on N GPUs prefers the others: core.readiness)."""
    bad = {f.port for f in assess(obs) if f.code in LINK_TROUBLE}
    return {bus: hit for bus, ports in gpu_nics(obs).items()
            if (hit := tuple(p for p in ports if p in bad))}


def shown_ports(obs: NicObservation) -> tuple[NicPort, ...]:
    """The ports the record and the metrics show: RDMA ports and expected ones. A node's
    other netdevs (containers' veths, bridges, the management NIC) would only add series
    that come and go with every pod."""
    expected = set(expected_ports(obs))
    return tuple(p for p in obs.ports if p.rdma or p.name in expected)


def with_memory(obs: NicObservation, memory: NicMemory | None) -> NicObservation:
    """The observation the classifier reads, with the daemon's memory attached."""
    return replace(obs, memory=memory)


def port_summary(ports: Sequence[NicPort]) -> list[dict[str, Any]]:
    """Each port as the backend's detail shows it (the probe table, the evidence)."""
    return [{"port": p.name, "kind": p.kind, "up": p.up, "state": p.state,
             "phys_state": p.phys_state, "rate_gbps": p.rate_gbps, "link_layer": p.link_layer,
             "rdma": p.rdma, "fw_ver": p.fw_ver, "pci_bus_id": p.pci_bus_id,
             "numa_node": p.numa_node, "gpus": dict(p.gpus)} for p in ports]
