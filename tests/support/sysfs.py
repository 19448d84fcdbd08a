"""Sysfs trees for the nic probe, written from the kernel's ABI documents.

Documentation/ABI/stable/sysfs-class-infiniband: ``ports/N/state`` "4: ACTIVE",
``phys_state`` "5: LinkUp" (2: Polling, no peer; 3: Disabled), ``rate`` "400 Gb/sec (4X NDR)",
``link_layer`` "InfiniBand" or "Ethernet", ``counters/*`` decimal integers, ``fw_ver`` on the
HCA and its ``device`` link to the PCI function. Documentation/ABI/testing/sysfs-class-net:
``operstate`` up/down, ``carrier`` 1/0, ``carrier_changes``, ``speed`` in Mb/s, ``device``.
Point the probe at it with GPUDIAG_SYSFS_ROOT.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

ACTIVE, DOWN, INIT = "4: ACTIVE", "1: DOWN", "2: INIT"
LINK_UP, POLLING, DISABLED = "5: LinkUp", "2: Polling", "3: Disabled"
NDR, HDR = "400 Gb/sec (4X NDR)", "200 Gb/sec (4X HDR)"


class SysfsTree:
    """A sysfs root under ``root`` (class/infiniband, class/net, bus/pci/devices)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "class" / "infiniband").mkdir(parents=True, exist_ok=True)
        (root / "class" / "net").mkdir(parents=True, exist_ok=True)
        self.boot_id = root / "boot_id"
        self.boot_id.write_text("6b3c7f2e-0000-4000-8000-000000000001\n")

    def env(self) -> dict[str, str]:
        """The probe child's variables that point it here (and at no config file)."""
        return {"GPUDIAG_SYSFS_ROOT": str(self.root), "GPUDIAG_BOOT_ID_FILE": str(self.boot_id),
                "GPUDIAG_BACKEND_SETTINGS": ""}

    def pci(self, bus_id: str, numa_node: int = 0,
            under: tuple[str, ...] = ("pci0000:00",)) -> Path:
        """A PCI function at ``devices/<under...>/<bus_id>`` (``under``: the host bridge, then
        the root port and switch ports above it), linked from ``bus/pci/devices``."""
        d = self.root.joinpath("devices", *under, bus_id)
        d.mkdir(parents=True, exist_ok=True)
        (d / "numa_node").write_text(f"{numa_node}\n")
        bus = self.root / "bus" / "pci" / "devices"
        bus.mkdir(parents=True, exist_ok=True)
        if not (bus / bus_id).is_symlink():
            (bus / bus_id).symlink_to(d)
        return d

    def gpu(self, bus_id: str, numa_node: int = 0,
            under: tuple[str, ...] = ("pci0000:00",)) -> Path:
        """An NVIDIA 3D controller (vendor 0x10de, class 0x030200)."""
        d = self.pci(bus_id, numa_node, under)
        (d / "vendor").write_text("0x10de\n")
        (d / "class").write_text("0x030200\n")
        return d

    def hca(self, name: str, *, fw_ver: str = "28.39.1002", bus_id: str = "0000:17:00.0",
            numa_node: int = 0, under: tuple[str, ...] = ("pci0000:00",)) -> Path:
        d = self.root / "class" / "infiniband" / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "fw_ver").write_text(fw_ver + "\n")
        (d / "hca_type").write_text("MT4129\n")
        link = d / "device"
        if not link.is_symlink():
            link.symlink_to(self.pci(bus_id, numa_node, under))
        return d

    def ib_port(self, hca: str, port: int = 1, *, state: str = ACTIVE,
                phys_state: str = LINK_UP, rate: str = NDR, link_layer: str = "InfiniBand",
                counters: Mapping[str, int] | None = None, fw_ver: str = "28.39.1002",
                bus_id: str = "0000:17:00.0", numa_node: int = 0,
                under: tuple[str, ...] = ("pci0000:00",)) -> Path:
        """Write (or rewrite) one HCA port."""
        self.hca(hca, fw_ver=fw_ver, bus_id=bus_id, numa_node=numa_node, under=under)
        d = self.root / "class" / "infiniband" / hca / "ports" / str(port)
        (d / "counters").mkdir(parents=True, exist_ok=True)
        (d / "hw_counters").mkdir(parents=True, exist_ok=True)
        (d / "state").write_text(state + "\n")
        (d / "phys_state").write_text(phys_state + "\n")
        (d / "rate").write_text(rate + "\n")
        (d / "link_layer").write_text(link_layer + "\n")
        base = {"symbol_error": 0, "link_downed": 0, "port_rcv_errors": 0,
                "local_link_integrity_errors": 0, "port_xmit_data": 123456}
        for name, value in {**base, **(counters or {})}.items():
            (d / "counters" / name).write_text(f"{value}\n")
        (d / "hw_counters" / "out_of_sequence").write_text("0\n")
        return d

    def counter(self, hca: str, port: int, name: str, value: int) -> None:
        path = self.root / "class" / "infiniband" / hca / "ports" / str(port) / "counters"
        (path / name).write_text(f"{value}\n")

    def netdev(self, name: str, *, up: bool = True, speed_mbps: int = 100000,
               carrier_changes: int = 2, bus_id: str | None = "0000:18:00.0",
               rdma: bool = False) -> Path:
        d = self.root / "class" / "net" / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "operstate").write_text(("up" if up else "down") + "\n")
        (d / "carrier").write_text(("1" if up else "0") + "\n")
        (d / "carrier_changes").write_text(f"{carrier_changes}\n")
        (d / "speed").write_text(f"{speed_mbps if up else -1}\n")
        if bus_id is not None and not (d / "device").is_symlink():
            dev = self.pci(bus_id)
            if rdma:
                (dev / "infiniband").mkdir(exist_ok=True)
            (d / "device").symlink_to(dev)
        return d
