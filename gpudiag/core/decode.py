"""JSON into frozen dataclasses, typed by their own hints: the one description of a probe's output.

A probe child's JSON is described once, by the typed record gpudiag reads it into
(gpudiag.core.observations). ``decode(Record, value)`` checks each field against its type hint
(str, int, float, bool, unions with None, ``tuple[X, ...]``/``list[X]``, ``Mapping[str, X]``,
``Literal``, ``Any``, nested dataclasses) and returns the instance, or raises ``SchemaError``
naming the bad field's path and what was wrong (``devices[3].memory.total_bytes: expected a
number, got "abc"``). Unknown keys pass, so a probe may add fields. A field that needs another
key, a looser reading or a conversion says so in its ``field(metadata=from_json(...))``, never
in a second table. A type hint without a rule (``set[int]``) is a TypeError when the record is
first decoded, a programming error, not a malformed observation. Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import json as _json
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Union

from gpudiag.core.records import dataclass

MISSING: Any = dataclasses.MISSING
_SCALARS = (str, int, float, bool)
_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false",
          type(None): "null"}


class SchemaError(ValueError):
    """A JSON value that does not have its record's shape; the message names the field."""


@dataclass(frozen=True)
class JsonField:
    """How one dataclass field is read from JSON (``field(metadata=from_json(...))``)."""

    key: str | None = None          # the JSON key (default: the field's name); "a.b" reaches in
    whole: bool = False             # read from the enclosing object itself, not one key
    as_type: Any = None             # the JSON value's type when it differs from the field's
    then: Callable[[Any], Any] | None = None  # converts the checked value into the field's
    lenient: bool = False           # a value of the wrong type reads as absent (None)
    values: Any = None              # every value of the JSON object must also be this (or null)


def from_json(*, key: str | None = None, whole: bool = False, as_type: Any = None,
              then: Callable[[Any], Any] | None = None, lenient: bool = False,
              values: Any = None) -> dict[str, JsonField]:
    """The metadata of a field read other than by its name and type hint."""
    return {"json": JsonField(key, whole, as_type, then, lenient, values)}


_PLAIN = JsonField()


def decode(cls: type[Any], value: Any, *, lenient: bool = False) -> Any:
    """``value`` as a ``cls`` instance; SchemaError names the first bad field.

    ``lenient``: every field of the wrong type reads as absent instead (the XID watcher's
    telemetry, where one bad reading must not drop the others).
    """
    return _plan(cls)(value, None, lenient)


def problem(cls: type[Any], value: Any) -> str | None:
    """Why ``value`` is no ``cls``; None when it decodes."""
    try:
        decode(cls, value)
    except SchemaError as e:
        return str(e)
    return None


# A decoder is planned once per type hint: a function of (value, path, lenient). The path is
# a chain of (parent, key) pairs, spelled out only for an error message.
Path = tuple[Any, str | int] | None
Step = Callable[[Any, Path, bool], Any]
_PLANS: dict[Any, Step] = {}


def _plan(hint: Any) -> Step:
    found = _PLANS.get(hint)
    if found is None:
        found = _PLANS[hint] = _make(hint)
    return found


