"""A verdict corpus for refactors: classify recorded probe runs the same way on two versions.

``record RUNS.json``: run host, nvml and cuda on the fake driver for 18 fault scenarios (and
jax/iree once each), keep what came back. ``classify RUNS.json``: print every verdict record
(8 requirements x job/gpus=1/node health x without/with XID 79) as JSON, keyed by scenario,
requirement, question, XIDs and probe plan. Run ``classify`` with PYTHONPATH at an old and a
new checkout and compare the two outputs (docs/testing.md).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

SCENARIOS: dict[str, dict[str, Any]] = {
    "healthy": {}, "nvml_not_loaded": {"FAKE_NVML_INIT_ERROR": 9},
    "nvml_mismatch": {"FAKE_NVML_INIT_ERROR": 18},
    "nvml_no_permission": {"FAKE_NVML_INIT_ERROR": 4},
    "nvml_gpu_lost": {"FAKE_NVML_INIT_ERROR": 15}, "cuda_no_device": {"FAKE_CUDA_INIT_ERROR": 100},
    "cuda_mismatch": {"FAKE_CUDA_INIT_ERROR": 803}, "cuda_too_old": {"FAKE_CUDA_INIT_ERROR": 35},
    "cuda_not_ready": {"FAKE_CUDA_INIT_ERROR": 802}, "cuda_busy": {"FAKE_CUDA_INIT_ERROR": 46},
    "cuda_oom": {"FAKE_CUDA_ALLOC_ERROR": 2}, "cuda_ctx": {"FAKE_CUDA_CTX_ERROR": 999},
    "visible_empty": {"CUDA_VISIBLE_DEVICES": ""},
    "visible_invalid": {"CUDA_VISIBLE_DEVICES": "9"},
    "ecc": {"FAKE_NVML_ECC_VOLATILE_UNCORRECTED": 3}, "two_gpus": {"FAKE_NVML_DEVICE_COUNT": 2},
    "exclusive": {"FAKE_NVML_COMPUTE_MODE": 3}, "count_mismatch": {"FAKE_CUDA_DEVICE_COUNT": 4},
}
BACKENDS = {"jax": ("jax", {"platform": "gpu"}), "jax:cpu": ("jax", {"platform": "cpu"}),
            "iree": ("iree", {"drivers": ["cuda"]}),
            "iree:local-task": ("iree", {"drivers": ["local-task"]})}
REQUIREMENTS = ("cuda", "nvml", "jax", "jax:cpu", "iree", "iree:local-task", "cuda,jax,iree",
                "nvml,cuda")
FIELDS = ("backend", "observation", "duration_s", "exit_code", "signal", "timed_out",
          "stderr_tail", "error", "argv", "skipped")


def record(target: Path) -> None:
    """Run the probes on the fakes and write what they returned."""
    # The fakes are built from the checkout's tests/ (run as a script, its folder is not on
    # the path).
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from gpudiag.core.environment import probe_environment
    from gpudiag.engine.isolation import run_probe
    from tests.fakes.build import build_fakes
    from tests.support.daemon import host_env

    root = Path(tempfile.mkdtemp(prefix="gpudiag-corpus-"))
    fakes = build_fakes(root / "fakes")
    out: dict[str, dict[str, Any]] = {}
    for name, knobs in SCENARIOS.items():
        env = probe_environment(host_env(fakes, root / name, gpus=8, **knobs))
        out[name] = {n: _dump(run_probe(n, env=env, timeout_s=30))
                     for n in ("host", "nvml", "cuda")}
    env = probe_environment(host_env(fakes, root / "backends", gpus=8))
    out["_backends"] = {key: _dump(run_probe(name, env=env, timeout_s=90, options=options))
                        for key, (name, options) in BACKENDS.items()}
    target.write_text(json.dumps(out, default=str))


def _dump(run: Any) -> dict[str, Any]:
    return {k: getattr(run, k) for k in FIELDS}


def classify_all(source: Path) -> dict[str, Any]:
    """Every verdict record of the corpus, keyed by what produced it."""
    from gpudiag.core import classify as classifier
    from gpudiag.core.classify import classify
    from gpudiag.core.findings import XidEvent
    from gpudiag.core.probe_run import ProbeRun
    from gpudiag.core.requirement import parse_requirement
    from gpudiag.engine.plan import probes_for

    runs = json.loads(source.read_text())
    backends = runs.pop("_backends")

    def run_of(d: dict[str, Any], backend: str) -> ProbeRun:
        return ProbeRun(**{**d, "backend": backend, "argv": tuple(d["argv"] or ())})

    def backend_key(name: str, options: dict[str, Any]) -> str:
        if name == "jax":
            return "jax:cpu" if options.get("platform") == "cpu" else "jax"
        return "iree" if options.get("drivers") == ["cuda"] else "iree:local-task"

    out: dict[str, Any] = {}
    questions = ((None, False), (1, False), (None, True))
    for scenario, recorded in runs.items():
        for text in REQUIREMENTS:
            for gpus, health in questions:
                req = parse_requirement(text, gpus=gpus, node_health=health)
                plan = probes_for(req)
                got = {name: run_of(recorded[name] if name in recorded
                                    else backends[backend_key(name, options or {})], name)
                       for name, options in plan}
                for xids in ((), (XidEvent(79, 0, None, 1.0e9),)):
                    # NodeFacts since round 6; a checkout before it takes xids= itself.
                    facts = getattr(classifier, "NodeFacts", None)
                    more: dict[str, Any] = ({"facts": facts(xids=xids)} if facts is not None
                                            else {"xids": xids})
                    verdict = classify(got, req, host="h", checked_at="2026-12-01T00:00:00Z",
                                       **more)
                    rec = verdict.record()
                    rec.pop("gpudiag_version", None)
                    out[f"{scenario}|{text}|gpus={gpus}|health={health}|xids={len(xids)}"
                        f"|plan={plan}"] = rec
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("record", "classify"):
        sys.exit("usage: verdict_corpus.py record|classify RUNS.json")
    if sys.argv[1] == "record":
        record(Path(sys.argv[2]))
    else:
        json.dump(classify_all(Path(sys.argv[2])), sys.stdout, sort_keys=True, default=str)
