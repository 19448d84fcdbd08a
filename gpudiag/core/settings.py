"""Config settings declared once, on the dataclass field: its kind, its bounds and the words for
what it expects. ``read_section`` builds the record from a TOML table with those words.

A field declared ``setting(default, kind)`` is a key of its class's table (``at`` names another
place: ``"scheduler.tick_s"`` keeps a DaemonConfig field in [scheduler]). A field without one
is not read by kind: it is fixed, or the caller reads it by hand and passes it in (runtimes,
listen, the remediation platforms registered at run time). Every refusal says
``KEY = VALUE: expected WHAT`` (tests/test_config_sections.py); unknown keys are refused too.
"""

from __future__ import annotations

import math
import re
from dataclasses import field, fields

from gpudiag.core.records import dataclass

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (gpudiag/__init__)
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from typing import Any, TypeVar

    T = TypeVar("T")

SETTING = "gpudiag.setting"  # the field metadata's key


class ConfigError(ValueError):
    """A configuration file or value that cannot be used; the message names the key."""


def refused(key: str, value: object, expected: str) -> ConfigError:
    """The one shape of a refused value."""
    return ConfigError(f"{key} = {value!r}: expected {expected}")


class Kind:
    """What a key holds: ``read`` gives the value to keep (never None) or raises ConfigError."""

    def read(self, value: object, key: str) -> Any:
        raise NotImplementedError


@dataclass(frozen=True)
class Number(Kind):
    """A finite number from ``minimum`` (excluded when ``above``) to ``maximum``."""

    minimum: float
    maximum: float
    expected: str
    above: bool = False

    def read(self, value: object, key: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                math.isfinite(value) and value <= self.maximum
                and (self.minimum < value if self.above else self.minimum <= value)):
            raise refused(key, value, self.expected)
        return float(value)


@dataclass(frozen=True)
class Count(Kind):
    """An integer from ``low`` to ``high``."""

    low: int
    high: int
    expected: str

    def read(self, value: object, key: str) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or not (
                self.low <= value <= self.high):
            raise refused(key, value, self.expected)
        return value


@dataclass(frozen=True)
class Flag(Kind):
    """true or false."""

    def read(self, value: object, key: str) -> bool:
        if not isinstance(value, bool):
            raise refused(key, value, "true or false")
        return value


@dataclass(frozen=True)
class Choice(Kind):
    """One of ``choices``, in any case (kept in lower case)."""

    choices: tuple[str, ...]

    def read(self, value: object, key: str) -> str:
        if not isinstance(value, str) or value.lower() not in self.choices:
            raise refused(key, value, f"one of {', '.join(self.choices)}")
        return value.lower()


@dataclass(frozen=True)
class Text(Kind):
    """A string that ``pattern`` matches whole (any character, newlines too, unless excluded)."""

    pattern: str
    expected: str

    def read(self, value: object, key: str) -> str:
        if not isinstance(value, str) or not re.fullmatch(self.pattern, value, re.DOTALL):
            raise refused(key, value, self.expected)
        return value


@dataclass(frozen=True)
class Check(Kind):
    """A rule that is not a bound: ``check(value, key)`` gives the value or raises."""

    check: Callable[[object, str], Any]

    def read(self, value: object, key: str) -> Any:
        return self.check(value, key)


def seconds(minimum: float = 0.01, maximum: float = 366 * 86400.0) -> Number:
    """A duration in seconds, fractions allowed."""
    return Number(minimum, maximum, f"a number of seconds from {minimum:g} to {maximum:g}")


def share() -> Number:
    """A ratio of a reference, above 0 and at most 1."""
    return Number(0.0, 1.0, "a ratio above 0 and at most 1 (0.8: at least 80% of the "
                  "reference)", above=True)


def ratio() -> Number:
    """A small ratio (jitter, hysteresis): 0 to 0.5."""
    return Number(0.0, 0.5, "a number from 0 to 0.5")


def path(expected: str = "an absolute path") -> Text:
    """An absolute path."""
    return Text(r"/.*", expected)


def executable() -> Text:
    """An executable's absolute path: never looked up in PATH."""
    return Text(r"/[^\0]*", "the absolute path of the executable (never looked up in PATH)")


@dataclass(frozen=True)
class Setting:
    """A field's declaration: its kind, and its place when not its own name in its table."""

    kind: Kind
    at: str | None = None


def setting(default: T, kind: Kind, *, at: str | None = None) -> T:
    """A dataclass field with ``default`` that the config file sets as ``kind``."""
    made: T = field(default=default, metadata={SETTING: Setting(kind, at)})
    return made


def declared(cls: type) -> dict[str, Setting]:
    """The settings of ``cls`` by field name."""
    return {f.name: f.metadata[SETTING] for f in fields(cls) if SETTING in f.metadata}


class Table:
    """One TOML table being read: remembers which keys were asked for."""

    def __init__(self, raw: Mapping[str, Any], where: str) -> None:
        self.raw, self.where, self.used = raw, where, set[str]()

    def key(self, key: str) -> str:
        """``key``'s full name in the file (``jobs.interval_s``)."""
        return f"{self.where}.{key}" if self.where else key

    def get(self, key: str) -> Any:
        self.used.add(key)
        return self.raw.get(key)

    def read(self, key: str, kind: Kind, default: Any = None) -> Any:
        """``key`` read as ``kind``; ``default`` when it is absent."""
        value = self.get(key)
        return default if value is None else kind.read(value, self.key(key))

    def table(self, key: str) -> Table:
        value = self.get(key)
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise ConfigError(f"{self.key(key)} must be a table ([{self.key(key)}])")
        return Table(value, self.key(key))

    def finish(self) -> None:
        unknown = sorted(set(self.raw) - self.used)
        if unknown:
            allowed = ", ".join(sorted(self.used))
            raise ConfigError(f"unknown key(s) {', '.join(self.key(k) for k in unknown)}; "
                              f"accepted here: {allowed}")


def read_fields(t: Table, cls: type, place: str = "") -> dict[str, Any]:
    """The settings of ``cls`` that live in ``t`` (``place``: ``at``'s table), by field
    name; an absent key is left out (its default stands)."""
    out: dict[str, Any] = {}
    for name, s in declared(cls).items():
        where, _, key = (s.at or name).rpartition(".")
        if where == place and (value := t.read(key, s.kind)) is not None:
            out[name] = value
    return out


def read_section(t: Table, cls: Callable[..., T], **given: Any) -> T:
    """``cls`` from its table ``t``: each setting read by its kind, ``given`` fields as the
    caller read them (from ``t``: their keys are asked for), unknown keys refused."""
    values = read_fields(t, cls)  # type: ignore[arg-type]
    t.finish()
    return cls(**values, **given)
