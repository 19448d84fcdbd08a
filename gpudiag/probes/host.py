"""The host probe: environment, visibility variables, device nodes, driver version, nvidia-smi.

Runs in a child. Test seams (also useful in containers): GPUDIAG_DEVICE_DIR (default /dev),
GPUDIAG_DRIVER_PROC_DIR (default /proc/driver/nvidia) and GPUDIAG_SYSFS_PCI_DIR (default
/sys/bus/pci/devices; set it empty to not count GPUs on the PCI bus).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import stat
import subprocess
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from gpudiag.core.environment import (
    allow_listed,
    parse_cuda_visible_devices,
    parse_nvidia_visible_devices,
    preallocation_disabled,
)
from gpudiag.core.visibility import CUDA_VISIBLE_DEVICES, NVIDIA_VISIBLE_DEVICES

TEXT_LIMIT = 64 * 1024
_NODE_RE = re.compile(r"^nvidia(ctl|-uvm|-uvm-tools|-modeset|[0-9]+)$")


def bounded(text: str, limit: int = TEXT_LIMIT) -> str:
    """Keep the tail of a long text (the end holds the error)."""
    return text if len(text) <= limit else text[-limit:]


def device_nodes(dev_dir: Path) -> dict[str, Any]:
    """/dev/nvidia* nodes: present, a character device, and openable by this user."""
    nodes: list[dict[str, Any]] = []
    try:
        names = sorted(n for n in os.listdir(dev_dir) if _NODE_RE.match(n))
    except OSError as e:
        return {"dir": str(dev_dir), "nodes": [], "error": str(e),
                "control_present": False, "gpu_nodes": 0, "all_accessible": False}
    for name in names:
        path = dev_dir / name
        info: dict[str, Any] = {"path": str(path), "name": name}
        try:
            st = path.stat()
            info["char_device"] = stat.S_ISCHR(st.st_mode)
            info["mode"] = oct(stat.S_IMODE(st.st_mode))
        except OSError as e:
            info["error"] = str(e)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
            os.close(fd)
            info["accessible"] = True
        except OSError as e:
            info["accessible"] = False
            info["open_error"] = f"{errno.errorcode.get(e.errno or 0, e.errno)}: {e.strerror}"
            info["permission_denied"] = e.errno in (errno.EACCES, errno.EPERM)
        nodes.append(info)
    gpu_nodes = [n for n in nodes if re.fullmatch(r"nvidia[0-9]+", n["name"])]
    return {
        "dir": str(dev_dir),
        "nodes": nodes,
        "control_present": any(n["name"] == "nvidiactl" for n in nodes),
        "gpu_nodes": len(gpu_nodes),
        "all_accessible": all(n.get("accessible") for n in nodes) if nodes else False,
        "permission_denied": [n["path"] for n in nodes if n.get("permission_denied")],
    }


def driver_proc(proc_dir: Path) -> dict[str, Any]:
    """/proc/driver/nvidia/version: present only when the kernel module is loaded."""
    version_file = proc_dir / "version"
    try:
        text = version_file.read_text(errors="replace")
    except OSError as e:
        return {"path": str(version_file), "present": False, "error": e.strerror,
                "text": None, "kernel_module_version": None}
    m = re.search(r"Kernel Module(?: for [^ ]+)?\s+([0-9][0-9.]+)", text)
    return {"path": str(version_file), "present": True, "text": bounded(text),
            "kernel_module_version": m.group(1) if m else None}


NVIDIA_VENDOR = 0x10DE
# PCI base class 03 (display): subclass 00 is a VGA controller, 02 a 3D controller (the
# data-center GPUs); NVSwitches (0680) and the GPUs' audio functions (0403) are not GPUs.
GPU_CLASSES = (0x0300, 0x0302)
SYSFS_PCI_DIR = "/sys/bus/pci/devices"


def _sysfs_hex(path: Path) -> int | None:
    try:
        return int(path.read_text().strip(), 16)
    except (OSError, ValueError):
        return None


def pci_gpus(pci_dir: str) -> dict[str, Any]:
    """NVIDIA GPUs on the PCI bus from sysfs, with the kernel driver each is bound to."""
    if not pci_dir:
        return {"dir": None, "available": False, "error": "GPUDIAG_SYSFS_PCI_DIR is empty",
                "gpus": []}
    root = Path(pci_dir)
    try:
        names = sorted(os.listdir(root))
    except OSError as e:
        return {"dir": pci_dir, "available": False, "error": f"{root}: {e.strerror or e}",
                "gpus": []}
    gpus: list[dict[str, Any]] = []
    for name in names:
        entry = root / name
        if _sysfs_hex(entry / "vendor") != NVIDIA_VENDOR:
            continue
        klass = _sysfs_hex(entry / "class")
        if klass is None or klass >> 8 not in GPU_CLASSES:
            continue
        try:
            driver: str | None = os.path.basename(os.readlink(entry / "driver"))
        except OSError:
            driver = None  # no driver bound: e.g. the nvidia module failed to take it
        gpus.append({"address": name.lower(), "class": f"0x{klass:06x}",
                     "device_id": _sysfs_hex(entry / "device"), "driver": driver})
    return {"dir": pci_dir, "available": True, "error": None, "gpus": gpus}


def run_command(argv: Sequence[str], timeout_s: float, env: Mapping[str, str]) -> dict[str, Any]:
    """Run a command with a deadline in its own session; the record keeps what it said."""
    started = time.monotonic()
    record: dict[str, Any] = {"argv": list(argv), "exit_code": None, "stdout": "",
                              "stderr": "", "duration_s": 0.0, "missing": False,
                              "timed_out": False}
    exe = shutil.which(argv[0], path=env.get("PATH"))
    if exe is None:
        record.update(missing=True, stderr=f"{argv[0]}: not found on PATH")
        return record
    try:
        proc = subprocess.Popen(  # noqa: S603 - fixed argv, no shell
            [exe, *argv[1:]], env=dict(env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True,
        )
    except OSError as e:
        record.update(missing=e.errno == errno.ENOENT, stderr=str(e))
        return record
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        record["timed_out"] = True
    record.update(
        exit_code=proc.returncode,
        stdout=bounded(out.decode("utf-8", errors="replace")),
        stderr=bounded(err.decode("utf-8", errors="replace")),
        duration_s=round(time.monotonic() - started, 4),
    )
    return record


def probe(options: Mapping[str, Any]) -> dict[str, Any]:
    """Observe the host side: nothing here loads a GPU library."""
    env = dict(os.environ)
    smi_timeout = float(options.get("nvidia_smi_timeout_s", 5.0))
    dev_dir = Path(env.get("GPUDIAG_DEVICE_DIR", "/dev"))
    proc_dir = Path(env.get("GPUDIAG_DRIVER_PROC_DIR", "/proc/driver/nvidia"))
    with ThreadPoolExecutor(max_workers=2) as pool:
        smi = pool.submit(run_command, ["nvidia-smi"], smi_timeout, env)
        smi_xml = pool.submit(run_command, ["nvidia-smi", "-q", "-x"], smi_timeout, env)
        nodes = device_nodes(dev_dir)
        proc = driver_proc(proc_dir)
        smi_record, smi_xml_record = smi.result(), smi_xml.result()
    cvd = parse_cuda_visible_devices(env.get(CUDA_VISIBLE_DEVICES))
    nvd = parse_nvidia_visible_devices(env.get(NVIDIA_VISIBLE_DEVICES))
    return {
        "environment": allow_listed(env),
        "visibility": {"cuda": cvd.record(), "nvidia": nvd.record()},
        "device_nodes": nodes,
        "driver_proc": proc,
        "nvidia_smi": smi_record,
        "nvidia_smi_xml": smi_xml_record,
        "pci": pci_gpus(env.get("GPUDIAG_SYSFS_PCI_DIR", SYSFS_PCI_DIR)),
        "preallocation_disabled": preallocation_disabled(env),
        "hostname": os.uname().nodename,
    }
