"""What the nvml probe child costs, this checkout against another, side by side in one run.

Run: .venv/bin/python benchmarks/nvml_probe.py [--base OTHER_CHECKOUT/.venv/bin/python]
     [--rounds 15] [--gpus 8]

Since issue 26 the nvml probe also reads each GPU's PCIe link, NVLink link states, fabric
state, pending page retirement and graphics processes. This prints the median (and min) wall
time of one ``python -m gpudiag.probes nvml`` child over the fake driver with 8 GPUs, on a PCIe
node (no NVLink: one NOT_SUPPORTED call per GPU) and on an NVLink node (18 links per GPU: 18
calls each), interleaved round by round; with ``--base`` (the interpreter of a checkout from
before the change, e.g. a worktree at the commit before) the same for that checkout and the
ratio. The child's wall time is what the daemon pays every ``backends.nvml.interval_s``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.conftest import clean_env  # noqa: E402
from tests.fakes.build import build_fakes  # noqa: E402

NODES: dict[str, dict[str, str]] = {
    "pcie": {},
    "nvlink": {"FAKE_NVML_NVLINKS": ",".join(f"{i}:18" for i in range(16)),
               "FAKE_NVML_FABRIC": ",".join(f"{i}:3/0" for i in range(16))},
}


def one(python: str, env: dict[str, str]) -> float:
    # Run from the interpreter's own checkout (python is CHECKOUT/.venv/bin/python): `-m`
    # puts the working folder first on sys.path, so another folder would test other code.
    start = time.perf_counter()
    proc = subprocess.run([python, "-m", "gpudiag.probes", "nvml"], env=env,
                          capture_output=True, check=False, timeout=120,
                          cwd=Path(python).parents[2])
    took = time.perf_counter() - start
    if proc.returncode != 0 or not json.loads(proc.stdout).get("ok"):
        raise SystemExit(f"{python}: nvml probe exit {proc.returncode}: {proc.stderr[-500:]!r}")
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", help="python of a checkout from before the change")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--gpus", type=int, default=8)
    args = ap.parse_args()
    sides = {"this": sys.executable, **({"base": args.base} if args.base else {})}
    with tempfile.TemporaryDirectory() as tmp_text:
        fakes = build_fakes(Path(tmp_text) / "fakes")
        times: dict[tuple[str, str], list[float]] = {}
        for node, knobs in NODES.items():
            env = fakes.env(base=clean_env(), FAKE_NVML_DEVICE_COUNT=args.gpus, **knobs)
            for python in sides.values():
                one(python, env)  # warm the page cache
            for _ in range(args.rounds):
                for side, python in sides.items():
                    times.setdefault((node, side), []).append(one(python, env))
    print(f"{'node':7} {'side':5} {'median ms':>10} {'min ms':>8}   ({args.rounds} rounds, "
          f"{args.gpus} GPUs)")
    for (node, side), values in times.items():
        print(f"{node:7} {side:5} {statistics.median(values) * 1000:10.1f} "
              f"{min(values) * 1000:8.1f}")
    if args.base:
        for node in NODES:
            ratio = (statistics.median(times[(node, "this")])
                     / statistics.median(times[(node, "base")]))
            print(f"{node}: this / base = {ratio:.2f}")


if __name__ == "__main__":
    main()
