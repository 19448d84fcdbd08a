"""One occupancy view: whether each GPU leaf is FREE, BUSY or UNKNOWN, and why.

docs/design-notes.md "Busy GPUs". Composed here and nowhere else (an AST test keeps it so):
NVML's compute processes on each leaf (core.occupancy's rule, MIG instances included); who
is no user (this process tree, and sibling probes: our uid, below a holder of the GPU's probe
mark as the holder's own /proc/PID/fdinfo says, never an argv alone); and the kernel's lock
answer (engine/locks.lock_state, O(1) in any pid namespace: a FREE GPU whose lock anyone but
a sibling probe holds is BUSY; the kernel's table only names a holder, within a bound, where
a probe or qualification mark is held; not named in time is BUSY, a lock file that cannot be
opened UNKNOWN). The scheduler takes all three after every NVML reading (and ``relook`` when
a lock may have gone); the probe round and qualification leave the locks to their claim (a
try-lock answers and takes in one step), and qualification counts sibling probes as users
(a probe's context would spoil minutes of measurement); admission asks ``lock_answers``.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import field
from pathlib import Path

from gpudiag.core.environment import is_full_uuid
from gpudiag.core.observations import GpuProcess, NvmlObservation
from gpudiag.core.occupancy import occupancy as leaf_occupancy
from gpudiag.core.readiness import BUSY, FREE, UNKNOWN, GpuOccupancy
from gpudiag.core.records import dataclass
from gpudiag.engine.locks import (
    JOB_LOCKED,
    LOCK_EXCLUSIVE,
    LOCK_FREE,
    Holder,
    LockFailed,
    holders,
    holds_probe_mark,
    kernel_locks,
    lock_state,
    mark_held,
)
from gpudiag.engine.processes import cmdline, is_probe_child, own_process_tree

SHARED_LOCKED = "under a shared lock that is not a probe's (a qualification or another user)"
# Every holder holds the qualification mark (engine/locks.Holder.qualifying, the kernel's word).
QUALIFYING = "under qualification (it stops within 1 s for a job that waits for the GPU)"
# Held, by a holder the kernel's table did not name in time (too large, too slow): never FREE.
HELD_UNNAMED = "its lock is held by a holder not named in time (the kernel's lock table)"
# Why a GPU NVML found FREE is BUSY in the lock view: what a fresh look at the locks revises.
LOCK_VIEW_WHYS = frozenset({JOB_LOCKED, SHARED_LOCKED, QUALIFYING, HELD_UNNAMED})


@dataclass(frozen=True)
class OccupancyView:
    """Each GPU leaf's occupancy at one NVML reading with its why (``by_nvml``: before the
    lock answer, where a fresh look starts; ``unusable``: uuid -> why its lock is unknown)."""

    gpus: Mapping[str, GpuOccupancy]
    by_nvml: Mapping[str, GpuOccupancy]
    unusable: Mapping[str, str] = field(default_factory=dict)


def occupancy_view(nvml: NvmlObservation | None, *, lock_dir: Path, siblings: bool = True,
                   locks: bool = True) -> OccupancyView:
    """Each GPU leaf's occupancy from an NVML reading: its processes, less this process tree
    (and sibling probes unless ``siblings`` is False), and with ``locks`` the kernel's answer
    on each FREE GPU's lock over it."""
    own: frozenset[int] = frozenset()
    if any(procs for _, procs in _listed(nvml)):
        # Only a listed process can make a GPU busy: with none (an idle node), this tree
        # (every /proc/PID/stat read) is not needed, nor psutil's import in a CLI.
        own = _not_foreign(nvml, lock_dir) if siblings else own_process_tree()
    by_nvml = _by_nvml(nvml, own)
    return _with_locks(by_nvml, by_nvml, lock_dir) if locks else OccupancyView(by_nvml, by_nvml)


