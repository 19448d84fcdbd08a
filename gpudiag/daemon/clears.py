"""Clearing a repaired GPU: request files in the daemon's state directory, applied each loop.

``gpudiag clear`` writes one JSON file into ``STATE_DIR/clear-requests/``; the daemon picks
it up on its next loop, releases the held XIDs of that GPU (or of all GPUs) that arrived
before the request, records the clear in the history with the file owner's uid and the
reason, and re-probes at once, so a GPU that still fails is blocked again by that round.
There is no new network surface: who may clear is who may write that folder (the daemon
creates it 0700, so its own user and root). The uid comes from the file's owner as the
kernel recorded it, never from the file's content.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gpudiag.core.fileio import RefusedFile, atomic_write, inbox_names, read_regular
from gpudiag.core.gpunames import GpuNameError, NamedGpu, resolve
from gpudiag.core.records import dataclass
from gpudiag.daemon.snapshot import ProbeKey

log = logging.getLogger("gpudiag.daemon.clears")
REQUEST_DIR = "clear-requests"
MAX_REQUEST_BYTES = 64 * 1024
MAX_REASON_CHARS = 500


class ClearRequestError(ValueError):
    """A request file that cannot be applied; the message says what was wrong."""


@dataclass(frozen=True)
class ClearRequest:
    """One operator's request: release the held XIDs of ``gpu`` (None: every GPU)."""

    gpu: str | None
    reason: str
    uid: int
    requested_wall: float
    # `gpudiag clear --no-repair`: nothing was repaired, so what it clears was a false blocker.
    no_repair: bool = False
    # Made by the daemon itself, not a person: a reboot-class hold healed by a reboot and a
    # clean fresh pass (daemon/reboots.py). Never read from a request file.
    automatic: bool = False


def request_dir(state_dir: Path) -> Path:
    """Where request files go."""
    return state_dir / REQUEST_DIR


def write_request(state_dir: Path, gpu: str | None, reason: str,
                  now: Callable[[], float] = time.time, *, no_repair: bool = False) -> Path:
    """Write a request file atomically; OSError (e.g. EACCES) goes to the caller."""
    folder = request_dir(state_dir)
    if not folder.is_dir():
        folder.mkdir(mode=0o700)
    wall = now()
    body = json.dumps({"gpu": gpu, "reason": reason[:MAX_REASON_CHARS],
                       "requested_wall": wall, "no_repair": no_repair}) + "\n"
    return atomic_write(folder / f"{time.time_ns()}-{os.getpid()}.json", body, 0o600)


def read_request(path: Path) -> ClearRequest:
    """Parse one request file; the uid is its owner's."""
    try:
        raw, st = read_regular(path, MAX_REQUEST_BYTES)
    except RefusedFile as e:
        raise ClearRequestError(str(e)) from e
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ClearRequestError(f"not JSON: {e}") from e
    if not isinstance(data, dict):
        raise ClearRequestError("not a JSON object")
    gpu, reason, wall = data.get("gpu"), data.get("reason", ""), data.get("requested_wall")
    if gpu is not None and not isinstance(gpu, str):
        raise ClearRequestError(f"gpu {gpu!r} is not a UUID string or null (all GPUs)")
    if not isinstance(reason, str):
        raise ClearRequestError(f"reason {reason!r} is not a string")
    if isinstance(wall, bool) or not isinstance(wall, (int, float)):
        raise ClearRequestError(f"requested_wall {wall!r} is not a time")
    no_repair = data.get("no_repair", False)
    if not isinstance(no_repair, bool):
        raise ClearRequestError(f"no_repair {no_repair!r} is not true or false")
    return ClearRequest(gpu, reason[:MAX_REASON_CHARS], st.st_uid, float(wall), no_repair)


