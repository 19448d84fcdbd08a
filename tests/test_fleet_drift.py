"""``gpudiag fleet --drift``'s rule over Prometheus samples (tests/test_fleet.py asks a real
Prometheus scraping real daemons): nodes grouped by a target label and GPU model, each field
against its group's majority of nodes."""

from __future__ import annotations

import pytest

from gpudiag.engine.fleet import FleetUsageError, Sample
from gpudiag.engine.fleet_drift import DriftQuery, FieldDrift, judge


def _config(instance: str, partition: str | None, **fields: str) -> list[Sample]:
    extra = {} if partition is None else {"partition": partition}
    return [({"instance": instance, "uuid": "GPU-0", "field": f, "value": v, **extra}, 1.0)
            for f, v in fields.items()]


def _info(instance: str, name: str) -> Sample:
    return {"instance": instance, "uuid": "GPU-0", "name": name}, 1.0


def test_a_node_is_compared_only_with_its_partition_and_gpu_model() -> None:
    config = [*_config("a", "p1", vbios_version="A"), *_config("b", "p1", vbios_version="A"),
              *_config("c", "p1", vbios_version="B"),  # the odd one of p1's H200 nodes
              *_config("d", "p1", vbios_version="L"),  # an L40S node: its own group
              *_config("e", "p2", vbios_version="B"), *_config("f", "p2", vbios_version="B")]
    info = [_info(i, "NVIDIA L40S" if i == "d" else "NVIDIA H200") for i in "abcdef"]
    nodes = {n.instance: n for n in judge(config, info, "partition")}
    assert nodes["c"].fields == (FieldDrift("vbios_version", "B", "A", 2, 3),)
    assert [i for i, n in nodes.items() if n.fields] == ["c"]
    assert list(nodes)[0] == "c"  # drifted nodes first
    assert (nodes["d"].group, nodes["d"].model) == ("p1", "NVIDIA L40S")


def test_a_node_whose_own_gpus_disagree_differs_and_a_tie_names_no_majority() -> None:
    mixed = [({"instance": "c", "uuid": u, "field": "power_limit_w", "value": v}, 1.0)
             for u, v in (("GPU-0", "700"), ("GPU-1", "500"))]
    config = [*_config("a", None, power_limit_w="700"), *_config("b", None, power_limit_w="700"),
              *mixed, *_config("x", None, ecc_mode="on"), *_config("y", None, ecc_mode="off")]
    nodes = {n.instance: n for n in judge(config, [], "partition")}
    assert nodes["c"].fields == (FieldDrift("power_limit_w", "500,700", "700", 2, 3),)
    assert not nodes["x"].fields and not nodes["y"].fields


@pytest.mark.parametrize("label", ["", "1st", "has space", "dash-ed", "ünï"])
def test_a_group_label_that_is_no_prometheus_label_is_a_usage_error(label: str) -> None:
    with pytest.raises(FleetUsageError, match="--drift-by"):
        DriftQuery(job="gpudiag", group_label=label)
