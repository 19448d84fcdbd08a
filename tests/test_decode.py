"""The generic JSON decoder (gpudiag.core.decode): a frozen dataclass is its own JSON schema.

Small hand-made records test the decoder's rules; the table at the end holds garbage probe
observations, one or more per backend, with the probe_error message each one gives (every
one of them was a malformed observation under the hand-written shape tables too).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import pytest

from gpudiag.core import observations, registry
from gpudiag.core.decode import SchemaError, decode, from_json, problem
from gpudiag.core.observations import GpuReadings, Malformed, NvmlObservation, OtherObservation
from gpudiag.core.probe_run import ProbeRun


@dataclass(frozen=True)
class Memory:
    """A nested record."""

    total_bytes: int | None = None
    free_ratio: float | None = None


@dataclass(frozen=True)
class Device:
    """A record with every kind of field the decoder reads."""

    index: int
    name: str | None = None
    healthy: bool | None = None
    mode: Literal["on", "off"] | None = None
    memory: Memory | None = None
    pids: tuple[int, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)
    tags: list[str] | None = None


@dataclass(frozen=True)
class Report:
    """A top-level record: a list of nested records."""

    devices: tuple[Device, ...] = ()
    env: Mapping[str, str | None] = field(default_factory=dict)


def test_a_well_formed_value_becomes_the_typed_record() -> None:
    found = decode(Report, {"devices": [
        {"index": 0, "name": "a", "healthy": True, "mode": "on",
         "memory": {"total_bytes": 8, "free_ratio": 1}, "pids": [4, 5],
         "labels": {"k": "v"}, "tags": ["x"], "unknown": {"extra": 1}}],
        "env": {"CUDA_VISIBLE_DEVICES": None}})
    assert found == Report((Device(0, "a", True, "on", Memory(8, 1), (4, 5), {"k": "v"}, ["x"]),),
                           {"CUDA_VISIBLE_DEVICES": None})
    assert decode(Report, {}) == Report()  # absent and null read as the field's default


@pytest.mark.parametrize(("value", "message"), [
    ({"devices": [{"index": 0}, {"index": 1}, {"index": 2}, {"index": "abc"}]},
     'devices[3].index: expected an integer, got "abc"'),
    ({"devices": [{"index": True}]}, "devices[0].index: expected an integer, got true"),
    ({"devices": [{"index": 1.5}]}, "devices[0].index: expected an integer, got 1.5"),
    ({"devices": [{"name": "a"}]}, "devices[0].index: missing (required)"),
    ({"devices": [{"index": None}]}, "devices[0].index: missing (required)"),
    ({"devices": [None]}, "devices[0]: expected an object, got null"),
    ({"devices": {"index": 0}}, "devices: expected a list, got an object"),
    ({"devices": [{"index": 0, "memory": {"total_bytes": "8"}}]},
     'devices[0].memory.total_bytes: expected an integer, got "8"'),
    ({"devices": [{"index": 0, "memory": {"free_ratio": False}}]},
     "devices[0].memory.free_ratio: expected a number, got false"),
    ({"devices": [{"index": 0, "mode": "maybe"}]},
     'devices[0].mode: expected one of "on", "off", got "maybe"'),
    ({"devices": [{"index": 0, "pids": [1, "2"]}]},
     'devices[0].pids[1]: expected an integer, got "2"'),
    ({"devices": [{"index": 0, "labels": {"k": 3}}]},
     "devices[0].labels.k: expected a string, got 3"),
    ({"devices": [{"index": 0, "labels": {"k": None}}]},
     "devices[0].labels.k: expected a string, got null"),
    ({"devices": [{"index": 0, "healthy": "yes"}]},
     'devices[0].healthy: expected true or false, got "yes"'),
    ({"env": ["CUDA_VISIBLE_DEVICES"]}, "env: expected an object, got a list"),
    ({"devices": [{"index": 0, "name": "x" * 100}, {"index": 0, "name": 7}]},
     "devices[1].name: expected a string, got 7"),
])
def test_a_bad_field_is_named_by_its_path(value: Any, message: str) -> None:
    with pytest.raises(SchemaError) as e:
        decode(Report, value)
    assert str(e.value) == message
    assert problem(Report, value) == message


def test_the_top_level_and_long_values_are_shown_briefly() -> None:
    assert problem(Report, [1]) == "the observation: expected an object, got a list"
    assert problem(Memory, {"total_bytes": "9" * 100}) == (
        'total_bytes: expected an integer, got "' + "9" * 36 + "...")


def _upper(value: Any) -> str | None:
    return None if value is None else str(value).upper()


@dataclass(frozen=True)
class Tuned:
    """Fields read under another key, loosely, converted, or from the whole object."""

    EMPTY_IS_NONE: ClassVar[bool] = True

    loaded: bool = field(default=False, metadata=from_json(key="library.loaded", as_type=Any,
                                                           then=bool))
    where: str | None = field(default=None, metadata=from_json(key="library.path"))
    code: str | None = field(default=None, metadata=from_json(as_type=Any, then=_upper))
    hint: int | None = field(default=None, metadata=from_json(lenient=True))
    counters: Memory | None = field(default=None, metadata=from_json(values=int))
    record: Mapping[str, Any] = field(default_factory=dict, compare=False,
                                      metadata=from_json(whole=True, as_type=Any))


def test_metadata_reads_other_keys_loosely_converted_or_whole() -> None:
    raw = {"library": {"loaded": 1, "path": "/lib"}, "code": 12, "hint": "soon",
           "counters": {"total_bytes": 3, "other": 4}}
    found = decode(Tuned, raw)
    assert found == Tuned(True, "/lib", "12", None, Memory(3))
    assert found.record is raw  # the record's own JSON, as it came
    assert decode(Tuned, {}) is None  # an empty record says nothing
    assert problem(Tuned, {"library": "x"}) == 'library: expected an object, got "x"'
    assert problem(Tuned, {"library": {"path": 3}}) == "library.path: expected a string, got 3"
    # ``values``: every value of the object, named or not, has the type (or is null)
    assert problem(Tuned, {"counters": {"other": "4"}}) == (
        'counters.other: expected an integer, got "4"')
    assert decode(Tuned, {"counters": {"other": None}}).counters == Memory()


def test_lenient_decoding_reads_each_bad_field_as_absent() -> None:
    raw = {"index": 2, "memory": {"total_bytes": "x", "free_bytes": 5}, "temperature_c": "hot",
           "power_w": 120.5}
    assert decode(GpuReadings, raw, lenient=True) == GpuReadings(
        index=2, memory=observations.Memory(free_bytes=5), power_w=120.5)
    with pytest.raises(SchemaError, match="temperature_c: expected a number"):
        decode(GpuReadings, {"temperature_c": "hot"})


# -- the probe observations ------------------------------------------------------------------
# Garbage that the hand-written shape tables also refused (a probe_error), with today's message.
GARBAGE = [
    ("host", {"device_nodes": {"gpu_nodes": "8"}},
     'device_nodes.gpu_nodes: expected a number, got "8"'),
    ("host", {"driver_proc": ["/proc/driver/nvidia"]},
     "driver_proc: expected an object, got a list"),
    ("host", {"environment": {"CUDA_VISIBLE_DEVICES": 0}},
     "environment.CUDA_VISIBLE_DEVICES: expected a string, got 0"),
    ("host", {"pci": {"gpus": [{"driver": "nvidia"}]}}, "pci.gpus[0].address: missing (required)"),
    ("host", {"nvidia_smi_xml": "<xml/>"}, 'nvidia_smi_xml: expected an object, got "<xml/>"'),
    ("nvml", {"devices": [{"index": "zero"}]}, 'devices[0].index: expected an integer, got "zero"'),
    ("nvml", {"devices": [{"ok": True}]}, "devices[0].index: missing (required)"),
    ("nvml", {"devices": [{"index": 0, "ecc": {"sram_parity": "many"}}]},
     'devices[0].ecc.sram_parity: expected a number, got "many"'),
    ("nvml", {"devices": [{"index": 0, "clocks_event_reasons": {"mask": "0x4"}}]},
     'devices[0].clocks_event_reasons.mask: expected a number, got "0x4"'),
    ("nvml", {"devices": [{"index": 0, "mig": {"instances": [{"slot": "a"}]}}]},
     'devices[0].mig.instances[0].slot: expected a number, got "a"'),
    ("nvml", {"devices": [{"index": 0, "processes": [7]}]},
     "devices[0].processes[0]: expected an object, got 7"),
    ("nvml", {"error": "NVML_ERROR_UNKNOWN"},
     'error: expected an object, got "NVML_ERROR_UNKNOWN"'),
    ("cuda", {"library": True}, "library: expected an object, got true"),
    ("cuda", {"devices": [{"context": [0]}]}, "devices[0].context: expected an object, got a list"),
    ("cuda", {"device_count": "1"}, 'device_count: expected a number, got "1"'),
    ("jax", {"platforms": ["cuda", None]}, "platforms[1]: expected a string, got null"),
    ("jax", {"compute": {"error": "boom"}}, 'compute.error: expected an object, got "boom"'),
    ("jax", {"versions": {"jax": [0, 4]}},
     "versions.jax: expected a string or a number or true or false, got a list"),
    ("iree", {"drivers": {"cuda": None}}, "drivers.cuda: expected an object, got null"),
    ("iree", {"drivers": {"cuda": {"execute": {"run": 1}}}},
     "drivers.cuda.execute.run: expected an object, got 1"),
    ("iree", {"required": [{"driver": "cuda"}]},
     "required[0]: expected a string or a number or true or false, got an object"),
]


@pytest.mark.parametrize(("backend", "value", "message"), GARBAGE)
def test_garbage_observations_are_a_probe_error_naming_the_field(backend: str, value: Any,
                                                                 message: str) -> None:
    found = registry.parse_observation(backend, {"ok": True, **value})
    assert isinstance(found, Malformed) and found.problem == message
    run = ProbeRun(backend, {"ok": True, **value}, 0.1, exit_code=0)
    assert not run.ok and run.error == f"probe {backend} returned a malformed observation: " \
        f"{message}"


def test_fields_filled_best_effort_read_as_absent_when_garbled() -> None:
    nvml = registry.parse_observation("nvml", {"ok": 1, "devices": [
        {"index": 0, "ok": "yes", "compute_mode": "exclusive", "persistence_mode": 1,
         "processes": [{"pid": 7.0, "name": 3, "user": ["root"]}], "uuid": ""}]})
    assert isinstance(nvml, NvmlObservation) and nvml.ok is True
    dev = nvml.devices[0]
    assert (dev.ok, dev.compute_mode, dev.persistence_mode, dev.uuid) == (True, None, None, None)
    assert dev.processes is not None and (dev.processes[0].pid, dev.processes[0].name,
                                          dev.processes[0].user) == (7, None, None)
    assert registry.parse_observation("no-such-probe", {"ok": 0}) == OtherObservation(False)


def test_every_registered_observation_uses_only_types_the_decoder_reads() -> None:
    for spec in registry.specs():
        try:
            decode(spec.observation_type(), {})  # planned first: a hint without a rule raises
        except SchemaError:
            pass  # a required field is missing: the plan was made


def test_a_type_hint_without_a_rule_is_a_programming_error_not_a_probe_error() -> None:
    @dataclass(frozen=True)
    class Odd:
        """A set is no JSON type."""

        ids: set[int] = field(default_factory=set)

    with pytest.raises(TypeError, match=r"no rule for the type hint set\[int\]"):
        decode(Odd, {"ids": [1]})
