"""A toy backend, declared the way a real one is: its probe, observation, classifier and spec.

tests/test_backend_registry.py adds ``SPEC`` to gpudiag.core.registry.BACKENDS (one line, in a
generated sitecustomize.py: tests/support/toy.py) and finds the backend in every place gpudiag
shows backends, the fault matrix included.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpudiag.core.backend import BackendSpec
from gpudiag.core.findings import Findings, GpuContext
from gpudiag.core.verdict import BackendRequirement, BackendStatus

TYPE_CHECKING = False
if TYPE_CHECKING:
    from gpudiag.core.backend import BackendRun


# Its fault injection, the way the fake drivers take theirs: knobs in the child's environment.
#   FAKE_TOY_ANSWER=N        the probe answers N (not 42: the classifier blocks, probe_error)
#   FAKE_TOY_FAULT=crash     the child dies of SIGSEGV (probe_crashed)
#   FAKE_TOY_FAULT=hang      the child sleeps past any deadline (probe_timeout)
# FAULTS says which knobs give which catalog code; the fault matrix (tests/test_fault_matrix.py)
# runs one case per entry for every registered backend whose probe module declares it.
FAULTS: dict[str, dict[str, str]] = {
    "probe_error": {"FAKE_TOY_ANSWER": "41"},
    "probe_crashed": {"FAKE_TOY_FAULT": "crash"},
    "probe_timeout": {"FAKE_TOY_FAULT": "hang"},
}


def probe(options: Mapping[str, Any]) -> dict[str, Any]:
    """The child's work: an answer and a version, or the fault its environment asks for."""
    fault = os.environ.get("FAKE_TOY_FAULT", "")
    if fault == "crash":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif fault == "hang":
        time.sleep(3600)
    return {"ok": True, "answer": int(os.environ.get("FAKE_TOY_ANSWER", "42")), "version": "0.1"}


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
    if not ok and run.error is None:  # a failed run is the probe layer's finding already
        f.block("probe_error", f"toy: answered {obs.answer if obs else None}, not 42",
                backend="toy")
    return BackendStatus("ok" if ok else "blocked", round(run.duration_s, 4),
                         {"toy": "0.1"}, {"answer": obs.answer if obs else None})


SPEC = BackendSpec(
    name="toy", layer="requirement", summary="A toy backend: answers 42.",
    probe_module="tests.toy.toy_backend", observation=ToyObservation,
    classify=classify_toy, interval_s=1.0, timeout_s=20.0, published=True,
)
