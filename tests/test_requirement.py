"""Parsers of what callers ask: requirements, sizes, device lists, deadlines."""

from __future__ import annotations

import pytest

from gpudiag.core.requirement import (
    RequirementError,
    parse_backends,
    parse_devices,
    parse_requirement,
    parse_size,
    parse_timeout,
)
from gpudiag.core.verdict import BackendRequirement


@pytest.mark.parametrize(("text", "expected"), [
    ("8GiB", 8 * 2**30), ("8GB", 8 * 10**9), ("8589934592", 8589934592), ("1.5 MiB", 1572864),
    ("512", 512), ("0", 0), ("2g", 2 * 2**30), ("10 kb", 10_000),
])
def test_sizes_accept_binary_decimal_and_plain_bytes(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["eight", "", "8 GiBs", "-1", "8XB", "1e400", "GiB"])
def test_bad_sizes_name_the_value_and_the_accepted_forms(text: str) -> None:
    with pytest.raises(RequirementError) as e:
        parse_size(text)
    assert repr(text) in str(e.value) or "too large" in str(e.value)
    assert "GiB" in str(e.value) or "too large" in str(e.value)


def test_requirements_combine_and_pick_platforms() -> None:
    assert parse_backends("cuda,jax,iree") == (
        BackendRequirement("cuda"), BackendRequirement("jax"), BackendRequirement("iree"))
    assert parse_backends("jax:cpu") == (BackendRequirement("jax", "cpu"),)
    assert parse_backends("JAX:cuda") == (BackendRequirement("jax"),)
    assert parse_backends("iree:local-task,iree:local-task") == (
        BackendRequirement("iree", "local-task"),)


def test_gpu_requirements_are_told_apart_from_cpu_ones() -> None:
    assert parse_requirement("jax").needs_gpu
    assert parse_requirement("iree").needs_gpu
    assert not parse_requirement("jax:cpu").needs_gpu
    assert not parse_requirement("iree:local-task").needs_gpu
    assert parse_requirement("jax:cpu").effective_min_devices == 0
    assert parse_requirement("cuda").effective_min_devices == 1


@pytest.mark.parametrize("text", ["", "cuda,", "tensorflow", "jax:tpu", "cuda:gpu", "iree:",
                                  "iree:Bad Driver", "iree:nosuch"])
def test_bad_requirements_are_refused_with_the_accepted_forms(text: str) -> None:
    with pytest.raises(RequirementError) as e:
        parse_backends(text)
    assert str(e.value)


def test_device_lists_take_indices_and_uuids_only() -> None:
    assert parse_devices("0,1") == ("0", "1")
    uuid = "GPU-f00d0000-0000-4000-8000-000000000000"
    assert parse_devices(uuid) == (uuid,)
    for bad in ("", "0,,1", "a", "0,0", "GPU-xyz", "1000"):
        with pytest.raises(RequirementError):
            parse_devices(bad)


@pytest.mark.parametrize("text", ["0", "-1", "nan", "inf", "soon", "100000"])
def test_bad_deadlines_are_refused(text: str) -> None:
    with pytest.raises(RequirementError):
        parse_timeout(text)


def test_deadlines_accept_fractions() -> None:
    assert parse_timeout("2.5") == 2.5
