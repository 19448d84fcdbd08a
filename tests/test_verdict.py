"""The verdict record: JSON round trip, key=value lines, root-cause order; visibility parsing."""

from __future__ import annotations

import json

from gpudiag.core.classify import NodeFacts, classify
from gpudiag.core.environment import (
    KnownDevice,
    allow_listed,
    parse_cuda_visible_devices,
    parse_nvidia_visible_devices,
    probe_environment,
    resolve_list,
)
from gpudiag.core.identity import GpuIdentity
from gpudiag.core.probe_run import ProbeRun
from gpudiag.core.requirement import parse_requirement
from gpudiag.core.verdict import Finding, Verdict, primary_blocker
from gpudiag.engine.isolation import _parse_observation


def _verdict() -> Verdict:
    runs = {
        "nvml": ProbeRun("nvml", {"ok": False, "error": {"code": 9, "name": "x",
                                                         "message": "Driver Not Loaded"}}, 0.1),
        "cuda": ProbeRun("cuda", None, 2.0, timed_out=True, error="deadline",
                         stderr_tail="line one\nline two"),
    }
    return classify(runs, parse_requirement("cuda", min_free_memory="1GiB"), host="h",
                    checked_at="2026-11-29T00:00:00.000Z")


def test_root_cause_is_the_lowest_layer_and_consequences_stay() -> None:
    v = _verdict()
    assert v.gpu_validation_blocker == "probe_timeout"
    codes = [b["code"] for b in v.record()["blockers"]]
    assert codes[0] == "probe_timeout" and "driver_not_loaded" in codes
    assert "insufficient_devices" in codes


def test_record_round_trips_through_json() -> None:
    v = _verdict()
    again = Verdict.from_record(json.loads(v.json()))
    assert again.record() == v.record()


def test_kv_lines_never_break_on_newlines_in_values() -> None:
    v = _verdict()
    text = v.kv()
    for line in text.splitlines():
        assert "=" in line
    assert "gpu_validation_blocker=probe_timeout" in text.splitlines()


def test_primary_of_no_blockers_is_none() -> None:
    assert primary_blocker([]) is None
    f = Finding.of("cuda_no_device", "m")
    assert primary_blocker([f, Finding.of("gpu_lost", "m")]).code == "gpu_lost"  # type: ignore[union-attr]


def test_cuda_visible_devices_forms() -> None:
    assert parse_cuda_visible_devices(None).mode == "unset"
    for empty in ("", "-1", "NoDevFiles"):
        assert parse_cuda_visible_devices(empty).mode == "empty"
    full = "GPU-f00d0002-0000-4000-8000-000000000002"
    v = parse_cuda_visible_devices(f"0,GPU-f00d0001,MIG-abc-def,{full},x")
    assert [e.kind for e in v.entries] == ["index", "uuid_prefix", "mig_uuid", "uuid", "invalid"]
    assert parse_nvidia_visible_devices("all").mode == "all"
    assert parse_nvidia_visible_devices("void").mode == "empty"
    assert parse_nvidia_visible_devices("none").mode == "empty"


def test_resolution_never_takes_an_ambiguous_prefix() -> None:
    devs = [KnownDevice(0, "GPU-aa11"), KnownDevice(1, "GPU-aa22")]
    res = resolve_list(parse_cuda_visible_devices("GPU-aa"), devs)
    assert res.indices == () and res.ambiguous == ("GPU-aa",)
    assert resolve_list(parse_cuda_visible_devices("1,0"), devs).indices == (1, 0)


def test_allow_list_keeps_gpu_variables_and_drops_secrets() -> None:
    env = {"CUDA_VISIBLE_DEVICES": "0", "AWS_SECRET_ACCESS_KEY": "x", "SLURM_JOB_GPUS": "0",
           "SLURM_JOB_ID": "7", "SLURM_JOB_ACCOUNT": "acct", "PATH": "/bin", "HOME": "/root"}
    assert allow_listed(env) == {"CUDA_VISIBLE_DEVICES": "0", "PATH": "/bin",
                                 "SLURM_JOB_GPUS": "0", "SLURM_JOB_ID": "7"}


def test_probe_environment_fills_in_but_never_overrides_preallocation() -> None:
    env = probe_environment({"XLA_PYTHON_CLIENT_PREALLOCATE": "true"})
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
    assert env["XLA_PYTHON_CLIENT_ALLOCATOR"] == "platform"


def test_garbage_observations_are_reported_not_raised() -> None:
    assert _parse_observation(b"")[0] is None
    assert _parse_observation(b"not json")[0] is None
    assert _parse_observation(b"[1, 2]")[0] is None
    assert _parse_observation(b'noise\n{"ok": true}\n')[0] == {"ok": True}


U0, U1 = "GPU-0a000000-0000-4000-8000-000000000000", "GPU-0a000001-0000-4000-8000-000000000001"


def _one_gpu_lost(last_seen: dict[int, GpuIdentity] | None) -> Verdict:
    lost = {"index": 1, "ok": False,
            "error": {"code": 15, "name": "NVML_ERROR_GPU_IS_LOST", "message": "GPU is lost"}}
    nvml = {"ok": True, "device_count": 2, "devices": [
        {"index": 0, "ok": True, "uuid": U0, "pci_bus_id": "00000000:18:00.0"}, lost]}
    return classify({"nvml": ProbeRun("nvml", nvml, 0.1)}, parse_requirement("cuda"),
                    host="h", checked_at="2026-12-01T00:00:00.000Z",
                    facts=NodeFacts(last_seen=last_seen))


def test_a_lost_gpu_is_named_by_its_last_uuid_never_by_one_another_gpu_carries() -> None:
    named = _one_gpu_lost({1: GpuIdentity(U1, "H200", "00000000:19:00.0")})
    gpu0, gpu1 = named.devices
    assert (gpu1.uuid, gpu1.uuid_source, gpu1.pci_bus_id) == (
        U1, "last_seen", "00000000:19:00.0")
    assert (gpu0.uuid_source, gpu1.name) == ("nvml", None)  # only the UUID is remembered
    assert [b.device for b in named.blockers if b.code == "gpu_lost"] == [U1]
    assert Verdict.from_record(json.loads(named.json())).record() == named.record()
    for last_seen in (None, {1: GpuIdentity(U0, "H200", "")}):  # none; GPU 0's UUID now
        plain = _one_gpu_lost(last_seen)
        assert (plain.devices[1].uuid, plain.devices[1].uuid_source) == (None, None)
        assert [b.device for b in plain.blockers if b.code == "gpu_lost"] == ["index 1"]
