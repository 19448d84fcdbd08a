"""The nic probe: the node's InfiniBand/RoCE ports and netdevs, from sysfs only.

Runs in a child, like every probe, and reads nothing but small sysfs files: never ibstat,
MADs or ACCESS_REG (a probe that fills the kernel log or the subnet manager's is its own
fault). What it reads (the kernel's Documentation/ABI/stable/sysfs-class-infiniband and
sysfs-class-net):

- ``class/infiniband/<hca>/ports/<n>/{state,phys_state,rate,link_layer}``, its
  ``counters/`` and ``hw_counters/``, ``<hca>/fw_ver`` and the ``<hca>/device`` link;
- ``class/net/<if>/{operstate,carrier,carrier_changes,speed,device}``.

Test seams: GPUDIAG_SYSFS_ROOT (default /sys), GPUDIAG_BOOT_ID_FILE (default
/proc/sys/kernel/random/boot_id). Settings (``[backends.nic]``: expect, min_rate_gbps, ...)
come from GPUDIAG_BACKEND_SETTINGS, the JSON the parent sets from the config it checked (the
daemon's ``--config``; the one-shot commands' ``--config``, default the node's config file
when it exists): ``{"nic": {"expect": [...]}}``. Unset: the defaults.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpudiag.core.nic import (
    NicPolicyError,
    affinity,
    ib_cabled,
    ib_up,
    parse_policy,
    parse_rate,
    policy_keys,
)

# Bounds: a read never grows with what another party can create in sysfs.
MAX_PORTS = 256
MAX_COUNTERS = 128
FAULTS: dict[str, dict[str, str]] = {}


def _text(path: Path) -> str | None:
    """A small sysfs file's text; None when absent or unreadable (EINVAL on a down link)."""
    try:
        with open(path, "rb") as f:
            return f.read(4096).decode("ascii", "replace").strip()
    except OSError:
        return None


def _int(path: Path) -> int | None:
    text = _text(path)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


NVIDIA_VENDOR = "0x10de"


def _pci_path(path: Path) -> list[str]:
    """A PCI function's place in the hierarchy: its sysfs path from the host bridge down
    (``["pci0000:00", "0000:00:01.0", "0000:17:00.0"]``); empty when unknown."""
    try:
        parts = Path(os.path.realpath(path)).parts
    except OSError:
        return []
    found = [i for i, part in enumerate(parts) if part.startswith("pci")]
    return [p.lower() for p in parts[found[0]:]] if found else []


def _gpus(root: Path) -> dict[str, tuple[list[str], int | None]]:
    """Every NVIDIA display/3D controller on the PCI bus: bus id -> (PCI path, NUMA node)."""
    base = root / "bus" / "pci" / "devices"
    out: dict[str, tuple[list[str], int | None]] = {}
    for name in _sorted_dir(base):
        d = base / name
        klass = _text(d / "class") or ""
        if _text(d / "vendor") != NVIDIA_VENDOR or not klass.startswith("0x03"):
            continue
        numa = _int(d / "numa_node")
        out[name.lower()] = (_pci_path(d), numa if numa is not None and numa >= 0 else None)
    return out


def _affinities(device: Path, numa: int | None,
                gpus: Mapping[str, tuple[list[str], int | None]]) -> dict[str, str]:
    path = _pci_path(device)
    if not path:
        return {}
    return {bus: affinity(path, numa, gpu_path, gpu_numa)
            for bus, (gpu_path, gpu_numa) in gpus.items()}


def _device(path: Path) -> tuple[str | None, int | None]:
    """The PCI function behind a ``device`` link, and its NUMA node."""
    if not path.exists():
        return None, None
    try:
        bus_id = os.path.basename(os.path.realpath(path))
    except OSError:
        return None, None
    numa = _int(path / "numa_node")
    return bus_id.lower() or None, numa if numa is None or numa >= 0 else None


