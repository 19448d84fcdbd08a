"""The one shape of the daemon's small collectors: read a state fresh at each scrape, render it.

Each collector holds a callable (the seam: tests pass a lambda) and renders what it returns on
every scrape, so nothing carries over between scrapes (prometheus_client's collector contract).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

S = TypeVar("S")


class StateCollector(Collector, Generic[S]):
    """Collects ``render(state())`` at scrape time; subclasses say how one state renders."""

    def __init__(self, state: Callable[[], S]) -> None:
        self._state = state

    def describe(self) -> list[Metric]:
        # Nothing to describe up front: registration must not call collect().
        return []

    def collect(self) -> Iterator[Metric]:
        yield from self.render(self._state())

    def render(self, state: S) -> Iterable[Metric]:
        """The metric families of one state."""
        raise NotImplementedError
