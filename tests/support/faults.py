"""How to produce each blocker code of the engine's layers through the fakes: one table,
``FAULTS``, for tests/test_probe_engine.py (which checks it covers every engine code) and the
fault matrix (tests/test_fault_matrix.py, which reuses its knobs)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.fakes.build import FakeDriver
from tests.fakes.sysfs import make_pci_tree
from tests.support.host import EnvFactory, make_host_dirs


@dataclass(frozen=True)
class Fault:
    """How to produce one blocker code through the fakes."""

    knobs: dict[str, str | int] = field(default_factory=dict)
    args: tuple[str, ...] = ()
    env: Callable[[Path, FakeDriver, EnvFactory], dict[str, str]] | None = None
    prefix: tuple[str, ...] = ()


def _nodes_missing(tmp: Path, fakes: FakeDriver, gpu_env: EnvFactory) -> dict[str, str]:
    dev, proc = make_host_dirs(tmp / "nonodes", nodes=False, driver_loaded=True)
    return gpu_env(GPUDIAG_DEVICE_DIR=str(dev), GPUDIAG_DRIVER_PROC_DIR=str(proc),
                   FAKE_NVML_INIT_ERROR=9, FAKE_CUDA_INIT_ERROR=100)


def _nodes_locked(tmp: Path, fakes: FakeDriver, gpu_env: EnvFactory) -> dict[str, str]:
    dev, proc = make_host_dirs(tmp / "locked", gpus=2)
    for node in dev.iterdir():  # owned by a uid that the test's user namespace does not map
        os.chown(node, 12345, 12345)
        node.chmod(0)
    return gpu_env(GPUDIAG_DEVICE_DIR=str(dev), GPUDIAG_DRIVER_PROC_DIR=str(proc),
                   FAKE_NVML_DEVICE_COUNT=2, FAKE_NVML_INIT_ERROR=4, FAKE_CUDA_INIT_ERROR=999)


def _no_libcuda(tmp: Path, fakes: FakeDriver, gpu_env: EnvFactory) -> dict[str, str]:
    only_nvml = tmp / "only-nvml"
    only_nvml.mkdir()
    (only_nvml / "libnvidia-ml.so.1").symlink_to(fakes.lib_dir / "libnvidia-ml.so.1")
    env = gpu_env()
    env["LD_LIBRARY_PATH"] = str(only_nvml)
    return env


def _broken_pynvml(tmp: Path, fakes: FakeDriver, gpu_env: EnvFactory) -> dict[str, str]:
    shadow = tmp / "shadow"
    shadow.mkdir()
    (shadow / "pynvml.py").write_text("raise RuntimeError('a broken pynvml install')\n")
    env = gpu_env()
    env["PYTHONPATH"] = os.pathsep.join([str(shadow), env.get("PYTHONPATH", "")])
    return env


# One row per blocker code of the engine's layers; a code without a row fails the suite.
FAULTS: dict[str, Fault] = {
    "probe_timeout": Fault({"FAKE_NVML_INIT_HANG": 1}, ("--timeout", "2")),
    "probe_crashed": Fault({"FAKE_NVML_INIT_CRASH": 1}),
    "probe_error": Fault(env=_broken_pynvml),
    "visible_devices_empty": Fault({"CUDA_VISIBLE_DEVICES": ""}),
    "visible_devices_invalid": Fault({"CUDA_VISIBLE_DEVICES": "7", "FAKE_NVML_DEVICE_COUNT": 2}),
    "device_nodes_missing": Fault(env=_nodes_missing),
    "device_nodes_no_access": Fault(env=_nodes_locked,
                                    prefix=("unshare", "--user", "--map-root-user")),
    "driver_library_missing": Fault(env=lambda tmp, f, g: {
        **g(), "LD_LIBRARY_PATH": str(tmp), "PATH": os.environ.get("PATH", "")}),
    "driver_not_loaded": Fault({"FAKE_NVML_INIT_ERROR": 9}),
    "driver_library_mismatch": Fault({"FAKE_NVML_INIT_ERROR": 18}),
    "nvml_no_permission": Fault({"FAKE_NVML_INIT_ERROR": 4}),
    "nvml_error": Fault({"FAKE_NVML_INIT_ERROR": 999}),
    "gpu_lost": Fault({"FAKE_NVML_DEVICE_ERRORS": "1:15"}),
    "gpu_reset_required": Fault({"FAKE_NVML_DEVICE_ERRORS": "3:16"}),
    "gpu_ecc_uncorrectable": Fault({"FAKE_NVML_ECC_VOLATILE_UNCORRECTED": "2:3"}),
    "gpu_inforom_corrupted": Fault({"FAKE_NVML_DEVICE_ERRORS": "0:14"}),
    "gpu_fabric_not_ready": Fault({"FAKE_NVML_FABRIC": "1:1/0"}),
    # No process listed, 20000 MiB used: GPU 0 lacks the 130 GiB asked for because of it.
    "gpu_memory_held_without_process": Fault({"FAKE_NVML_MEMORY_USED_MIB": "0:20000"},
                                             ("--min-free-memory", "130GiB", "--devices", "0")),
    # GPU 7 fell off the bus without an XID: the PCI bus shows 8 GPUs, NVML 7.
    "gpu_missing": Fault(env=lambda tmp, f, g: {
        **g(FAKE_NVML_DEVICE_COUNT=7),
        "GPUDIAG_SYSFS_PCI_DIR": str(make_pci_tree(tmp / "pci", gpus=8))}),
    "cuda_library_missing": Fault(env=_no_libcuda),
    "cuda_no_device": Fault({"FAKE_CUDA_INIT_ERROR": 100}),
    "cuda_driver_mismatch": Fault({"FAKE_CUDA_INIT_ERROR": 803}),
    "cuda_driver_too_old": Fault({"FAKE_CUDA_INIT_ERROR": 35}),
    "cuda_system_not_ready": Fault({"FAKE_CUDA_INIT_ERROR": 802}),
    "cuda_devices_unavailable": Fault({"FAKE_CUDA_CTX_ERROR": 46}),
    "cuda_out_of_memory": Fault({"FAKE_CUDA_ALLOC_ERROR": 2}),
    "cuda_init_failed": Fault({"FAKE_CUDA_INIT_ERROR": 999}),
    "cuda_context_failed": Fault({"FAKE_CUDA_CTX_ERROR": 201}),
    "insufficient_devices": Fault(args=("--min-devices", "9")),
    "insufficient_free_memory": Fault(args=("--min-free-memory", "200GiB")),
}
