"""``[remediation]``'s settings (validated by gpudiag/daemon/config.py): the policy in
gpudiag/core/remediation.py and every actuator (gpudiag/daemon/actuators.py) read them."""

from __future__ import annotations

from gpudiag.core.records import dataclass


@dataclass(frozen=True)
class RemediationConfig:
    """``[remediation]``: the daemon drains a node on a hardware fault (docs/operations.md).

    Executables and the node come from this root-owned file, never from the environment.
    """

    mode: str = "off"             # off | observe | act
    scheduler: str = "slurm"
    scontrol: str = "/usr/bin/scontrol"
    sinfo: str = "/usr/bin/sinfo"
    slurm_conf: str | None = None  # SLURM_CONF for scontrol and sinfo; None: Slurm's default
    node_name: str | None = None   # None: the short host name
    partition: str | None = None   # the fleet guard's partition(s); None: the node's own
    killswitch_file: str = "/etc/gpudiag/remediation-killswitch"
    tick_s: float = 1.0            # the killswitch is re-read, and the node looked at, each
    command_timeout_s: float = 5.0
    retry_max_s: float = 30.0
    fleet_window_s: float = 600.0
    fleet_min_nodes: int = 2
    fleet_ratio: float = 0.10
    max_attempts_per_gpu: int = 2
    attempt_window_s: float = 7 * 86400.0
    # An expected network port down or flapping drains too (default: observe only for NIC
    # codes; gpudiag.core.catalog.NIC_DRAINS).
    drain_on_nic: bool = False
