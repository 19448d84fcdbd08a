"""Where one /v1/preflight request's microseconds go, stage by stage, in one process.

The daemon's app on a scheduler replaying real probe runs (8 fake GPUs), its HttpServer on
127.0.0.1 port 0, and each stage of a request's path timed alone (median and p99 of
``--runs``): h11's parse, the app's answer (query parsing, requirement, cached encoded answer),
the WSGI environ and response bytes around it, the hand-off to a worker thread and back (what
an answer not at hand still pays), and whole requests over a socket from a client process of
its own against the daemon's server and the minimal threaded one (sequential, so the figure is
the path's latency, not queueing):

    .venv/bin/python benchmarks/preflight_path.py [--runs 3000]
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.daemon import FLOOR_SERVER  # noqa: E402
from gpudiag.daemon.app import DaemonApp, serve  # noqa: E402
from gpudiag.daemon.httpparse import RequestReader  # noqa: E402
from gpudiag.daemon.httpserver import _Conn, _Pool  # noqa: E402
from gpudiag.daemon.scheduler import Scheduler  # noqa: E402
from tests.fakes.build import build_fakes  # noqa: E402
from tests.support.daemon import Replay, host_env, quick_config, real_runs, wait_for  # noqa: E402

PATH = "/v1/preflight?require=cuda"
HEAD = f"GET {PATH} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n".encode()
CLIENT = """
import socket, sys, time
port, n, head = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].encode()
out = []
for _ in range(n):
    t = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(head.replace(b"|", b"\\r\\n"))
        while s.recv(65536):
            pass
    out.append((time.perf_counter() - t) * 1e6)
    time.sleep(0.002)
print(" ".join(f"{x:.1f}" for x in out))
"""


def timed(fn: Callable[[], Any], runs: int) -> list[float]:
    """Microseconds per call of ``fn``."""
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e6)
    return out


def row(name: str, us: list[float]) -> None:
    us = sorted(us)
    print(f"  {name:58} p50 {statistics.median(us):8.1f} us  p99 "
          f"{us[int(len(us) * .99)]:8.1f} us")


def handoff(runs: int) -> list[float]:
    """A worker pool submit, the worker's run and the way back to a waiting thread."""
    pool = _Pool("bench", 8, 512)
    done: queue.SimpleQueue[float] = queue.SimpleQueue()
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        pool.submit(lambda: done.put(time.perf_counter()))
        done.get()
        out.append((time.perf_counter() - t) * 1e6)
    pool.shutdown()
    return out


def client(port: int, runs: int) -> list[float]:
    """Whole requests from a client process of its own, one at a time, in microseconds."""
    proc = subprocess.run([sys.executable, "-c", CLIENT, str(port), str(min(runs, 2000)),
                           HEAD.decode().replace("\r\n", "|")],
                          capture_output=True, text=True, check=True)
    return [float(x) for x in proc.stdout.split()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3000)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gpudiag-path-"))
    env = host_env(build_fakes(tmp / "fakes"), tmp / "host", gpus=8)
    sched = Scheduler(quick_config(), runner=Replay(real_runs(env)), env={})
    sched.start()
    wait_for(lambda: sched.snapshot().round_complete, 10)
    app = DaemonApp(sched)
    httpd, thread = serve(app, "127.0.0.1", 0)
    try:
        request = RequestReader().feed(HEAD)
        assert request is not None
        conn = _Conn(None, "127.0.0.1", 0.0)  # type: ignore[arg-type]
        run_app = httpd._run_app
        body = run_app(conn, request, app)
        assert body is not None
        print(f"{PATH}: {len(body)} bytes; load average "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        row("h11 parse of the head (RequestReader per connection)",
            timed(lambda: RequestReader().feed(HEAD), args.runs))
        environ = {"REQUEST_METHOD": "GET", "PATH_INFO": "/v1/preflight",
                   "QUERY_STRING": "require=cuda"}
        row("the app alone (WSGI call, cached answer)",
            timed(lambda: app(environ, lambda *a: None), args.runs))
        row("the app's answer_now (what the selector thread asks)",
            timed(lambda: app.answer_now(environ, lambda *a: None), args.runs))
        row("environ + app + response bytes (_run_app)",
            timed(lambda: run_app(conn, request, app.answer_now), args.runs))
        row("hand-off: pool submit -> worker -> back to a waiting thread",
            handoff(args.runs))
        row("whole request over TCP, sequential client process",
            client(int(httpd.server_address[1]), args.runs))
        floor = subprocess.Popen([sys.executable, "-c", FLOOR_SERVER, str(len(body))],
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert floor.stdout is not None
            row("the same against the minimal threaded server (the floor)",
                client(int(floor.stdout.readline()), args.runs))
        finally:
            floor.kill()
            floor.wait()
    finally:
        httpd.shutdown()
        thread.join(5)
        sched.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
