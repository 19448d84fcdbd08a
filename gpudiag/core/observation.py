"""The shape of each probe's observation, checked where it enters: a child's JSON.

A probe child prints one JSON object. gpudiag.core.observations parses it into typed records
after this check, which lets those parsers assume a dict is a dict and a count is a number;
a malformed observation (a broken or foreign probe, a truncated write) must become a
``probe_error`` naming the bad field, never an exception in the daemon. Only the types of
the fields that gpudiag reads are checked; unknown fields pass, so probes may add fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias

NUMBER = (int, float)


@dataclass(frozen=True)
class Obj:
    """A JSON object; listed fields have these shapes (or are null), ``required`` not null."""

    fields: Mapping[str, Spec] = field(default_factory=dict)
    required: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ListOf:
    """A JSON array whose items (never null) have this shape."""

    item: Spec


@dataclass(frozen=True)
class MapOf:
    """A JSON object with any keys whose values have this shape (or are null if allowed)."""

    value: Spec
    nullable: bool = True


Spec: TypeAlias = type | tuple[type, ...] | Obj | ListOf | MapOf
ANY: Spec = object
SCALAR: Spec = (str, int, float, bool)

_ERROR = Obj({"code": ANY, "name": ANY, "message": ANY, "type": ANY, "step": ANY,
              "where": ANY})
_MEMORY = Obj({"total_bytes": NUMBER, "free_bytes": NUMBER, "used_bytes": NUMBER})
_PROCESSES = ListOf(Obj({"pid": NUMBER, "used_memory_bytes": NUMBER}))
_DEVICE = Obj({
    "index": int, "uuid": str, "name": str, "pci_bus_id": str, "error": _ERROR,
    "recovery_action": SCALAR, "memory": _MEMORY, "processes": _PROCESSES,
    "ecc": MapOf(NUMBER), "remapped_rows": MapOf((int, float, bool)),
    "clocks_event_reasons": Obj({"reasons": ListOf(str), "mask": NUMBER}),
    "mig": Obj({"instances": ListOf(Obj({"uuid": str, "slot": NUMBER, "memory": _MEMORY,
                                         "processes": _PROCESSES, "error": _ERROR}))}),
    "utilization_gpu_ratio": NUMBER, "temperature_c": NUMBER, "power_w": NUMBER,
    "retired_pages_pending": bool, "graphics_processes": _PROCESSES,
    "pcie": Obj({k: int for k in ("current_generation", "max_generation", "current_width",
                                  "max_width")}),
    "nvlinks": Obj({"active": ListOf(int), "inactive": ListOf(int)}),
    "fabric": Obj({"state": int, "status": int}),
}, required=frozenset({"index"}))
_CUDA_STEP = Obj({"ok": ANY, "code": ANY, "message": ANY})

SHAPES: dict[str, Spec] = {
    "host": Obj({
        "environment": MapOf(str),
        "device_nodes": Obj({"gpu_nodes": NUMBER, "permission_denied": ListOf(str),
                             "dir": str}),
        "driver_proc": Obj({"path": str, "kernel_module_version": str}),
        "nvidia_smi": Obj(), "nvidia_smi_xml": Obj(),
        "pci": Obj({"available": bool, "gpus": ListOf(Obj({"address": str, "driver": str},
                                                           required=frozenset({"address"})))}),
    }),
    "nvml": Obj({
        "error": _ERROR, "devices": ListOf(_DEVICE), "device_count": NUMBER,
        "visibility_env": MapOf(str), "driver_version": SCALAR,
        "cuda_driver_version": SCALAR, "nvml_version": SCALAR,
    }),
    "cuda": Obj({
        "library": Obj(), "init": _CUDA_STEP, "device_count": NUMBER,
        "devices": ListOf(Obj({"uuid": str, "error": _ERROR, "context": _CUDA_STEP,
                               "alloc": _CUDA_STEP})),
        "driver_version": SCALAR, "init_duration_s": NUMBER,
    }),
    "jax": Obj({
        "versions": MapOf(SCALAR), "import_error": _ERROR, "init_error": _ERROR,
        "required_error": _ERROR, "platforms": ListOf(str),
        "registered_platforms": ListOf(str), "jax_platforms": str,
        "backend_errors": MapOf(SCALAR), "required_devices": ListOf(ANY),
        "compute": Obj({"error": _ERROR}), "xla_env": MapOf(SCALAR),
        "devices": ListOf(Obj()), "environment": MapOf(str), "default_backend": SCALAR,
        "init_s": NUMBER, "init_duration_s": NUMBER, "static": str, "plugins": ListOf(str),
    }),
    "iree": Obj({
        "versions": MapOf(SCALAR), "import_error": _ERROR, "required": ListOf(SCALAR),
        "drivers": MapOf(Obj({
            "error": _ERROR, "devices": ListOf(Obj()),
            "execute": Obj({"compile": Obj(), "run": Obj(), "skipped": SCALAR}),
        }), nullable=False),
        "environment": MapOf(str), "init_s": NUMBER, "init_duration_s": NUMBER,
        "static": str,
    }),
}


def _name(t: type | tuple[type, ...]) -> str:
    types = t if isinstance(t, tuple) else (t,)
    return " or ".join("JSON value" if x is object else x.__name__ for x in types)


def problem(value: Any, spec: Spec, path: str = "") -> str | None:
    """Why ``value`` does not have the shape ``spec``; None when it does."""
    where = path or "the observation"
    if isinstance(spec, Obj):
        if not isinstance(value, Mapping):
            return f"{where} is a {type(value).__name__}, not an object"
        for key in spec.required:
            if value.get(key) is None:
                return f"{where}.{key} is missing"
        for key, sub in spec.fields.items():
            v = value.get(key)
            if v is not None:
                found = problem(v, sub, f"{path}.{key}" if path else key)
                if found is not None:
                    return found
        return None
    if isinstance(spec, ListOf):
        if not isinstance(value, list):
            return f"{where} is a {type(value).__name__}, not a list"
        for i, item in enumerate(value):
            found = problem(item, spec.item, f"{path}[{i}]")
            if found is not None:
                return found
        return None
    if isinstance(spec, MapOf):
        if not isinstance(value, Mapping):
            return f"{where} is a {type(value).__name__}, not an object"
        for key, v in value.items():
            if v is None and not spec.nullable:
                return f"{path}.{key} is null"
            if v is not None:
                found = problem(v, spec.value, f"{path}.{key}")
                if found is not None:
                    return found
        return None
    if spec is object:
        return None
    # A bool is an int to Python; a count or size that is true/false is still malformed.
    if isinstance(value, bool) and bool not in (spec if isinstance(spec, tuple) else (spec,)):
        return f"{where} is a bool, not a {_name(spec)}"
    if not isinstance(value, spec):
        return f"{where} is a {type(value).__name__}, not a {_name(spec)}"
    return None


def observation_problem(backend: str, observation: Any) -> str | None:
    """Why a probe's observation is malformed; None when gpudiag can read it."""
    return problem(observation, SHAPES.get(backend, Obj()))
