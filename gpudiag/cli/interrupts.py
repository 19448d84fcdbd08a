"""A Ctrl-C seen through a second error: both console paths end it as the interrupt."""

from __future__ import annotations


def interrupted(error: BaseException) -> bool:
    """Whether ``error`` was raised while a Ctrl-C unwound (a KeyboardInterrupt in its
    ``__context__`` chain): an import the interrupt cut short leaves a half-made module, and
    whatever touches it on the way out raises a second error that would otherwise read as
    gpudiag failing (exit 3) instead of as the interrupt it is (exit 1, "Aborted!")."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            return True
        seen.add(id(cause))
        cause = cause.__context__ or cause.__cause__
    return False
