"""Runtimes (issue 37): what proving the job's environment costs, side by side in one run.

Run: .venv/bin/python benchmarks/runtimes.py [--runs 11] [--idle-s 60] [--base DIR]

On the fake driver (8 fake GPUs), with two runtimes (venvs of this suite's CPU-only JAX and
IREE, tests/support/venvs.py):
1. A daemon-answered CLI call, the job's fingerprint included: `gpudiag preflight --require
   jax:cpu --format kv` from a runtime's venv, answered from that runtime's proof over the
   unix socket, beside `gpudiag preflight --require cuda --format kv` (no fingerprint) and
   `python -c pass` (that venv's interpreter).
2. A hybrid answer (the daemon's device layer, JAX proven here: `JAX_PLATFORMS=cpu` matches
   no runtime) against an inline JAX probe alone (`--no-daemon`).
3. Idle daemon CPU with its probe children at the default settings, two runtimes configured:
   the steady window after the first round, and the first proofs' CPU amortized over their
   maximum age (the jax and iree intervals). With ``--base DIR`` (another checkout's gpudiag
   package, e.g. ``git archive 3ae9147 gpudiag | tar -x -C DIR``) the same daemon of that
   checkout with no runtimes is measured in the same run: before and after.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fakes.build import build_fakes  # noqa: E402
from tests.support.host import clean_env, make_host_dirs  # noqa: E402
from tests.support.venvs import make_venv  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat_s(pid: int) -> float:
    """A process's CPU seconds with its reaped children (utime, stime, cutime, cstime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / CLK_TCK


def cpu_s(pid: int) -> float:
    """The daemon's CPU seconds with every descendant's, once each: a live process counts
    its own and its reaped children's; a dead one is in its reaper's (the probe fork server
    lives as long as the daemon and reaps the children it forks)."""
    total = _stat_s(pid)
    for kid in psutil.Process(pid).children(recursive=True):
        try:
            total += _stat_s(kid.pid)
        except OSError:
            continue
    return total


def get(sock: Path, path: str) -> tuple[int, bytes]:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(30)
        s.connect(str(sock))
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
                  .encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def start_daemon(tmp: Path, env: dict[str, str], python: str, config: str,
                 head: list[str] | None = None) -> tuple[subprocess.Popen[bytes], Path]:
    """`gpudiag serve` (``head``: how to run gpudiag, default ``python -m gpudiag``) on a
    unix socket in ``tmp``, once /readyz answers."""
    tmp.mkdir(parents=True, exist_ok=True)
    sock = tmp / "d.sock"
    (tmp / "d.toml").write_text(f'listen = "127.0.0.1:0"\nsocket = "{sock}"\n' + config)
    proc = subprocess.Popen([*(head or [python, "-m", "gpudiag"]), "serve", "--config",
                             str(tmp / "d.toml"), "--state-dir", str(tmp / "state")], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    end = time.monotonic() + 120
    while time.monotonic() < end:
        try:
            if get(sock, "/readyz")[0] == 200:
                return proc, sock
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the daemon did not become ready")


def runs_done(sock: Path, want: int) -> bool:
    """Whether the runtimes' probe children have run ``want`` times in all."""
    text = get(sock, "/metrics")[1].decode()
    total = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("gpudiag_runtime_probe_runs_total{")
                and 'runtime="gpudiag"' not in line)
    return total >= want


def wall_ms(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   check=False)
    return (time.perf_counter() - started) * 1000


def side_by_side(cases: dict[str, tuple[list[str], dict[str, str]]], runs: int
                 ) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(runs):
        for name, (argv, env) in cases.items():
            times[name].append(wall_ms(argv, env))
    return {name: statistics.median(values) for name, values in times.items()}


