"""The reboot healer part: reboot-class holds from an earlier boot, released by the first
clean fresh pass (daemon/reboots.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from gpudiag.core.verdict import Verdict
from gpudiag.daemon.bootid import boot_id
from gpudiag.daemon.part import BasePart, Listens, PartContext
from gpudiag.daemon.parts.clears import ClearsPart
from gpudiag.daemon.parts.qualification import QualificationPart
from gpudiag.daemon.qualify_queue import RequestRefused
from gpudiag.daemon.reboots import (
    FRESH_PROBES,
    QUALIFY_TIER,
    RebootHealer,
    note_boot,
    reboot_candidates,
)
from gpudiag.daemon.snapshot import Snapshot, verdict_for

log = logging.getLogger("gpudiag.daemon")


class RebootsPart(BasePart):
    """Needs the clears (it clears what healed) and the qualification (it asks for one)."""

    name = "reboots"

    def __init__(self) -> None:
        self.healer: RebootHealer | None = None

    def build(self, context: PartContext) -> None:
        """The boot is noted before the watcher starts, so every XID it keeps from now on is
        of this boot."""
        cfg, scheduler, recorder = context.cfg, context.scheduler, context.recorder
        clears = context.part(ClearsPart).poller
        qualifier = context.part(QualificationPart).qualifier
        assert clears is not None and qualifier is not None
        started = time.time()
        boot = note_boot(recorder.store, boot_id(context.env), started)
        candidates = reboot_candidates(recorder.store, context.watcher.state().recent,
                                       boot.boot_id)
        if not candidates:
            return
        log.info("the node rebooted since XID(s) %s were held (boot %s): released once a "
                 "fresh pass finds no fault", ", ".join(sorted({f"{x.xid} on GPU "
                                                                 f"{x.device_index}"
                                                                 for x in candidates})),
                 boot.boot_id, extra={"boot_id": boot.boot_id})
        qualify = cfg.qualification.enabled

        def judge(snap: Snapshot) -> Verdict | None:
            return verdict_for(snap, scheduler.ready_requirement, now_wall=time.time(),
                               policy=scheduler.policy)

        def ask(gpus: Sequence[str]) -> bool:
            try:
                qualifier.request(list(gpus), QUALIFY_TIER)
            except RequestRefused as e:
                log.warning("quick qualification after the reboot refused: %s", e)
                return False
            return True

        def passed(uuid: str, since: float) -> bool | None:
            q = qualifier.state().latest.get(uuid)
            if q is None or (q.result.started_at or 0.0) <= since or q.severity == "aborted":
                return None
            return q.severity != "blocker"

        self.healer = RebootHealer(candidates, boot, started, judge=judge, submit=clears.submit,
                                   qualify=ask if qualify else None,
                                   qualified=passed if qualify else None,
                                   probes=[b for b in FRESH_PROBES
                                           if b in cfg.enabled_backends])

    def listens(self) -> Listens:
        return Listens(snapshots=self.healer.offer) if self.healer is not None else Listens()
