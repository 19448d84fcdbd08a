"""Time from a real link going down to the daemon's verdict, and what the 1 s port read costs.

As root (veth pairs), one `gpudiag serve` whose only backend is nic with `expect = [A]`:
    .venv/bin/python benchmarks/nic_verdict.py [--cuts 30] [--idle-s 30]

Each cut: `ip link set B down` (A's carrier drops), then /v1/health?require=nic is asked
every 10 ms until it names `nic_link_down` on A; then B comes back up and the verdict clears.
A random pause before each cut samples every phase of the daemon's 1 s read. The idle part
reads the daemon's and its children's CPU time (/proc, utime+stime of the daemon and its
reaped children) over ``--idle-s`` with the link up.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.daemon import Daemon
from tests.support.host import clean_env

CONFIG = """default_requirement = "nic"
[scheduler]
tick_s = 0.05
jitter_ratio = 0.0
[backends.host]
enabled = false
[backends.nvml]
enabled = false
[backends.cuda]
enabled = false
[backends.jax]
enabled = false
[backends.iree]
enabled = false
[backends.nic]
enabled = true
flap_transitions = 1000
expect = ["{a}"]
[xid]
enabled = false
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def _health(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/v1/health?require=nic", timeout=10) as r:
        data: dict[str, Any] = json.loads(r.read())
    return data


def _down(rec: dict[str, Any], port: str) -> bool:
    return any(b["code"] == "nic_link_down" and b["device"] == port for b in rec["blockers"])


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and every live descendant (the probe fork server's reaped
    children count in its cutime), utime+stime+cutime+cstime."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isascii() and entry.name.isdigit():
            try:
                parents[int(entry.name)] = int(_stat(int(entry.name))[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, grew = {pid}, True
    while grew:
        more = {p for p, pp in parents.items() if pp in tree} - tree
        tree |= more
        grew = bool(more)
    ticks = 0
    for p in tree:
        try:
            ticks += sum(int(x) for x in _stat(p)[11:15])
        except (OSError, IndexError, ValueError):
            continue
    return ticks / os.sysconf("SC_CLK_TCK")


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(f"stopped by signal {signum}")  # the finally blocks delete the links


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cuts", type=int, default=30)
    ap.add_argument("--idle-s", type=float, default=30.0)
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root for veth pairs")
    signal.signal(signal.SIGTERM, _stop)
    tag = uuid.uuid4().hex[:8]
    a, b = f"gba{tag}", f"gbb{tag}"
    _ip("link", "add", a, "type", "veth", "peer", "name", b)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            _ip("link", "set", a, "up")
            _ip("link", "set", b, "up")
            config = Path(tmp) / "gpudiag.toml"
            config.write_text(CONFIG.format(a=a))
            daemon = Daemon(clean_env(), config, Path(tmp) / "state")
            try:
                daemon.wait_ready()
                url, pid = daemon.url, daemon.proc.pid
                while _health(url)["backends"].get("nic", {}).get("status") != "ok":
                    time.sleep(0.1)
                took: list[float] = []
                for _ in range(args.cuts):
                    time.sleep(random.uniform(0.0, 1.0))
                    _ip("link", "set", b, "down")
                    cut = time.monotonic()
                    while not _down(_health(url), a):
                        time.sleep(0.01)
                    took.append(time.monotonic() - cut)
                    _ip("link", "set", b, "up")
                    while _down(_health(url), a):
                        time.sleep(0.05)
                took.sort()
                p99 = took[min(len(took) - 1, int(round(0.99 * (len(took) - 1))))]
                print(f"cut to verdict over {len(took)} cuts: median "
                      f"{statistics.median(took):.3f} s, p99 {p99:.3f} s, max {took[-1]:.3f} s")
                before, started = _cpu_s(pid), time.monotonic()
                time.sleep(args.idle_s)
                used = _cpu_s(pid) - before
                share = 100 * used / (time.monotonic() - started)
                print(f"idle with the 1 s port read: {share:.1f}% of one core (the daemon and "
                      f"its process tree) over {args.idle_s:g} s")
            finally:
                daemon.stop()
        finally:
            subprocess.run(["ip", "link", "del", a], capture_output=True, timeout=10, check=False)


if __name__ == "__main__":
    main()
