"""One visibility resolver, two rules (preflight's PREFIX, admission's FULL_UUID), one view
that the verdict, the busy-GPU round and admission read."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gpudiag.core.classify import classify
from gpudiag.core.decode import decode
from gpudiag.core.environment import (
    FULL_UUID,
    PREFIX,
    KnownDevice,
    Pick,
    Rule,
    job_view,
    parse_cuda_visible_devices,
    resolve_list,
)
from gpudiag.core.observations import NvmlObservation
from gpudiag.core.occupancy import leaves_from_nvml
from gpudiag.core.probe_run import ProbeRun
from gpudiag.core.requirement import parse_requirement
from gpudiag.core.visibility import VISIBILITY_VARIABLES
from gpudiag.engine.guard import visible_uuids
from gpudiag.runner.admission import narrow


def gpu(i: int) -> str:
    return f"GPU-f00d{i:04x}-0000-4000-8000-00000000{i:04x}"


MIG = "MIG-f00d0001-0000-4000-8000-000000000000"
DEVICES = [KnownDevice(0, gpu(0)), KnownDevice(1, gpu(1), (MIG,)), KnownDevice(2, gpu(2))]


@pytest.mark.parametrize("rule", [PREFIX, FULL_UUID])
def test_indices_full_uuids_and_mig_uuids_resolve_under_both_rules(rule: Rule) -> None:
    res = resolve_list(parse_cuda_visible_devices(f"2,{gpu(0)},{MIG}"), DEVICES, rule)
    assert res.indices == (2, 0, 1) and res.unresolved == ()
    assert res.picks == ((Pick(2),), (Pick(0),), (Pick(1, MIG),))


def test_a_unique_prefix_names_a_gpu_for_preflight_but_never_for_admission() -> None:
    prefix = gpu(2)[:12]
    assert resolve_list(parse_cuda_visible_devices(prefix), DEVICES, PREFIX).indices == (2,)
    strict = resolve_list(parse_cuda_visible_devices(prefix), DEVICES, FULL_UUID)
    assert strict.indices == () and strict.unresolved == (prefix,)


def test_an_ambiguous_prefix_is_unresolved_and_named_ambiguous() -> None:
    res = resolve_list(parse_cuda_visible_devices("GPU-f00d"), DEVICES, PREFIX)
    assert res.indices == () and res.ambiguous == ("GPU-f00d",)
    assert res.unresolved == ("GPU-f00d",) and len(res.picks[0]) == 3


@pytest.mark.parametrize("rule", [PREFIX, FULL_UUID])
@pytest.mark.parametrize("raw", ["7", "MIG-GPU-x/1/0", "bogus"])
def test_entries_that_name_nothing_are_unresolved(rule: Rule, raw: str) -> None:
    res = resolve_list(parse_cuda_visible_devices(f"0,{raw}"), DEVICES, rule)
    assert res.indices == (0,) and res.unresolved == (raw,) and res.picks[1] == ()


@pytest.mark.parametrize("raw, indices", [(None, (0, 1, 2)), ("-1", ())])
def test_unset_sees_everything_and_empty_sees_nothing(raw: str | None,
                                                     indices: tuple[int, ...]) -> None:
    for rule in (PREFIX, FULL_UUID):
        assert resolve_list(parse_cuda_visible_devices(raw), DEVICES, rule).indices == indices


# --- resolved once: the verdict, the busy-GPU round and admission read one view -------------


def gpu4(i: int) -> str:
    return f"GPU-f00d{i:04x}-0000-4000-8000-00000000{i:04x}"


_NVML = {"ok": True, "device_count": 4, "devices": [
    {"index": i, "ok": True, "uuid": gpu4(i), "memory": {"free_bytes": 1, "total_bytes": 2},
     "processes": []} for i in range(4)]}

# (the job's variables, the GPUs it sees in CUDA's order, the verdict's and admission's codes)
_VIEWS: list[tuple[dict[str, str], list[int], list[str], list[str]]] = [
    ({"CUDA_VISIBLE_DEVICES": "3,1"}, [3, 1], [], []),
    ({"NVIDIA_VISIBLE_DEVICES": f"{gpu4(2)},{gpu4(0)}"}, [2, 0], [], []),
    ({"CUDA_VISIBLE_DEVICES": gpu4(1), "NVIDIA_VISIBLE_DEVICES": f"{gpu4(3)},{gpu4(1)}"}, [1],
     [], []),
    # CUDA names GPU 3, which the container's list hides: the verdict says the name matches
    # nothing the job can see, admission that the two variables disagree.
    ({"CUDA_VISIBLE_DEVICES": "3,1", "NVIDIA_VISIBLE_DEVICES": gpu4(1)}, [1],
     ["visible_devices_invalid"], ["visible_devices_conflict"]),
    ({"CUDA_VISIBLE_DEVICES": "-1"}, [], ["visible_devices_empty"], []),
    ({"NVIDIA_VISIBLE_DEVICES": "void", "CUDA_VISIBLE_DEVICES": "0"}, [],
     ["visible_devices_empty"], ["visible_devices_conflict"]),
    ({"CUDA_VISIBLE_DEVICES": "7"}, [], ["visible_devices_invalid"], ["visible_devices_invalid"]),
]


@pytest.mark.parametrize("env, seen, verdict_codes, admission_codes", _VIEWS)
def test_the_verdict_the_round_and_admission_see_the_same_gpus(
        env: dict[str, str], seen: list[int], verdict_codes: list[str],
        admission_codes: list[str]) -> None:
    nvml = decode(NvmlObservation, _NVML)
    view = job_view(env, [KnownDevice(d.index, str(d.uuid)) for d in nvml.devices])
    assert list(view.indices) == seen
    # The busy-GPU round (engine/round.py through guard.visible_uuids):
    assert visible_uuids(nvml, env) == [gpu4(i) for i in seen]
    # The verdict (its devices are the candidates it selects from):
    run = {**_NVML, "visibility_env": {k: env.get(k) for k in VISIBILITY_VARIABLES}}
    verdict = classify({"nvml": ProbeRun("nvml", run, 0.1)}, parse_requirement("cuda"),
                       host="h", checked_at="2026-12-02T00:00:00.000Z")
    assert [d.index for d in verdict.devices] == seen
    codes = [b.code for b in verdict.blockers if b.code.startswith("visible_devices")]
    assert codes == verdict_codes
    # Admission (full UUIDs or indices only; it narrows leaves, never widens):
    narrowing = narrow(leaves_from_nvml(nvml), env)
    assert [b.code for b in narrowing.blockers] == admission_codes
    assert narrowing.allowed == frozenset(gpu4(i) for i in seen)


def test_a_container_naming_mig_instances_exposes_only_those() -> None:
    mig_a, mig_b = "MIG-a0000000-0000-4000-8000-00000000000a", \
        "MIG-b0000000-0000-4000-8000-00000000000b"
    devices = [KnownDevice(0, gpu(0), (mig_a, mig_b)), KnownDevice(1, gpu(1))]
    view = job_view({"NVIDIA_VISIBLE_DEVICES": mig_b, "CUDA_VISIBLE_DEVICES": mig_a}, devices,
                    FULL_UUID)
    assert view.indices == () and view.hidden == (mig_a,)
    inside = job_view({"NVIDIA_VISIBLE_DEVICES": mig_b, "CUDA_VISIBLE_DEVICES": mig_b},
                      devices, FULL_UUID)
    assert inside.indices == (0,) and inside.hidden == ()


_RESOLVERS = {"resolve_list", "parse_cuda_visible_devices", "parse_nvidia_visible_devices"}
# Where the resolvers may be called: the view itself, and the host probe, which records what
# the variables say (parsed, never resolved) as evidence.
_RESOLVER_HOMES = {"gpudiag/core/environment.py", "gpudiag/probes/host.py"}
# Where the two names may be spelled: their home, and core/child.py, which is copied whole
# into a run's sitecustomize.py and so imports nothing of gpudiag.
_NAME_HOMES = {"gpudiag/core/visibility.py", "gpudiag/core/child.py"}


def test_visibility_is_resolved_in_one_place_and_its_names_spelled_in_one() -> None:
    resolvers: list[str] = []
    spelled: list[str] = []
    root = Path(__file__).resolve().parent.parent
    for path in sorted((root / "gpudiag").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in _RESOLVERS and rel not in _RESOLVER_HOMES):
                resolvers.append(f"{rel}:{node.lineno}")
            if (isinstance(node, ast.Constant) and node.value in VISIBILITY_VARIABLES
                    and rel not in _NAME_HOMES):
                spelled.append(f"{rel}:{node.lineno}")
    assert resolvers == [], "resolve visibility through core.environment.job_view"
    assert spelled == [], "spell the variable names as core.visibility's constants"