def idle(tmp: Path, env: dict[str, str], python: str, config: str, want_runs: int,
         idle_s: float, max_age_s: float) -> tuple[float, float, float]:
    """(steady CPU %, first proofs' CPU s, amortized CPU %) of a daemon at its defaults."""
    tmp.mkdir(parents=True, exist_ok=True)
    proc, sock = start_daemon(tmp, env, python, config)
    try:
        end = time.monotonic() + 300
        while want_runs and not runs_done(sock, want_runs) and time.monotonic() < end:
            time.sleep(0.5)
        time.sleep(5)  # the first round's children reaped
        first = cpu_s(proc.pid)
        t0 = time.monotonic()
        time.sleep(idle_s)
        steady = (cpu_s(proc.pid) - first) / (time.monotonic() - t0) * 100
        return steady, first, first / max_age_s * 100
    finally:
        proc.terminate()
        proc.wait(20)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=11)
    ap.add_argument("--idle-s", type=float, default=60.0)
    ap.add_argument("--base", type=Path, default=None)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gpudiag-bench-runtimes-"))
    fakes = build_fakes(tmp / "fakes")
    dev, proc_dir = make_host_dirs(tmp / "host")
    env = fakes.env(base={**clean_env(), "GPUDIAG_DEVICE_DIR": str(dev),
                          "GPUDIAG_DRIVER_PROC_DIR": str(proc_dir)})
    venvs = [make_venv(tmp / name, with_jax=True) for name in ("train", "infer")]
    runtimes = "".join(f'[runtimes.{p.parent.parent.name}]\npython = "{p}"\nuser = "root"\n'
                       for p in venvs)
    python = str(venvs[0])

    print(f"load average {os.getloadavg()[0]:.2f}")
    daemon, sock = start_daemon(tmp / "cli", env, sys.executable, runtimes)
    try:
        end = time.monotonic() + 300
        while not runs_done(sock, 4) and time.monotonic() < end:
            time.sleep(0.5)
        asked = {**env, "GPUDIAG_DAEMON_URL": f"unix:{sock}", "GPUDIAG_DAEMON_USER": "0"}
        cli = [python, "-m", "gpudiag.cli.entry"]
        medians = side_by_side({
            "python -c pass": ([python, "-c", "pass"], asked),
            "preflight --require cuda (daemon)": ([*cli, "preflight", "--format", "kv"], asked),
            "preflight --require jax:cpu (daemon, fingerprint)": (
                [*cli, "preflight", "--require", "jax:cpu", "--format", "kv"], asked),
        }, args.runs)
        base = medians["python -c pass"]
        print("\n1. daemon-answered CLI calls (median ms, ratio to python -c pass)")
        for name, ms in medians.items():
            print(f"   {name:52s} {ms:8.1f} ms  {ms / base:5.2f}x")
        cpu_env = {**asked, "JAX_PLATFORMS": "cpu"}
        hybrid = side_by_side({
            "inline JAX probe alone (--no-daemon)": (
                [*cli, "preflight", "--require", "jax:cpu", "--no-daemon", "--format", "kv"],
                cpu_env),
            "hybrid (daemon + JAX proven here)": (
                [*cli, "preflight", "--require", "jax:cpu", "--format", "kv"], cpu_env),
        }, max(3, args.runs // 2))
        alone = hybrid["inline JAX probe alone (--no-daemon)"]
        print("\n2. hybrid answer against an inline JAX probe alone (median ms)")
        for name, ms in hybrid.items():
            print(f"   {name:52s} {ms:8.1f} ms  {ms / alone:5.2f}x")
    finally:
        daemon.terminate()
        daemon.wait(20)

    print(f"\n3. idle daemon CPU with its children, default settings, {args.idle_s:g} s window")
    steady, first, amortized = idle(tmp / "idle", env, sys.executable, runtimes, 4,
                                    args.idle_s, 3600.0)
    print(f"   this tree, two runtimes: steady {steady:.3f}% + first round {first:.1f} CPU-s "
          f"over a 3600 s max age {amortized:.3f}% = {steady + amortized:.3f}% of a core")
    if args.base is not None:
        base_env = {**env, "PYTHONPATH": str(args.base)}
        b_steady, b_first, _ = idle(tmp / "idle-base", base_env, sys.executable, "", 0,
                                    args.idle_s, 300.0)
        b_amortized = b_first / 300.0 * 100
        print(f"   base {args.base}, one environment: steady {b_steady:.3f}% + first round "
              f"{b_first:.1f} CPU-s over its 300 s interval {b_amortized:.3f}% = "
              f"{b_steady + b_amortized:.3f}% of a core")
    print(f"load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
