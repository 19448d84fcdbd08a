"""One visibility resolver, two rules: preflight's PREFIX and admission's FULL_UUID."""

from __future__ import annotations

import pytest

from gpudiag.core.environment import (
    FULL_UUID,
    PREFIX,
    KnownDevice,
    Pick,
    Rule,
    parse_cuda_visible_devices,
    resolve,
)


def gpu(i: int) -> str:
    return f"GPU-f00d{i:04x}-0000-4000-8000-00000000{i:04x}"


MIG = "MIG-f00d0001-0000-4000-8000-000000000000"
DEVICES = [KnownDevice(0, gpu(0)), KnownDevice(1, gpu(1), (MIG,)), KnownDevice(2, gpu(2))]


@pytest.mark.parametrize("rule", [PREFIX, FULL_UUID])
def test_indices_full_uuids_and_mig_uuids_resolve_under_both_rules(rule: Rule) -> None:
    res = resolve(parse_cuda_visible_devices(f"2,{gpu(0)},{MIG}"), DEVICES, rule)
    assert res.indices == (2, 0, 1) and res.unresolved == ()
    assert res.picks == ((Pick(2),), (Pick(0),), (Pick(1, MIG),))


def test_a_unique_prefix_names_a_gpu_for_preflight_but_never_for_admission() -> None:
    prefix = gpu(2)[:12]
    assert resolve(parse_cuda_visible_devices(prefix), DEVICES, PREFIX).indices == (2,)
    strict = resolve(parse_cuda_visible_devices(prefix), DEVICES, FULL_UUID)
    assert strict.indices == () and strict.unresolved == (prefix,)


def test_an_ambiguous_prefix_is_unresolved_and_named_ambiguous() -> None:
    res = resolve(parse_cuda_visible_devices("GPU-f00d"), DEVICES, PREFIX)
    assert res.indices == () and res.ambiguous == ("GPU-f00d",)
    assert res.unresolved == ("GPU-f00d",) and len(res.picks[0]) == 3


@pytest.mark.parametrize("rule", [PREFIX, FULL_UUID])
@pytest.mark.parametrize("raw", ["7", "MIG-GPU-x/1/0", "bogus"])
def test_entries_that_name_nothing_are_unresolved(rule: Rule, raw: str) -> None:
    res = resolve(parse_cuda_visible_devices(f"0,{raw}"), DEVICES, rule)
    assert res.indices == (0,) and res.unresolved == (raw,) and res.picks[1] == ()


@pytest.mark.parametrize("raw, indices", [(None, (0, 1, 2)), ("-1", ())])
def test_unset_sees_everything_and_empty_sees_nothing(raw: str | None,
                                                     indices: tuple[int, ...]) -> None:
    for rule in (PREFIX, FULL_UUID):
        assert resolve(parse_cuda_visible_devices(raw), DEVICES, rule).indices == indices
