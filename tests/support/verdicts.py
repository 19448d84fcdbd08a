"""Verdicts for tests: one made by hand (``verdict``) and any Hypothesis draws (``verdicts``)."""

from __future__ import annotations

from hypothesis import strategies as st

from gpudiag.core.catalog import BLOCKERS, WARNINGS
from gpudiag.core.verdict import (
    BackendRequirement,
    BackendStatus,
    DeviceInfo,
    Finding,
    Requirement,
    Verdict,
)


def verdict(*blockers: tuple[str, str], warnings: tuple[str, ...] = (),
            stderr: str = "", big: int = 0) -> Verdict:
    """A verdict with the given (code, device) blockers."""
    return Verdict(
        requirement=Requirement(),
        blockers=tuple(Finding.of(code, f"{code} on {dev}", backend="nvml", device=dev or None)
                       for code, dev in blockers),
        warnings=tuple(Finding.of(w, w, backend="nvml") for w in warnings),
        devices=(), backends={},
        evidence={"driver": {"version": "570"}, "probe_stderr": {"nvml": stderr + "x" * big}},
        preallocation_disabled=True, host="node1", checked_at="2026-11-29T00:00:00.000Z")


FREE_TEXT = st.text(max_size=30) | st.sampled_from(["a\nb", "x\\ny", "c\\\\", "\r\n", "=", ""])


@st.composite
def verdicts(draw: st.DrawFn) -> Verdict:
    def finding(codes: list[str]) -> Finding:
        return Finding.of(draw(st.sampled_from(codes)), draw(FREE_TEXT),
                          backend=draw(st.none() | st.sampled_from(["nvml", "cuda", "jax"])),
                          device=draw(st.none() | FREE_TEXT))
    backends = draw(st.lists(st.sampled_from([BackendRequirement("cuda"),
                                              BackendRequirement("jax", "cpu"),
                                              BackendRequirement("iree", "local-task")]),
                             min_size=1, max_size=3, unique=True))
    return Verdict(
        requirement=Requirement(tuple(backends),
                                draw(st.none() | st.lists(st.sampled_from(["0", "1"]),
                                                          min_size=1, unique=True).map(tuple)),
                                draw(st.none() | st.integers(0, 64)),
                                draw(st.none() | st.integers(0, 2**40))),
        blockers=tuple(finding(sorted(BLOCKERS)) for _ in range(draw(st.integers(0, 3)))),
        warnings=tuple(finding(sorted(WARNINGS)) for _ in range(draw(st.integers(0, 2)))),
        devices=tuple(DeviceInfo(i, draw(st.none() | FREE_TEXT), draw(st.none() | FREE_TEXT),
                                 None, draw(st.none() | st.integers(0, 2**50)), None)
                      for i in range(draw(st.integers(0, 2)))),
        backends={"cuda": BackendStatus(draw(st.sampled_from(["ok", "blocked"])),
                                        draw(st.none() | st.floats(0, 100)),
                                        {"cuda_driver": draw(st.none() | FREE_TEXT)}, {})},
        evidence={"driver": {"version": draw(st.none() | FREE_TEXT)}},
        preallocation_disabled=draw(st.booleans()),
        host=draw(FREE_TEXT), checked_at=draw(FREE_TEXT), source="inline")
