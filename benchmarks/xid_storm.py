"""An XID storm against a real `gpudiag serve` on the fakes (issue 52).

Run: .venv/bin/python benchmarks/xid_storm.py [--rate 10000] [--seconds 10] [--gpus 8]

The fake NVML delivers XID 45 (and 13, 31, 43) interleaved across every GPU at ``--rate`` a
second for ``--seconds`` (FAKE_NVML_XID_STORM, paced by FAKE_NVML_XID_STORM_RATE); half-way
through, XID 79 on the last GPU is written into the fakes' state file. Meanwhile /metrics and
/healthz are asked every 50 ms. Printed: the XIDs the daemon counted per second, the
/metrics and /healthz latencies (p50, p99, max) before and during the storm, the daemon's CPU
share during it, how long after it was written XID 79 blocked /v1/health, and the daemon's
log lines about XIDs. ``--base DIR`` runs another checkout's daemon on the same storm.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fakes.build import build_fakes, write_state_file  # noqa: E402
from tests.support.daemon import Daemon, daemon_toml, metric_samples  # noqa: E402
from tests.support.host import clean_env, make_host_dirs  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")


def quantile(values: list[float], q: float) -> float:
    """The nearest-rank quantile."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def cpu_s(pid: int) -> float:
    """The process's CPU seconds with its reaped children's (the watcher child runs on)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / CLK_TCK


def tree_cpu_s(pid: int) -> float:
    """The daemon's CPU seconds and its live children's (the watcher child among them)."""
    total = cpu_s(pid)
    for task in Path(f"/proc/{pid}/task").iterdir():
        children = (task / "children")
        if children.exists():
            for child in children.read_text().split():
                try:
                    total += cpu_s(int(child))
                except (OSError, ValueError):
                    pass
    return total


def timed(daemon: Daemon, path: str, out: list[float]) -> None:
    start = time.perf_counter()
    status, _ = daemon.get(path)
    if status == 200:
        out.append(time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=int, default=10_000, help="XIDs a second")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--base", type=Path, default=None,
                        help="another checkout's gpudiag to run instead (git archive REV | "
                        "tar -x -C DIR): the same storm against the code before")
    args = parser.parse_args()
    total = int(args.rate * args.seconds)
    gpus = args.gpus
    xids = (45, 45, 45, 13, 31, 43)  # mostly XID 45, as in the field
    per = total // (gpus * len(xids))
    storm = ",".join(f"{g}:{x}*{per}" for g in range(gpus) for x in xids)
    total = per * gpus * len(xids)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        fakes = build_fakes(tmp / "fakes")
        dev, proc = make_host_dirs(tmp / "host", gpus=gpus)
        state_file = tmp / "fake-state"
        write_state_file(state_file, {})
        env = fakes.env(base={**clean_env(), "GPUDIAG_DEVICE_DIR": str(dev),
                              "GPUDIAG_DRIVER_PROC_DIR": str(proc)},
                        FAKE_NVML_DEVICE_COUNT=gpus, FAKE_GPU_STATE_FILE=str(state_file))
        if args.base is not None:
            env["PYTHONPATH"] = str(args.base.resolve())
        config = tmp / "gpudiag.toml"
        config.write_text(daemon_toml({"": {"socket": ""}}))
        daemon = Daemon(env, config, tmp / "state")
        try:
            daemon.wait_ready(60)
            quiet: dict[str, list[float]] = {"/metrics": [], "/healthz": []}
            for _ in range(40):
                for path, out in quiet.items():
                    timed(daemon, path, out)
                time.sleep(0.05)
            lines_before = daemon.log_lines
            cpu_before, wall_before = tree_cpu_s(daemon.proc.pid), time.monotonic()
            knobs = {"FAKE_NVML_XID_STORM": storm, "FAKE_NVML_XID_STORM_RATE": str(args.rate)}
            write_state_file(state_file, knobs)
            during: dict[str, list[float]] = {"/metrics": [], "/healthz": []}
            fatal: dict[str, float] = {}

            def inject() -> None:
                time.sleep(args.seconds / 2)
                fatal["written"] = time.monotonic()
                write_state_file(state_file, {**knobs, "FAKE_NVML_XIDS": f"{gpus - 1}:79"})
                while time.monotonic() - fatal["written"] < 10:
                    if daemon.get("/v1/health")[1].get("gpu_validation_blocker") == "gpu_lost":
                        fatal["blocked"] = time.monotonic()
                        return
                    time.sleep(0.005)

            injector = threading.Thread(target=inject)
            injector.start()
            counted = 0.0
            while counted < total + 1 and time.monotonic() - wall_before < args.seconds * 4:
                for path, out in during.items():
                    timed(daemon, path, out)
                counted = sum(v for _, v in metric_samples(daemon, "gpudiag_gpu_xid_errors_total"))
                time.sleep(0.05)
            took = time.monotonic() - wall_before
            cpu = tree_cpu_s(daemon.proc.pid) - cpu_before
            injector.join()
            folded = sum(v for _, v in metric_samples(daemon, "gpudiag_xid_storm_folded_total"))
            said = [ln for ln in daemon.lines[lines_before:] if '"xid":' in ln]
        finally:
            daemon.stop()
    print(f"XID storm: {total + 1} XIDs ({total} of 45/13/31/43 on {gpus} GPUs at "
          f"{args.rate}/s, then XID 79) on the fakes, one `gpudiag serve`")
    print(f"  counted {counted:.0f} in {took:.2f} s ({counted / took:.0f}/s); folded "
          f"{folded:.0f}; log lines about XIDs: {len(said)}")
    print(f"  daemon + watcher child CPU during the storm: {cpu / took * 100:.0f}% of a core")
    for path in quiet:
        q, d = quiet[path], during[path]
        print(f"  {path}: quiet p50 {statistics.median(q) * 1000:.1f} ms, p99 "
              f"{quantile(q, 0.99) * 1000:.1f} ms | storm p50 "
              f"{statistics.median(d) * 1000:.1f} ms, p99 {quantile(d, 0.99) * 1000:.1f} ms, "
              f"max {max(d) * 1000:.1f} ms ({len(d)} asks)")
    if "blocked" in fatal:
        print(f"  XID 79 written mid-storm -> /v1/health gpu_lost: "
              f"{(fatal['blocked'] - fatal['written']) * 1000:.0f} ms")
    else:
        print("  XID 79 written mid-storm never blocked /v1/health within 10 s")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
