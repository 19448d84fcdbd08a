"""Run the sdc tier's probe N times in one process on fake GPU 0 and judge every run.

    python -m tests.support.sdc_runs N      (in an environment with the fake driver)

Prints one JSON line: {"runs", "codes": {code: count}, "hashes": [distinct golden hashes],
"statuses": {check: {status: count}}, "seconds_per_run"}. Every run after the first is
judged against the first run's golden as the stored one, as the engine would; the clean-runs
test expects no blocker in any of them.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter

from gpudiag.core.qualify_golden import resolve_goldens
from gpudiag.core.qualify_score import parse_result, score
from gpudiag.probes.qualify import probe

TARGET = {"uuid": "GPU-f00d0000-0000-4000-8000-000000000000", "index": 0,
          "name": "NVIDIA H200", "memory_total_bytes": 24 * 1024 ** 2}


def main(runs: int) -> None:
    codes: Counter[str] = Counter()
    statuses: dict[str, Counter[str]] = {}
    hashes: set[str] = set()
    stored: dict[str, str] = {}
    started = time.monotonic()
    for _ in range(runs):
        (raw,) = probe({"tier": "sdc", "platform": "cuda", "targets": [TARGET],
                        "deadline_s": 10.0})["results"]
        result = parse_result(raw)
        golden = next(c for c in result.checks if c.check == "golden")
        if golden.golden_key and golden.output_hash:
            hashes.add(golden.output_hash)
            stored.setdefault(golden.golden_key, golden.output_hash)
        (judged,), _ = resolve_goldens([result], [], stored)
        q = score(judged)
        codes[q.code] += 1
        for c in judged.checks:
            statuses.setdefault(c.check, Counter())[c.status] += 1
    print(json.dumps({"runs": runs, "codes": dict(codes), "hashes": sorted(hashes),
                      "statuses": {k: dict(v) for k, v in statuses.items()},
                      "seconds_per_run": round((time.monotonic() - started) / runs, 4)}))


if __name__ == "__main__":
    main(int(sys.argv[1]))
