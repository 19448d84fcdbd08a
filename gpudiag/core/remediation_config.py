"""``[remediation]``'s settings (read by gpudiag/daemon/config.py from their declarations): the
policy in gpudiag/core/remediation.py and every actuator (gpudiag/daemon/actuators.py) read them."""

from __future__ import annotations

from gpudiag.core.records import dataclass
from gpudiag.core.settings import Choice, Count, Flag, Number, Text, executable, path, seconds
from gpudiag.core.settings import setting as s


@dataclass(frozen=True)
class RemediationConfig:
    """``[remediation]``: the daemon drains a node on a hardware fault (docs/operations.md).

    Executables and the node come from this root-owned file, never from the environment.
    """

    mode: str = s("off", Choice(("off", "observe", "act")))
    scheduler: str = "slurm"  # a registered platform (daemon/actuators.py), checked there
    scontrol: str = s("/usr/bin/scontrol", executable())
    sinfo: str = s("/usr/bin/sinfo", executable())
    # SLURM_CONF for scontrol and sinfo; None: Slurm's default.
    slurm_conf: str | None = s(None, path())
    # One node, None: the short host name. Not a list ("n1,n2"): that would let one daemon
    # drain several nodes.
    node_name: str | None = s(None, Text(
        r"[A-Za-z0-9._-]{1,255}", "one Slurm node name (letters, digits, '.', '_', '-'; no "
        "list or host range: a daemon drains its own node only)"))
    # The fleet guard's partition(s); None: the node's own.
    partition: str | None = s(None, Text(r"[A-Za-z0-9._,-]{1,255}", "a Slurm name (letters, "
                                         "digits, '.', '_', '-'; partitions comma-separated)"))
    killswitch_file: str = s("/etc/gpudiag/remediation-killswitch", path())
    # The killswitch is re-read, and the node looked at, each tick.
    tick_s: float = s(1.0, seconds(0.05, 60.0))
    command_timeout_s: float = s(5.0, seconds(0.1, 60.0))
    retry_max_s: float = s(30.0, seconds(0.1, 3600.0))
    fleet_window_s: float = s(600.0, seconds(1.0, 86400.0))
    fleet_min_nodes: int = s(2, Count(0, 100000, "a node count from 0 to 100000"))
    fleet_ratio: float = s(0.10, Number(0.0, 1.0, "a share from 0 to 1"))
    max_attempts_per_gpu: int = s(2, Count(1, 100, "a number of drains from 1 to 100"))
    attempt_window_s: float = s(7 * 86400.0, seconds(1.0))
    # An expected network port down or flapping drains too (default: observe only for NIC
    # codes; gpudiag.core.catalog.NIC_DRAINS).
    drain_on_nic: bool = s(False, Flag())
