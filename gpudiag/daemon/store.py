"""SQLite history (WAL): every verdict change and every blocker episode, bounded retention.

Durability: WAL with ``synchronous=FULL``, so a commit has been fsynced to the WAL before
``record()`` returns. A SIGKILL loses nothing committed (the OS keeps written pages even at
NORMAL); FULL also survives power loss, and verdict changes are rare enough that the fsync
per change costs nothing. Readers (``gpudiag history``) open the file read-only while the
daemon writes: WAL lets them read without blocking it.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from gpudiag.core.findings import XidEvent
from gpudiag.core.incident import Incident
from gpudiag.core.records import dataclass
from gpudiag.core.redact import redact_text
from gpudiag.core.verdict import Verdict

SCHEMA_VERSION = 2  # 2: serials (issue 43); _migrate() brings a version-1 history up
EVIDENCE_TEXT_LIMIT = 4096
DB_NAME = "history.sqlite3"

_DDL = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS verdicts (
    id INTEGER PRIMARY KEY,
    ts REAL NOT NULL,
    checked_at TEXT NOT NULL,
    requirement TEXT NOT NULL,
    blocker TEXT NOT NULL,
    ready INTEGER NOT NULL,
    blockers TEXT NOT NULL,
    warnings TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    record TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS verdicts_ts ON verdicts (ts);
CREATE TABLE IF NOT EXISTS episodes (
    id INTEGER PRIMARY KEY,
    code TEXT NOT NULL,
    layer TEXT NOT NULL,
    backend TEXT,
    device TEXT,
    started REAL NOT NULL,
    ended REAL,
    message TEXT NOT NULL,
    evidence TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS episodes_open ON episodes (ended);
CREATE TABLE IF NOT EXISTS xids (
    id INTEGER PRIMARY KEY,
    ts REAL NOT NULL,
    xid INTEGER NOT NULL,
    gpu INTEGER,
    uuid TEXT
);
CREATE INDEX IF NOT EXISTS xids_ts ON xids (ts);
CREATE TABLE IF NOT EXISTS gpu_identities (
    serial TEXT NOT NULL,
    uuid TEXT NOT NULL,
    gpu INTEGER NOT NULL,
    pci_bus_id TEXT,
    first_seen REAL NOT NULL,
    last_seen REAL NOT NULL,
    PRIMARY KEY (serial, uuid, gpu)
);
"""
# Schema 2 keys every per-GPU row by the board's serial as well as its UUID (after an RMA or a
# slot move the slot's history would mix two parts): columns added to a version-1 history by
# _migrate(), NULL on its old rows (their serial was never read). ``gpu_identities`` says which
# serial carried which UUID in which slot, and when.
_SERIAL_COLUMNS = (("episodes", "serial"), ("xids", "serial"), ("clears", "serial"),
                   ("clears", "no_repair"), ("clears", "codes"),
                   # Issue 38: how a job's window is known (ATTESTED_BY), and its run's id.
                   ("jobs", "attested"), ("jobs", "run_id"))
# Held XIDs are re-armed from ``xids`` at start (daemon/holds.py); the table is new in round 3
# and CREATE ... IF NOT EXISTS adds it to an older history when the daemon opens it.
# Created with the first `gpudiag clear` (most nodes never have one): the base schema above
# stays what every history has, and a history from before clears existed reads as none.
_CLEARS_DDL = """
CREATE TABLE IF NOT EXISTS clears (
    id INTEGER PRIMARY KEY,
    ts REAL NOT NULL,
    uid INTEGER NOT NULL,
    gpu TEXT,
    reason TEXT NOT NULL,
    released INTEGER NOT NULL,
    serial TEXT,
    no_repair INTEGER,
    codes TEXT
)"""

# Issue 52: the boots the daemon started in (one row per boot id change, written at start):
# an XID's boot is the newest row at or before it, so a hold knows whether the node rebooted
# since. Created on first use, as clears are; a history from before it knows no boot.
_BOOTS_DDL = """
CREATE TABLE IF NOT EXISTS boots (
    id INTEGER PRIMARY KEY,
    ts REAL NOT NULL,
    boot_id TEXT NOT NULL
)"""

# Issue 52: the daemon's GPU resets (the reset rung, daemon/gpu_reset.py), one row per reset
# when its outcome is known. Created on first use, as clears are.
_RESETS_DDL = """
CREATE TABLE IF NOT EXISTS resets (
    id INTEGER PRIMARY KEY,
    ts REAL NOT NULL,
    gpu TEXT NOT NULL,
    outcome TEXT NOT NULL,
    detail TEXT NOT NULL,
    serial TEXT
)"""

# Issue 52: the node's incidents (core.incident), one row per incident id, updated as codes
# join it and when it closes. Created on first use, as clears are.
_INCIDENTS_DDL = """
CREATE TABLE IF NOT EXISTS incidents (
    id TEXT PRIMARY KEY,
    started REAL NOT NULL,
    ended REAL,
    code TEXT NOT NULL,
    gpu TEXT,
    codes TEXT NOT NULL
)"""

