"""The spinner a person at a terminal sees while gpudiag probes: one for every command."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def progress(message: str) -> Iterator[None]:
    """A live spinner on a terminal; nothing at all when stderr is a pipe or a file."""
    if sys.stderr.isatty():
        from rich.console import Console

        with Console(stderr=True).status(message):
            yield
    else:
        yield
