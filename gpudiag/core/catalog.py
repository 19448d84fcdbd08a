"""The blocker and warning catalog: code -> layer, summary, remediation, in one table.

The codes are a contract (docs/reference.md): add freely, rename or remove nothing without a
migration note in CHANGELOG.md. The primary ``gpu_validation_blocker`` is the blocker of
the lowest layer in ``LAYER_ORDER``.
"""

from __future__ import annotations

from dataclasses import replace

from gpudiag.core.records import dataclass

LAYER_ORDER: tuple[str, ...] = (
    "probe",
    "visibility",
    "driver",
    "device",
    "network",
    "cuda",
    "jax",
    "iree",
    "requirement",
    "admission",
)
_LAYER_RANK = {layer: rank for rank, layer in enumerate(LAYER_ORDER)}
# jax and iree share one rank: neither is the other's cause.
_LAYER_RANK["iree"] = _LAYER_RANK["jax"]


@dataclass(frozen=True)
class CatalogEntry:
    """One row of the catalog."""

    code: str
    layer: str
    summary: str
    remediation: str
    # Whether the daemon's remediation ([remediation], docs/operations.md) may drain the node
    # on this code: hardware faults of a GPU or the node only (DRAINS below).
    drains: bool = False


# The remediation column: a hardware fault of a GPU or of the node, that a reset, a reboot or
# a repair fixes. Never a busy GPU, an unproven backend, a software, configuration or driver
# install code, a job's visibility, nor a runtime's backend codes (jax, iree): those are the
# job's environment, and draining a node for them takes healthy GPUs away from everyone.
DRAINS: frozenset[str] = frozenset({
    "gpu_lost", "gpu_reset_required", "gpu_ecc_uncorrectable", "gpu_inforom_corrupted",
    "gpu_missing", "gpu_fabric_not_ready", "gpu_nvlink_down", "node_reboot_required",
    "gpu_compute_mismatch",
})


# NIC codes that may drain, only where the operator says so ([remediation] drain_on_nic =
# true): a port down or flapping is hardware of the node, but whether a job can run without
# that port is the site's call, so the default observes only (never in DRAINS).
NIC_DRAINS: frozenset[str] = frozenset({"nic_link_down", "nic_link_flapping"})


def _rows(layer: str, *rows: tuple[str, str, str]) -> list[CatalogEntry]:
    return [CatalogEntry(code, layer, summary, fix) for code, summary, fix in rows]


_SLOW_FIX = ("Compare the figures in the message (gpudiag qualify --format json); check "
             "clocks, power cap, PCIe link width/generation and thermals (nvidia-smi -q -d "
             "PERFORMANCE,CLOCK); reseat or replace the GPU if it stays slow. A later "
             "passing qualification clears it.")

