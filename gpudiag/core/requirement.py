"""Parsers for what callers ask: requirement strings, sizes, device lists, deadlines.

The same syntax serves the CLI, the Python API and HTTP. Every parser raises
``RequirementError`` naming the bad value and the accepted forms.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from gpudiag.core import registry
from gpudiag.core.deadlines import RequirementError as RequirementError
from gpudiag.core.deadlines import parse_timeout as parse_timeout
from gpudiag.core.gpunames import is_gpu_name
from gpudiag.core.limits import MAX_DEVICES
from gpudiag.core.sizes import SIZE_FORMS as SIZE_FORMS
from gpudiag.core.sizes import size_bytes
from gpudiag.core.verdict import BackendRequirement, Requirement


def parse_backends(text: str) -> tuple[BackendRequirement, ...]:
    """``cuda,jax,iree:local-task`` -> backend requirements (duplicates merged)."""
    specs = [s.strip() for s in text.split(",")]
    if not text.strip() or any(not s for s in specs):
        raise RequirementError(
            f"requirement {text!r} is empty or has an empty item; accepted: a comma list of "
            f"{', '.join(registry.requirable())}, with jax:cpu|gpu and iree:DRIVER "
            f"(e.g. cuda,jax,iree)")
    backends = registry.requirable()
    out: list[BackendRequirement] = []
    for spec in specs:
        name, sep, platform = spec.partition(":")
        name = name.lower()
        if name not in backends:
            raise RequirementError(
                f"unknown backend {name!r} in requirement {text!r}; accepted: "
                f"{', '.join(backends)} (jax:cpu, iree:local-task and the like pick a platform)")
        plat: str | None = platform.lower() if sep else None
        if sep and not plat:
            raise RequirementError(f"{spec!r} has an empty platform after ':'")
        req = BackendRequirement(name, _platform(name, plat, spec))
        if req not in out:
            out.append(req)
    return tuple(out)


def _platform(name: str, plat: str | None, text: str) -> str | None:
    """The platform of one ``NAME:PLATFORM`` entry as its backend spec spells it ("gpu" and
    none are one: the default GPU platform)."""
    spec = registry.spec(name)
    if plat is None or spec is None:
        return None
    if spec.platforms is None:
        raise RequirementError(f"{name} takes no platform, got {text!r}")
    if plat not in spec.platforms:
        raise RequirementError(f"{spec.platform_word} {plat!r} in {text!r} " + spec.platform_help
                               .format(choices=", ".join(spec.platforms)))
    plat = spec.platform_aliases.get(plat, plat)
    return None if plat == "gpu" else plat


def parse_size(text: str) -> int:
    """``8GiB`` -> 8589934592; ``8GB`` -> 8000000000; ``123`` -> 123 bytes."""
    value = size_bytes(text)
    if value is None:
        raise RequirementError(_size_problem(text))
    return value


_SIZE_SHAPE = re.compile(r"^\s*[0-9]+(?:\.[0-9]+)?\s*[A-Za-z]*\s*$")


def _size_problem(text: str) -> str:
    """Why ``text`` is not a size: too large, or not understood."""
    if _SIZE_SHAPE.match(text) and size_bytes(re.sub(r"[0-9.]+", "1", text, count=1)) \
            is not None:
        return f"size {text!r} is too large"
    return f"size {text!r} is not understood; accepted: {SIZE_FORMS}"


def format_size(n: int | None) -> str:
    """Bytes for people: 1.5 GiB."""
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


_DEVICE_RE = re.compile(r"^([0-9]{1,3}|(GPU|MIG)-[0-9a-fA-F-]{1,64})$")


def parse_devices(text: str) -> tuple[str, ...]:
    """``0,1`` or ``GPU-...`` UUIDs -> device selectors (indices within visible devices)."""
    items = [s.strip() for s in text.split(",")]
    if not text.strip() or any(not s for s in items):
        raise RequirementError(
            f"device list {text!r} is empty or has an empty item; accepted: comma-separated "
            "indices (0,1) or full GPU-/MIG- UUIDs")
    for item in items:
        if not _DEVICE_RE.match(item) and not is_gpu_name(item):
            raise RequirementError(
                f"device {item!r} in {text!r} is not a GPU name: an index (0-999), a GPU-/MIG- "
                "UUID or a unique prefix of one, or a PCI bus id (0000:1b:00.0)")
    if len(items) > MAX_DEVICES:
        raise RequirementError(f"device list {text!r} names more than {MAX_DEVICES} devices")
    if len(set(items)) != len(items):
        raise RequirementError(f"device list {text!r} names a device twice")
    return tuple(items)


def parse_requirement(require: str | Iterable[str] = "cuda", *, devices: str | None = None,
                      min_devices: int | None = None,
                      min_free_memory: str | int | None = None, gpus: int | None = None,
                      node_health: bool = False) -> Requirement:
    """Build a Requirement from the CLI/API/HTTP forms."""
    text = require if isinstance(require, str) else ",".join(require)
    backends = parse_backends(text)
    devs = parse_devices(devices) if devices is not None else None
    if min_devices is not None and (min_devices < 0 or min_devices > MAX_DEVICES):
        raise RequirementError(f"min_devices {min_devices} must be between 0 and {MAX_DEVICES}")
    mem: int | None
    if min_free_memory is None:
        mem = None
    elif isinstance(min_free_memory, int):
        if min_free_memory < 0:
            raise RequirementError(f"min_free_memory {min_free_memory} must not be negative")
        mem = min_free_memory
    else:
        mem = parse_size(min_free_memory)
    if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int)
                             or gpus < 1 or gpus > MAX_DEVICES):
        raise RequirementError(f"gpus {gpus!r} must be a whole number between 1 and "
                               f"{MAX_DEVICES}")
    if gpus is not None and node_health:
        raise RequirementError("gpus asks for job readiness; the node-health question "
                               "takes no GPU count")
    return Requirement(backends=backends, devices=devs, min_devices=min_devices,
                       min_free_memory_bytes=mem, gpus=gpus, node_health=node_health)
