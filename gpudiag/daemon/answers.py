"""A verdict's JSON answer, encoded once per snapshot and requirement.

A snapshot never changes, so the daemon classifies a requirement once per snapshot; of the
26 KB answer (8 GPUs) only ``age_s`` and ``fresh`` move between two requests. Encoding the
whole record per request cost more than the rest of the answer (docs/benchmarks.md), so the
record is encoded once with two markers and each answer splices the two values in: the bytes
are those ``json.dumps`` of the full record would give (tests/test_answers.py checks it).
"""

from __future__ import annotations

import json
import math
import secrets

from gpudiag.core.records import dataclass
from gpudiag.core.verdict import Verdict
from gpudiag.daemon.envelope import encode_json


@dataclass(frozen=True)
class EncodedAnswer:
    """A daemon verdict's JSON body in three pieces around ``age_s`` and ``fresh``."""

    verdict: Verdict
    pieces: tuple[bytes, bytes, bytes] | None  # None: encode per answer (a marker clashed)

    @classmethod
    def of(cls, verdict: Verdict, source: str = "daemon") -> EncodedAnswer:
        """Encode ``verdict`` as answered by ``source``, with markers where the values go."""
        verdict = verdict.with_source(source, 0.0)
        # Random markers: no probe's evidence text can hold them by chance or by design.
        age, fresh = (f"\0{secrets.token_hex(16)}\0" for _ in range(2))
        record = verdict.record()
        record["age_s"] = age
        record["fresh"] = fresh
        text = encode_json(record)
        head, age_sep, rest = text.partition(json.dumps(age).encode())
        middle, fresh_sep, tail = rest.partition(json.dumps(fresh).encode())
        clean = age_sep and fresh_sep and not any(
            json.dumps(m).encode() in part for m in (age, fresh) for part in (head, middle, tail))
        return cls(verdict, (head, middle, tail) if clean else None)

    def body(self, age_s: float, fresh: bool) -> bytes:
        """The answer's JSON bytes for this age and freshness."""
        age = round(age_s, 3)  # what Verdict.with_source keeps
        if self.pieces is None:
            record = self.verdict.with_source(self.verdict.source, age).record()
            record["fresh"] = fresh
            return encode_json(record)
        head, middle, tail = self.pieces
        # A finite float's repr is json's own spelling of it, without the encoder's setup.
        number = repr(age) if math.isfinite(age) else json.dumps(age)
        return b"".join((head, number.encode(), middle,
                         b"true" if fresh else b"false", tail))

