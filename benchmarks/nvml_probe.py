"""What the nvml probe child costs, this checkout against another, side by side in one run.

Run: .venv/bin/python benchmarks/nvml_probe.py [--base OTHER_CHECKOUT/.venv/bin/python]
     [--rounds 15] [--gpus 8]

Since issue 26 the nvml probe also reads each GPU's PCIe link, NVLink link states, fabric
state, pending page retirement and graphics processes. This prints the median (and min) wall
time of one ``python -m gpudiag.probes nvml`` child over the fake driver with 8 GPUs, on a PCIe
node (no NVLink: one NOT_SUPPORTED call per GPU) and on an NVLink node (18 links per GPU: 18
calls each), interleaved round by round; with ``--base`` (the interpreter of a checkout from
before the change, e.g. a worktree at the commit before) the same for that checkout and the
ratio. The child's wall time is what the daemon pays every ``backends.nvml.interval_s``;
on a shared machine it is dominated by Python's start, so the probe's own work (``probe()``
called in one warm process, after nvmlInit's library load) is timed too, in the same rounds.
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

from tests.fakes.build import build_fakes  # noqa: E402
from tests.support.host import clean_env  # noqa: E402

NODES: dict[str, dict[str, str]] = {
    "pcie": {},
    "nvlink": {"FAKE_NVML_NVLINKS": ",".join(f"{i}:18" for i in range(16)),
               "FAKE_NVML_FABRIC": ",".join(f"{i}:3/0" for i in range(16))},
}


# One warm process: the probe function alone, each call initializing and shutting NVML down.
IN_PROCESS = """
import json, statistics, sys, time
from gpudiag.probes.nvml import probe
probe({})
took = []
for _ in range(int(sys.argv[1])):
    t = time.perf_counter()
    assert probe({})["ok"]
    took.append(time.perf_counter() - t)
print(json.dumps(took))
"""


def in_process(python: str, env: dict[str, str], calls: int) -> list[float]:
    proc = subprocess.run([python, "-c", IN_PROCESS, str(calls)], env=env, capture_output=True,
                          check=False, timeout=300, cwd=Path(python).parents[2])
    if proc.returncode != 0:
        raise SystemExit(f"{python}: in-process probe exit {proc.returncode}: "
                         f"{proc.stderr[-500:]!r}")
    took: list[float] = json.loads(proc.stdout)
    return took


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
        calls: dict[tuple[str, str], list[float]] = {}
        for node, knobs in NODES.items():
            env = fakes.env(base=clean_env(), FAKE_NVML_DEVICE_COUNT=args.gpus, **knobs)
            for python in sides.values():
                one(python, env)  # warm the page cache
            for _ in range(args.rounds):
                for side, python in sides.items():
                    times.setdefault((node, side), []).append(one(python, env))
            for side, python in sides.items():
                calls[(node, side)] = in_process(python, env, args.rounds)
    print(f"{'node':7} {'side':5} {'child median ms':>16} {'min':>7} "
          f"{'probe() median ms':>18} {'min':>7}   ({args.rounds} each, {args.gpus} GPUs)")
    for key, values in times.items():
        node, side = key
        print(f"{node:7} {side:5} {statistics.median(values) * 1000:16.1f} "
              f"{min(values) * 1000:7.1f} {statistics.median(calls[key]) * 1000:18.2f} "
              f"{min(calls[key]) * 1000:7.2f}")
    if args.base:
        for node in NODES:
            child = (statistics.median(times[(node, "this")])
                     / statistics.median(times[(node, "base")]))
            own = (statistics.median(calls[(node, "this")])
                   / statistics.median(calls[(node, "base")]))
            print(f"{node}: this / base = {child:.2f} (child), {own:.2f} (probe())")


if __name__ == "__main__":
    main()
