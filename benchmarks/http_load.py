"""/metrics latency of a real `gpudiag serve` idle and under abuse, side by side in one run.

The abuse: 1000 connections that never finish their request head (slowloris), and threads
sending malformed requests and disconnecting mid-response, all on 127.0.0.1. Prints the median
and p99 latency of a well-behaved scrape in each case, their ratio, the daemon's threads, RSS
and log lines, and what it rejected:

    .venv/bin/python benchmarks/http_load.py [--requests 300] [--idle-connections 1000]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.soak import rss_bytes, soak_config, thread_count
from tests.fakes.build import build_fakes
from tests.support.daemon import Daemon
from tests.support.host import clean_env, make_host_dirs

SCRAPE = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
MALFORMED = (b"GARBAGE\r\n\r\n", b"GET /x HTTP/9.9\r\n\r\n", b"\x16\x03\x01" + b"\0" * 60 +
             b"\r\n\r\n")


def scrape(port: int) -> float:
    """One well-behaved scrape; its latency in seconds (status 200 or it raises)."""
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(SCRAPE)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    if not data.startswith(b"HTTP/1.1 200 "):
        raise RuntimeError(f"scrape answered {data[:40]!r}")
    return time.perf_counter() - started


def latencies(port: int, n: int) -> list[float]:
    return [scrape(port) for _ in range(n)]


def abuser(port: int, stop: threading.Event, counts: dict[str, int]) -> None:
    """Malformed requests and mid-response disconnects, as fast as one thread can."""
    i = 0
    while not stop.is_set():
        i += 1
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                if i % 2:
                    s.sendall(MALFORMED[i % len(MALFORMED)])
                    s.recv(4096)
                else:
                    s.sendall(SCRAPE)
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            counts["sent"] = counts.get("sent", 0) + 1
        except OSError:
            counts["errors"] = counts.get("errors", 0) + 1


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--idle-connections", type=int, default=1000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpudiag-load-") as tmp:
        root = Path(tmp)
        fakes = build_fakes(root / "fakes")
        dev, proc_dir = make_host_dirs(root / "host", gpus=8)
        env = clean_env()
        env.update(GPUDIAG_DEVICE_DIR=str(dev), GPUDIAG_DRIVER_PROC_DIR=str(proc_dir))
        env = fakes.env(base=env, FAKE_NVML_DEVICE_COUNT=8)
        config = root / "gpudiag.toml"
        config.write_text(soak_config(3600))
        daemon = Daemon(env, config, root / "state")
        try:
            port = int(daemon.url.rsplit(":", 1)[1])
            end = time.monotonic() + 30
            while daemon.get("/readyz")[0] != 200 and time.monotonic() < end:
                time.sleep(0.1)
            latencies(port, 20)  # warm-up
            pid = daemon.proc.pid
            threads0, rss0, logs0 = thread_count(pid), rss_bytes(pid), daemon.log_lines
            idle_lat = latencies(port, args.requests)

            held = []
            for _ in range(args.idle_connections):
                s = socket.create_connection(("127.0.0.1", port), timeout=10)
                s.sendall(b"GET /metrics HTTP/1.1\r\n")  # a head that never ends
                held.append(s)
            stop = threading.Event()
            counts: dict[str, int] = {}
            workers = [threading.Thread(target=abuser, args=(port, stop, counts), daemon=True)
                       for _ in range(3)]
            for w in workers:
                w.start()
            try:
                abused_lat = latencies(port, args.requests)
                threads1, rss1 = thread_count(pid), rss_bytes(pid)
            finally:
                stop.set()
                for w in workers:
                    w.join(10)
                for s in held:
                    s.close()
            time.sleep(0.5)
            status, metrics = daemon.get("/metrics")
            rejected = [ln for ln in str(metrics).splitlines()
                        if ln.startswith("gpudiag_http_rejected_total") and not
                        ln.endswith(" 0.0")]
            log_lines = daemon.log_lines - logs0
        finally:
            daemon.stop()
    ms = 1000.0
    med_i, med_a = statistics.median(idle_lat), statistics.median(abused_lat)
    print(f"scrape /metrics, {args.requests} requests each, 8 fake GPUs")
    print(f"  idle           median {med_i * ms:7.2f} ms   p99 {pct(idle_lat, 0.99) * ms:7.2f} ms")
    print(f"  under abuse    median {med_a * ms:7.2f} ms   p99 "
          f"{pct(abused_lat, 0.99) * ms:7.2f} ms   ({args.idle_connections} stalled "
          f"connections + 3 abusers, {counts.get('sent', 0)} abusive requests)")
    print(f"  ratio          median {med_a / med_i:.2f}x")
    print(f"daemon threads   {threads0} before, {threads1} under abuse")
    print(f"daemon RSS       {rss0 / 2**20:.1f} MiB before, {rss1 / 2**20:.1f} MiB under abuse")
    print(f"daemon log       {log_lines} lines during the abuse")
    for line in rejected:
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