def _make(hint: Any) -> Step:
    origin = typing.get_origin(hint)
    if hint is Any or hint is object:
        return lambda value, path, lenient: value
    if origin in (Union, types.UnionType):
        return _union(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        return _checked(hint, lambda v: type(v) in _SCALARS and v in choices)
    if origin in (tuple, list, Sequence):
        return _sequence(hint, origin is list)
    if origin in (dict, Mapping) or hint in (dict, Mapping):
        return _mapping(hint)
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return _record(hint)
    if hint in _SCALARS:
        accepted = _ACCEPTS[hint]
        return _checked(hint, lambda v: type(v) in accepted)
    raise TypeError(f"gpudiag.core.decode has no rule for the type hint {hint!r}")


def _checked(hint: Any, ok: Callable[[Any], bool]) -> Step:
    def step(value: Any, path: Path, lenient: bool) -> Any:
        if value is None or not ok(value):
            raise _error(path, hint, value)
        return value
    return step


# The JSON value types each scalar hint accepts: a bool is no number; an int is a float.
_ACCEPTS: dict[Any, frozenset[type]] = {str: frozenset({str}), int: frozenset({int}),
                                        float: frozenset({int, float}),
                                        bool: frozenset({bool})}


def _union(hint: Any) -> Step:
    options = typing.get_args(hint)
    none_ok = type(None) in options or Any in options
    accepted = frozenset(t for o in options if o in _SCALARS for t in _ACCEPTS[o])
    rest = [o for o in options if o not in _SCALARS and o is not type(None)]
    inner = _plan(rest[0]) if len(rest) == 1 else None

    def step(value: Any, path: Path, lenient: bool) -> Any:
        if value is None:
            if none_ok:
                return None
        elif type(value) in accepted:
            return value
        elif inner is not None:
            return inner(value, path, lenient)
        raise _error(path, hint, value)
    return step


def _sequence(hint: Any, as_list: bool) -> Step:
    args = typing.get_args(hint)
    item = _plan(args[0] if args else Any)

    def step(value: Any, path: Path, lenient: bool) -> Any:
        if not isinstance(value, list):
            raise _error(path, hint, value)
        items = [item(v, (path, i), lenient) for i, v in enumerate(value)]
        return items if as_list else tuple(items)
    return step


def _mapping(hint: Any) -> Step:
    args = typing.get_args(hint)
    item = _plan(args[1] if len(args) == 2 else Any)

    def step(value: Any, path: Path, lenient: bool) -> Any:
        if not isinstance(value, Mapping):
            raise _error(path, hint, value)
        return {str(k): item(v, (path, str(k)), lenient) for k, v in value.items()}
    return step


def _record(cls: type) -> Step:
    empty_is_none = getattr(cls, "EMPTY_IS_NONE", False)
    hints = typing.get_type_hints(cls)
    fields = [(f.name, _field(f, hints[f.name])) for f in dataclasses.fields(cls) if f.init]

    def step(value: Any, path: Path, lenient: bool) -> Any:
        if not isinstance(value, Mapping):
            raise _error(path, cls, value)
        if not value and empty_is_none:
            return None  # an empty record says nothing (an error with no field set)
        return cls(**{name: read(value, path, lenient) for name, read in fields})
    return step


def _field(f: dataclasses.Field[Any], hint: Any) -> Callable[[Mapping[str, Any], Path, bool],
                                                              Any]:
    """How one field is read from its record's JSON object."""
    how: JsonField = f.metadata.get("json") or _PLAIN
    keys = () if how.whole else tuple((how.key or f.name).split("."))
    check = _plan(hint if how.as_type is None else how.as_type)
    each = _plan(how.values) if how.values is not None else None
    has_default = f.default is not MISSING or f.default_factory is not MISSING
    make: Callable[[], Any] = f.default_factory  # type: ignore[assignment]

    def default() -> Any:
        return f.default if f.default is not MISSING else make()

    def read(obj: Mapping[str, Any], path: Path, lenient: bool) -> Any:
        where: Path
        if len(keys) == 1:
            raw, where = obj.get(keys[0]), (path, keys[0])
        else:
            raw, where = _lookup(obj, keys, path)
        if raw is None and has_default:
            return default()
        try:
            checked = check(raw, where, lenient)
            if each is not None and isinstance(raw, Mapping):
                for k, v in raw.items():
                    if v is not None:
                        each(v, (where, str(k)), lenient)
        except SchemaError:
            if not (lenient or how.lenient):
                if raw is None:
                    raise SchemaError(f"{_spelled(where)}: missing (required)") from None
                raise
            if has_default:
                return default()
            checked = None
        return how.then(checked) if how.then is not None else checked
    return read


def _lookup(obj: Mapping[str, Any], keys: tuple[str, ...], path: Path) -> tuple[Any, Path]:
    """The value at ``keys`` (``a.b``: ``b`` of the object at ``a``; absent when ``a`` is)."""
    value: Any = obj
    for i, key in enumerate(keys):
        if i:
            if value is None:
                return None, path
            if not isinstance(value, Mapping):
                raise _error(path, dict, value)
        path = (path, key)
        value = value.get(key)
    return value, path


def _spelled(path: Path) -> str:
    """``devices[3].memory``: the path as the error names it."""
    parts: list[str] = []
    while path is not None:
        path, key = path
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
    return "".join(reversed(parts)).lstrip(".")


def _error(path: Path, hint: Any, value: Any) -> SchemaError:
    where = _spelled(path) or "the observation"
    return SchemaError(f"{where}: expected {_expected(hint)}, got {_shown(value)}")


def _expected(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        args = typing.get_args(hint)
        # An integer is a number: "a number", not "an integer or a number".
        return " or ".join(_expected(a) for a in args if a is not type(None)
                           and not (a is int and float in args))
    if origin is Literal:
        return "one of " + ", ".join(_json.dumps(a) for a in typing.get_args(hint))
    if origin in (tuple, list, Sequence):
        return "a list"
    if origin in (dict, Mapping) or hint in (dict, Mapping) or dataclasses.is_dataclass(hint):
        return "an object"
    return _NAMES.get(hint, str(hint))


def _shown(value: Any) -> str:
    """The wrong value as the error shows it: a short scalar as JSON, a container by its kind."""
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "null"
    try:
        text = _json.dumps(value)
    except (TypeError, ValueError):
        return f"a {type(value).__name__}"
    return text if len(text) <= 40 else text[:37] + "..."
