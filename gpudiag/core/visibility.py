"""The two visibility variables, spelled in one place, and a child pinned to GPUs.

CUDA reads ``CUDA_VISIBLE_DEVICES``; the NVIDIA container runtime reads
``NVIDIA_VISIBLE_DEVICES``. A child gpudiag points at GPUs gets both, set to the same full
UUIDs (docs/runner.md, the exact child environment). No imports: the daemon-answered CLI call
(gpudiag.engine.wire) reads these names too.
"""

from __future__ import annotations

TYPE_CHECKING = False  # no imports at run time (the fast path)
if TYPE_CHECKING:
    from collections.abc import Sequence

CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
NVIDIA_VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
# CUDA's first: the order every record and query lists them in.
VISIBILITY_VARIABLES = (CUDA_VISIBLE_DEVICES, NVIDIA_VISIBLE_DEVICES)


def pinned_to(uuids: Sequence[str]) -> dict[str, str]:
    """Both visibility variables set to exactly these GPUs (full UUIDs, in order)."""
    listed = ",".join(uuids)
    return {CUDA_VISIBLE_DEVICES: listed, NVIDIA_VISIBLE_DEVICES: listed}
