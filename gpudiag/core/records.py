"""``dataclass``: the standard library's, with the same meaning, without compiling code per class.

Why: ``dataclasses.dataclass`` writes each method it adds as source text and compiles it with
``exec``: ``__init__``, ``__repr__`` and ``__eq__``, and for a frozen class ``__setattr__``,
``__delattr__`` and ``__hash__`` too. ``gpudiag probe`` imports about 100 record classes, and
compiling their methods took 51 of its 135 ms (docs/benchmarks.md, "Probe overhead"). Here the
standard library still reads the fields (so ``dataclasses.fields``, ``replace``, ``asdict`` and
``is_dataclass`` work unchanged), and each method is a closure over the class's field names,
made without compiling anything: the same behaviour (``tests/test_records.py`` compares it
with the standard library's), at a seventh of the start-up cost. An instance costs about a
microsecond more to build (2 us against 1 for eight fields), which nothing here does in bulk.

mypy sees ``dataclasses.dataclass`` itself under this name, so every static check (frozen
fields, the ``__init__`` signature, ``replace``) is the standard library's. A flag this module
does not implement (``order``, ``unsafe_hash``, ``slots``, ``kw_only``, ...) hands the class
to the standard library unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, FrozenInstanceError
from operator import attrgetter

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (see gpudiag/__init__)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

# The flags implemented here; any other goes to dataclasses.dataclass.
_OWN_FLAGS = frozenset({"init", "repr", "eq", "frozen"})


def _key(names: list[str]) -> Callable[[object], tuple[Any, ...]]:
    """A function giving an instance's values of ``names`` as a tuple (what the standard
    library's methods compare and hash)."""
    if not names:
        return lambda _: ()
    if len(names) == 1:
        one = attrgetter(names[0])
        return lambda obj: (one(obj),)
    return attrgetter(*names)  # a tuple for two or more names


