"""A fake sysfs PCI tree (``/sys/bus/pci/devices`` look-alike) for the host probe's GPU count.

Point ``GPUDIAG_SYSFS_PCI_DIR`` at the folder ``make_pci_tree`` fills. GPU ``i`` gets the
address the fake NVML and libcuda report for it (bus ``0x18 + i``, fake_common.h's
``fake_pci_bus``), so that NVML's bus IDs and the tree agree. Each tree also holds devices
that are not GPUs and must not be counted: a host bridge, an NVIDIA GPU's audio function and
an NVSwitch.
"""

from __future__ import annotations

import shutil
from pathlib import Path

__all__ = ["make_pci_tree", "pci_address"]

NVIDIA = "0x10de"
_NOT_GPUS = (("0000:00:00.0", "0x8086", "0x060000", "pcieport"),   # Intel host bridge
             ("0000:18:00.1", NVIDIA, "0x040300", "snd_hda_intel"),  # a GPU's audio function
             ("0000:05:00.0", NVIDIA, "0x068000", None))             # an NVSwitch


def pci_address(gpu: int) -> str:
    """The PCI address of fake GPU ``gpu`` as sysfs names it."""
    return f"0000:{0x18 + gpu:02x}:00.0"


def _device(root: Path, address: str, vendor: str, klass: str, driver: str | None) -> None:
    entry = root / address
    entry.mkdir(parents=True, exist_ok=True)
    (entry / "vendor").write_text(vendor + "\n")
    (entry / "class").write_text(klass + "\n")
    (entry / "device").write_text("0x2335\n")
    link = entry / "driver"
    if link.is_symlink():
        link.unlink()
    if driver is not None:
        target = root.parent / "drivers" / driver
        target.mkdir(parents=True, exist_ok=True)
        link.symlink_to(target)


def make_pci_tree(root: Path, gpus: int = 8, *, extra: tuple[int, ...] = (),
                  driver: str | None = "nvidia", klass: str = "0x030200") -> Path:
    """Fill ``root`` (emptied first) with ``gpus`` fake GPUs, plus GPUs numbered ``extra``."""
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    for gpu in (*range(gpus), *extra):
        _device(root, pci_address(gpu), NVIDIA, klass, driver)
    for address, vendor, cls, drv in _NOT_GPUS:
        _device(root, address, vendor, cls, drv)
    return root
