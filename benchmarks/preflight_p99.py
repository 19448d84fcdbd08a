"""/v1/preflight p99 under paced load against a minimal threaded server, interleaved rounds.

Issue 31's figure: 32 clients, each paced at 10 requests/s, against a real `gpudiag serve` on
8 fake GPUs, and the same load against a minimal threaded Python server that answers a fixed
body of the same size (the floor on this machine). On a shared 2-core machine one run of each
side drifts with whatever else runs, so the sides take turns for ``--rounds`` rounds (order
rotating each round) and the ratio is of the pooled p99s. ``--base NAME=DIR`` (repeatable)
adds a daemon run from another source tree (``git archive COMMIT | tar -x -C DIR``), for
before/after in one run:

    .venv/bin/python benchmarks/preflight_p99.py [--rounds 6] [--seconds 10] [--base NAME=DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.daemon import FLOOR_SERVER, http_body, http_get, load, pct  # noqa: E402
from tests.fakes.build import build_fakes  # noqa: E402
from tests.support.host import clean_env, make_host_dirs  # noqa: E402

PATH = "/v1/preflight?require=cuda"


def start_daemon(env: dict[str, str], state: Path, source: Path | None
                 ) -> tuple[subprocess.Popen[str], int]:
    """A `gpudiag serve` on 127.0.0.1:0 (from ``source`` when given); (process, port)."""
    env = dict(env)
    if source is not None:
        env["PYTHONPATH"] = str(source)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpudiag", "serve", "--listen", "127.0.0.1:0",
         "--state-dir", str(state), "--log-format", "json"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        cwd=str(source or ROOT))
    assert proc.stderr is not None
    url = ""
    for line in proc.stderr:
        url = json.loads(line).get("url", "")
        if url:
            break
    stderr = proc.stderr
    threading.Thread(target=lambda: [None for _ in stderr], daemon=True).start()
    port = int(url.rsplit(":", 1)[1])
    while http_get("127.0.0.1", port, "/readyz")[2] != 200:
        time.sleep(0.1)
    return proc, port


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=10.0, help="per side per round")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--rate", type=float, default=10.0, help="requests/s per client")
    ap.add_argument("--base", action="append", default=[], metavar="NAME=DIR",
                    help="another source tree to run as a daemon named NAME (repeatable)")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="gpudiag-p99-"))
    fakes = build_fakes(tmp / "fakes")
    dev, proc_dir = make_host_dirs(tmp / "host", gpus=8)
    env = clean_env()
    env.update(GPUDIAG_DEVICE_DIR=str(dev), GPUDIAG_DRIVER_PROC_DIR=str(proc_dir))
    env = fakes.env(base=env, FAKE_NVML_DEVICE_COUNT=8)
    procs: list[subprocess.Popen[str]] = []
    try:
        sides: dict[str, int] = {}
        daemon, sides["daemon"] = start_daemon(env, tmp / "state", None)
        procs.append(daemon)
        for base in args.base:
            name, _, source = base.partition("=")
            other, sides[name] = start_daemon(env, tmp / f"state-{name}", Path(source).resolve())
            procs.append(other)
        size = len(http_body("127.0.0.1", sides["daemon"], PATH))
        floor = subprocess.Popen([sys.executable, "-c", FLOOR_SERVER, str(size)],
                                 stdout=subprocess.PIPE, text=True)
        procs.append(floor)
        assert floor.stdout is not None
        sides["minimal"] = int(floor.stdout.readline())
        names = list(sides)
        client: dict[str, list[float]] = {n: [] for n in names}
        server: dict[str, list[float]] = {n: [] for n in names}
        errors = dict.fromkeys(names, 0)
        round_p99: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            line = []
            for name in order:
                path = "/" if name == "minimal" else PATH
                c, s, e = load("127.0.0.1", sides[name], path, args.clients, args.seconds,
                               args.rate)
                client[name] += c
                server[name] += s
                errors[name] += e
                round_p99[name].append(pct(c, .99))
                line.append(f"{name} p99 {pct(c, .99):.2f} ms")
            print(f"round {r + 1}: " + ", ".join(line), flush=True)
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
    floor_p99 = pct(client["minimal"], .99)
    # Per round, against the minimal server's p99 of the same round: a burst of load from
    # elsewhere on the machine moves one round, not the median of the rounds.
    floors = round_p99["minimal"]
    per_round = {n: statistics.median(a / b for a, b in zip(round_p99[n], floors, strict=True))
                 for n in names}
    print(f"{args.clients} clients x {args.rate:g}/s, {args.rounds} rounds of "
          f"{args.seconds:g} s per side, body {size} bytes; load average "
          f"{os.getloadavg()[0]:.1f}")
    for name in names:
        c = client[name]
        timing = ""
        if name != "minimal":
            s = server[name]
            timing = f"; app's own p50 {pct(s, .5):.2f} ms p99 {pct(s, .99):.2f} ms"
        print(f"  {name:8} {len(c)} requests, {errors[name]} errors; client p50 "
              f"{pct(c, .5):.2f} ms p99 {pct(c, .99):.2f} ms -> p99/minimal "
              f"{pct(c, .99) / floor_p99:.2f}x (median of rounds {per_round[name]:.2f}x)"
              f"{timing}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