# Created with the first job closeout, as clears are: the jobs that closed out on this node,
# for `gpudiag explain` and a run's failure attribution (the XID timeline is ``xids`` above).
_JOBS_DDL = """
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY,
    ts REAL NOT NULL,
    uid INTEGER NOT NULL,
    pid INTEGER,
    slurm_job_id TEXT,
    started REAL,
    ended REAL,
    attribution TEXT NOT NULL,
    record TEXT NOT NULL,
    attested TEXT,
    run_id TEXT
)"""
# How a stored job's window is known (``jobs.attested``): ``socket``, the daemon saw the run
# begin and end on its unix socket (peer credentials); ``root``, a record only root could
# have written (the kernel says root owns its file). NULL: a record from before issue 38,
# believed as written then: never trusted now.
ATTESTED_BY = ("socket", "root")
# The jobs' share of the history's size bound: a flood of closeouts is pruned before any
# verdict change (issue 38: 21 MB of jobs against a 1 MiB limit emptied the verdicts).
JOBS_SHARE = 0.25
# A stored job's size in the history beyond its record's text (row, index, page slack).
JOB_ROW_OVERHEAD_BYTES = 96
# Job writes between two prunes (verdict writes prune on their own count).
PRUNE_EVERY_JOBS = 64


@dataclass(frozen=True)
class StoredXid:
    """One XID the daemon's watcher saw, as stored (``ts``: when the daemon got it)."""

    id: int
    ts: float
    xid: int
    gpu_index: int | None
    uuid: str | None
    serial: str | None = None

    def record(self) -> dict[str, Any]:
        return {"id": self.id, "ts": self.ts, "xid": self.xid, "gpu_index": self.gpu_index,
                "uuid": self.uuid, "serial": self.serial}


@dataclass(frozen=True)
class StoredJob:
    """One run that closed out on this node (its inbox record), with the owner's uid."""

    id: int
    ts: float
    uid: int
    pid: int | None
    slurm_job_id: str | None
    attribution: str
    record: Mapping[str, Any]
    attested: str | None = None  # one of ATTESTED_BY; None: believed as written, never trusted
    run_id: str | None = None  # the attested run's id (POST /v1/runs/begin)


@dataclass(frozen=True)
class ClearEntry:
    """One `gpudiag clear` the daemon applied: who (uid), which GPU (None: all), why."""

    id: int
    ts: float
    uid: int
    gpu: str | None
    reason: str
    released: int  # held XIDs it released
    serial: str | None = None
    # The operator said no repair was done (`gpudiag clear --no-repair`): the blockers it
    # cleared (``codes``) were false blockers. None in a history from before schema 2.
    no_repair: bool | None = None
    codes: tuple[str, ...] = ()

    def record(self) -> dict[str, Any]:
        return {"id": self.id, "ts": self.ts, "uid": self.uid, "gpu": self.gpu,
                "reason": self.reason, "released_xids": self.released, "serial": self.serial,
                "no_repair": self.no_repair, "codes": list(self.codes)}


class HistoryError(Exception):
    """The history database cannot be opened or read; the message names the file."""


class HistoryWriteError(HistoryError):
    """A write to the history failed (disk full, I/O error); nothing of it was kept."""


class HistoryDamagedError(HistoryError):
    """The history file is not a usable SQLite database (damaged, or not a database)."""


# SQLite's primary result codes that mean "this file is damaged", not "the host is unwell".
_DAMAGED_CODES = frozenset({11, 26})  # SQLITE_CORRUPT, SQLITE_NOTADB


def is_damaged(error: sqlite3.Error) -> bool:
    """True when SQLite says the file itself is damaged or not a database."""
    code = getattr(error, "sqlite_errorcode", None)
    return isinstance(code, int) and (code & 0xFF) in _DAMAGED_CODES


def _rollback(db: sqlite3.Connection) -> None:
    """Roll back what is still open: SQLite itself rolls back on a full disk or an I/O error,
    and a second ROLLBACK would fail ("no transaction is active") over the real cause."""
    if db.in_transaction:
        try:
            db.execute("ROLLBACK")
        except sqlite3.Error:
            pass  # the connection is unusable; the caller reports the original error


@dataclass(frozen=True)
class HistoryEntry:
    """One verdict change as stored."""

    id: int
    ts: float
    checked_at: str
    requirement: str
    gpu_validation_blocker: str
    ready: bool
    blockers: tuple[str, ...]
    warnings: tuple[str, ...]

    def record(self) -> dict[str, Any]:
        return {"id": self.id, "ts": self.ts, "checked_at": self.checked_at,
                "requirement": self.requirement,
                "gpu_validation_blocker": self.gpu_validation_blocker, "ready": self.ready,
                "blockers": list(self.blockers), "warnings": list(self.warnings)}


@dataclass(frozen=True)
class Episode:
    """One stretch of time during which a blocker was present."""

    id: int
    code: str
    layer: str
    backend: str | None
    device: str | None
    started: float
    ended: float | None
    message: str
    evidence: Mapping[str, Any]
    serial: str | None = None  # the board serial of ``device``'s GPU, when known

    def record(self) -> dict[str, Any]:
        return {"id": self.id, "code": self.code, "layer": self.layer,
                "backend": self.backend, "device": self.device, "started": self.started,
                "ended": self.ended, "message": self.message, "evidence": dict(self.evidence),
                "serial": self.serial}


@dataclass(frozen=True)
class ResetEntry:
    """One GPU reset the daemon made (the reset rung), and what became of it."""

    id: int
    ts: float  # when the reset was made
    gpu: str
    outcome: str  # core.gpu_reset.OUTCOMES
    detail: str
    serial: str | None = None

    def record(self) -> dict[str, Any]:
        return {"id": self.id, "ts": self.ts, "gpu": self.gpu, "outcome": self.outcome,
                "detail": self.detail, "serial": self.serial}