def relook(published: Mapping[str, GpuOccupancy], by_nvml: Mapping[str, GpuOccupancy], *,
           lock_dir: Path) -> OccupancyView:
    """``published`` with its lock view taken now: a GPU BUSY only because of its lock gets
    NVML's word (``by_nvml``) back, then the kernel decides again (a lock still held keeps it
    BUSY; a FREE GPU whose lock is now held becomes BUSY)."""
    base = {uuid: by_nvml[uuid] if occ.why in LOCK_VIEW_WHYS and uuid in by_nvml else occ
            for uuid, occ in published.items()}
    return _with_locks(base, by_nvml, lock_dir)


def locked_by_claim(occupancy: Mapping[str, GpuOccupancy], left_alone: Mapping[str, str]
                    ) -> dict[str, GpuOccupancy]:
    """``occupancy`` with the GPUs a claim found ``locked`` (engine/guard.claim_free) BUSY."""
    return {**occupancy, **{uuid: GpuOccupancy(uuid, BUSY, why=JOB_LOCKED)
                            for uuid, why in left_alone.items() if why == "locked"}}


def _by_nvml(nvml: NvmlObservation | None, own: frozenset[int]) -> dict[str, GpuOccupancy]:
    out: dict[str, GpuOccupancy] = {}
    if nvml is None or not nvml.ok:
        return out
    for dev in nvml.devices:
        gpu: GpuOccupancy | None = None
        if dev.uuid is not None and is_full_uuid(dev.uuid):
            occ = leaf_occupancy(dev, own)
            gpu = GpuOccupancy(dev.uuid, occ.state, occ.pids, occ.reason or "")
        for inst in dev.mig.instances if dev.mig is not None and dev.mig.enabled else ():
            if inst.uuid is None or not is_full_uuid(inst.uuid):
                continue
            occ = leaf_occupancy(inst, own, parent=dev)
            leaf = GpuOccupancy(inst.uuid, occ.state, occ.pids, occ.reason or "")
            out[leaf.uuid] = leaf
            if gpu is not None and leaf.state != FREE and gpu.state == FREE:
                gpu = GpuOccupancy(gpu.uuid, leaf.state, leaf.pids,
                                   f"a MIG instance is {leaf.state}")
        if gpu is not None:
            out[gpu.uuid] = gpu
    return out


def _listed(nvml: NvmlObservation | None) -> list[tuple[str | None, Sequence[GpuProcess]]]:
    """Each GPU's and MIG instance's processes in an NVML reading, under the GPU's uuid."""
    listed: list[tuple[str | None, Sequence[GpuProcess]]] = []
    for d in nvml.devices if nvml is not None and nvml.ok else ():
        listed.append((d.uuid, d.processes or ()))
        listed += [(d.uuid, i.processes or ()) for i in (d.mig.instances if d.mig else ())]
    return listed


def _not_foreign(nvml: NvmlObservation | None, lock_dir: Path) -> frozenset[int]:
    """The PIDs that make no GPU busy: this process tree, and sibling probe children (of our
    uid, below a process whose own descriptors hold the probe mark of the GPU NVML lists
    them on). Only listed PIDs are looked at; a process that cannot be read is a user."""
    ours = own_process_tree()
    own_uids = frozenset({os.geteuid()})
    by_gpu: dict[str, set[int]] = {}
    for uuid, procs in _listed(nvml):
        for p in procs:
            if p.pid is not None and p.pid not in ours and uuid and is_full_uuid(uuid):
                by_gpu.setdefault(uuid, set()).add(p.pid)
    # A GPU whose probe mark nobody holds (the O(1) attempt) has no sibling on it; on the
    # others, each listed process's parents are asked whether they hold it.
    siblings = {pid for uuid, pids in by_gpu.items() if mark_held(lock_dir, uuid)
                for pid in pids if _sibling_probe(pid, lock_dir, uuid, own_uids)}
    return ours | frozenset(siblings)


