"""The shape of each probe's observation, checked where it enters: a child's JSON.

A probe child prints one JSON object. gpudiag.core.observations parses it into typed records
after this check, which lets those parsers assume a dict is a dict and a count is a number;
a malformed observation (a broken or foreign probe, a truncated write) must become a
``probe_error`` naming the bad field, never an exception in the daemon. Only the types of
the fields that gpudiag reads are checked; unknown fields pass, so probes may add fields.
Each backend's shape is declared in its spec (gpudiag.core.backends); this module is the checker.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

TYPE_CHECKING = False  # typing stays off the CLI's fast path (gpudiag.core.backend)
if TYPE_CHECKING:
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


if TYPE_CHECKING:
    Spec: TypeAlias = type | tuple[type, ...] | Obj | ListOf | MapOf
ANY: Spec = object
SCALAR: Spec = (str, int, float, bool)

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
