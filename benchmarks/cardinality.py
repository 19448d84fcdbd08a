"""/metrics series per node: a real `gpudiag serve` on 8 and 64 fake GPUs, series counted.

Run: .venv/bin/python benchmarks/cardinality.py [--gpus 8,64] [--tree DIR] [--hold]

Starts the daemon (the fakes, one NVML round and the XID watcher), waits for its first full
round, scrapes /metrics three times and prints the series count (samples, histogram buckets
included) in total and per family, as JSON. ``--tree DIR`` runs the gpudiag of another
checkout (e.g. the main branch's, for "before"); ``--hold`` makes this process lock every GPU
and announce one attested run per GPU on the daemon's socket (as N `gpudiag run` jobs holding
every GPU would: the worst case of gpudiag_gpu_allocation_info) while the scrape happens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from tests.fakes.build import build_fakes  # noqa: E402
from tests.support.daemon import daemon_toml, write_config  # noqa: E402
from tests.support.host import clean_env, make_host_dirs  # noqa: E402

NUMBERS_FAMILIES = (
    "gpudiag_fault_to_verdict_seconds", "gpudiag_faults", "gpudiag_faults_flagged_before_xid",
    "gpudiag_preflight_blocks", "gpudiag_false_blockers",
    "gpudiag_gpu_incident_interval_seconds", "gpudiag_job_gpu_energy_joules",
    "gpudiag_gpu_allocation_info")


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read().decode()
    except OSError:
        return 0, ""


def _hold(locks: Path, sock: Path, gpus: int) -> list[object]:
    """Lock every GPU and begin one attested run per GPU on the daemon's socket."""
    from gpudiag.engine.announce import begin_run
    from gpudiag.engine.locks import try_lock

    held: list[object] = []
    for i in range(gpus):
        uuid = f"GPU-f00d{i:04x}-0000-4000-8000-{i:012x}"
        held.append(try_lock(locks, uuid))
        run, why = begin_run(f"unix:{sock}", [uuid], str(1000 + i), os.environ)
        assert run is not None, why
    return held


def measure(gpus: int, tree: Path, hold: bool, work: Path) -> dict[str, object]:
    """Series of one daemon on ``gpus`` fake GPUs."""
    fakes = build_fakes(work / "fakes")
    dev, proc = make_host_dirs(work / f"host{gpus}", gpus=gpus)
    env = fakes.env(base={**clean_env(), "GPUDIAG_DEVICE_DIR": str(dev),
                          "GPUDIAG_DRIVER_PROC_DIR": str(proc)},
                    FAKE_NVML_DEVICE_COUNT=gpus, FAKE_CUDA_DEVICE_COUNT=gpus)
    env["PYTHONPATH"] = str(tree)
    state = work / f"state{gpus}"
    state.mkdir()
    locks, sock = work / "locks", work / "d.sock"
    env["GPUDIAG_LOCK_DIR"] = str(locks)
    config = write_config(work / f"gpudiag{gpus}.toml", daemon_toml({}))
    port_file = work / f"log{gpus}"
    with port_file.open("w") as log:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "gpudiag", "serve", "--listen", "127.0.0.1:0", "--config",
             str(config), "--state-dir", str(state), "--log-format", "json",
             "--socket", str(sock)],
            env=env, cwd=tree, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=log)
    try:
        url = ""
        deadline = time.monotonic() + 120
        while not url and time.monotonic() < deadline:
            for line in port_file.read_text().splitlines():
                try:
                    url = json.loads(line).get("url") or url
                except ValueError:
                    pass
            time.sleep(0.1)
        while _get(url + "/readyz")[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        held = _hold(locks, sock, gpus) if hold else []
        time.sleep(2.0)  # the watcher's first telemetry, the history's first write, the runs
        counts: list[int] = []
        families: Counter[str] = Counter()
        for _ in range(3):
            status, text = _get(url + "/metrics")
            assert status == 200, text[:200]
            families = Counter()
            for fam in text_string_to_metric_families(text):
                families[fam.name] += len(fam.samples)
            counts.append(sum(families.values()))
            time.sleep(1.0)
        numbers = {f: families[f] for f in NUMBERS_FAMILIES if f in families}
        return {"gpus": gpus, "tree": str(tree), "hold": hold, "series": max(counts),
                "families": len(families), "numbers_series": sum(numbers.values()),
                "numbers": numbers, "top": families.most_common(8), "held": len(held)}
    finally:
        daemon.terminate()
        daemon.wait(20)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="8,64")
    parser.add_argument("--tree", type=Path, default=ROOT)
    parser.add_argument("--hold", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpudiag-cardinality-") as tmp:
        for n in (int(g) for g in args.gpus.split(",")):
            work = Path(tmp) / f"n{n}"
            work.mkdir()
            print(json.dumps(measure(n, args.tree.resolve(), args.hold, work)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
