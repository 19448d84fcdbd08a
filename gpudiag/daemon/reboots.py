"""Reboot-class faults heal after a reboot (issue 52): no person needs to clear them.

An XID whose action is a node reboot (core.xids ``reboot_heals``: 79, 110, 151, 159, 168) is
held, like any XID, until ``gpudiag clear`` or ``xid.hold_s``: NVML cannot show afterwards
whether it is gone. A reboot is the repair it asks for, and the kernel says whether one
happened: the boot id (daemon.bootid) is noted in the history at each start
(``HistoryStore.record_boot``), so each held XID's boot is known. At start, the held XIDs of
that class from an earlier boot become candidates; the first fresh pass of this start (host,
nvml and cuda all started after it, and the quick qualification tier on their GPUs where
qualification is on) is judged without them, and each candidate GPU on which that verdict
finds no fault (and no fault of the node as a whole) is released as ``gpudiag clear`` would
release it, recorded in the history as the daemon's own clear. Remediation then resumes its
own drain as after a clear (a fresh pass after the release), and counts the incident as
recovered with no person. A GPU whose fault is still there stays held; so does everything
in the same boot (a restart of the daemon alone repairs nothing), and everything whose boot
is not known (no boot id, a history from before boots were noted).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from gpudiag.core.findings import XidEvent
from gpudiag.core.records import dataclass
from gpudiag.core.verdict import Verdict
from gpudiag.core.xids import xid_entry
from gpudiag.daemon.clears import ClearRequest
from gpudiag.daemon.snapshot import Snapshot
from gpudiag.daemon.store import HistoryError, HistoryStore

log = logging.getLogger("gpudiag.daemon.reboots")
FRESH_PROBES = ("host", "nvml", "cuda")
QUALIFY_TIER = "quick"


@dataclass(frozen=True)
class BootFacts:
    """This start's boot, and whether the history last noted another one."""

    boot_id: str | None
    changed: bool


def note_boot(store: object, boot_id: str | None, now: float) -> BootFacts:
    """Note this start's boot in the history (when it can be written and the id read)."""
    if boot_id is None or not isinstance(store, HistoryStore):
        return BootFacts(boot_id, False)
    try:
        return BootFacts(boot_id, store.record_boot(boot_id, now))
    except HistoryError as e:
        log.warning("the boot id could not be noted in the history (%s): holds made in this "
                    "boot will not heal by a reboot", e)
        return BootFacts(boot_id, False)


def reboot_candidates(store: object, held: Iterable[XidEvent], boot_id: str | None
                      ) -> list[XidEvent]:
    """The held XIDs a reboot heals that were seen in an earlier boot than ``boot_id``."""
    if boot_id is None or not isinstance(store, HistoryStore):
        return []
    out = []
    for x in held:
        entry = xid_entry(x.xid)
        if entry is None or not entry.reboot_heals or not x.uuid:
            continue
        try:
            seen_in = store.boot_at(x.timestamp)
        except HistoryError:
            seen_in = None
        if seen_in is not None and seen_in != boot_id:
            out.append(x)
    return out


class RebootHealer:
    """A snapshot listener: releases the candidates once a fresh pass finds their GPUs clean."""

    def __init__(self, candidates: Sequence[XidEvent], boot: BootFacts, started_wall: float, *,
                 judge: Callable[[Snapshot], Verdict | None],
                 submit: Callable[[ClearRequest], None],
                 qualify: Callable[[Sequence[str]], bool] | None = None,
                 qualified: Callable[[str, float], bool | None] | None = None,
                 probes: Sequence[str] = FRESH_PROBES) -> None:
        """``judge`` gives the node-health verdict of a snapshot; ``submit`` applies a clear;
        with qualification on, ``qualify`` asks for the quick tier on GPUs (False: refused)
        and ``qualified(uuid, since)`` says whether it passed since (None: no result yet);
        ``probes``: those of FRESH_PROBES the daemon runs (a fresh pass is all of them)."""
        self._candidates = tuple(candidates)
        self._boot = boot
        self._since = started_wall
        self._judge, self._submit = judge, submit
        self._qualify, self._qualified = qualify, qualified
        self._probes = tuple(p for p in probes if p in FRESH_PROBES) or FRESH_PROBES
        self._lock = threading.Lock()
        self._done = not self._candidates
        self._asked = False

    @property
    def pending(self) -> tuple[XidEvent, ...]:
        """The candidates not yet decided on."""
        return () if self._done else self._candidates

    def offer(self, snap: Snapshot) -> None:
        """Look at a published snapshot; decide once, on the first fresh pass."""
        with self._lock:
            if self._done:
                return
            if not self._fresh(snap):
                return
            gpus = sorted({x.uuid for x in self._candidates if x.uuid})
            if self._qualify is not None and not self._asked:
                self._asked = True
                if not self._qualify(gpus):
                    log.warning("reboot-class holds on %s: the quick qualification tier "
                                "could not be asked for; they stay held", ", ".join(gpus))
                    self._done = True
                    return
            if self._qualified is not None and any(
                    self._qualified(u, self._since) is None for u in gpus):
                return  # the qualification has not finished on every GPU yet
            self._done = True
            self._decide(snap, gpus)

    def _fresh(self, snap: Snapshot) -> bool:
        results = [snap.result(name) for name in self._probes]
        return all(r is not None and r.started_wall > self._since for r in results)

    def _decide(self, snap: Snapshot, gpus: list[str]) -> None:
        candidates = set(self._candidates)
        recent = tuple(x for x in snap.watcher.recent if x not in candidates)
        verdict = self._judge(replace(snap, watcher=replace(snap.watcher, recent=recent)))
        if verdict is None:
            log.warning("reboot-class holds on %s: no verdict from the fresh pass; they stay "
                        "held", ", ".join(gpus))
            return
        node_wide = [b.code for b in verdict.blockers if not b.device]
        faulty = {b.device for b in verdict.blockers if b.device}
        labels = {d.uuid: d for d in verdict.devices if d.uuid}
        for uuid in gpus:
            xids = sorted({x.xid for x in self._candidates if x.uuid == uuid})
            said = ", ".join(str(x) for x in xids)
            failed = self._qualified(uuid, self._since) is False if self._qualified else False
            if node_wide or uuid in faulty or uuid not in labels or failed:
                why = (f"the node's {', '.join(node_wide)}" if node_wide else
                       "the GPU is not seen" if uuid not in labels else
                       "its quick qualification failed" if failed else
                       ", ".join(sorted({b.code for b in verdict.blockers
                                         if b.device == uuid})))
                log.warning("XID %s on GPU %s held from an earlier boot: the node rebooted, "
                            "but the fresh pass still finds a fault (%s); held until `gpudiag "
                            "clear` or its hold ends", said, uuid, why,
                            extra={"uuid": uuid, "xids": xids})
                continue
            old = {x.timestamp for x in self._candidates if x.uuid == uuid}
            self._submit(ClearRequest(
                gpu=uuid, reason=f"rebooted (boot {self._boot.boot_id}): XID {said} from an "
                f"earlier boot, and the fresh pass finds no fault", uid=os.getuid(),
                requested_wall=max(old), automatic=True))