BLOCKERS: dict[str, CatalogEntry] = {
    e.code: replace(e, drains=e.code in DRAINS)
    for e in [
        *_rows(
            "probe",
            ("probe_timeout", "A probe child missed its deadline (a hung driver call).",
             "Look for processes stuck in the driver (D state), dmesg for Xid/NVRM errors; "
             "reload the driver or reboot the node if the hang persists."),
            ("probe_crashed", "A probe child was killed by a signal.",
             "Read the child's stderr in evidence.probe_stderr; a crash inside the driver "
             "library usually means a broken driver install: reinstall it."),
            ("probe_error", "A probe failed unexpectedly; the traceback is in evidence.",
             "Rerun that probe alone (gpudiag probe --backend NAME --format json) to see "
             "whether it repeats; if the traceback (evidence.probe_stderr) is not a host "
             "problem, report it as a gpudiag bug with that record."),
        ),
        *_rows(
            "visibility",
            ("visible_devices_empty",
             "CUDA_VISIBLE_DEVICES or NVIDIA_VISIBLE_DEVICES hides every GPU.",
             "Unset CUDA_VISIBLE_DEVICES (\"\", -1 and NoDevFiles hide all GPUs) or set it "
             "to full GPU UUIDs; NVIDIA_VISIBLE_DEVICES=void/none exposes no GPU."),
            ("visible_devices_invalid",
             "CUDA_VISIBLE_DEVICES names an index, UUID or MIG device that does not exist.",
             "Use `nvidia-smi -L` to list the real GPU-/MIG- UUIDs and set "
             "CUDA_VISIBLE_DEVICES to those."),
            ("device_nodes_missing",
             "/dev/nvidiactl or /dev/nvidiaN is absent while the driver is loaded.",
             "In a container, pass the devices (--gpus, CDI or the device plugin); on the "
             "host, run nvidia-modprobe -u -c=0 or check udev rules."),
            ("device_nodes_no_access", "The GPU device nodes exist but cannot be opened.",
             "Add the user to the group that owns /dev/nvidia* (often 'video'), or allow "
             "the devices in the cgroup (DeviceAllow=/dev/nvidia* for systemd units)."),
        ),
        *_rows(
            "driver",
            ("driver_library_missing", "libnvidia-ml.so.1 cannot be loaded.",
             "Install the NVIDIA driver (it ships libnvidia-ml.so.1) or add its folder to "
             "the loader path; in a container use the NVIDIA container toolkit."),
            ("driver_not_loaded", "NVML reports the NVIDIA kernel driver is not loaded.",
             "Load the kernel module (modprobe nvidia), check dmesg for why it failed, or "
             "reinstall the driver for the running kernel."),
            ("driver_library_mismatch",
             "The user-space driver library and the kernel module versions differ.",
             "A driver upgrade left the old kernel module loaded: reboot, or unload and "
             "reload the nvidia modules when no process uses the GPUs."),
            ("nvml_no_permission", "NVML was refused access to the GPUs.",
             "Check device-node permissions and cgroup device rules for this user."),
            ("nvml_error", "NVML failed in an unexpected way; its code is in evidence.",
             "Run nvidia-smi -q and dmesg | grep -i NVRM for the driver's side; an NVML "
             "error after a driver update or an XID usually clears with a reload of the "
             "nvidia modules or a reboot (the NVML code in the message names the call)."),
        ),
        *_rows(
            "device",
            ("gpu_lost", "A GPU has fallen off the bus (NVML GPU_IS_LOST or XID 79).",
             "Drain the node and reset the GPU or reboot; check power, cooling and PCIe "
             "seating if it recurs. After the repair run `gpudiag clear --gpu N` (index, "
             "UUID or PCI bus id) so that the daemon releases a held XID at once."),
            ("gpu_reset_required",
             "A GPU needs a reset (NVML RESET_REQUIRED, a recovery action or a critical XID).",
             "Drain the node, stop GPU processes and run nvidia-smi -r on that GPU, or "
             "reboot as the recovery action says; then run `gpudiag clear --gpu N` (index, "
             "UUID or PCI bus id) so that the daemon releases a held XID at once."),
            ("gpu_ecc_uncorrectable",
             "Volatile uncorrectable ECC errors, or a row-remapping failure.",
             "Drain the node and reset the GPU; a row-remapping failure means the GPU has "
             "no spare rows left and NVIDIA's RMA policy applies: replace it."),
            ("gpu_inforom_corrupted", "The GPU's InfoROM is corrupted (NVML 14).",
             "Drain the node and contact the vendor; the InfoROM needs reflashing."),
            ("gpu_missing",
             "An NVIDIA GPU on the PCI bus, or one of expected_gpus, is missing from NVML.",
             "Drain the node; check dmesg for the GPU (NVRM, PCIe AER, RmInitAdapter "
             "errors), reseat or power-cycle it, and replace it if it stays missing."),
            ("gpu_fabric_not_ready",
             "The GPU's NVSwitch fabric registration has not completed or failed (NVML "
             "fabric state), or NVML asks to recover the IMEX domain.",
             "Start nvidia-fabricmanager (NVSwitch systems) and read its log; the GPU "
             "cannot run CUDA work until its fabric registration completes (cuInit then "
             "fails with 802)."),
            ("gpu_nvlink_down",
             "NVLink links that were active (or expected_nvlinks) are down.",
             "Drain the node; check the NVLink errors (nvidia-smi nvlink -s -e), reset the "
             "GPU or reboot; reseat or replace the GPU or baseboard if a link stays down."),
            ("gpu_pcie_link_degraded",
             "The GPU's PCIe link is narrower than [nvml] pcie_block_below_width lanes.",
             "Drain the node; reseat the GPU or its riser, check the slot's BIOS settings "
             "and PCIe AER errors in dmesg."),
            ("gpu_memory_held_without_process",
             "A GPU with no process listed holds memory, and the job's free-memory need is "
             "not met.",
             "Memory of a killed job or a leaked (zombie) context: find what still holds "
             "/dev/nvidia* (fuser -v /dev/nvidia*), end it, or reset the GPU."),
            ("node_reboot_required",
             "An XID asks for a node reboot or power-off service (docs/xids.md lists them).",
             "Drain the node and follow the XID's action in docs/xids.md (reboot, power "
             "cycle, or reconnect the GPU's power), then run `gpudiag clear --gpu N` (or "
             "--all) so that the daemon releases the held XID at once."),
            ("gpu_compute_mismatch",
             "A GPU returned a wrong answer in its qualification: the known-answer matmul or "
             "the memory pattern read back differed from the trusted result, a repeated "
             "GEMM differed bit for bit from its first product, or its golden hash differed "
             "from the node's majority or the stored golden.",
             "Drain the GPU and run the vendor's diagnostics (dcgmi diag -r 3); a GPU that "
             "computes wrong answers must not run jobs. A later passing qualification "
             "(POST /v1/qualify?gpus=N) clears it."),
            ("gpu_memory_test_failed",
             "A GPU's memory test (sdc tier: address-in-address, walking ones, seeded random "
             "pattern) read back a word different from the one written.",
             "Drain the GPU; read the offset and bits in the evidence, check NVML's ECC and "
             "remapped-row counters (nvidia-smi -q -d ECC,ROW_REMAPPER) and run the vendor's "
             "memory test (dcgmi diag -r 4); replace the GPU if it fails again. A later "
             "passing sdc qualification (POST /v1/qualify?gpus=N&tier=sdc) clears it."),
            ("gpu_underperforming",
             "A GPU measured below its model's reference, its node peers' median or its own "
             "history, and qualification.block = true makes that a blocker.",
             _SLOW_FIX),
        ),
        *_rows(
            "cuda",
            ("cuda_library_missing", "libcuda.so.1 cannot be loaded.",
             "Install the NVIDIA driver's CUDA library or add its folder to the loader path."),
            ("cuda_no_device", "cuInit found no CUDA device (CUDA_ERROR_NO_DEVICE, 100).",
             "Check CUDA_VISIBLE_DEVICES and that the GPUs are passed into the container."),
            ("cuda_driver_mismatch",
             "cuInit: system driver mismatch (CUDA_ERROR_SYSTEM_DRIVER_MISMATCH, 803).",
             "libcuda and the kernel driver differ (often after an upgrade, or a compat "
             "package): reboot or remove the mismatched cuda-compat library."),
            ("cuda_driver_too_old",
             "The driver is too old for this CUDA runtime (error 35, cudaErrorInsufficientDriver).",
             "Upgrade the NVIDIA driver or use a CUDA build that this driver supports."),
            ("cuda_system_not_ready",
             "cuInit: system not ready (CUDA_ERROR_SYSTEM_NOT_READY, 802).",
             "Start nvidia-fabricmanager (NVSwitch systems) and check its log."),
            ("cuda_devices_unavailable",
             "The GPU is busy or unavailable (CUDA_ERROR_DEVICE_UNAVAILABLE, 46).",
             "The GPU is in exclusive-process mode and used by another process: wait, or "
             "pick another GPU."),
            ("cuda_out_of_memory", "CUDA ran out of memory (CUDA_ERROR_OUT_OF_MEMORY, 2).",
             "Other processes hold the GPU memory: see nvidia-smi and pick a free GPU."),
            ("cuda_init_failed", "cuInit failed with another CUDA error.",
             "Check dmesg | grep -i -e NVRM -e Xid for the driver's reason; make sure the "
             "nvidia-uvm module is loaded (modprobe nvidia-uvm; /dev/nvidia-uvm exists) and "
             "nvidia-persistenced runs; if cuInit still fails (999 after an XID, 3, 101), "
             "reset the GPU with nvidia-smi -r or reboot."),
            ("cuda_context_failed",
             "cuInit worked but creating a context or allocating memory failed.",
             "Read the CUDA error in the message; check compute mode and other processes."),
        ),
        *_rows(
            "jax",
            ("jax_not_installed", "JAX is not importable in the job's environment.",
             "pip install 'jax[cuda12]' (or jax for CPU) in the job's environment."),
            ("jax_gpu_backend_absent", "JAX has no GPU platform: the CUDA plugin is missing.",
             "pip install 'jax[cuda12]' so that jax-cuda12-plugin and jax-cuda12-pjrt are "
             "installed, matching the jax version."),
            ("jax_cpu_fallback", "JAX came up on the CPU while a GPU was required.",
             "Set JAX_PLATFORMS=cuda so a missing GPU fails loudly; the backend errors in "
             "evidence say why the GPU platform did not start."),
            ("jax_backend_init_failed", "JAX's GPU backend failed to initialize.",
             "Fix the inner cause first (often a cuInit error: gpudiag probe --backend "
             "cuda shows it alone); then check that jax, jaxlib and the CUDA plugin are one "
             "version (pip list | grep jax)."),
            ("jax_plugin_version_mismatch",
             "The JAX CUDA plugin does not match jax/jaxlib (PJRT API version mismatch).",
             "Install jax, jaxlib and jax-cuda12-plugin/pjrt of the same version."),
            ("jax_cuda_libs_mismatch", "JAX found missing or mismatched CUDA libraries.",
             "Install the nvidia-* CUDA wheels jax asks for, or unset LD_LIBRARY_PATH "
             "entries that shadow them with older copies."),
            ("jax_preallocation_enabled",
             "The JAX child ran with preallocation enabled (takes 75% of the GPU).",
             "Set XLA_PYTHON_CLIENT_PREALLOCATE=false, XLA_PYTHON_CLIENT_ALLOCATOR=platform "
             "and XLA_PYTHON_CLIENT_USE_CUDA_HOST_ALLOCATOR=false (gpudiag run does)."),
            ("jax_compute_failed", "A tiny JAX computation failed or gave a wrong result.",
             "Read the error in the message; a wrong result points at a broken GPU."),
        ),
        *_rows(
            "iree",
            ("iree_not_installed", "IREE's runtime is not importable.",
             "pip install iree-base-runtime (and iree-base-compiler to compile)."),
            ("iree_driver_unavailable", "IREE could not create the HAL driver.",
             "For cuda: libcuda.so must be on the loader path (the NVIDIA driver installed, "
             "or the container started with --gpus). For another driver: install an IREE "
             "runtime built with it (the backend's compiled_in_drivers lists what this one "
             "has), or require one it has, e.g. iree:local-task."),
            ("iree_no_device", "IREE's driver found no device.",
             "Run gpudiag probe --backend cuda for the driver's side and fix that first; "
             "then check that the GPU is visible to the job (CUDA_VISIBLE_DEVICES)."),
            ("iree_device_create_failed", "IREE could not create the device.",
             "Pick a free GPU or wait for the process holding it (nvidia-smi); with memory "
             "free and no other process on it, reset the GPU (nvidia-smi -r)."),
            ("iree_execute_failed", "IREE failed to compile or run a tiny kernel.",
             "Read the message; check that the compiler supports the GPU's target."),
        ),
        *_rows(
            "network",
            ("nic_link_down",
             "An expected network port (InfiniBand/RoCE HCA port or netdev) is not "
             "ACTIVE/LinkUp or has no carrier.",
             "Check the cable, transceiver and switch port (the message gives state and "
             "phys_state: Polling means no peer trained, Disabled an administrative "
             "shutdown); ibstat or ip link on the node, the subnet manager's log. Remove a "
             "port that is not meant to be cabled from [backends.nic] expect."),
            ("nic_link_degraded",
             "An expected port runs below min_rate_gbps (a blocker only when that is "
             "configured; below its peers' rate it is a warning).",
             "A link trained at a lower rate or width: reseat or replace the cable or "
             "transceiver, check the switch port's speed settings; the message gives the "
             "rate seen."),
            ("nic_link_flapping",
             "An expected port changed link state flap_transitions times within "
             "flap_window_s.",
             "A marginal cable, transceiver or switch port: replace the cable or move the "
             "port; read the switch's port log. It clears once the window passes steady."),
        ),
        *_rows(
            "requirement",
            ("insufficient_devices", "Fewer usable GPUs than the requirement asks for.",
             "Name GPUs that are here (gpudiag probe lists each one's index, UUID and PCI "
             "bus id), ask for fewer devices, or run where more GPUs are healthy and "
             "visible."),
            ("insufficient_free_memory", "A selected GPU has less free memory than required.",
             "Wait for other processes to release memory or pick another GPU."),
        ),
        *_rows(
            "admission",
            ("devices_busy", "Not enough FREE GPUs: others' processes are on them.",
             "Wait, ask for fewer GPUs, or pick GPUs nobody uses."),
            ("device_state_unknown", "GPU occupancy could not be read; UNKNOWN is never FREE.",
             "Check that NVML can list compute processes (permissions, driver)."),
            ("visible_devices_conflict",
             "CUDA_VISIBLE_DEVICES and NVIDIA_VISIBLE_DEVICES disagree.",
             "Set both to the same full GPU UUID list, or unset one."),
            ("admission_changed",
             "GPU topology, visibility, occupancy or memory changed while admitting.",
             "Retry; if it keeps happening, something else schedules these GPUs."),
            ("lock_timeout", "The GPUs stayed locked by others (gpudiag jobs, a qualification, "
             "another user's lock) past the timeout; the refusal names each holder.",
             "Wait for them, raise --lock-timeout, or ask for other GPUs."),
            ("backend_unproven",
             "A required backend was not proven on this host's GPUs: no GPU was free to prove "
             "it on (jobs hold them) or a sibling probe held them past the wait. Nothing "
             "known is broken: node-health checks do not drain on it.",
             "Ask again when a GPU is free (or ask the daemon, which proves it between jobs); "
             "`gpudiag run` and admit() prove it on the GPUs they lock."),
        ),
    ]
}

