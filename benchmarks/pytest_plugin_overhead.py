"""Overhead of the gpudiag pytest plugin in a session with no GPU tests (target: none to measure).

Runs the same project of plain (unmarked) tests with the plugin loaded (its ``pytest11`` entry
point, as installed) and without it (``-p no:gpudiag``), alternately in fresh processes, and
prints the median wall times side by side with their ratio; then the plugin module's own
import time in a fresh interpreter:
    .venv/bin/python benchmarks/pytest_plugin_overhead.py [--runs 15] [--tests 200] [--modules 20]

The tests are spread over ``--modules`` files: the plugin reads each test module's source
before it is imported (a substring test), so the number of files is what it could cost.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.host import clean_env

PLAIN = """
import pytest

@pytest.mark.parametrize("i", range({n}))
def test_plain(i):
    assert i >= 0
"""

IMPORT_TIME = ("import time, pytest; t = time.perf_counter(); import gpudiag.pytest_plugin; "
               "print(time.perf_counter() - t)")


def wall_s(argv: list[str], cwd: Path, env: dict[str, str]) -> float:
    """Wall time of one fresh process (it must pass)."""
    started = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{argv} failed with {proc.returncode}: {proc.stdout[-2000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--tests", type=int, default=200)
    parser.add_argument("--modules", type=int, default=20)
    args = parser.parse_args()
    env = clean_env()
    with tempfile.TemporaryDirectory() as tmp:
        project = Path(tmp)
        (project / "pytest.ini").write_text("[pytest]\n")
        for m in range(args.modules):
            (project / f"test_plain_{m}.py").write_text(PLAIN.format(n=args.tests // args.modules))
        base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        with_plugin, without = [], []
        for i in range(args.runs + 1):  # the first round warms the page cache
            a = wall_s(base, project, env)
            b = wall_s([*base, "-p", "no:gpudiag"], project, env)
            if i:
                with_plugin.append(a)
                without.append(b)
        imports = [float(subprocess.run([sys.executable, "-c", IMPORT_TIME], env=env,
                                        capture_output=True, text=True, check=True).stdout)
                   for _ in range(args.runs)]
    t_with, t_without = statistics.median(with_plugin), statistics.median(without)
    print(f"tests={args.tests} (none marked) in {args.modules} modules runs={args.runs} "
          f"cpus={os.cpu_count()} "
          f"load={os.getloadavg()[0]:.2f}")
    print(f"{'with the plugin':>24} {'-p no:gpudiag':>16} {'ratio':>8}")
    print(f"{t_with * 1000:>21.0f} ms {t_without * 1000:>13.0f} ms {t_with / t_without:>8.3f}")
    print(f"plugin module import (median): {statistics.median(imports) * 1000:.2f} ms")


if __name__ == "__main__":
    main()
