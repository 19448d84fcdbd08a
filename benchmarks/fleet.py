"""`gpudiag fleet` against 3 and 30 scraped nodes, side by side with the bare PromQL query.

Three real `gpudiag serve` daemons on the fake driver (healthy, one lost GPU, one busy GPU);
the other nodes are static copies of the healthy daemon's exposition served by one small HTTP
server (Prometheus relabels each into an instance of its own). For each fleet size it prints
the median and p95 of: the CLI as a user runs it (a new Python process), the same question
in-process (`ask_fleet`: its instant queries), and one bare PromQL instant query of the
recording rule:

    .venv/bin/python benchmarks/fleet.py [--runs 20]
"""

from __future__ import annotations

import argparse
import http.server
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpudiag.engine.fleet import (
    FleetQuery,
    PrometheusAccess,
    PrometheusClient,
    PrometheusError,
    ask_fleet,
)
from tests.fakes.build import build_fakes
from tests.fakes.jobs import FakeJobs
from tests.support.daemon import Daemon
from tests.support.host import clean_env, free_port
from tests.support.prometheus import RULES, node_env, start_daemon

BARE = 'gpudiag:gpus_ready_free:by_backend{backend="cuda"} >= 2'


def serve_static(text: bytes) -> tuple[http.server.ThreadingHTTPServer, int]:
    """One server answering every /nodes/NAME/metrics with the same exposition."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(text)))
            self.end_headers()
            self.wfile.write(text)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, int(server.server_address[1])


def prometheus_config(root: Path, real: list[str], static: list[str], port: int) -> Path:
    path = root / f"prometheus-{len(real) + len(static)}.yml"
    lines = ["global:", "  scrape_interval: 1s", "  evaluation_interval: 1s",
             f"rule_files: [{root / 'gpudiag.rules.yml'}]", "scrape_configs:",
             "  - job_name: gpudiag", "    static_configs:",
             f"      - targets: {json.dumps(real)}"]
    if static:
        lines += ["  - job_name: gpudiag-static", "    static_configs:",
                  f"      - targets: {json.dumps(static)}", "    relabel_configs:",
                  "      - source_labels: [__address__]", "        target_label: instance",
                  "      - source_labels: [__address__]",
                  "        target_label: __metrics_path__",
                  "        replacement: /nodes/$1/metrics",
                  "      - target_label: __address__",
                  f"        replacement: 127.0.0.1:{port}",
                  "      - target_label: job", "        replacement: gpudiag"]
    path.write_text("\n".join(lines) + "\n")
    return path


def timed(fn: object, runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()  # type: ignore[operator]
        out.append(time.perf_counter() - started)
    return out


def ms(samples: list[float]) -> str:
    q = statistics.quantiles(samples, n=20) if len(samples) > 1 else samples
    return f"{statistics.median(samples) * 1000:7.1f} / {q[-1] * 1000:7.1f}"


def measure(root: Path, real: list[Daemon], static: list[str], static_port: int,
            runs: int) -> dict[str, list[float]]:
    prom = shutil.which("prometheus")
    assert prom is not None, "prometheus not installed (apt-get install prometheus)"
    port = free_port()
    config = prometheus_config(root, [d.instance for d in real], static, static_port)
    tsdb = root / f"tsdb-{len(real) + len(static)}"
    proc = subprocess.Popen([prom, f"--config.file={config}", f"--storage.tsdb.path={tsdb}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    client = PrometheusClient(PrometheusAccess(url))
    query = FleetQuery(backends=("cuda",), gpus=2)
    n = len(real) + len(static)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if len(client.query(BARE.replace(" >= 2", ""))) == n:
                    break
            except PrometheusError:  # Prometheus still starting
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"Prometheus never saw all {n} nodes")
            time.sleep(0.5)
        answer = ask_fleet(query, client, url)
        assert len(answer.nodes) == n, answer
        cli = [sys.executable, "-m", "gpudiag", "fleet", "--prometheus", url, "--gpus", "2",
               "--format", "json"]

        def run_cli() -> None:
            proc = subprocess.run(cli, env=clean_env(), capture_output=True, check=False)
            assert proc.returncode == 0, proc.stderr

        def bare() -> None:
            q = urllib.parse.urlencode({"query": BARE})
            with urllib.request.urlopen(f"{url}/api/v1/query?{q}", timeout=10) as r:
                json.loads(r.read())

        return {"cli": timed(run_cli, runs), "ask_fleet": timed(
            lambda: ask_fleet(query, client, url), runs), "bare": timed(bare, runs)}
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="gpudiag-fleet-bench-"))
    shutil.copy(RULES, root / "gpudiag.rules.yml")
    fakes = build_fakes(root / "fakes")
    daemons: list[Daemon] = []
    with FakeJobs(root / "jobs", compute_modes={0: 3}) as jobs:
        try:
            for name, knobs in (("a", {}), ("b", {"FAKE_NVML_DEVICE_ERRORS": "1:15"}),
                                ("c", {"FAKE_GPU_STATE_FILE": str(jobs.state_file)})):
                env = node_env(fakes, root / f"host-{name}", **knobs)
                env["GPUDIAG_LOCK_DIR"] = str(root / f"locks-{name}")
                daemons.append(start_daemon(root / name, env))
            jobs.start(0, memory_mib=70_000)
            for d in daemons:
                d.wait_ready()
            time.sleep(3)  # a cuda round on every node
            exposition = urllib.request.urlopen(daemons[0].url + "/metrics").read()
            server, static_port = serve_static(exposition)
            results = {}
            for n in (3, 30):
                static = [f"node-{i:02d}" for i in range(3, n)]
                results[n] = measure(root, daemons, static, static_port, args.runs)
            server.shutdown()
        finally:
            for d in daemons:
                d.stop()
    print(f"gpudiag fleet --require cuda --gpus 2 vs bare PromQL ({args.runs} runs; "
          "median / p95 ms)")
    print(f"{'nodes':>5}  {'gpudiag fleet (CLI)':>21}  {'ask_fleet (in-proc)':>21}  "
          f"{'bare PromQL query':>21}")
    for n, r in results.items():
        print(f"{n:>5}  {ms(r['cli']):>21}  {ms(r['ask_fleet']):>21}  {ms(r['bare']):>21}")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