def _counters(folder: Path, prefix: str = "") -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        names = sorted(os.listdir(folder))[:MAX_COUNTERS]
    except OSError:
        return out
    for name in names:
        value = _int(folder / name)
        if value is not None:
            out[prefix + name] = value
    return out


def _sorted_dir(folder: Path) -> list[str]:
    try:
        return sorted(os.listdir(folder))[:MAX_PORTS]
    except OSError:
        return []


def _ib_ports(root: Path, gpus: Mapping[str, tuple[list[str], int | None]]
              ) -> list[dict[str, Any]]:
    ports: list[dict[str, Any]] = []
    base = root / "class" / "infiniband"
    for hca in _sorted_dir(base):
        fw_ver = _text(base / hca / "fw_ver")
        hca_type = _text(base / hca / "hca_type")
        bus_id, numa = _device(base / hca / "device")
        for n in _sorted_dir(base / hca / "ports"):
            d = base / hca / "ports" / n
            state, phys = _text(d / "state"), _text(d / "phys_state")
            rate = _text(d / "rate")
            ndev = _text(d / "gid_attrs" / "ndevs" / "0")
            ports.append({
                "name": f"{hca}/{n}", "kind": "ib", "up": ib_up(state, phys),
                "state": state, "phys_state": phys, "rate_text": rate,
                "rate_gbps": parse_rate(rate), "link_layer": _text(d / "link_layer"),
                "cabled": ib_cabled(phys), "rdma": True, "fw_ver": fw_ver,
                "hca_type": hca_type or None,
                "pci_bus_id": bus_id, "numa_node": numa, "netdev": ndev or None,
                "gpus": _affinities(base / hca / "device", numa, gpus),
                "counters": {**_counters(d / "counters"),
                             **_counters(d / "hw_counters", "hw_")},
            })
    return ports


def _net_ports(root: Path, gpus: Mapping[str, tuple[list[str], int | None]]
               ) -> list[dict[str, Any]]:
    ports: list[dict[str, Any]] = []
    base = root / "class" / "net"
    for name in _sorted_dir(base):
        d = base / name
        if name == "lo":
            continue
        operstate, carrier = _text(d / "operstate"), _text(d / "carrier")
        speed = _int(d / "speed")
        bus_id, numa = _device(d / "device")
        ports.append({
            "name": name, "kind": "net", "up": carrier == "1" and operstate in ("up", "unknown"),
            "state": operstate, "phys_state": carrier,
            "rate_gbps": speed / 1000.0 if speed is not None and speed > 0 else None,
            "rate_text": f"{speed} Mb/s" if speed is not None and speed > 0 else None,
            "rdma": (d / "device" / "infiniband").is_dir(), "pci_bus_id": bus_id,
            "numa_node": numa, "carrier_changes": _int(d / "carrier_changes"),
            "gpus": _affinities(d / "device", numa, gpus),
        })
    return ports


def _policy(env: Mapping[str, str]) -> dict[str, Any]:
    """``[backends.nic]``'s settings as the parent passed them (none: the defaults)."""
    settings = json.loads(env.get("GPUDIAG_BACKEND_SETTINGS") or "{}")
    table = settings.get("nic") if isinstance(settings, dict) else None
    own = {k: v for k, v in (table or {}).items() if k in policy_keys()}
    try:
        return parse_policy(own).record()
    except NicPolicyError as e:
        raise NicPolicyError(f"backends.nic.{e}") from e


def probe(options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Every port sysfs shows, the boot id, and the settings that say which are expected."""
    env = os.environ
    root = Path(env.get("GPUDIAG_SYSFS_ROOT") or "/sys")
    boot = _text(Path(env.get("GPUDIAG_BOOT_ID_FILE") or "/proc/sys/kernel/random/boot_id"))
    policy = _policy(env)
    gpus = _gpus(root)
    return {"ok": True, "boot_id": boot, "sysfs_root": str(root), "policy": policy,
            "ports": _ib_ports(root, gpus) + _net_ports(root, gpus)}
