"""Daemon benchmark: preflight and /metrics latency, RSS and CPU, daemon vs inline preflight.

Run: .venv/bin/python benchmarks/daemon.py [--preflight-s 20] [--idle-s 60]

Everything runs against the fake driver (8 fake GPUs) on loopback, side by side in one run:
1. /v1/preflight p50/p99 with 32 concurrent clients for --preflight-s seconds, each client
   paced at --rate requests/s (a fleet of job runners), plus a closed-loop saturation run.
2. /metrics p50/p99 (8 GPUs) from one client.
3. The daemon's RSS and CPU over --idle-s seconds at the default intervals (daemon process
   alone, and with its probe children).
4. The ratio of a daemon preflight to an inline `gpudiag preflight --require cuda`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fakes.build import build_fakes  # noqa: E402
from tests.support.host import clean_env, make_host_dirs  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def http_get(host: str, port: int, path: str) -> tuple[float, float, int]:
    """One HTTP/1.0 GET on a fresh connection: (client ms, server ms, status)."""
    t = time.perf_counter()
    with socket.create_connection((host, port), timeout=30) as s:
        s.sendall(f"GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
        chunks = []
        while True:
            b = s.recv(65536)
            if not b:
                break
            chunks.append(b)
    ms = (time.perf_counter() - t) * 1000
    data = b"".join(chunks)
    head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1")
    status = int(head.split(" ", 2)[1])
    server = float("nan")
    for line in head.split("\r\n"):
        if line.lower().startswith("server-timing:"):
            server = float(line.partition("dur=")[2])
    return ms, server, status


FLOOR_SERVER = """
import socketserver, sys
body = b"x" * int(sys.argv[1])
head = b"HTTP/1.0 200 OK\\r\\nContent-Length: %d\\r\\n\\r\\n" % len(body)
class H(socketserver.StreamRequestHandler):
    def handle(self):
        while self.rfile.readline() not in (b"\\r\\n", b"\\n", b""):
            pass
        self.wfile.write(head + body)
class S(socketserver.ThreadingTCPServer):
    daemon_threads = True
    request_queue_size = 128
