"""The daemon's pre-encoded answers: the same bytes as encoding the whole record per request."""

from __future__ import annotations

import json
import secrets

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpudiag.core.verdict import Verdict
from gpudiag.daemon.answers import EncodedAnswer
from gpudiag.daemon.envelope import encode_json
from tests.support.verdicts import verdicts

# Encoding is deterministic: a few dozen generated verdicts cover it (the inner loop stays fast).
FAST = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))


def _whole(verdict: Verdict, age_s: float, fresh: bool) -> bytes:
    """What the daemon sent before: the record with its age and freshness, encoded whole."""
    record = verdict.with_source("daemon", age_s).record()
    record["fresh"] = fresh
    return encode_json(record)


@FAST
@given(verdicts(), st.floats(0, 1e7, allow_nan=False), st.booleans())
def test_a_spliced_answer_is_byte_for_byte_the_whole_encoding(
        verdict: Verdict, age_s: float, fresh: bool) -> None:
    answer = EncodedAnswer.of(verdict)
    assert answer.pieces is not None
    assert answer.body(age_s, fresh) == _whole(verdict, age_s, fresh)
    assert json.loads(answer.body(age_s, fresh))["age_s"] == round(age_s, 3)


@FAST
@given(verdicts())
def test_a_marker_found_in_the_evidence_falls_back_to_whole_encoding(
        verdict: Verdict) -> None:
    token = "ab" * 16
    noisy = Verdict(**{**verdict.__dict__, "evidence": {"probe_stderr": {
        "cuda": f"\0{token}\0"}}})  # the marker as a whole JSON string: a clash
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(secrets, "token_hex", lambda n: token)
        answer = EncodedAnswer.of(noisy)
    assert answer.pieces is None
    assert answer.body(1.5, True) == _whole(noisy, 1.5, True)