@dataclass(frozen=True)
class SeenGpu:
    """One (serial, UUID, slot) the history has seen, first and last (core/identity.GpuIdentity
    is what NVML last said a GPU index is)."""

    serial: str
    uuid: str
    gpu_index: int
    pci_bus_id: str | None
    first_seen: float
    last_seen: float

    def record(self) -> dict[str, Any]:
        return {"serial": self.serial, "uuid": self.uuid, "gpu_index": self.gpu_index,
                "pci_bus_id": self.pci_bus_id, "first_seen": self.first_seen,
                "last_seen": self.last_seen}


@dataclass(frozen=True)
class Offender:
    """A GPU (by serial) and its incidents: blocker episodes opened on it at distinct times."""

    serial: str
    incidents: int
    first: float
    last: float
    codes: tuple[str, ...]
    uuids: tuple[str, ...]

    def record(self) -> dict[str, Any]:
        return {"serial": self.serial, "incidents": self.incidents, "first": self.first,
                "last": self.last, "codes": list(self.codes), "uuids": list(self.uuids)}


def _tail(text: Any, limit: int = EVIDENCE_TEXT_LIMIT) -> Any:
    if isinstance(text, str) and len(text) > limit:
        return text[-limit:]
    return text


def fingerprint(verdict: Verdict) -> str:
    """What makes a verdict a change: blocker, findings and where they apply, not timing."""
    key: dict[str, Any] = {
        "requirement": [b.spec() for b in verdict.requirement.backends],
        "blocker": verdict.gpu_validation_blocker,
        "blockers": sorted([b.code, b.backend or "", b.device or ""] for b in verdict.blockers),
        "warnings": sorted([w.code, w.backend or "", w.device or ""] for w in verdict.warnings),
    }
    # Which board sits in which slot: a GPU moved or replaced (an RMA) is a change to keep, so
    # that the history by serial sees it. Left out where NVML gives no serial (as before).
    boards = sorted((d.index, d.uuid or "", d.serial) for d in verdict.devices if d.serial)
    if boards:
        key["boards"] = boards
    return json.dumps(key, sort_keys=True, separators=(",", ":"))


def _stored_record(verdict: Verdict) -> dict[str, Any]:
    """The verdict record with bulky evidence cut down (the history must stay small)."""
    rec = verdict.record()
    ev = rec.get("evidence") or {}
    rec["evidence"] = {
        "driver": ev.get("driver"),
        "probe_stderr": {k: _tail(v) for k, v in (ev.get("probe_stderr") or {}).items()},
        "nvidia_smi": {k: _tail(v) for k, v in (ev.get("nvidia_smi") or {}).items()}
        if isinstance(ev.get("nvidia_smi"), dict) else None,
    }
    return rec


