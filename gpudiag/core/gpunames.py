"""One way to name a GPU everywhere a person types one: index, full UUID, a unique UUID prefix
(or ``head…tail``, as the terminal table shortens UUIDs that share a long prefix), or a PCI
bus id (``0000:1b:00.0``, ``1B:00.0``, as ``nvidia-smi -i`` takes it).

``preflight --devices``, ``clear --gpu``, ``qualify --gpus`` and ``explain --gpus`` resolve
their names here; a name that matches nothing says ``no GPU named X; GPUs here: ...``. Pure:
the caller says which GPUs there are (NVML's reading, the daemon's history).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from gpudiag.core.records import dataclass


@dataclass(frozen=True)
class NamedGpu:
    """A GPU as a name may select it: its index, full UUID and PCI bus id."""

    index: int
    uuid: str
    pci_bus_id: str | None = None


class GpuNameError(ValueError):
    """A GPU name that matches no GPU, or several."""


_INDEX = re.compile(r"[0-9]+")
_PCI = re.compile(r"(?:([0-9a-f]{1,8}):)?([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])", re.I)
# What a name may look like at all (checked before any GPU is known: a usage error early).
_NAME = re.compile(r"[0-9]{1,3}|(?:GPU|MIG)-[0-9a-fA-F-]{1,64}(?:(?:…|\.\.\.)[0-9a-fA-F-]{1,64})?"
                   r"|(?:[0-9a-fA-F]{1,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]")


def pci_key(text: str) -> tuple[int, int, int, int] | None:
    """``0000:1b:00.0``, ``00000000:1B:00.0`` and ``1B:00.0`` name one PCI address."""
    m = _PCI.fullmatch(text.strip())
    if not m:
        return None
    return (int(m.group(1) or "0", 16), int(m.group(2), 16), int(m.group(3), 16),
            int(m.group(4)))


def is_gpu_name(text: str) -> bool:
    """Whether ``text`` has the form of a GPU name (index, UUID or prefix, PCI bus id)."""
    return _NAME.fullmatch(text.strip()) is not None


def listing(gpus: Sequence[NamedGpu]) -> str:
    """``0 GPU-... (18:00.0), 1 ...``: what a person may name, for error messages."""
    return ", ".join(f"{g.index} {g.uuid}" + (f" ({g.pci_bus_id})" if g.pci_bus_id else "")
                     for g in gpus) or "none"


def matches(name: str, gpus: Sequence[NamedGpu]) -> tuple[str, list[NamedGpu]]:
    """What kind of name ``name`` is, and the GPUs it names (none, one or several)."""
    text = name.strip()
    if _INDEX.fullmatch(text):
        return "index", [g for g in gpus if g.index == int(text)]
    key = pci_key(text)
    if key is not None:
        return "PCI bus id", [g for g in gpus
                              if g.pci_bus_id and pci_key(g.pci_bus_id) == key]
    low = text.lower()
    exact = [g for g in gpus if g.uuid.lower() == low]
    if exact:
        return "UUID", exact
    head, _, tail = low.replace("...", "…").partition("…")
    return "UUID prefix", [g for g in gpus if g.uuid.lower().startswith(head)
                           and g.uuid.lower().endswith(tail)]


def resolve(name: str, gpus: Sequence[NamedGpu]) -> NamedGpu:
    """The one GPU ``name`` names; GpuNameError saying what is here when none or several."""
    what, found = matches(name, gpus)
    if len(found) == 1:
        return found[0]
    if found:
        raise GpuNameError(f"{what} {name!r} names {len(found)} GPUs "
                           f"({', '.join(g.uuid for g in found)}): give more of the UUID")
    raise GpuNameError(no_gpu_named(name, gpus))


def no_gpu_named(name: str, gpus: Sequence[NamedGpu]) -> str:
    """The one message for a name that matches nothing."""
    return f"no GPU named {name!r}; GPUs here (index, UUID, PCI bus id): {listing(gpus)}"
