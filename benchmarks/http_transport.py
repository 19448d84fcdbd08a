"""The HTTP transport alone: gpudiag's HttpServer with a fixed 26.6 KB answer vs a minimal server.

No daemon, no verdict: the app returns the same bytes every time, so what differs between
the sides is accepting, parsing (h11 since round 3), dispatching to a worker and sending.
``this`` hands every request to a worker; ``inline`` gives the app an ``answer_now`` (as the
daemon's app has for an answer at hand), so the selector thread answers. Each side runs in
its own process; ``--base NAME=DIR`` (repeatable) adds the HttpServer of another source tree
(``git archive COMMIT | tar -x -C DIR``). Interleaved rounds of one sequential client
(latency per request) and of 16 closed-loop clients (requests/s):

    .venv/bin/python benchmarks/http_transport.py [--rounds 4] [--base NAME=DIR]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.daemon import FLOOR_SERVER, http_get, load, pct  # noqa: E402

BODY_BYTES = 27123  # the 8-GPU /v1/preflight answer
SERVER = """
import sys
sys.path.insert(0, sys.argv[1])
sys.setswitchinterval(0.0005)  # as `gpudiag serve` sets it
from gpudiag.daemon.httpserver import HttpServer
body = b"x" * int(sys.argv[2])
class App:
    def __call__(self, environ, start_response):
        start_response("200 OK", [("Content-Type", "application/json"),
                                  ("Content-Length", str(len(body)))])
        return [body]
if sys.argv[3] == "inline":
    App.answer_now = App.__call__
server = HttpServer(App(), "127.0.0.1", 0)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--sequential", type=int, default=300, help="requests per side per round")
    ap.add_argument("--seconds", type=float, default=4.0, help="closed loop, per side per round")
    ap.add_argument("--base", action="append", default=[], metavar="NAME=DIR")
    args = ap.parse_args()
    trees = [("this", ROOT, "pooled"), ("inline", ROOT, "inline")] + [
        (n, Path(d).resolve(), "pooled") for n, _, d in (b.partition("=") for b in args.base)]
    procs: list[subprocess.Popen[str]] = []
    ports: dict[str, int] = {}
    try:
        for _, tree, mode in trees:
            procs.append(subprocess.Popen([sys.executable, "-c", SERVER, str(tree),
                                           str(BODY_BYTES), mode],
                                          stdout=subprocess.PIPE, text=True))
        procs.append(subprocess.Popen([sys.executable, "-c", FLOOR_SERVER, str(BODY_BYTES)],
                                      stdout=subprocess.PIPE, text=True))
        for name, proc in zip([n for n, _, _ in trees] + ["minimal"], procs, strict=True):
            assert proc.stdout is not None
            ports[name] = int(proc.stdout.readline())
        latency: dict[str, list[float]] = {n: [] for n in ports}
        rates: dict[str, list[float]] = {n: [] for n in ports}
        names = list(ports)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                path = "/" if name == "minimal" else "/v1/preflight"
                latency[name] += [http_get("127.0.0.1", ports[name], path)[0]
                                  for _ in range(args.sequential)]
                done, _, _ = load("127.0.0.1", ports[name], path, 16, args.seconds, None)
                rates[name].append(len(done) / args.seconds)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
    print(f"fixed {BODY_BYTES} byte answer, {args.rounds} interleaved rounds")
    for name in names:
        lat, rate = latency[name], statistics.median(rates[name])
        print(f"  {name:8} one client: p50 {pct(lat, .5):.3f} ms p90 {pct(lat, .9):.3f} ms; "
              f"16 closed-loop clients: {rate:.0f} req/s (median of rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
