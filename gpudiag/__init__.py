"""gpudiag: can this job's backend really initialize on this host's GPUs now, and if not, why?

Public API (stable): ``preflight``, ``parse_requirement``, ``Verdict``, ``Requirement``.
Nothing happens at import: no NVML, CUDA, JAX or IREE is touched here.
"""

from __future__ import annotations

__version__ = "0.1.0"

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpudiag.admission import Admission as Admission
    from gpudiag.admission import AdmissionError as AdmissionError
    from gpudiag.admission import admit as admit
    from gpudiag.admission import child_environment as child_environment
    from gpudiag.engine import preflight as preflight
    from gpudiag.requirement import parse_requirement as parse_requirement
    from gpudiag.verdict import Requirement as Requirement
    from gpudiag.verdict import Verdict as Verdict

_LAZY = {
    "preflight": ("gpudiag.engine", "preflight"),
    "parse_requirement": ("gpudiag.requirement", "parse_requirement"),
    "Verdict": ("gpudiag.verdict", "Verdict"),
    "Requirement": ("gpudiag.verdict", "Requirement"),
    "admit": ("gpudiag.admission", "admit"),
    "child_environment": ("gpudiag.admission", "child_environment"),
    "Admission": ("gpudiag.admission", "Admission"),
    "AdmissionError": ("gpudiag.admission", "AdmissionError"),
}


def __getattr__(name: str) -> Any:
    # Lazy so that `import gpudiag` stays cheap (probe children import it too).
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'gpudiag' has no attribute {name!r}")


__all__ = ["Admission", "AdmissionError", "Requirement", "Verdict", "__version__", "admit",
           "child_environment", "parse_requirement", "preflight"]