class ClearPoller:
    """Applies pending request files; ``poll()`` runs on each scheduler loop."""

    def __init__(self, state_dir: Path, *, release: Callable[[str | None, float], int],
                 record: Callable[[ClearRequest, int], object],
                 recheck: Callable[[], object],
                 wall: Callable[[], float] = time.time) -> None:
        self.folder = request_dir(state_dir)
        self._release, self._record, self._recheck, self._wall = release, record, recheck, wall
        self._refused: set[str] = set()
        self._lock = threading.Lock()
        self._submitted: list[ClearRequest] = []

    def submit(self, request: ClearRequest) -> None:
        """Apply ``request`` (the daemon's own) on the next poll, like a request file."""
        with self._lock:
            self._submitted.append(request)

    def prepare(self) -> None:
        """Create the request folder, writable by the daemon's user (and root) only."""
        self.folder.mkdir(mode=0o700, exist_ok=True)

    def poll(self) -> list[ClearRequest]:
        """Apply every request file present, oldest first; returns what was applied."""
        applied: list[ClearRequest] = []
        with self._lock:
            submitted, self._submitted = self._submitted, []
        for request in submitted:
            released = self._release(request.gpu, min(request.requested_wall, self._wall()))
            self._record(request, released)
            log.warning("GPU %s released without a person: %s; %d held XID(s) released; "
                        "re-probing", request.gpu or "(all)", request.reason, released,
                        extra={"gpu": request.gpu, "reason": request.reason,
                               "released": released, "automatic": True})
            applied.append(request)
        for name in inbox_names(self.folder, self._refused):
            path = self.folder / name
            try:
                request = read_request(path)
            except ClearRequestError as e:
                # Kept aside, not deleted: what an operator wrote is never silently lost.
                log.warning("clear request %s refused: %s; renamed to %s.rejected", path, e,
                            name, extra={"request": str(path), "error": str(e)})
                try:
                    os.rename(path, path.with_name(name + ".rejected"))
                except OSError:
                    self._refused.add(name)  # cannot move it: at least do not retry it
                continue
            released = self._release(request.gpu, min(request.requested_wall, self._wall()))
            self._record(request, released)
            path.unlink(missing_ok=True)
            log.warning("GPU %s cleared by uid %d (%s): %d held XID(s) released; re-probing",
                        request.gpu or "(all)", request.uid, request.reason or "no reason",
                        released, extra={"gpu": request.gpu, "uid": request.uid,
                                         "reason": request.reason, "released": released})
            applied.append(request)
        if applied:
            self._recheck()
        return applied


# A GPU as the daemon's history last knew it: what ``gpudiag clear --gpu`` may name.
KnownGpu = NamedGpu


def known_gpus(records: Iterable[Mapping[str, Any]]) -> list[KnownGpu]:
    """Each GPU index's newest UUID and PCI bus id, from verdict records given newest first.

    A GPU lost now has no UUID in the newest record (NVML cannot read it), but an older one
    of the same daemon still has it: that is the GPU an operator repaired.
    """
    found: dict[int, KnownGpu] = {}
    for record in records:
        for dev in record.get("devices") or ():
            index, uuid = dev.get("index"), dev.get("uuid")
            if (isinstance(index, int) and index not in found and isinstance(uuid, str)
                    and uuid):
                pci = dev.get("pci_bus_id")
                found[index] = KnownGpu(index, uuid, pci if isinstance(pci, str) else None)
    return [found[i] for i in sorted(found)]


def known_in_history(folder: Path, last: int = 200) -> list[KnownGpu] | None:
    """The GPUs the daemon's history in ``folder`` knows (its last ``last`` verdicts), or None
    when there is no history; HistoryError when it cannot be read."""
    from gpudiag.daemon.store import HistoryStore, default_path

    path = default_path(folder)
    if not path.is_file():
        return None
    store = HistoryStore(path, readonly=True)
    try:
        ids = store.ids()[-last:]
        records = (store.verdict_record(i) for i in reversed(ids))
        return known_gpus(r for r in records if r is not None)
    finally:
        store.close()


def resolve_gpu(selector: str, known: Sequence[KnownGpu]) -> KnownGpu:
    """The GPU an index, a UUID or unique prefix (or ``head…tail``) or a PCI bus id names
    (``gpudiag.core.gpunames``, the one resolver of GPU names); ClearRequestError when it
    names none or several, saying which GPUs the daemon has seen."""
    try:
        return resolve(selector, known)
    except GpuNameError as e:
        raise ClearRequestError(str(e)) from None


def recheck_keys(scheduled: Sequence[ProbeKey]) -> list[ProbeKey]:
    """The scheduled probes that look at GPUs (a clear re-runs them at once)."""
    return [k for k in scheduled if k.backend in ("host", "nvml", "cuda")]
