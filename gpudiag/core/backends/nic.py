"""The nic probe: the node's InfiniBand/RoCE ports and netdevs, read from sysfs (network layer)."""

from __future__ import annotations

from gpudiag.core.backend import BackendSpec
from gpudiag.core.nic import policy_keys

SPEC = BackendSpec(
    name="nic", layer="network",
    classify="gpudiag.core.classify_nic:classify_nic", published=True,
    summary="The node's InfiniBand/RoCE ports and netdevs from sysfs: state, rate, flaps, "
            "error counters.",
    probe_module="gpudiag.probes.nic_probe",
    observation="gpudiag.core.nic:NicObservation",
    # IB ports are read every second (a few small files): an expected port going down is a
    # verdict within 2 s (docs/reference.md, "nic").
    interval_s=1.0, timeout_s=10.0,
    # Off unless configured ([backends.nic] enabled = true): a node without a fabric needs
    # no child a second, and one with a fabric says which ports it expects.
    enabled=False,
    settings_keys=policy_keys(),
    check_settings="gpudiag.core.nic:parse_policy",
)
