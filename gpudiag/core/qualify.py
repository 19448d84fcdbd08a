"""GPU qualification, the pure part: measurements, the reference table, tiers and scoring.

A GPU that initializes can still run at a third of its peers' speed or compute wrong answers.
Qualification measures each FREE GPU (the probe child gpudiag.probes.qualify does the work)
and scores every measurement against three references, each shown in the result:

1. ``table``: the data-sheet peak of the GPU's model (``REFERENCE_TABLE``, sources cited)
   times the share of that peak a healthy GPU reaches by the same route;
2. ``peers``: the median of the same node's GPUs of the same model and tier;
3. ``history``: the median of this GPU's own last results of the same tier.

A wrong answer (the known-answer matmul or the memory pattern) is ``gpu_compute_mismatch``
whatever the speed; a measurement below a threshold is ``gpu_underperforming``; a run stopped
because another process appeared on the GPU is ``qualification_aborted`` and changes nothing.
No I/O here: the engine runs the child and keeps the history, this module decides.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import field
from typing import Any

from gpudiag.core.records import dataclass

SCHEMA = "gpudiag.qualification/1"

# What a qualification measures, in base units (the metric label `measure`).
MEASURES: tuple[str, ...] = (
    "memory_bandwidth",           # bytes/s, device to device copy, read + written bytes
    "host_to_device_bandwidth",   # bytes/s, pinned host memory
    "device_to_host_bandwidth",   # bytes/s, pinned host memory
    "matmul_bf16",                # FLOP/s, dense n x n x n, 2 n^3 FLOP per product
    "matmul_fp32",                # FLOP/s, dense, full fp32 precision (no TF32)
    "matmul_fp32_iree",           # FLOP/s, the same through IREE (full tier, where it runs)
)
UNITS: Mapping[str, str] = {m: ("flops_per_second" if m.startswith("matmul")
                                else "bytes_per_second") for m in MEASURES}

# Outcome codes (core.catalog QUALIFICATION holds their summaries and remediations).
PASSED = "none"
UNDERPERFORMING = "gpu_underperforming"
COMPUTE_MISMATCH = "gpu_compute_mismatch"
ABORTED = "qualification_aborted"
DIAGNOSTIC_SIDE_EFFECT = "diagnostic_side_effect"  # the run changed its GPU (a warning)

GIB = 1024 ** 3


@dataclass(frozen=True)
class TierSpec:
    """What one tier measures, how big and how long it may take."""

    name: str
    deadline_s: float          # the child's deadline per GPU
    copy_bytes: int            # one buffer of the bandwidth copies (two live for DtoD)
    copy_repeats: int          # timed copies per bandwidth; the best counts
    matmul_n: int              # n of the n x n matmul on a GPU
    cpu_matmul_n: int          # n on JAX's CPU devices (no GPU here)
    matmul_repeats: int
    measures: tuple[str, ...]


# Budgets (docs/qualify.md): quick at most 3 s per GPU on an H200 (a Slurm Prolog on an idle
# GPU), full at most 60 s (Slurm's HealthCheckProgram limit, one GPU at a time). The deadline
# is the child's hard stop; sizes are chosen so that a healthy GPU ends well inside it.
TIERS: Mapping[str, TierSpec] = {
    "quick": TierSpec("quick", 10.0, 64 * 1024 ** 2, 5, 4096, 256, 5,
                      ("memory_bandwidth", "host_to_device_bandwidth",
                       "device_to_host_bandwidth", "matmul_bf16")),
    "full": TierSpec("full", 60.0, 512 * 1024 ** 2, 10, 8192, 512, 10, MEASURES),
    # The silent-data-corruption screen (core.sdc): checks, no throughput figures; its
    # sizes and its 10 s budget per GPU are core.sdc.SDC's.
    "sdc": TierSpec("sdc", 10.0, 0, 0, 0, 0, 0, ()),
}


def memory_budget_bytes(total_bytes: int | None) -> int:
    """The most GPU memory a qualification may use: 10% of the GPU or 4 GiB, the smaller."""
    if total_bytes is None or total_bytes <= 0:
        return 0
    return min(total_bytes // 10, 4 * GIB)


def sized_copy_bytes(tier: TierSpec, total_bytes: int | None) -> int:
    """The tier's copy buffer, shrunk so that both DtoD buffers fit the memory budget."""
    budget = memory_budget_bytes(total_bytes)
    return max(0, min(tier.copy_bytes, budget // 2) // 4096 * 4096)


# -- the reference table --------------------------------------------------------------------

@dataclass(frozen=True)
class ReferenceModel:
    """Data-sheet peaks of one GPU model, base units, and where they come from."""

    model: str
    names: tuple[str, ...]              # lower-case substrings of NVML's name, any matches
    peaks: Mapping[str, float]          # measure -> data-sheet peak
    source: str
    healthy_share: Mapping[str, float] = field(default_factory=dict)  # overrides the default


# The share of a data-sheet peak a healthy GPU reaches by our routes (cuMemcpy, one XLA dot):
# STREAM-like copies reach 80-90% of HBM peak, pinned PCIe copies about 80% of the link,
# a single large XLA matmul 60-75% of the tensor peak. Estimates pending the H200 calibration
# run (docs/qualify.md); a site can ship its own table with `--reference FILE`.
DEFAULT_HEALTHY_SHARE: Mapping[str, float] = {
    "memory_bandwidth": 0.80, "host_to_device_bandwidth": 0.75,
    "device_to_host_bandwidth": 0.75, "matmul_bf16": 0.60, "matmul_fp32": 0.70,
    # IREE's generic codegen, not a vendor library: a low floor until calibrated.
    "matmul_fp32_iree": 0.30,
}

_TB, _GB, _TF = 1e12, 1e9, 1e12
# PCIe per direction: Gen5 x16 64 GB/s, Gen4 x16 32 GB/s (the data sheets give both directions).
_GEN5, _GEN4 = 64 * _GB, 32 * _GB


def _peaks(hbm: float, bf16: float, fp32: float, pcie: float) -> dict[str, float]:
    return {"memory_bandwidth": hbm, "host_to_device_bandwidth": pcie,
            "device_to_host_bandwidth": pcie, "matmul_bf16": bf16, "matmul_fp32": fp32,
            "matmul_fp32_iree": fp32}


# Most specific first: "h100 nvl" before "h100". Dense (not sparse) tensor figures.
REFERENCE_TABLE: tuple[ReferenceModel, ...] = (
    ReferenceModel("H200", ("h200",), _peaks(4.8 * _TB, 989 * _TF, 67 * _TF, _GEN5),
                   "NVIDIA H200 Tensor Core GPU data sheet (SXM): HBM3e 4.8 TB/s, BF16 "
                   "1,979 TFLOPS with sparsity (989 dense), FP32 67 TFLOPS, PCIe Gen5 128 GB/s"),
    ReferenceModel("H100 NVL", ("h100 nvl",), _peaks(3.9 * _TB, 835 * _TF, 60 * _TF, _GEN5),
                   "NVIDIA H100 Tensor Core GPU data sheet (H100 NVL): 3.9 TB/s, BF16 1,671 "
                   "TFLOPS sparse (835 dense), FP32 60 TFLOPS, PCIe Gen5 128 GB/s"),
    ReferenceModel("H100 PCIe", ("h100 pcie",), _peaks(2.0 * _TB, 756 * _TF, 51 * _TF, _GEN5),
                   "NVIDIA H100 Tensor Core GPU data sheet (H100 PCIe): 2 TB/s, BF16 1,513 "
                   "TFLOPS sparse (756 dense), FP32 51 TFLOPS, PCIe Gen5 128 GB/s"),
    ReferenceModel("H100 SXM", ("h100",), _peaks(3.35 * _TB, 989 * _TF, 67 * _TF, _GEN5),
                   "NVIDIA H100 Tensor Core GPU data sheet (H100 SXM): 3.35 TB/s, BF16 1,979 "
                   "TFLOPS sparse (989 dense), FP32 67 TFLOPS, PCIe Gen5 128 GB/s"),
    ReferenceModel("A100 80GB PCIe", ("a100 80gb pcie",),
                   _peaks(1.935 * _TB, 312 * _TF, 19.5 * _TF, _GEN4),
                   "NVIDIA A100 Tensor Core GPU data sheet (80GB PCIe): 1,935 GB/s, BF16 312 "
                   "TFLOPS dense, FP32 19.5 TFLOPS, PCIe Gen4 64 GB/s"),
    ReferenceModel("A100 SXM 80GB", ("a100-sxm4-80gb", "a100 sxm4 80gb"),
                   _peaks(2.039 * _TB, 312 * _TF, 19.5 * _TF, _GEN4),
                   "NVIDIA A100 Tensor Core GPU data sheet (80GB SXM): 2,039 GB/s, BF16 312 "
                   "TFLOPS dense, FP32 19.5 TFLOPS, PCIe Gen4 64 GB/s"),
    ReferenceModel("A100 40GB", ("a100",), _peaks(1.555 * _TB, 312 * _TF, 19.5 * _TF, _GEN4),
                   "NVIDIA A100 Tensor Core GPU data sheet (40GB PCIe/SXM): 1,555 GB/s, BF16 "
                   "312 TFLOPS dense, FP32 19.5 TFLOPS, PCIe Gen4 64 GB/s"),
    ReferenceModel("L40S", ("l40s",), _peaks(864 * _GB, 362 * _TF, 91.6 * _TF, _GEN4),
                   "NVIDIA L40S data sheet: GDDR6 864 GB/s, BF16 733 TFLOPS sparse (362 "
                   "dense), FP32 91.6 TFLOPS, PCIe Gen4 x16 64 GB/s"),
    ReferenceModel("L4", ("nvidia l4",), _peaks(300 * _GB, 121 * _TF, 30.3 * _TF, _GEN4),
                   "NVIDIA L4 Tensor Core GPU data sheet: 300 GB/s, BF16 242 TFLOPS sparse "
                   "(121 dense), FP32 30.3 TFLOPS, PCIe Gen4 x16 64 GB/s"),
)


def reference_for(name: str | None, table: Sequence[ReferenceModel] = REFERENCE_TABLE
                  ) -> ReferenceModel | None:
    """The table row of a GPU named ``name`` by NVML (first match), None when unknown."""
    low = (name or "").lower()
    return next((m for m in table if any(n in low for n in m.names)), None)


def expected(model: ReferenceModel, measure: str) -> float | None:
    """What a healthy GPU of ``model`` reaches on ``measure``: peak times healthy share."""
    peak = model.peaks.get(measure)
    if peak is None:
        return None
    share = model.healthy_share.get(measure, DEFAULT_HEALTHY_SHARE.get(measure, 1.0))
    return peak * share


class ReferenceError(ValueError):
    """A reference table file that cannot be used (the message names the fix)."""


def parse_reference_table(data: Any) -> tuple[ReferenceModel, ...]:
    """A table from JSON ``{"models": [{"model", "names", "peaks", "source",
    "healthy_share"?}]}``: a site's own calibrated figures, or the test table on JAX CPU."""
    models = data.get("models") if isinstance(data, Mapping) else None
    if not isinstance(models, list) or not models:
        raise ReferenceError('a reference table is {"models": [...]} with at least one model')
    out = []
    for i, row in enumerate(models):
        where = f"models[{i}]"
        if not isinstance(row, Mapping):
            raise ReferenceError(f"{where} is not an object")
        names, source = row.get("names"), row.get("source")
        if not (isinstance(names, list) and names and all(isinstance(n, str) for n in names)):
            raise ReferenceError(f"{where}.names must be a list of name substrings")
        if not isinstance(source, str) or not source.strip():
            raise ReferenceError(f"{where}.source must say where the figures come from")
        peaks = _measure_map(row.get("peaks"), f"{where}.peaks")
        share = _measure_map(row.get("healthy_share", {}), f"{where}.healthy_share")
        out.append(ReferenceModel(str(row.get("model") or names[0]),
                                  tuple(n.lower() for n in names), peaks, source, share))
    return tuple(out)


def _measure_map(value: Any, where: str) -> dict[str, float]:
    if not isinstance(value, Mapping):
        raise ReferenceError(f"{where} must be an object of measure: number")
    out: dict[str, float] = {}
    for key, v in value.items():
        if key not in MEASURES:
            raise ReferenceError(f"{where}: unknown measure {key!r}; known: "
                                 f"{', '.join(MEASURES)}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ReferenceError(f"{where}.{key} must be a positive number")
        out[key] = float(v)
    return out


# -- calibration: warn and fail lines per model (docs/qualify.md "Calibration") ---------------

@dataclass(frozen=True)
class Band:
    """Warn and fail lines of one measure on one model: relative to the node's median of
    its peers (the one slow GPU) and absolute (a whole node misconfigured). An absolute line
    applies only to a measurement at least ``min_bytes`` in size (per copy; for a matmul its
    operands), the size its anchor was measured at: smaller copies pay fixed overheads."""

    warn_peer: float | None
    fail_peer: float | None
    warn_abs: float | None
    fail_abs: float | None
    min_bytes: int
    basis: str


# H200 SXM (700 W, full clocks), proposed lines from shared anchors: HBM 4.8 TB/s data sheet,
# a device copy reaching about 87% counting read and written bytes; BF16 989 TFLOPS dense,
# a best-shape GEMM about 80%; PCIe Gen5 x16 about 63 GB/s per direction, pinned copy-engine
# copies about 55 GB/s. To be confirmed on the first real H200 run (scripts/gpu-validate.sh).
CALIBRATION: Mapping[str, Mapping[str, Band]] = {
    "H200": {
        "memory_bandwidth": Band(0.90, 0.80, 4.0e12, 3.6e12, 512 * 1024 ** 2,
                                 "H200 HBM3e 4.8 TB/s; device copy about 87% of peak "
                                 "(2x bytes); warn < 4.0 TB/s (83%), fail < 3.6 TB/s (75%)"),
        "matmul_bf16": Band(0.92, 0.85, None, 0.5 * 989e12, 8192 * 8192 * 8,
                            "H200 BF16 989 TFLOPS dense; best-shape GEMM about 80%; fail < "
                            "0.50 x 989 TFLOPS at n >= 8192"),
        "host_to_device_bandwidth": Band(None, None, 50e9, 40e9, 256 * 1024 ** 2,
                                         "PCIe Gen5 x16 about 63 GB/s per direction; pinned CE "
                                         "copies about 55 GB/s; warn < 50, fail < 40 GB/s"),
        "device_to_host_bandwidth": Band(None, None, 50e9, 40e9, 256 * 1024 ** 2,
                                         "PCIe Gen5 x16 about 63 GB/s per direction; pinned CE "
                                         "copies about 55 GB/s; warn < 50, fail < 40 GB/s"),
    },
}


def band_of(model: str | None, measure: str, value: float | None, peer_median: float | None,
            size_bytes: int | None) -> tuple[str | None, str]:
    """(ok | warn | fail, why) of one measurement against its model's calibration row;
    (None, why) when the model has no row for the measure or nothing was measured."""
    band = CALIBRATION.get(model or "", {}).get(measure)
    if band is None or value is None:
        return None, "no calibration row"
    hits: list[tuple[str, str]] = []
    if peer_median is not None and peer_median > 0:
        ratio = value / peer_median
        for level, line in (("fail", band.fail_peer), ("warn", band.warn_peer)):
            if line is not None and ratio < line:
                hits.append((level, f"{ratio:.2f} of the node's median (< {line})"))
    if (size_bytes or 0) >= band.min_bytes:
        for level, line in (("fail", band.fail_abs), ("warn", band.warn_abs)):
            if line is not None and value < line:
                hits.append((level, f"{value:.4g} below the absolute line {line:.4g}"))
    if not hits:
        return "ok", band.basis
    level = "fail" if any(h[0] == "fail" for h in hits) else "warn"
    return level, "; ".join(h[1] for h in hits if h[0] == level) + f" ({band.basis})"
