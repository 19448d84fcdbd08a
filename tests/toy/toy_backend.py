"""A toy backend, declared the way a real one is: its probe, observation, classifier and spec.

tests/test_backend_registry.py adds ``SPEC`` to gpudiag.core.registry.BACKENDS (one line, in a
generated sitecustomize.py) and finds the backend in every place gpudiag shows backends.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpudiag.core.backend import BackendSpec
from gpudiag.core.findings import Findings, GpuContext
from gpudiag.core.verdict import BackendRequirement, BackendStatus

TYPE_CHECKING = False
if TYPE_CHECKING:
    from gpudiag.core.backend import BackendRun


def probe(options: Mapping[str, Any]) -> dict[str, Any]:
    """The child's work: here only an answer and a version."""
    return {"ok": True, "answer": 42, "version": "0.1"}


@dataclass(frozen=True)
class ToyObservation:
    """What the toy probe saw (and its JSON's schema: ``answer`` is a required integer)."""

    answer: int
    ok: bool = False


def classify_toy(run: BackendRun, req: BackendRequirement, gpu: GpuContext,
                 f: Findings) -> BackendStatus:
    """ok when the toy answered 42."""
    obs = run.parsed if isinstance(run.parsed, ToyObservation) else None
    ok = run.ok and obs is not None and obs.answer == 42
    if not ok:
        f.block("probe_error", f"toy: {run.error or 'wrong answer'}", backend="toy")
    return BackendStatus("ok" if ok else "blocked", round(run.duration_s, 4),
                         {"toy": "0.1"}, {"answer": obs.answer if obs else None})


SPEC = BackendSpec(
    name="toy", layer="requirement", summary="A toy backend: answers 42.",
    probe_module="tests.toy.toy_backend", observation=ToyObservation,
    classify=classify_toy, interval_s=1.0, timeout_s=20.0, published=True,
)
