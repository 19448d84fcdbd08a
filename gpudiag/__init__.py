"""gpudiag: can this job's backend really initialize on this host's GPUs now, and if not, why?

Public API (stable): ``preflight``, ``parse_requirement``, ``Verdict``, ``Requirement``;
``qualify`` with ``QualifyOptions`` (docs/qualify.md).
Nothing happens at import: no NVML, CUDA, JAX or IREE is touched here.
"""

from __future__ import annotations

from gpudiag.core.version import __version__

# typing.TYPE_CHECKING without importing typing, which every gpudiag start would pay (about
# 2 ms: docs/benchmarks.md, "CLI start"); mypy treats any name TYPE_CHECKING as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from gpudiag.core.requirement import parse_requirement as parse_requirement
    from gpudiag.core.verdict import Requirement as Requirement
    from gpudiag.core.verdict import Verdict as Verdict
    from gpudiag.engine.api import node_health as node_health
    from gpudiag.engine.api import preflight as preflight
    from gpudiag.engine.qualify import QualifyOptions as QualifyOptions
    from gpudiag.engine.qualify import qualify as qualify
    from gpudiag.runner.admission import Admission as Admission
    from gpudiag.runner.admission import AdmissionError as AdmissionError
    from gpudiag.runner.admission import admit as admit
    from gpudiag.runner.admission import child_environment as child_environment

_LAZY = {
    "preflight": ("gpudiag.engine.api", "preflight"),
    "node_health": ("gpudiag.engine.api", "node_health"),
    "parse_requirement": ("gpudiag.core.requirement", "parse_requirement"),
    "Verdict": ("gpudiag.core.verdict", "Verdict"),
    "Requirement": ("gpudiag.core.verdict", "Requirement"),
    "admit": ("gpudiag.runner.admission", "admit"),
    "child_environment": ("gpudiag.runner.admission", "child_environment"),
    "Admission": ("gpudiag.runner.admission", "Admission"),
    "AdmissionError": ("gpudiag.runner.admission", "AdmissionError"),
    "qualify": ("gpudiag.engine.qualify", "qualify"),
    "QualifyOptions": ("gpudiag.engine.qualify", "QualifyOptions"),
}


def __getattr__(name: str) -> Any:
    # Lazy so that `import gpudiag` stays cheap (probe children import it too).
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'gpudiag' has no attribute {name!r}")


__all__ = ["Admission", "AdmissionError", "QualifyOptions", "Requirement", "Verdict",
           "__version__", "admit", "child_environment", "node_health", "parse_requirement",
           "preflight", "qualify"]