s = S(("127.0.0.1", 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
"""


def http_body(host: str, port: int, path: str) -> bytes:
    """The body of one GET."""
    with socket.create_connection((host, port), timeout=30) as s:
        s.sendall(f"GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data.split(b"\r\n\r\n", 1)[1]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * q))]


def load(host: str, port: int, path: str, clients: int, seconds: float,
         rate: float | None) -> tuple[list[float], list[float], int]:
    """Clients spread over processes (so the load generator's GIL is not what we measure)."""
    procs = min(clients, 4)
    ctx = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(procs, mp_context=ctx) as pool:
        parts = [pool.submit(_load_threads, host, port, path,
                             list(range(p, clients, procs)), clients, seconds, rate)
                 for p in range(procs)]
        client_ms: list[float] = []
        server_ms: list[float] = []
        errors = 0
        for f in parts:
            c, s, e = f.result()
            client_ms += c
            server_ms += s
            errors += e
    return client_ms, server_ms, errors


def _load_threads(host: str, port: int, path: str, ids: list[int], clients: int,
                  seconds: float, rate: float | None) -> tuple[list[float], list[float], int]:
    """Clients in threads, paced at ``rate`` per client (None: closed loop)."""
    client_ms: list[float] = []
    server_ms: list[float] = []
    errors = [0]
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def worker(i: int) -> None:
        nxt = time.monotonic() + (i / clients) / (rate or 1e9)
        while time.monotonic() < end:
            if rate:
                delay = nxt - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                nxt += 1.0 / rate
            c, s, status = http_get(host, port, path)
            with lock:
                if status != 200:
                    errors[0] += 1
                client_ms.append(c)
                server_ms.append(s)

    threads = [threading.Thread(target=worker, args=(i,)) for i in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return client_ms, server_ms, errors[0]


def proc_stat(pid: int) -> tuple[float, float, int]:
    """(own CPU s, reaped children's CPU s, RSS bytes) of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    rss = int(fields[21]) * PAGE
    return (utime + stime) / CLK_TCK, (cutime + cstime) / CLK_TCK, rss


def children_cpu_s(pid: int) -> float:
    """CPU s of a process's reaped children plus its live children's own and reaped ones'
    (the probe fork server lives as long as the daemon: its children are reaped by it)."""
    total = proc_stat(pid)[1]
    for kid in psutil.Process(pid).children():
        try:
            own, reaped, _ = proc_stat(kid.pid)
        except OSError:
            continue
        total += own + reaped
    return total


def render_times(env: dict[str, str]) -> tuple[float, float]:
    """The Collector's full render over a real 8-GPU snapshot, without the daemon's cache."""
    from prometheus_client import CollectorRegistry, generate_latest

    from gpudiag.daemon.exporter import SnapshotCollector
    from gpudiag.daemon.scheduler import Scheduler
    from tests.support.daemon import Replay, quick_config, real_runs, wait_for

    sched = Scheduler(quick_config(), runner=Replay(real_runs(env)), env={})
    sched.start()
    snap = wait_for(lambda: (s := sched.snapshot()).round_complete and s, 10)
    sched.stop()
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(lambda: snap))
    times = []
    for _ in range(300):
        t = time.perf_counter()
        generate_latest(registry)
        times.append((time.perf_counter() - t) * 1000)
    return pct(times, 0.5), pct(times, 0.99)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preflight-s", type=float, default=20.0)
    ap.add_argument("--idle-s", type=float, default=60.0)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--rate", type=float, default=10.0, help="requests/s per paced client")
    ap.add_argument("--gpus", type=int, default=8, help="fake GPUs on the host (1..64)")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="gpudiag-bench-"))
    fakes = build_fakes(tmp / "fakes")
    dev, proc_dir = make_host_dirs(tmp / "host", gpus=args.gpus)
    env = clean_env()
    env.update(GPUDIAG_DEVICE_DIR=str(dev), GPUDIAG_DRIVER_PROC_DIR=str(proc_dir))
    env = fakes.env(base=env, FAKE_NVML_DEVICE_COUNT=args.gpus)
    # Default intervals; jax and iree stay on as by default (their first run is in round 1).
    daemon = subprocess.Popen(
        [sys.executable, "-m", "gpudiag", "serve", "--listen", "127.0.0.1:0",
         "--state-dir", str(tmp / "state"), "--log-format", "json"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert daemon.stderr is not None
    url = ""
    for line in daemon.stderr:
        url = json.loads(line).get("url", "")
        if url:
            break
    threading.Thread(target=lambda: [None for _ in daemon.stderr or []], daemon=True).start()
    host, port_text = url.removeprefix("http://").rsplit(":", 1)
    port = int(port_text)
    try:
        t0 = time.monotonic()
        while http_get(host, port, "/readyz")[2] != 200:
            time.sleep(0.1)
        print(f"first full round (host, nvml, cuda, jax, iree): {time.monotonic() - t0:.1f} s")

        render_p50, render_p99 = render_times(env)

        # 3 first, while nothing else loads the machine: steady state at default intervals.
        cpu0, child0 = proc_stat(daemon.pid)[0], children_cpu_s(daemon.pid)
        w0 = time.monotonic()
        rss_max = 0
        while time.monotonic() - w0 < args.idle_s:
            time.sleep(1)
            rss_max = max(rss_max, proc_stat(daemon.pid)[2])
        cpu1, _, rss = proc_stat(daemon.pid)
        child1 = children_cpu_s(daemon.pid)
        wall = time.monotonic() - w0
        own = (cpu1 - cpu0) / wall * 100
        kids = (child1 - child0) / wall * 100
        print(f"idle {wall:.0f} s at default intervals: daemon CPU {own:.2f}% of a core "
              f"(target <= 1%), with probe children {own + kids:.2f}%; RSS {rss / 2**20:.1f} MiB"
              f" (max {rss_max / 2**20:.1f} MiB, target <= 80 MB)")

        # 1. preflight under 32 paced clients, then closed loop.
        path = "/v1/preflight?require=cuda"
        c, s, err = load(host, port, path, args.clients, args.preflight_s, args.rate)
        print(f"/v1/preflight, {args.clients} clients x {args.rate:g}/s for "
              f"{args.preflight_s:g} s: {len(c)} requests, {err} errors; client p50 "
              f"{pct(c, .5):.2f} ms p99 {pct(c, .99):.2f} ms (target p99 <= 5 ms); daemon "
              f"p50 {pct(s, .5):.2f} ms p99 {pct(s, .99):.2f} ms")
        # The floor on this machine: the same load against a minimal threaded Python server
        # that answers a fixed body of the same size (no routing, no verdict, no JSON).
        size = len(http_body(host, port, path))
        floor = subprocess.Popen([sys.executable, "-c", FLOOR_SERVER, str(size)],
                                 stdout=subprocess.PIPE, text=True)
        assert floor.stdout is not None
        floor_port = int(floor.stdout.readline())
        try:
            fc, _, _ = load("127.0.0.1", floor_port, "/", args.clients, args.preflight_s,
                            args.rate)
        finally:
            floor.kill()
            floor.wait()
        print(f"  same load on a minimal threaded Python server ({size} byte body): client "
              f"p50 {pct(fc, .5):.2f} ms p99 {pct(fc, .99):.2f} ms -> daemon/minimal p99 "
              f"{pct(c, .99) / pct(fc, .99):.2f}x")
        c2, s2, err2 = load(host, port, path, args.clients, 5.0, None)
        print(f"/v1/preflight, {args.clients} clients closed loop for 5 s: "
              f"{len(c2) / 5:.0f} req/s, {err2} errors; client p50 {pct(c2, .5):.2f} ms p99 "
              f"{pct(c2, .99):.2f} ms; daemon p50 {pct(s2, .5):.2f} ms p99 {pct(s2, .99):.2f} ms")

        # 2. /metrics with 8 GPUs, one scraper.
        c3, s3, _ = load(host, port, "/metrics", 1, 5.0, None)
        print(f"/metrics (8 GPUs), 1 client closed loop for 5 s: {len(c3)} scrapes; client "
              f"p50 {pct(c3, .5):.2f} ms p99 {pct(c3, .99):.2f} ms (target p99 <= 10 ms); "
              f"daemon p50 {pct(s3, .5):.2f} ms p99 {pct(s3, .99):.2f} ms")

        print(f"/metrics uncached render of the same 8-GPU snapshot (the daemon renders at "
              f"most once per snapshot and second): p50 {render_p50:.2f} ms "
              f"p99 {render_p99:.2f} ms")

        # 4. daemon preflight vs inline, both as the CLI a job runner calls.
        def cli(extra: list[str]) -> float:
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "gpudiag", "preflight", "--require", "cuda",
                            "--format", "json", *extra], env=env, capture_output=True,
                           check=False)
            return time.perf_counter() - t

        via_daemon = statistics.median(cli(["--daemon-url", url]) for _ in range(5))
        inline = statistics.median(cli(["--no-daemon"]) for _ in range(5))
        api = statistics.median(http_get(host, port, path)[0] for _ in range(50)) / 1000
        print(f"gpudiag preflight --require cuda: via daemon {via_daemon * 1000:.0f} ms, "
              f"inline {inline * 1000:.0f} ms -> inline/daemon {inline / via_daemon:.1f}x; "
              f"the HTTP call alone {api * 1000:.2f} ms -> inline/HTTP "
              f"{inline / api:.0f}x")
    finally:
        daemon.terminate()
        daemon.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
