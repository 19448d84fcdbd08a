"""Fault to drain on the fakes with a real slurmctld + slurmd (issue 40).

Runs tests/test_remediation_slurm.py's latency test with ``--rounds`` XID 79s on one real
`gpudiag serve` (each drained, then cleared and resumed) and prints the median and p99 of:
the fault written to the fakes' state file to the drain seen by `scontrol show node`, and
the daemon's own figure (the XID's arrival to its `scontrol update` done). Needs root and
slurm-wlm + munge, as the test does:

    .venv/bin/python benchmarks/remediation.py [--rounds 40]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST = "tests/test_remediation_slurm.py::test_every_fault_to_drain_is_within_5_s"


def quantile(values: list[float], q: float) -> float:
    """The nearest-rank quantile (p99 of 40 samples is the largest)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rounds.json"
        env = {**os.environ, "GPUDIAG_BENCH_ROUNDS": str(args.rounds),
               "GPUDIAG_BENCH_OUT": str(out)}
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               TEST], cwd=ROOT, env=env, check=False)
        if proc.returncode != 0 or not out.exists():
            print("the latency test failed or was skipped", file=sys.stderr)
            return 1
        rounds = json.loads(out.read_text())
    print(f"{len(rounds)} rounds of XID 79 -> scontrol drain (fakes, real slurmctld):")
    for key, what in (("seen_s", "fault written -> drain seen by scontrol show node"),
                      ("daemon_s", "XID arrival -> the daemon's scontrol update done")):
        values = [r[key] for r in rounds]
        print(f"  {what}: median {statistics.median(values) * 1000:.0f} ms, "
              f"p99 {quantile(values, 0.99) * 1000:.0f} ms, max {max(values) * 1000:.0f} ms")
    print("  NVSentinel's published fault to cordon: p50 16.8 s, p90 28 s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
