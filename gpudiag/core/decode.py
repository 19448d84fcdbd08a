"""JSON into frozen dataclasses, typed by their own hints: the one description of a probe's output.

A probe child's JSON is described once, by the typed record gpudiag reads it into
(gpudiag.core.observations). ``decode(Record, value)`` checks each field against its type hint
(str, int, float, bool, unions with None, ``tuple[X, ...]``/``list[X]``, ``Mapping[str, X]``,
``Literal``, ``Any``, nested dataclasses) and returns the instance, or raises ``SchemaError``
naming the bad field's path and what was wrong (``devices[3].memory.total_bytes: expected a
number, got "abc"``). Unknown keys pass, so a probe may add fields. A field that needs another
key, a looser reading or a conversion says so in its ``field(metadata=from_json(...))``, never in a
second table. Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import json as _json
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union

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


def decode(cls: type[Any], value: Any, *, lenient: bool = False, path: str = "") -> Any:
    """``value`` as a ``cls`` instance; SchemaError names the first bad field.

    ``lenient``: every field of the wrong type reads as absent instead (the XID watcher's
    telemetry, where one bad reading must not drop the others).
    """
    return _decode(cls, value, path, lenient)


def problem(cls: type[Any], value: Any) -> str | None:
    """Why ``value`` is no ``cls``; None when it decodes."""
    try:
        decode(cls, value)
    except SchemaError as e:
        return str(e)
    return None


def _decode(hint: Any, value: Any, path: str, lenient: bool) -> Any:
    origin = typing.get_origin(hint)
    if hint is Any or hint is object:
        return value
    if origin in (Union, types.UnionType):
        return _union(hint, value, path, lenient)
    if value is None:
        raise _error(path, hint, value)
    if origin is Literal:
        if value in typing.get_args(hint) and type(value) in _SCALARS:
            return value
        raise _error(path, hint, value)
    if origin in (tuple, list, Sequence):
        return _sequence(hint, origin, value, path, lenient)
    if origin in (dict, Mapping) or hint in (dict, Mapping):
        return _mapping(hint, value, path, lenient)
    if dataclasses.is_dataclass(hint):
        return _record(hint, value, path, lenient)
    if hint in _SCALARS and _is(value, hint):
        return value
    raise _error(path, hint, value)


def _is(value: Any, scalar: type) -> bool:
    """Whether a JSON value is this scalar type (a bool is no number; an int is a float)."""
    if isinstance(value, bool):
        return scalar is bool
    if scalar is float:
        return isinstance(value, (int, float))
    return isinstance(value, scalar)


def _union(hint: Any, value: Any, path: str, lenient: bool) -> Any:
    options = typing.get_args(hint)
    if value is None:
        if type(None) in options or Any in options:
            return None
        raise _error(path, hint, value)
    for option in options:
        if option in _SCALARS and _is(value, option):
            return value
    rest = [o for o in options if o not in _SCALARS and o is not type(None)]
    if len(rest) == 1:
        return _decode(rest[0], value, path, lenient)
    raise _error(path, hint, value)


def _sequence(hint: Any, origin: Any, value: Any, path: str, lenient: bool) -> Any:
    if not isinstance(value, list):
        raise _error(path, hint, value)
    args = typing.get_args(hint)
    item = args[0] if args else Any
    items = [_decode(item, v, f"{path}[{i}]", lenient) for i, v in enumerate(value)]
    return items if origin is list else tuple(items)


def _mapping(hint: Any, value: Any, path: str, lenient: bool) -> Any:
    if not isinstance(value, Mapping):
        raise _error(path, hint, value)
    args = typing.get_args(hint)
    item = args[1] if len(args) == 2 else Any
    return {str(k): _decode(item, v, _join(path, str(k)), lenient) for k, v in value.items()}


def _record(cls: Any, value: Any, path: str, lenient: bool) -> Any:
    if not isinstance(value, Mapping):
        raise _error(path, cls, value)
    if not value and getattr(cls, "EMPTY_IS_NONE", False):
        return None  # an empty record says nothing (an error with no field set)
    return cls(**{f.name: _field(f, hint, value, path, lenient) for f, hint in _fields(cls)})


_FIELDS: dict[type, tuple[tuple[dataclasses.Field[Any], Any], ...]] = {}


def _fields(cls: type) -> tuple[tuple[dataclasses.Field[Any], Any], ...]:
    """A record's init fields with their resolved type hints (resolved once per class)."""
    if cls not in _FIELDS:
        hints = typing.get_type_hints(cls)
        _FIELDS[cls] = tuple((f, hints[f.name]) for f in dataclasses.fields(cls) if f.init)
    return _FIELDS[cls]


def _field(f: dataclasses.Field[Any], hint: Any, obj: Mapping[str, Any], path: str,
           lenient: bool) -> Any:
    how: JsonField = f.metadata.get("json") or _PLAIN
    where = path if how.whole else _join(path, how.key or f.name)
    raw = obj if how.whole else _lookup(obj, how.key or f.name, path)
    if raw is None and _has_default(f):
        return _default(f)
    try:
        checked = _decode(hint if how.as_type is None else how.as_type, raw, where, lenient)
        if how.values is not None and isinstance(raw, Mapping):
            for k, v in raw.items():
                if v is not None:
                    _decode(how.values, v, _join(where, str(k)), lenient)
    except SchemaError:
        if not (lenient or how.lenient):
            if raw is None:
                raise SchemaError(f"{where}: missing (required)") from None
            raise
        if _has_default(f):
            return _default(f)
        checked = None
    return how.then(checked) if how.then is not None else checked


def _has_default(f: dataclasses.Field[Any]) -> bool:
    return f.default is not MISSING or f.default_factory is not MISSING


def _default(f: dataclasses.Field[Any]) -> Any:
    make: Callable[[], Any] = f.default_factory  # type: ignore[assignment]
    return f.default if f.default is not MISSING else make()


def _lookup(obj: Mapping[str, Any], key: str, path: str) -> Any:
    """The value at ``key`` (``a.b``: ``b`` of the object at ``a``; absent when ``a`` is)."""
    *outer, last = key.split(".")
    for i, part in enumerate(outer):
        inner = obj.get(part)
        if inner is None:
            return None
        if not isinstance(inner, Mapping):
            raise _error(_join(path, ".".join(outer[:i + 1])), dict, inner)
        obj = inner
    return obj.get(last)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _error(path: str, hint: Any, value: Any) -> SchemaError:
    where = path or "the observation"
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
