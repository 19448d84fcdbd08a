"""Each GPU index's last identity NVML gave: a lost GPU keeps its UUID, name and PCI bus id.

One memory for the daemon's verdicts (a lost GPU's row and blockers name its last UUID) and
for the exporter's labels (a lost GPU's series do not churn, alerts keyed on uuid still match).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from gpudiag.core.observations import NvmlObservation
from gpudiag.core.records import dataclass


@dataclass(frozen=True)
class GpuIdentity:
    """What NVML last said a GPU index is ("" where it did not say)."""

    uuid: str
    name: str
    pci_bus_id: str


class LastIdentities:
    """Thread-safe memory of each GPU index's last identity (a daemon lives with one)."""

    def __init__(self) -> None:
        self._by_index: dict[int, GpuIdentity] = {}
        self._lock = threading.Lock()

    def known(self, index: int, uuid: str | None, name: str | None = None,
              pci: str | None = None) -> tuple[str, str, str]:
        """(uuid, name, pci) of GPU ``index``: as read now, else as last read."""
        with self._lock:
            old = self._by_index.get(index)
            if uuid and name is None and pci is None and old is not None and old.uuid == uuid:
                return _tuple(old)
            if uuid:
                self._by_index[index] = GpuIdentity(uuid, name or "", pci or "")
                return _tuple(self._by_index[index])
            if old is not None:
                return _tuple(old)
            return "", name or "", pci or ""

    def learn(self, nvml: NvmlObservation | None) -> None:
        """Remember what one NVML reading says of each GPU it could read."""
        for d in nvml.devices if nvml is not None and nvml.ok else ():
            if d.ok and d.uuid:
                self.known(d.index, d.uuid, d.name, d.pci_bus_id)

    def current(self) -> Mapping[int, GpuIdentity]:
        """A copy of what is remembered now (for one published snapshot)."""
        with self._lock:
            return dict(self._by_index)


def _tuple(i: GpuIdentity) -> tuple[str, str, str]:
    return i.uuid, i.name, i.pci_bus_id
