"""``dataclass``: the standard library's, with the same meaning, without compiling code per class.

Why: ``dataclasses.dataclass`` writes each method it adds as source text and compiles it with
``exec``: ``__init__``, ``__repr__`` and ``__eq__``, and for a frozen class ``__setattr__``,
``__delattr__`` and ``__hash__`` too. ``gpudiag probe`` imports about 100 record classes, and
compiling their methods took 51 of its 135 ms (docs/benchmarks.md, "Probe overhead"). Here the
standard library still reads the fields (so ``dataclasses.fields``, ``replace``, ``asdict`` and
``is_dataclass`` work unchanged), and the methods are written once, below, reading each class's
field table: the same behaviour (``tests/test_records.py`` compares it with the standard
library's, class by class), at a fraction of the start-up cost; an instance is built about as
fast.

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


class _Table:
    """One record class's fields as the shared methods read them."""

    __slots__ = ("compared", "hashed", "shown", "fields")

    def __init__(self, cls: type) -> None:
        fields = dataclasses.fields(cls)
        self.fields = frozenset(f.name for f in fields)
        self.compared = _key([f.name for f in fields if f.compare])
        self.hashed = _key([f.name for f in fields
                            if (f.compare if f.hash is None else f.hash)])
        self.shown = tuple(f.name for f in fields if f.repr)


def _key(names: list[str]) -> Callable[[object], tuple[Any, ...]]:
    """A function giving an instance's values of ``names`` as a tuple (what the standard
    library's methods compare and hash)."""
    if not names:
        return lambda _: ()
    if len(names) == 1:
        one = attrgetter(names[0])
        return lambda obj: (one(obj),)
    return attrgetter(*names)  # a tuple for two or more names


def _table(obj: object) -> _Table:
    table: _Table = type(obj).__record_table__  # type: ignore[attr-defined]
    return table


def _eq(self: object, other: object) -> bool:
    if other.__class__ is not self.__class__:
        return NotImplemented  # type: ignore[no-any-return]  # typeshed: Any
    key = _table(self).compared
    return bool(key(self) == key(other))


def _hash(self: object) -> int:
    return hash(_table(self).hashed(self))


def _repr(self: object) -> str:
    shown = ", ".join(f"{n}={getattr(self, n)!r}" for n in _table(self).shown)
    return f"{type(self).__qualname__}({shown})"


def _frozen_setattr(self: object, name: str, value: object) -> None:
    if name in _table(self).fields or "__record_table__" in type(self).__dict__:
        raise FrozenInstanceError(f"cannot assign to field {name!r}")
    object.__setattr__(self, name, value)


def _frozen_delattr(self: object, name: str) -> None:
    if name in _table(self).fields or "__record_table__" in type(self).__dict__:
        raise FrozenInstanceError(f"cannot delete field {name!r}")
    object.__delattr__(self, name)


def _make_init(cls: type, frozen: bool) -> Callable[..., None]:
    """The ``__init__`` the standard library would write for ``cls``: its init fields by
    position or keyword, their defaults and factories, the non-init fields' defaults, then
    ``__post_init__``."""
    fields = dataclasses.fields(cls)
    params = tuple((f.name, f.default, f.default_factory) for f in fields if f.init)
    names = tuple(name for name, _, _ in params)
    # The non-init fields that start with a value: a default, or a factory's.
    later: tuple[tuple[str, Any, Any], ...] = tuple(
        (f.name, f.default, f.default_factory) for f in fields
        if not f.init and (f.default is not MISSING or f.default_factory is not MISSING))
    post_init = hasattr(cls, "__post_init__")
    put = object.__setattr__ if frozen else setattr
    # Python's own words for a bad call, as the standard library's generated __init__ says them.
    where = f"{cls.__qualname__}.__init__()"
    least = sum(1 for _, default, factory in params
                if default is MISSING and factory is MISSING)
    takes = (f"{len(names) + 1} positional argument{'s' if names else ''}"
             if least == len(names) else
             f"from {least + 1} to {len(names) + 1} positional arguments")

    def _refuse(kwargs: dict[str, object]) -> None:
        """A keyword no field takes, or one given by position too: Python checks these
        first, in the order given (a keyword a field took is gone from ``kwargs``)."""
        for name in kwargs:
            if name in names:
                raise TypeError(f"{where} got multiple values for argument {name!r}")
            raise TypeError(f"{where} got an unexpected keyword argument {name!r}")

    def __init__(self: object, *args: object, **kwargs: object) -> None:
        if len(args) > len(names):
            _refuse(kwargs)
            raise TypeError(f"{where} takes {takes} but {len(args) + 1} were given")
        values = list(args)
        missing = []
        for name, default, factory in params[len(args):]:
            if name in kwargs:
                values.append(kwargs.pop(name))
            elif default is not MISSING:
                values.append(default)
            elif factory is not MISSING:
                values.append(factory())
            else:
                missing.append(name)
        if kwargs:
            _refuse(kwargs)
        if missing:
            quoted = [repr(n) for n in missing]
            listed = (" and ".join(quoted) if len(quoted) < 3
                      else ", ".join(quoted[:-1]) + ", and " + quoted[-1])
            raise TypeError(f"{where} missing {len(missing)} required positional "
                            f"argument{'s' if len(missing) > 1 else ''}: {listed}")
        for name, value in zip(names, values, strict=True):
            put(self, name, value)
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
    added: dict[str, object] = {"__record_table__": _Table(cls), "__record_frozen__": frozen}
    if init and "__init__" not in own:
        added["__init__"] = _make_init(cls, frozen)
    if repr and "__repr__" not in own:
        added["__repr__"] = _repr
    if eq and "__eq__" not in own:
        added["__eq__"] = _eq
    if frozen:
        added.update(__setattr__=_frozen_setattr, __delattr__=_frozen_delattr)
    if eq and not explicit_hash:
        # The standard library's rule: eq and frozen give a hash of the fields; eq alone
        # makes instances unhashable.
        added["__hash__"] = _hash if frozen else None
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