WARNINGS: dict[str, CatalogEntry] = {
    e.code: e
    for e in [
        CatalogEntry("gpu_thermal_throttling", "device",
                     "The GPU has been clocked down for heat while working, past a dwell time.",
                     "Check cooling, airflow and fan status."),
        CatalogEntry("gpu_power_throttling", "device",
                     "The GPU's power brake has held its clocks down while working, past a "
                     "dwell time (its own power cap under load is normal and never warns).",
                     "Check the PSU and the system's power-brake signal (an external "
                     "power-capping controller, a failing supply)."),
        CatalogEntry("gpu_ecc_correctable", "device", "The GPU reports correctable ECC errors.",
                     "Watch the rate; a rising count predicts uncorrectable errors."),
        CatalogEntry("gpu_persistence_off", "device", "Persistence mode is off.",
                     "Enable nvidia-persistenced so that init is fast and state is kept."),
        CatalogEntry("diagnostic_side_effect", "device",
                     "A diagnostic (a qualification) left the GPU's configuration changed: its "
                     "inventory (power limit, application clocks, persistence, ECC, compute "
                     "or MIG mode, firmware) differs after the run from before it.",
                     "Set the field the message names back (nvidia-smi -pl, -ac, -pm, -e, -c) "
                     "and find what changed it: a diagnostic must leave the GPU as it found "
                     "it. The GPU's next qualification replaces the warning."),
        CatalogEntry("gpu_config_drift", "device",
                     "A GPU's configuration or firmware (driver, VBIOS, InfoROM, GSP firmware, "
                     "power limit, application clocks, persistence, ECC or compute mode) "
                     "differs from the majority of the node's GPUs of its model.",
                     "Set the field the message names back to the node's value (nvidia-smi "
                     "-pl, -ac, -pm, -e, -c; an ECC change applies at the next reset) or flash "
                     "the GPU's firmware to its peers' at the next drain; gpudiag never "
                     "changes a GPU's settings itself."),
        CatalogEntry("gpu_xid_application", "device",
                     "An application XID (13 31 43 45 ...; docs/xids.md) was reported.",
                     "Usually a bug or fault in a job, not in the GPU; read the job's log."),
        CatalogEntry("gpu_pcie_link_degraded", "device",
                     "The GPU's PCIe link runs below its width, or below its generation "
                     "while the GPU works.",
                     "Reseat the GPU or riser, check the slot's BIOS settings and PCIe AER "
                     "errors in dmesg; a narrower link slows host transfers."),
        CatalogEntry("gpu_memory_held_without_process", "device",
                     "A GPU with no process listed holds memory (a killed job, a leaked "
                     "context).",
                     "Find what still holds /dev/nvidia* (fuser -v /dev/nvidia*) and end "
                     "it, or reset the GPU when it is free."),
        CatalogEntry("gpu_reset_pending", "device",
                     "A reset is due: row remaps or page retirements are pending.",
                     "New work may still run (NVIDIA); reset the GPU (nvidia-smi -r) at the "
                     "next drain to apply them."),
        CatalogEntry("nic_link_degraded", "network",
                     "An expected port runs below its peers' rate (no min_rate_gbps "
                     "configured).",
                     "Reseat or replace the cable or transceiver; check the switch port's "
                     "speed; set [backends.nic] min_rate_gbps to make it a blocker."),
        CatalogEntry("nic_errors_rising", "network",
                     "An expected port's error counters (symbol, link-downed, receive, link "
                     "integrity) grew.",
                     "Watch the counters (gpudiag_nic_errors_total); a steady climb is a "
                     "marginal cable or transceiver: replace it at the next drain. Counter "
                     "resets and a reboot start a new baseline."),
        CatalogEntry("nic_config_drift", "network",
                     "An HCA runs other firmware (fw_ver) than the majority of the node's HCAs "
                     "of its model.",
                     "Flash the node's HCAs to one firmware (mlxfwmanager, or the vendor's "
                     "tool) at the next drain; mixed firmware across the ports of one job is "
                     "a known source of link and RDMA differences."),
        CatalogEntry("device_count_mismatch", "cuda",
                     "NVML and cuInit disagree on the number of GPUs.",
                     "Check CUDA_VISIBLE_DEVICES and MIG; a GPU may be hidden or failing."),
        CatalogEntry("device_nodes_missing", "visibility",
                     "GPU device nodes are missing but NVML and CUDA initialized.",
                     "Usually harmless (WSL, some containers)."),
        CatalogEntry("gpu_fault_outside_selection", "device",
                     "A GPU the job does not use has a fault (job readiness on N GPUs).",
                     "The job can run on the GPUs named; repair the faulty one (see its code)."),
        CatalogEntry("gpu_underperforming", "device",
                     "A GPU measured below its model's reference, its node peers' median or "
                     "its own history in its qualification (a blocker with "
                     "qualification.block = true).", _SLOW_FIX),
        CatalogEntry("xid_watcher_gap", "device",
                     "The XID watcher is not running; critical XIDs could be missed.",
                     "Check the daemon's log (journalctl -u gpudiag) for why the watcher keeps "
                     "dying and restart the daemon; XIDs in the gap are unknown: check "
                     "dmesg | grep Xid for them."),
        CatalogEntry("backend_not_checked", "requirement",
                     "The backend is not installed in the job's environment that was checked, "
                     "or no job environment this daemon proves needs it, so the answer says "
                     "nothing about it (not a fault: nobody asked for it).",
                     "For a job: give its interpreter (--python /path/to/venv/bin/python, or "
                     "activate its venv) or require the backend by name. For the daemon: "
                     "[runtimes.NAME] with python = \"/path/to/venv/bin/python\" in its config "
                     "(docs/operations.md, \"Runtimes\")."),
    ]
}