def _eq_of(key: Callable[[object], tuple[Any, ...]]) -> Callable[[object, object], bool]:
    def __eq__(self: object, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return key(self) == key(other)

    return __eq__


def _hash_of(key: Callable[[object], tuple[Any, ...]]) -> Callable[[object], int]:
    def __hash__(self: object) -> int:
        return hash(key(self))

    return __hash__


def _repr_of(shown: tuple[str, ...]) -> Callable[[object], str]:
    def __repr__(self: object) -> str:
        values = ", ".join(f"{n}={getattr(self, n)!r}" for n in shown)
        return f"{type(self).__qualname__}({values})"

    return __repr__


def _frozen_of(cls: type, names: frozenset[str]
               ) -> tuple[Callable[[Any, str, object], None], Callable[[Any, str], None]]:
    """The standard library's frozen ``__setattr__`` and ``__delattr__`` for ``cls``: a
    field, or anything on an instance of ``cls`` itself, is refused."""

    def __setattr__(self: Any, name: str, value: object) -> None:
        if type(self) is cls or name in names:
            raise FrozenInstanceError(f"cannot assign to field {name!r}")
        object.__setattr__(self, name, value)

    def __delattr__(self: Any, name: str) -> None:
        if type(self) is cls or name in names:
            raise FrozenInstanceError(f"cannot delete field {name!r}")
        object.__delattr__(self, name)

    return __setattr__, __delattr__


def _init_of(cls: type, frozen: bool) -> Callable[..., None]:
    """The ``__init__`` the standard library would write for ``cls``: its init fields by
    position or keyword, their defaults and factories, the non-init fields' defaults, then
    ``__post_init__``; a bad call is refused in Python's own words."""
    fields = dataclasses.fields(cls)
    params = tuple((f.name, f.default, f.default_factory) for f in fields if f.init)
    names = tuple(name for name, _, _ in params)
    # The non-init fields that start with a value: a default, or a factory's.
    later: tuple[tuple[str, Any, Any], ...] = tuple(
        (f.name, f.default, f.default_factory) for f in fields
        if not f.init and (f.default is not MISSING or f.default_factory is not MISSING))
    post_init = hasattr(cls, "__post_init__")
    put = object.__setattr__ if frozen else setattr
    where = f"{cls.__qualname__}.__init__()"
    least = sum(1 for _, default, factory in params
                if default is MISSING and factory is MISSING)
    takes = (f"{len(names) + 1} positional argument{'s' if names else ''}"
             if least == len(names) else
             f"from {least + 1} to {len(names) + 1} positional arguments")

    def refuse(kwargs: dict[str, object]) -> None:
        """A keyword no field takes, or one given by position too: Python checks these
        first, in the order given (a keyword a field took is gone from ``kwargs``)."""
        for name in kwargs:
            if name in names:
                raise TypeError(f"{where} got multiple values for argument {name!r}")
            raise TypeError(f"{where} got an unexpected keyword argument {name!r}")

    def __init__(self: object, *args: object, **kwargs: object) -> None:
        given = len(args)
        if given > len(names):
            refuse(kwargs)
            raise TypeError(f"{where} takes {takes} but {given + 1} were given")
        for name, value in zip(names, args, strict=False):  # names may be the longer
            put(self, name, value)
        missing = []
        for name, default, factory in params[given:]:
            if name in kwargs:
                put(self, name, kwargs.pop(name))
            elif default is not MISSING:
                put(self, name, default)
            elif factory is not MISSING:
                put(self, name, factory())
            else:
                missing.append(name)
        if kwargs:
            refuse(kwargs)
        if missing:
            quoted = [repr(n) for n in missing]
            listed = (" and ".join(quoted) if len(quoted) < 3
                      else ", ".join(quoted[:-1]) + ", and " + quoted[-1])
            raise TypeError(f"{where} missing {len(missing)} required positional "
                            f"argument{'s' if len(missing) > 1 else ''}: {listed}")
        for name, default, factory in later:
            put(self, name, factory() if default is MISSING else default)
        if post_init:
            self.__post_init__()  # type: ignore[attr-defined]

    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    return __init__


def _process(cls: type, *, init: bool = True, repr: bool = True, eq: bool = True,
             frozen: bool = False) -> type:
    own = dict(cls.__dict__)  # what the class body defines: never replaced, as the stdlib does
    class_hash = own.get("__hash__", MISSING)
    explicit_hash = not (class_hash is MISSING or (class_hash is None and "__eq__" in own))
    if frozen and ("__setattr__" in own or "__delattr__" in own):
        return dataclasses.dataclass(cls, init=init, repr=repr, eq=eq, frozen=frozen)
    for base in cls.__mro__[1:]:
        if getattr(base, "__record_frozen__", frozen) != frozen:  # the stdlib's own check
            raise TypeError(f"cannot inherit {'' if frozen else 'non-'}frozen dataclass from a "
                            f"{'non-' if frozen else ''}frozen one")
    # The fields only: with these flags the standard library compiles nothing.
    cls = dataclasses.dataclass(cls, init=False, repr=False, eq=False)
    fields = dataclasses.fields(cls)
    added: dict[str, object] = {"__record_frozen__": frozen}
    if init and "__init__" not in own:
        added["__init__"] = _init_of(cls, frozen)
    if repr and "__repr__" not in own:
        added["__repr__"] = _repr_of(tuple(f.name for f in fields if f.repr))
    if eq and "__eq__" not in own:
        added["__eq__"] = _eq_of(_key([f.name for f in fields if f.compare]))
    if frozen:
        added["__setattr__"], added["__delattr__"] = _frozen_of(
            cls, frozenset(f.name for f in fields))
    if eq and not explicit_hash:
        # The standard library's rule: eq and frozen give a hash of the fields; eq alone
        # makes instances unhashable.
        added["__hash__"] = _hash_of(_key([
            f.name for f in fields if (f.compare if f.hash is None else f.hash)
        ])) if frozen else None
    for name, value in added.items():
        setattr(cls, name, value)
    return cls


def _dataclass(cls: type | None = None, /, **flags: Any) -> Any:
    """``dataclasses.dataclass`` with the same arguments and meaning (see the module's text)."""
    if not flags.keys() <= _OWN_FLAGS:
        return dataclasses.dataclass(cls, **flags)

    def wrap(c: type) -> type:
        return _process(c, **flags)

    return wrap if cls is None else wrap(cls)


if TYPE_CHECKING:
    from dataclasses import dataclass as dataclass
else:
    dataclass = _dataclass
