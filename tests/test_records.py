"""gpudiag.core.records.dataclass behaves as dataclasses.dataclass: twin classes, one made by
each, built from the same calls (good and bad) and compared in everything a caller sees."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import re
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import gpudiag
from gpudiag.core import records

Decorator = Callable[..., Any]


def _bodies(decorate: Decorator, **flags: Any) -> list[type]:
    """The same record classes, decorated by ``decorate`` with ``flags``."""

    @decorate(**flags)
    class Plain:
        a: int
        b: str = "b"

    @decorate(**flags)
    class Rich:
        a: int
        b: str
        c: float = 1.5
        d: tuple[int, ...] = dataclasses.field(default_factory=tuple)
        quiet: object = dataclasses.field(default=None, compare=False, repr=False)
        e: list[int] = dataclasses.field(default_factory=list, hash=False)

    @decorate(**flags)
    class Empty:
        pass

    @decorate(**flags)
    class Derived:
        x: int
        seen: int = dataclasses.field(init=False, default=0, compare=False)
        made: list[int] = dataclasses.field(init=False, default_factory=list, compare=False)

        def __post_init__(self) -> None:
            object.__setattr__(self, "seen", self.x * 2)

    @decorate(**flags)
    class Child(Plain):
        c: int = 3

    @decorate(**flags)
    class Own:
        a: int

        def __repr__(self) -> str:
            return "own"

        def __eq__(self, other: object) -> bool:
            return True

    return [Plain, Rich, Empty, Derived, Child, Own]


FLAGS = [{}, {"frozen": True}, {"frozen": True, "eq": False, "repr": False},
         {"eq": False}, {"repr": False}, {"init": True, "frozen": True, "eq": True}]
CALLS: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
    ((1,), {}), ((1, "x"), {}), ((), {"a": 1}), ((), {"a": 1, "b": "y"}), ((1, "x", 2.0), {}),
    ((1, "x", 2.0, (1,), "q", [1]), {}), ((1, "x", 2.0, (1,), "q", [1], 9), {}),
    ((), {}), ((1,), {"a": 2}), ((1,), {"z": 1}), ((), {"b": "x"}), ((), {"z": 1, "a": 1}),
    ((1, 2, 3, 4), {}), ((1,), {"x": 1}), ((), {"x": 3}), ((1,), {"c": 2}), ((), {"c": 1}),
    ((), {"q": 1, "a": 1, "b": 2, "c": 3}),
]


def _outcome(cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, Any]:
    try:
        obj = cls(*args, **dict(kwargs))
    except TypeError as e:
        return "TypeError", str(e)
    return "made", obj


def _seen(obj: Any) -> dict[str, Any]:
    """What a caller sees of an instance: its fields, repr, equality, hash, immutability."""
    shown = re.sub(r" at 0x[0-9a-f]+", "", repr(obj)).replace("_bodies.<locals>.", "")
    seen: dict[str, Any] = {"fields": dataclasses.asdict(obj), "repr": shown}
    twin = dataclasses.replace(obj) if any(f.init for f in dataclasses.fields(obj)) else obj
    seen["eq_copy"] = obj == twin
    seen["eq_other"] = obj == object()
    try:
        seen["hash_equal"] = hash(obj) == hash(twin)
        seen["hashable"] = True
    except TypeError as e:
        seen["hashable"] = str(e)
    for field in dataclasses.fields(obj)[:1]:
        try:
            setattr(obj, field.name, getattr(obj, field.name))
            seen["set"] = "ok"
        except dataclasses.FrozenInstanceError as e:
            seen["set"] = str(e)
    try:
        obj.not_a_field = 1
        seen["set_other"] = "ok"
    except dataclasses.FrozenInstanceError as e:
        seen["set_other"] = str(e)
    return seen


@pytest.mark.parametrize("flags", FLAGS, ids=str)
def test_every_call_made_or_refused_as_the_standard_library_does(flags: dict[str, Any]
                                                                 ) -> None:
    ours, stdlib = _bodies(records.dataclass, **flags), _bodies(dataclasses.dataclass, **flags)
    compared = 0
    for mine, theirs in zip(ours, stdlib, strict=True):
        assert [f.name for f in dataclasses.fields(mine)] == [
            f.name for f in dataclasses.fields(theirs)]
        for args, kwargs in CALLS:
            got, want = _outcome(mine, args, kwargs), _outcome(theirs, args, kwargs)
            assert got[0] == want[0], (mine, args, kwargs, got, want)
            if got[0] == "TypeError":
                assert got[1] == want[1]
            else:
                assert _seen(got[1]) == _seen(want[1]), (mine, args, kwargs)
            compared += 1
    assert compared == len(CALLS) * 6


@given(a=st.one_of(st.integers(), st.floats(allow_nan=True), st.text()),
       b=st.text(), c=st.floats(allow_nan=True))
def test_equality_and_hash_match_on_any_values(a: Any, b: str, c: float) -> None:
    ours = _bodies(records.dataclass, frozen=True)[1]
    stdlib = _bodies(dataclasses.dataclass, frozen=True)[1]
    x, y = ours(a, b, c), ours(a, b, c)
    p, q = stdlib(a, b, c), stdlib(a, b, c)
    assert (x == y) == (p == q)  # NaN in a field: unequal unless the same object, as tuples
    assert (x == x) == (p == p)
    assert hash(x) == hash(p)
    assert repr(x).split("(", 1)[1] == repr(p).split("(", 1)[1]


def test_other_flags_go_to_the_standard_library() -> None:
    @records.dataclass(frozen=True, order=True)
    class Ordered:
        a: int

    assert Ordered(1) < Ordered(2)
    assert "__record_frozen__" not in Ordered.__dict__


def test_frozen_and_mutable_do_not_mix_as_in_the_standard_library() -> None:
    @records.dataclass(frozen=True)
    class Frozen:
        a: int

    with pytest.raises(TypeError, match="cannot inherit non-frozen dataclass from a frozen one"):
        @records.dataclass
        class Thawed(Frozen):  # type: ignore[misc]  # mypy says it too
            b: int


def test_every_record_class_of_the_package_is_made_here() -> None:
    """The whole package uses this module's dataclass (an import of the standard library's
    would compile again at every start): every dataclass found is one of ours, but for the
    flags this module hands on."""
    found = []
    for info in pkgutil.walk_packages(gpudiag.__path__, "gpudiag."):
        if info.name.startswith(("gpudiag.pytest_plugin", "gpudiag.__main__")):
            continue
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if (isinstance(value, type) and dataclasses.is_dataclass(value)
                    and value.__module__ == module.__name__):
                found.append(value)
    stdlib_made = [c.__qualname__ for c in found if "__record_frozen__" not in c.__dict__
                   and "__lt__" not in c.__dict__]  # order=True: the standard library's
    assert len(found) > 200
    assert stdlib_made == []