# Outcomes of GPU qualification (gpudiag qualify; docs/qualify.md). The two that change a
# verdict are rows of BLOCKERS / WARNINGS above (the daemon adds them per GPU:
# core.qualify_verdict); an aborted run measured nothing and never enters a verdict.
QUALIFICATION: dict[str, CatalogEntry] = {
    "gpu_underperforming": WARNINGS["gpu_underperforming"],
    "gpu_compute_mismatch": BLOCKERS["gpu_compute_mismatch"],
    "gpu_memory_test_failed": BLOCKERS["gpu_memory_test_failed"],
    "qualification_aborted": CatalogEntry(
        "qualification_aborted", "device",
        "A qualification stopped early (another process appeared on the GPU, or its "
        "deadline passed); no verdict changed.",
        "Nothing to repair: it runs again when the GPU is idle."),
}


# The job watch's warnings (core.job_watch; docs/daemon.md "The job watch"): on a running
# job, in its closeout, /v1/health's runs evidence and metrics; never in a verdict, never a
# blocker, never a drain. Layer "job": a run's, not a verdict layer.
RUN_WARNINGS: dict[str, CatalogEntry] = {
    e.code: e
    for e in [
        CatalogEntry("job_stalled", "job",
                     "Every GPU of a run spins at high utilization at a fraction of its power "
                     "limit, its links flat, past [jobs] stall_after_s: a hung collective "
                     "(an NCCL all-reduce waiting on a peer that never comes).",
                     "Take the job's stacks (py-spy dump, NCCL_DEBUG=INFO, "
                     "TORCH_NCCL_DUMP_ON_TIMEOUT) and look for the rank that did not arrive "
                     "(another node, a dead process); kill and restart the job from its last "
                     "checkpoint."),
        CatalogEntry("gpu_straggler_suspect", "job",
                     "One GPU of a run keeps its SM clock or power at or below [jobs] "
                     "straggler_ratio of the run's median past straggler_after_s, every GPU "
                     "working; the cause NVML shows (thermal, power_cap, pcie, ecc) or "
                     "unknown.",
                     "Check the GPU by its cause: cooling and fans (thermal), the power cap "
                     "and PSU (power_cap: nvidia-smi -q -d POWER), the PCIe link (pcie: "
                     "reseat), pending row remaps (ecc: reset at the next drain); then run "
                     "gpudiag qualify on it when it is free."),
    ]
}


