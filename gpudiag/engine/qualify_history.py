"""Qualification history: one JSON line per GPU result in the state directory.

``<state dir>/qualifications.jsonl``, appended under an flock so that the daemon's schedule,
`gpudiag qualify` and POST /v1/qualify can write side by side; pruned to the newest
``MAX_RECORDS`` lines. Each line is a ``gpudiag.qualification/1`` record (core.qualify_score).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from gpudiag.core.qualify import SCHEMA
from gpudiag.core.records import dataclass

FILE_NAME = "qualifications.jsonl"
MAX_RECORDS = 5000


class HistoryUnavailable(Exception):
    """The history file cannot be read or written (the message says which and why)."""


@dataclass(frozen=True)
class QualificationHistory:
    """The history file of one state directory."""

    path: Path

    @classmethod
    def in_state_dir(cls, state_dir: Path) -> QualificationHistory:
        return cls(state_dir / FILE_NAME)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[int]:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise HistoryUnavailable(f"cannot open {self.path}: {e.strerror or e}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield fd
        finally:
            os.close(fd)

    def records(self) -> list[dict[str, Any]]:
        """Every readable record, oldest first (a damaged line is skipped, not fatal)."""
        if not self.path.exists():
            return []
        with self._locked() as fd, os.fdopen(os.dup(fd), "r", encoding="utf-8",
                                             errors="replace") as f:
            lines = f.read().splitlines()
        out = []
        for line in lines:
            with contextlib.suppress(ValueError, RecursionError):
                value = json.loads(line)
                if isinstance(value, dict) and value.get("schema") == SCHEMA:
                    out.append(value)
        return out

    def append(self, records: Sequence[dict[str, Any]]) -> None:
        """Add records; keep the newest MAX_RECORDS lines."""
        if not records:
            return
        text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in records)
        with self._locked() as fd:
            try:
                os.lseek(fd, 0, os.SEEK_END)
                os.write(fd, text.encode())
                if os.fstat(fd).st_size > MAX_RECORDS * 4096:  # a cheap bound, then count
                    self._prune(fd)
            except OSError as e:
                raise HistoryUnavailable(f"cannot write {self.path}: {e.strerror or e}") from e

    def _prune(self, fd: int) -> None:
        os.lseek(fd, 0, os.SEEK_SET)
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        lines = b"".join(chunks).splitlines(keepends=True)[-MAX_RECORDS:]
        os.ftruncate(fd, 0)
        os.pwrite(fd, b"".join(lines), 0)


GOLDENS_FILE = "goldens.json"
GOLDENS_SCHEMA = "gpudiag.goldens/1"


@dataclass(frozen=True)
class GoldenStore:
    """The sdc tier's goldens of one state directory: golden key -> output hash, recorded
    once three GPUs agreed (core.qualify_golden), in ``goldens.json`` under an flock."""

    path: Path

    @classmethod
    def in_state_dir(cls, state_dir: Path) -> GoldenStore:
        return cls(state_dir / GOLDENS_FILE)

    def _read(self, fd: int) -> dict[str, Any]:
        os.lseek(fd, 0, os.SEEK_SET)
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        try:
            value = json.loads(b"".join(chunks) or b"{}")
        except ValueError:
            return {}  # a damaged store is no golden: the next three agreeing GPUs make one
        goldens = value.get("goldens") if isinstance(value, dict) else None
        return goldens if isinstance(goldens, dict) else {}

    def hashes(self) -> dict[str, str]:
        """Every stored golden: key -> hash."""
        if not self.path.exists():
            return {}
        with QualificationHistory(self.path)._locked() as fd:
            goldens = self._read(fd)
        return {k: v["hash"] for k, v in goldens.items()
                if isinstance(v, dict) and isinstance(v.get("hash"), str)}

    def record(self, updates: Sequence[Any], at: str) -> None:
        """Store goldens (core.qualify_golden.GoldenUpdate), replacing older ones per key."""
        if not updates:
            return
        with QualificationHistory(self.path)._locked() as fd:
            goldens = self._read(fd)
            for u in updates:
                goldens[u.key] = {"hash": u.output_hash, "gpus": list(u.gpus),
                                  "recorded_at": at}
            text = json.dumps({"schema": GOLDENS_SCHEMA, "goldens": goldens},
                              sort_keys=True, indent=1).encode()
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, text, 0)
            except OSError as e:
                raise HistoryUnavailable(f"cannot write {self.path}: {e.strerror or e}") from e