class HistoryStore:
    """The history database; one writer (the daemon), any number of read-only readers."""

    def __init__(self, path: str | Path, *, retention_s: float = 30 * 86400.0,
                 max_bytes: int = 64 * 2**20, readonly: bool = False,
                 clock: Callable[[], float] = time.time, check: bool = False) -> None:
        self.path = Path(path)
        self.retention_s = retention_s
        self.max_bytes = max_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self._last_fp: str | None = None
        self._writes = 0
        self._job_writes = 0
        # Retention also by time, so that a store with few changes is still pruned
        # (every 50 writes alone could keep rows for months past the retention).
        self._prune_every_s = min(3600.0, max(1.0, retention_s / 10))
        self._last_prune = -float("inf")
        try:
            if readonly:
                if not self.path.exists():
                    raise HistoryError(f"no history at {self.path} (has `gpudiag serve` run "
                                       "with this --state-dir?)")
                self._db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True,
                                           check_same_thread=False, timeout=5.0)
                self._db.execute("PRAGMA query_only=ON")
            else:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                if check:
                    self._check()
                self._db = sqlite3.connect(str(self.path), check_same_thread=False,
                                           timeout=5.0, isolation_level=None)
                try:
                    self._setup()
                except BaseException:
                    self._db.close()  # a damaged file is moved aside: let go of it first
                    raise
        except sqlite3.Error as e:
            if is_damaged(e):
                raise HistoryDamagedError(f"history {self.path} is damaged: {e}") from e
            raise HistoryError(f"cannot open history {self.path}: {e}") from e

    def _check(self) -> None:
        """HistoryDamagedError when the existing file is damaged; read-only, on purpose.

        A read-write connection to a damaged file checkpoints its WAL into it and deletes the
        WAL on close: the newest changes would be lost before the file is moved aside.
        quick_check reads every page once (0.1-0.2 s for 63 MiB, measured), so a file
        damaged inside is found at start, not by a write failing at 3 a.m.
        """
        if not self.path.exists() or self.path.stat().st_size == 0:
            return
        db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=5.0)
        try:
            found = [str(r[0]) for r in db.execute("PRAGMA quick_check").fetchall()]
        finally:
            db.close()
        if found != ["ok"]:
            raise HistoryDamagedError(f"history {self.path} is damaged: "
                                      f"{'; '.join(found[:3])}")

    def _setup(self) -> None:
        db = self._db
        # auto_vacuum only takes effect before the first table exists.
        db.execute("PRAGMA auto_vacuum=INCREMENTAL")
        mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise HistoryError(f"{self.path}: SQLite refused WAL mode (got {mode})")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("PRAGMA busy_timeout=5000")
        # One transaction: a crash while the schema is created leaves all of it or none,
        # never a verdicts table without its episodes table.
        db.executescript("BEGIN IMMEDIATE;\n" + _DDL + "\nINSERT OR IGNORE INTO meta (key, value) "
                         f"VALUES ('schema_version', '{int(SCHEMA_VERSION)}');\nCOMMIT;")
        self._migrate()
        row = db.execute("SELECT fingerprint FROM verdicts ORDER BY id DESC LIMIT 1").fetchone()
        self._last_fp = row[0] if row else None

    def _migrate(self) -> None:
        """Bring an older history to SCHEMA_VERSION in one transaction (ADD COLUMN only: a
        reader of an older gpudiag still reads it, and nothing is rewritten)."""
        with self._transaction("migrate") as db:
            for table, column in _SERIAL_COLUMNS:
                if not db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name=?",
                                  (table,)).fetchone():
                    continue  # made on first use, with the column
                have = {str(r[1]) for r in db.execute(f"PRAGMA table_info({table})")}
                if column not in have:
                    # Fixed names from _SERIAL_COLUMNS, never input.
                    db.execute(f"ALTER TABLE {table} ADD COLUMN {column} "
                               f"{'INTEGER' if column == 'no_repair' else 'TEXT'}")
            db.execute("UPDATE meta SET value=? WHERE key='schema_version'",
                       (str(SCHEMA_VERSION),))

    def schema_version(self) -> int:
        """The schema version the file says it has."""
        rows = self._query("SELECT value FROM meta WHERE key='schema_version'", [])
        return int(rows[0][0]) if rows else 0

    @property
    def last_fingerprint(self) -> str | None:
        """The fingerprint of the newest stored verdict (None for an empty history)."""
        with self._lock:
            return self._last_fp

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- writing -------------------------------------------------------------------------
    @contextlib.contextmanager
    def _transaction(self, what: str | None = None) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE ... COMMIT, rolled back on any error (SQLite may have rolled back
        already: _rollback copes). With ``what``, an SQLite error becomes HistoryWriteError
        ("cannot WHAT PATH: ..."); without, it goes up as it is (pruning's callers catch it)."""
        db = self._db
        try:
            db.execute("BEGIN IMMEDIATE")
            yield db
            db.execute("COMMIT")
        except sqlite3.Error as e:
            _rollback(db)
            if what is None:
                raise
            raise HistoryWriteError(f"cannot {what} {self.path}: {e}") from e
        except BaseException:
            _rollback(db)
            raise

    def record(self, verdict: Verdict, now: float | None = None) -> int | None:
        """Store the verdict if it differs from the last one; returns its id once durable."""
        fp = fingerprint(verdict)
        ts = self._clock() if now is None else now
        with self._lock:
            if fp == self._last_fp:
                return None
            rec = _stored_record(verdict)
            with self._transaction("write history") as db:
                cur = db.execute(
                    "INSERT INTO verdicts (ts, checked_at, requirement, blocker, ready, "
                    "blockers, warnings, fingerprint, record) VALUES (?,?,?,?,?,?,?,?,?)",
                    (ts, verdict.checked_at,
                     ",".join(b.spec() for b in verdict.requirement.backends),
                     verdict.gpu_validation_blocker, int(verdict.ready),
                     ",".join(sorted({b.code for b in verdict.blockers})),
                     ",".join(sorted({w.code for w in verdict.warnings})), fp,
                     json.dumps(rec, separators=(",", ":"), default=str)))
                serials = self._identities(verdict, ts)
                self._episodes(verdict, rec, ts, serials)
            self._last_fp = fp
            self._writes += 1
            if self._writes % 50 == 0 or ts - self._last_prune >= self._prune_every_s:
                # The change is durable: a failed prune must not report it as lost (it
                # would be written twice). Pruning is retried on a later write.
                with contextlib.suppress(sqlite3.Error):
                    self._prune_locked(ts)
            row_id = cur.lastrowid
            return int(row_id) if row_id is not None else None

    def _identities(self, verdict: Verdict, ts: float) -> dict[str, str]:
        """Keep which serial carried which UUID in which slot; UUID -> serial of this verdict
        (a lost GPU, whose serial NVML cannot read now, keeps the one it had)."""
        db = self._db
        for d in verdict.devices:
            if d.serial and d.uuid:
                db.execute("INSERT INTO gpu_identities (serial, uuid, gpu, pci_bus_id, "
                           "first_seen, last_seen) VALUES (?,?,?,?,?,?) ON CONFLICT (serial, "
                           "uuid, gpu) DO UPDATE SET last_seen=excluded.last_seen",
                           (d.serial, d.uuid, d.index, d.pci_bus_id, ts, ts))
        return {d.uuid: d.serial for d in verdict.devices if d.uuid and d.serial}

    def _serial_of(self, uuid: str | None) -> str | None:
        """The serial the history last saw carry ``uuid`` (lock held)."""
        if not uuid:
            return None
        row = self._db.execute("SELECT serial FROM gpu_identities WHERE uuid=? ORDER BY "
                               "last_seen DESC LIMIT 1", (uuid,)).fetchone()
        return str(row[0]) if row else None

    def _episodes(self, verdict: Verdict, rec: Mapping[str, Any], ts: float,
                  serials: Mapping[str, str]) -> None:
        db = self._db
        current = {(b.code, b.backend or "", b.device or ""): b for b in verdict.blockers}
        open_rows = db.execute("SELECT id, code, IFNULL(backend,''), IFNULL(device,'') "
                               "FROM episodes WHERE ended IS NULL").fetchall()
        open_keys = set()
        for row_id, code, backend, device in open_rows:
            key = (code, backend, device)
            if key in current:
                open_keys.add(key)
            else:
                db.execute("UPDATE episodes SET ended=? WHERE id=?", (ts, row_id))
        stderr = (rec.get("evidence") or {}).get("probe_stderr") or {}
        for key, b in current.items():
            if key in open_keys:
                continue
            evidence = {"driver": (rec.get("evidence") or {}).get("driver"),
                        "probe_stderr": stderr.get(b.backend or "", ""),
                        "checked_at": verdict.checked_at}
            serial = serials.get(b.device or "") or self._serial_of(b.device)
            db.execute("INSERT INTO episodes (code, layer, backend, device, started, ended, "
                       "message, evidence, serial) VALUES (?,?,?,?,?,NULL,?,?,?)",
                       (b.code, b.layer, b.backend, b.device, ts, _tail(redact_text(b.message)),
                        json.dumps(evidence, default=str), serial))

    def record_clear(self, *, uid: int, gpu: str | None, reason: str, released: int,
                     now: float | None = None, no_repair: bool = False,
                     codes: Sequence[str] = ()) -> int:
        """Store an applied `gpudiag clear`; returns its id once durable. ``no_repair``: the
        operator said nothing was repaired, so ``codes`` (what it cleared) were false."""
        ts = self._clock() if now is None else now
        with self._lock:
            with self._transaction("record the clear in") as db:
                db.execute(_CLEARS_DDL)
                cur = db.execute("INSERT INTO clears (ts, uid, gpu, reason, released, serial, "
                                 "no_repair, codes) VALUES (?,?,?,?,?,?,?,?)",
                                 (ts, uid, gpu, reason, released, self._serial_of(gpu),
                                  int(no_repair), ",".join(sorted(set(codes)))))
            return int(cur.lastrowid or 0)

    def record_reset(self, *, gpu: str, outcome: str, detail: str, ts: float) -> int:
        """Store a GPU reset the daemon made (made at ``ts``) and its outcome; its id."""
        with self._lock:
            with self._transaction("record the GPU reset in") as db:
                db.execute(_RESETS_DDL)
                cur = db.execute("INSERT INTO resets (ts, gpu, outcome, detail, serial) VALUES "
                                 "(?,?,?,?,?)", (ts, gpu, outcome, _tail(redact_text(detail)),
                                                 self._serial_of(gpu)))
            return int(cur.lastrowid or 0)

    def record_incident(self, incident: Incident) -> None:
        """Store an incident as it stands now (opened, joined or closed), by its id."""
        with self._lock:
            with self._transaction("record the incident in") as db:
                db.execute(_INCIDENTS_DDL)
                db.execute("INSERT INTO incidents (id, started, ended, code, gpu, codes) VALUES "
                           "(?,?,?,?,?,?) ON CONFLICT(id) DO UPDATE SET ended=excluded.ended, "
                           "codes=excluded.codes",
                           (incident.id, incident.started_wall, incident.ended_wall,
                            incident.code, incident.gpu, ",".join(incident.codes)))

    def incidents(self, *, since: float | None = None, limit: int = 50) -> list[Incident]:
        """The node's incidents, newest first (none before the first)."""
        if not self._has("incidents"):
            return []
        rows = self._query("SELECT id, started, code, gpu, codes, ended FROM incidents" + (
            " WHERE started >= ?" if since is not None else "") +
            " ORDER BY started DESC LIMIT ?", [*([since] if since is not None else []), limit])
        return [Incident(str(r[0]), float(r[1]), str(r[2]), r[3], _split(r[4] or ""),
                         None if r[5] is None else float(r[5])) for r in rows]

    def resets(self, *, since: float | None = None, limit: int = 50) -> list[ResetEntry]:
        """The daemon's GPU resets, newest first (none before the first)."""
        if not self._has("resets"):
            return []
        rows = self._newest("SELECT id, ts, gpu, outcome, detail, serial FROM resets",
                            {"ts >= ?": since}, limit)
        return [ResetEntry(int(r[0]), float(r[1]), str(r[2]), str(r[3]), str(r[4]), r[5])
                for r in rows]

    def record_xids(self, events: Sequence[XidEvent]) -> None:
        """Store XIDs the watcher saw (so that a restart holds them again), in one commit."""
        with self._lock:
            with self._transaction("record XIDs in") as db:
                db.executemany("INSERT INTO xids (ts, xid, gpu, uuid, serial) VALUES (?,?,?,?,?)",
                               [(e.timestamp, e.xid, e.device_index, e.uuid,
                                 self._serial_of(e.uuid)) for e in events])

    def record_boot(self, boot_id: str, now: float | None = None) -> bool:
        """Note the boot the daemon starts in, when it is not the last one noted; True when
        it was new (the node rebooted since the last start, or this is the first)."""
        ts = self._clock() if now is None else now
        with self._lock:
            with self._transaction("record the boot in") as db:
                db.execute(_BOOTS_DDL)
                row = db.execute("SELECT boot_id FROM boots ORDER BY ts DESC, id DESC "
                                 "LIMIT 1").fetchone()
                if row is not None and row[0] == boot_id:
                    return False
                db.execute("INSERT INTO boots (ts, boot_id) VALUES (?,?)", (ts, boot_id))
                return True

    def boot_at(self, ts: float) -> str | None:
        """The boot the daemon was running in at ``ts`` (None: not known)."""
        if not self._has("boots"):
            return None
        rows = self._query("SELECT boot_id FROM boots WHERE ts <= ? ORDER BY ts DESC, id DESC "
                           "LIMIT 1", [ts])
        return str(rows[0][0]) if rows else None

    def held_xids(self, since: float) -> list[XidEvent]:
        """XIDs seen at or after ``since`` that no later `gpudiag clear` released, oldest first.

        A clear of one GPU releases that GPU's XIDs, a clear of all GPUs every XID, each only
        when the clear came at or after the XID (a later XID holds its GPU again).
        """
        cleared = ""
        if self._query("SELECT 1 FROM sqlite_master WHERE type='table' AND name='clears'", []):
            cleared = (" AND NOT EXISTS (SELECT 1 FROM clears c WHERE c.ts >= x.ts AND "
                       "(c.gpu IS NULL OR c.gpu = x.uuid))")
        rows = self._query("SELECT xid, gpu, uuid, ts FROM xids x WHERE ts >= ?" + cleared
                           + " ORDER BY ts, id", [since])
        return [XidEvent(int(r[0]), None if r[1] is None else int(r[1]), r[2], float(r[3]))
                for r in rows]

    def cleared_after(self, ts: float, uuid: str | None) -> bool:
        """Whether a `gpudiag clear` of GPU ``uuid`` (or of all GPUs) came at or after ``ts``."""
        if not self._query("SELECT 1 FROM sqlite_master WHERE type='table' AND name='clears'",
                           []):
            return False
        return bool(self._query("SELECT 1 FROM clears WHERE ts >= ? AND (gpu IS NULL OR gpu = ?)"
                                " LIMIT 1", [ts, uuid]))

    def open_episodes(self) -> list[Episode]:
        """Blocker episodes still open (the daemon stopped while they were), oldest first."""
        return [Episode(int(r[0]), str(r[1]), str(r[2]), r[3], r[4], float(r[5]), None,
                        str(r[6]), json.loads(r[7]))
                for r in self._query("SELECT id, code, layer, backend, device, started, "
                                     "message, evidence FROM episodes WHERE ended IS NULL "
                                     "ORDER BY id", [])]

    def record_job(self, *, ts: float, uid: int, pid: int | None, slurm_job_id: str | None,
                   started: float | None, ended: float | None, attribution: str,
                   record: Mapping[str, Any], attested: str | None = None,
                   run_id: str | None = None) -> int:
        """Store one run's closeout record; returns its id once durable. ``attested``: how
        its window is known (ATTESTED_BY), None for a record believed as written."""
        with self._lock:
            with self._transaction("record the job in") as db:
                db.execute(_JOBS_DDL)
                cur = db.execute(
                    "INSERT INTO jobs (ts, uid, pid, slurm_job_id, started, ended, attribution, "
                    "record, attested, run_id) VALUES (?,?,?,?,?,?,?,?,?,?)",
                    (ts, uid, pid, slurm_job_id, started, ended, attribution,
                     json.dumps(record, separators=(",", ":"), default=str), attested, run_id))
            self._job_writes += 1
            if self._job_writes % PRUNE_EVERY_JOBS == 0:
                # Jobs come from users: they must not grow the history past its bound.
                with contextlib.suppress(sqlite3.Error):
                    self._prune_locked(self._clock())
            return int(cur.lastrowid or 0)

    def prune(self, now: float | None = None) -> None:
        """Apply retention by age and by size."""
        with self._lock:
            try:
                self._prune_locked(self._clock() if now is None else now)
            except sqlite3.Error as e:
                raise HistoryWriteError(f"cannot prune history {self.path}: {e}") from e

    def _prune_locked(self, now: float) -> None:
        db = self._db
        self._last_prune = now
        cutoff = now - self.retention_s
        with self._transaction():
            # The newest verdict stays whatever its age: it is the current state.
            db.execute("DELETE FROM verdicts WHERE ts < ? AND id < "
                       "(SELECT MAX(id) FROM verdicts)", (cutoff,))
            db.execute("DELETE FROM episodes WHERE ended IS NOT NULL AND ended < ?", (cutoff,))
            db.execute("DELETE FROM gpu_identities WHERE last_seen < ?", (cutoff,))
            for table in ("clears", "xids", "jobs", "resets"):  # made on first use
                if db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name=?",
                              (table,)).fetchone():
                    # A fixed name from the tuple above, never input.
                    db.execute(f"DELETE FROM {table} WHERE ts < ?", (cutoff,))
            if db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND "
                          "name='incidents'").fetchone():
                db.execute("DELETE FROM incidents WHERE ended IS NOT NULL AND ended < ?",
                           (cutoff,))
        self._prune_jobs_by_size()
        for _ in range(20):
            if self.size_bytes() <= self.max_bytes:
                break
            n = db.execute("SELECT COUNT(*) FROM verdicts").fetchone()[0]
            if n <= 1:
                break
            drop = max(1, n // 4)
            with self._transaction():
                db.execute("DELETE FROM verdicts WHERE id IN (SELECT id FROM verdicts "
                           "ORDER BY id LIMIT ?)", (drop,))
                db.execute("DELETE FROM episodes WHERE ended IS NOT NULL AND id IN (SELECT id "
                           "FROM episodes WHERE ended IS NOT NULL ORDER BY id LIMIT ?)",
                           (drop,))
            db.execute("PRAGMA incremental_vacuum")
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def _prune_jobs_by_size(self) -> None:
        """Drop the oldest jobs until they take at most JOBS_SHARE of the size bound: jobs
        are bounded apart, so that they never cost the verdict history its place."""
        db = self._db
        if not db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='jobs'"
                          ).fetchone():
            return
        budget = int(self.max_bytes * JOBS_SHARE)
        n, text = db.execute("SELECT COUNT(*), COALESCE(SUM(LENGTH(record)), 0) FROM jobs"
                             ).fetchone()
        used = int(text) + int(n) * JOB_ROW_OVERHEAD_BYTES
        if used <= budget or not n:
            return
        # The oldest rows whose share brings the rest within the budget, at once.
        keep = max(0, int(n * budget / used))
        with self._transaction():
            db.execute("DELETE FROM jobs WHERE id IN (SELECT id FROM jobs ORDER BY id "
                       "LIMIT ?)", (int(n) - keep,))
        db.execute("PRAGMA incremental_vacuum")
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def size_bytes(self) -> int:
        """The database's size in pages (the WAL is checkpointed into it)."""
        pages = self._db.execute("PRAGMA page_count").fetchone()[0]
        free = self._db.execute("PRAGMA freelist_count").fetchone()[0]
        size = self._db.execute("PRAGMA page_size").fetchone()[0]
        return int((pages - free) * size)

    # -- reading -------------------------------------------------------------------------
    def verdicts(self, *, since: float | None = None, blocked: bool = False,
                 limit: int = 50) -> list[HistoryEntry]:
        """Verdict changes, newest first."""
        rows = self._newest(
            "SELECT id, ts, checked_at, requirement, blocker, ready, blockers, warnings "
            "FROM verdicts", {"ts >= ?": since, "ready = ?": 0 if blocked else None}, limit)
        return [HistoryEntry(int(r[0]), float(r[1]), str(r[2]), str(r[3]), str(r[4]),
                             bool(r[5]), _split(r[6]), _split(r[7])) for r in rows]

    def episodes(self, *, since: float | None = None, limit: int = 50,
                 serial: str | None = None) -> list[Episode]:
        """Blocker episodes that were open at any time since ``since`` (of the GPU with
        ``serial``), newest first."""
        rows = self._newest(
            f"SELECT id, code, layer, backend, device, started, ended, message, evidence, "
            f"{self._col('episodes', 'serial')} FROM episodes",
            {"(ended IS NULL OR ended >= ?)": since, "serial = ?": serial}, limit)
        return [Episode(int(r[0]), str(r[1]), str(r[2]), r[3], r[4], float(r[5]),
                        None if r[6] is None else float(r[6]), str(r[7]), json.loads(r[8]),
                        r[9])
                for r in rows]

    def clears(self, *, since: float | None = None, limit: int = 50,
               serial: str | None = None) -> list[ClearEntry]:
        """Applied clears, newest first (none in a history written before clears existed)."""
        if not self._has("clears"):
            return []
        rows = self._newest(
            f"SELECT id, ts, uid, gpu, reason, released, {self._col('clears', 'serial')}, "
            f"{self._col('clears', 'no_repair')}, {self._col('clears', 'codes')} FROM clears",
            {"ts >= ?": since, "serial = ?": serial}, limit)
        return [ClearEntry(int(r[0]), float(r[1]), int(r[2]), r[3], str(r[4]), int(r[5]),
                           r[6], None if r[7] is None else bool(r[7]), _split(r[8] or ""))
                for r in rows]

    def _col(self, table: str, column: str) -> str:
        """``column`` when ``table`` has it, else NULL: a read-only reader of a history from
        before schema 2 (not migrated until its daemon opens it) reads NULLs."""
        have = {str(r[1]) for r in self._query(f"PRAGMA table_info({table})", [])}
        return column if column in have else "NULL"

    def identities(self, *, serial: str | None = None) -> list[SeenGpu]:
        """Which serial carried which UUID in which slot, most recently seen first."""
        if not self._has("gpu_identities"):
            return []
        sql = ("SELECT serial, uuid, gpu, pci_bus_id, first_seen, last_seen FROM "
               "gpu_identities")
        args: list[Any] = []
        if serial is not None:
            sql += " WHERE serial = ?"
            args.append(serial)
        return [SeenGpu(str(r[0]), str(r[1]), int(r[2]), r[3], float(r[4]), float(r[5]))
                for r in self._query(sql + " ORDER BY last_seen DESC", args)]

    def worst(self, n: int, *, since: float | None = None) -> list[Offender]:
        """The ``n`` GPUs (by serial) with the most incidents since ``since``, most first.

        An incident is a moment blocker episodes opened on the GPU: one fault opens several
        (an XID and NVML's reset-required in the same verdict) and counts once. An episode
        that a `gpudiag clear --no-repair` of its GPU (or of all) ended while it was open, and
        whose code it named, was a false blocker: no incident."""
        if self._col("episodes", "serial") == "NULL":
            return []
        false = ""
        if self._has("clears") and self._col("clears", "no_repair") != "NULL":
            false = (" AND NOT EXISTS (SELECT 1 FROM clears c WHERE c.no_repair = 1 "
                     "AND (c.gpu IS NULL OR c.gpu = episodes.device) "
                     "AND c.ts >= episodes.started "
                     "AND (episodes.ended IS NULL OR episodes.ended >= c.ts) "
                     "AND (COALESCE(c.codes, '') = '' "
                     "OR (',' || c.codes || ',') LIKE ('%,' || episodes.code || ',%')))")
        rows = self._query(
            "SELECT serial, COUNT(DISTINCT started), MIN(started), MAX(started), "
            "GROUP_CONCAT(DISTINCT code), GROUP_CONCAT(DISTINCT device) FROM episodes "
            f"WHERE serial IS NOT NULL AND started >= ?{false} GROUP BY serial "
            "ORDER BY COUNT(DISTINCT started) DESC, MAX(started) DESC, serial LIMIT ?",
            [-1.0 if since is None else since, n])
        return [Offender(str(r[0]), int(r[1]), float(r[2]), float(r[3]),
                         tuple(sorted(_split(r[4] or ""))), tuple(sorted(_split(r[5] or ""))))
                for r in rows]

    def incident_times(self) -> dict[str, list[float]]:
        """Each serial's incident times, oldest first (the daemon seeds its interval
        histogram's last incidents from it at start)."""
        if self._col("episodes", "serial") == "NULL":
            return {}
        out: dict[str, list[float]] = {}
        for serial, started in self._query(
                "SELECT DISTINCT serial, started FROM episodes WHERE serial IS NOT NULL "
                "ORDER BY started", []):
            out.setdefault(str(serial), []).append(float(started))
        return out

    def _has(self, table: str) -> bool:
        return bool(self._query("SELECT 1 FROM sqlite_master WHERE type='table' AND name=?",
                                [table]))

    def xids(self, *, since: float | None = None, until: float | None = None,
             limit: int = 50, serial: str | None = None) -> list[StoredXid]:
        """XIDs the watcher saw in [since, until], newest first."""
        if not self._has("xids"):
            return []
        rows = self._newest(f"SELECT id, ts, xid, gpu, uuid, {self._col('xids', 'serial')} "
                            "FROM xids",
                            {"ts >= ?": since, "ts <= ?": until, "serial = ?": serial}, limit)
        return [StoredXid(int(r[0]), float(r[1]), int(r[2]), r[3], r[4], r[5]) for r in rows]

    def jobs(self, *, pid: int | None = None, slurm_job_id: str | None = None,
             since: float | None = None, limit: int = 50) -> list[StoredJob]:
        """Runs that closed out here, newest first; by the run's or its child's pid, or by
        Slurm job id."""
        if not self._has("jobs"):
            return []
        sql = (f"SELECT id, ts, uid, pid, slurm_job_id, attribution, record, "
               f"{self._col('jobs', 'attested')}, {self._col('jobs', 'run_id')} FROM jobs "
               "WHERE ts >= ?")
        args: list[Any] = [-1.0 if since is None else since]
        if slurm_job_id is not None:
            sql += " AND slurm_job_id = ?"
            args.append(slurm_job_id)
        rows = self._query(sql + " ORDER BY id DESC", args)
        out: list[StoredJob] = []
        for r in rows:
            rec = json.loads(r[6])
            pids = {r[3], rec.get("child_pid")} if isinstance(rec, dict) else {r[3]}
            if pid is not None and pid not in pids:
                continue
            attested = r[7] if r[7] in ATTESTED_BY else None
            out.append(StoredJob(int(r[0]), float(r[1]), int(r[2]), r[3], r[4], str(r[5]),
                                 rec if isinstance(rec, dict) else {}, attested, r[8]))
            if len(out) >= limit:
                break
        return out

    def verdict_record(self, row_id: int) -> dict[str, Any] | None:
        rows = self._query("SELECT record FROM verdicts WHERE id = ?", [row_id])
        return json.loads(rows[0][0]) if rows else None

    def ids(self) -> list[int]:
        return [int(r[0]) for r in self._query("SELECT id FROM verdicts ORDER BY id", [])]

    def integrity(self) -> str:
        rows = self._query("PRAGMA integrity_check", [])
        return "; ".join(str(r[0]) for r in rows)

    def _newest(self, select: str, where: Mapping[str, Any], limit: int
                ) -> list[tuple[Any, ...]]:
        """The rows of ``select`` newest first, filtered by each clause whose value is set."""
        given = {clause: value for clause, value in where.items() if value is not None}
        sql = select + (" WHERE " + " AND ".join(given) if given else "")
        return self._query(sql + " ORDER BY id DESC LIMIT ?", [*given.values(), limit])

    def _query(self, sql: str, args: Sequence[Any]) -> list[tuple[Any, ...]]:
        with self._lock:
            try:
                return list(self._db.execute(sql, list(args)).fetchall())
            except sqlite3.Error as e:
                raise HistoryError(f"cannot read history {self.path}: {e}") from e


def _split(text: str) -> tuple[str, ...]:
    return tuple(t for t in text.split(",") if t)


def default_path(state_dir: str | Path) -> Path:
    """Where the daemon keeps its history inside the state dir."""
    return Path(state_dir) / DB_NAME