# How far up a probe child's parents the probing gpudiag may be (child, fork server, daemon).
_SIBLING_DEPTH = 3


def _sibling_probe(pid: int, lock_dir: Path, uuid: str, uids: Collection[int]) -> bool:
    import psutil
    try:
        proc = psutil.Process(pid)
        return (all(u in uids for u in proc.uids()) and is_probe_child(cmdline(pid))
                and any(all(u in uids for u in parent.uids())
                        and holds_probe_mark(lock_dir, uuid, parent.pid)
                        for parent in proc.parents()[:_SIBLING_DEPTH]))
    except (psutil.Error, OSError):
        return False


def sibling_holder(holder: Holder) -> bool:
    """Whether a lock holder is a gpudiag probe of our own uid, proving the GPU right now
    (the kernel says it holds the probe mark), not a user of it."""
    return holder.pid is not None and holder.probing and holder.of_uid({os.geteuid()})


@dataclass(frozen=True)
class LockAnswers:
    """The kernel's O(1) answer on some GPUs' locks."""

    held: Mapping[str, str]  # uuid -> LOCK_SHARED | LOCK_EXCLUSIVE, for the locks held now
    unusable: Mapping[str, str]  # uuid -> why its lock file cannot be checked


def lock_answers(lock_dir: Path, uuids: Iterable[str]) -> LockAnswers:
    """Which of these GPUs' locks someone holds now (no table read, nothing kept held)."""
    held: dict[str, str] = {}
    unusable: dict[str, str] = {}
    for uuid in uuids:
        try:
            state = lock_state(lock_dir, uuid)
        except LockFailed as e:
            unusable[uuid] = str(e)
            continue
        if state != LOCK_FREE:
            held[uuid] = state
    return LockAnswers(held, unusable)


def _with_locks(occupancy: Mapping[str, GpuOccupancy], by_nvml: Mapping[str, GpuOccupancy],
                lock_dir: Path) -> OccupancyView:
    """``occupancy`` with every FREE GPU whose lock anyone but a sibling probe holds BUSY."""
    out = dict(occupancy)
    answers = lock_answers(lock_dir, (uuid for uuid, found in occupancy.items()
                                      if found.state == FREE and is_full_uuid(uuid)))
    for uuid, error in answers.unusable.items():
        out[uuid] = GpuOccupancy(uuid, UNKNOWN, why=f"its lock cannot be checked: {error}")
    # Where no probe or qualification mark is held (O(1) each), no holder can be a sibling
    # probe or a qualification: nothing to name. Elsewhere, one bounded reading names them.
    marked = {uuid for uuid in answers.held
              if mark_held(lock_dir, uuid) or mark_held(lock_dir, uuid, "qualify")}
    table = kernel_locks() if marked else None
    for uuid, state in answers.held.items():
        if uuid not in marked:
            out[uuid] = GpuOccupancy(uuid, BUSY, why=(
                JOB_LOCKED if state == LOCK_EXCLUSIVE else SHARED_LOCKED))
            continue
        found = holders(lock_dir, uuid, table) if table is not None else None
        if found is None:
            why = JOB_LOCKED if state == LOCK_EXCLUSIVE else HELD_UNNAMED
            out[uuid] = GpuOccupancy(uuid, BUSY, why=why)
            continue
        users = [h for h in found if not sibling_holder(h)]
        if users:
            why = (QUALIFYING if all(h.qualifying for h in users) else
                   JOB_LOCKED if any(not h.shared for h in users) else SHARED_LOCKED)
            out[uuid] = GpuOccupancy(uuid, BUSY, why=why)
    return OccupancyView(out, by_nvml, answers.unusable)


def any_lock_free(lock_dir: Path, uuids: Collection[str]) -> bool:
    """Whether one of these locks, found held a moment ago, is free now (the O(1) test)."""
    answers = lock_answers(lock_dir, uuids)
    return len(answers.held) + len(answers.unusable) < len(set(uuids))
