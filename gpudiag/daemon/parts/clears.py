"""The clears part: `gpudiag clear` requests taken in on each tick (daemon/clears.py).

An applied clear releases the watcher's held XIDs, is announced to every part that listens
to clears (the numbers count false blockers, remediation moves its recovery boundary), is
kept in the history with the codes it cleared, and re-runs the probes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from functools import partial

from gpudiag.daemon.clears import ClearPoller, ClearRequest, recheck_keys
from gpudiag.daemon.part import BasePart, Cleared, Listens, PartContext, StartError
from gpudiag.daemon.recorder import HistoryRecorder
from gpudiag.daemon.scheduler import Scheduler
from gpudiag.daemon.store import HistoryError, HistoryStore

log = logging.getLogger("gpudiag.daemon")


class ClearsPart(BasePart):
    """The `gpudiag clear` inbox; ``poller.submit`` takes the daemon's own clears too."""

    name = "clears"

    def __init__(self) -> None:
        self.poller: ClearPoller | None = None

    def build(self, context: PartContext) -> None:
        self.poller = ClearPoller(context.state_dir, release=context.watcher.clear,
                                  record=partial(_cleared, context, context.recorder),
                                  recheck=partial(_recheck, context.scheduler))
        try:
            self.poller.prepare()
        except OSError as e:
            raise StartError(f"cannot use --state-dir {context.state_dir}: {e}") from e

    def listens(self) -> Listens:
        return Listens(ticks=self.poller.poll) if self.poller is not None else Listens()


def _recheck(scheduler: Scheduler) -> None:
    """A clear re-runs the probes."""
    scheduler.trigger(recheck_keys(scheduler.scheduled))
    scheduler.prove_again()  # a repair: every runtime's backends again too


def _cleared(context: PartContext, recorder: HistoryRecorder, request: ClearRequest,
             released: int) -> None:
    """An applied clear: announced to the parts, then kept in the history."""
    codes = context.announce_clear(Cleared(request.gpu, min(request.requested_wall,
                                                            time.time()),
                                           request.no_repair, not request.automatic))
    record_clear(recorder, request, released, codes)


def record_clear(recorder: HistoryRecorder, request: ClearRequest, released: int,
                 codes: Sequence[str] = ()) -> None:
    """Keep an applied ``gpudiag clear`` in the history, or say why it is not kept."""
    # The store is locked per call; it may be missing while the disk is full.
    history = recorder.store
    again = "; a restart would hold its XIDs again (run gpudiag clear once more then)"
    if not isinstance(history, HistoryStore):
        log.warning("clear of %s applied but not recorded: the history is not writable%s",
                    request.gpu or "all GPUs", again, extra={"uid": request.uid})
        return
    try:
        # Stamped with the time up to which XIDs were released (the request's), so that a
        # restart re-arms exactly the XIDs the watcher still holds (daemon/holds.py).
        history.record_clear(uid=request.uid, gpu=request.gpu, reason=request.reason,
                             released=released, now=min(request.requested_wall, time.time()),
                             no_repair=request.no_repair, codes=codes)
    except HistoryError as e:
        log.warning("clear of %s applied but not recorded: %s%s", request.gpu or "all GPUs",
                    e, again, extra={"uid": request.uid})
