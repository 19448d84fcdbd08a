"""NVML's GPU recovery actions by name: one table for the probe, the rules and the metrics.

Its own module with no imports, because the nvml probe child imports it and pays for every
import at each round.
"""

from __future__ import annotations

# nvmlDeviceGpuRecoveryAction_t's values 0..7 (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION).
RECOVERY_ACTION_NAMES: tuple[str, ...] = (
    "none", "gpu_reset", "node_reboot", "drain_p2p", "drain_and_reset",
    "recover_imex_domain", "bus_reset", "system_reboot")