def entry(code: str) -> CatalogEntry:
    """The catalog row of a blocker, warning or qualification code."""
    found = (BLOCKERS.get(code) or WARNINGS.get(code) or QUALIFICATION.get(code)
             or RUN_WARNINGS.get(code))
    if found is None:
        raise KeyError(f"unknown blocker or warning code: {code!r}")
    return found


def drains(code: str, *, drain_on_nic: bool = False) -> bool:
    """Whether remediation may drain a node on blocker ``code`` (False for unknown codes);
    ``drain_on_nic``: also the NIC codes of ``NIC_DRAINS``."""
    row = BLOCKERS.get(code)
    return row is not None and (row.drains or (drain_on_nic and code in NIC_DRAINS))


def layer_rank(layer: str) -> int:
    """Position of a layer in the root-cause order (lower = closer to the root)."""
    return _LAYER_RANK[layer]


# Which blockers a failure below brings about: code -> the layers whose blocker can cause it.
# A blocker of a higher layer is "because of" the root only when declared here; one that
# holds whatever happens below (a package not installed, a busy GPU, a version skew, a
# setting) is a finding of its own and is never folded under another (cli.render).
_BELOW_CUDA = frozenset({"probe", "visibility", "driver", "device"})
_GPU_PATH = _BELOW_CUDA | {"cuda"}
CAUSED_BY: dict[str, frozenset[str]] = {
    "nvml_error": frozenset({"visibility"}),
    "nvml_no_permission": frozenset({"visibility"}),
    "gpu_missing": frozenset({"visibility", "driver"}),
    **{code: _BELOW_CUDA for code in (
        "cuda_library_missing", "cuda_no_device", "cuda_driver_mismatch",
        "cuda_driver_too_old", "cuda_system_not_ready", "cuda_devices_unavailable",
        "cuda_out_of_memory", "cuda_init_failed", "cuda_context_failed")},
    **{code: _GPU_PATH for code in (
        "jax_cpu_fallback", "jax_backend_init_failed", "jax_compute_failed",
        "iree_driver_unavailable", "iree_no_device", "iree_device_create_failed",
        "iree_execute_failed", "insufficient_devices")},
    "insufficient_free_memory": frozenset({"device"}),
    "device_state_unknown": frozenset({"probe", "driver", "device"}),
    # A backend not proven because something below failed, or its own runtime did.
    "backend_unproven": _GPU_PATH | {"jax", "iree"},
}


def caused_by(code: str, root_layer: str) -> bool:
    """Whether blocker ``code`` may be a consequence of a blocker in ``root_layer``: the
    catalog declares it (CAUSED_BY) and the root's layer is below the code's."""
    row = BLOCKERS.get(code)
    return (row is not None and root_layer in CAUSED_BY.get(code, frozenset())
            and layer_rank(root_layer) < layer_rank(row.layer))
