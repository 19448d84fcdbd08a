"""CLI start: daemon-answered `gpudiag preflight` and `gpudiag --version` vs `python -c pass`.

Run: .venv/bin/python benchmarks/cli_start.py [--runs 15] [--base DIR] [--floors]

Starts `gpudiag serve` on the fake driver (8 fake GPUs) with a unix socket, waits for its first
round, then runs every case once per round, in turn (a busy machine slows all cases alike), and
prints medians, minima and each ratio against `python -c pass` side by side:
- `python -c pass` (the same interpreter);
- `gpudiag --version`;
- `gpudiag preflight --require cuda --format kv` and `gpudiag health --format json`, answered by
  the daemon over its unix socket;
- `gpudiag probe --backend nvml,cuda --json`: the probes run here, in their children (the CLI's
  own start is the part of it this benchmark follows; benchmarks/probe_overhead.py compares it
  with a bare NVML child);
- the same HTTP question asked in-process (`ask_daemon`): the answer without a Python start.
With ``--floors`` it also times bare interpreters importing only what a daemon-answered call
needs at the least (``re``, which the console script imports; then ``json`` and ``socket``;
then gpudiag's modules on that path), and one with ``dataclasses``, which the typed verdict
model would add and the path avoids: where the figure's floor lies.
With ``--base DIR`` (a folder holding another checkout's ``gpudiag`` package, e.g. from
``git archive OLD gpudiag pyproject.toml | tar -x -C DIR``) each CLI case also runs with that
package first on ``PYTHONPATH``, through the console entry its pyproject.toml declares: before
and after in the same rounds, against the same daemon.

Both packages are byte-compiled first (``compileall``), as an installed wheel is: a
development shell with PYTHONDONTWRITEBYTECODE=1 would otherwise compile every gpudiag module
from source on every start.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fakes.build import build_fakes  # noqa: E402
from tests.support.host import clean_env, make_host_dirs  # noqa: E402

PASS = "python -c pass"
# Interpreters that import a daemon-answered call's least needs, one layer more each row.
FLOORS = {
    "python: import re (the console script's own import)": "import re",
    "python: + json, socket (a bare HTTP exchange)": "import re, json, socket",
    "python: + gpudiag's modules on the daemon-answered path": (
        "import re, json, gpudiag.cli.entry, gpudiag.core.deadlines, gpudiag.engine.wire, "
        "gpudiag.core.recordtext"),
    "python: + dataclasses (what the typed verdict model would add, at the least)": (
        "import re, json, socket, dataclasses"),
}


def wall_ms(argv: list[str], env: dict[str, str], expect: int) -> float:
    """One fresh process's wall time in ms; a wrong exit code is a broken benchmark."""
    t = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, check=False)
    ms = (time.perf_counter() - t) * 1000
    if done.returncode != expect or done.stderr:
        raise SystemExit(f"{argv} exited {done.returncode}: {done.stderr.decode()[-400:]}")
    return ms


def start_daemon(tmp: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], Path]:
    """`gpudiag serve` on a unix socket, once its first full round is done."""
    sock = tmp / "run" / "gpudiag.sock"
    sock.parent.mkdir(mode=0o755)
    log = (tmp / "daemon.log").open("wb")
    daemon = subprocess.Popen(
        [sys.executable, "-m", "gpudiag", "serve", "--listen", "127.0.0.1:0", "--socket",
         str(sock), "--state-dir", str(tmp / "state"), "--log-format", "json"],
        env=env, stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if _ready(sock):
            return daemon, sock
        time.sleep(0.2)
    daemon.kill()
    raise SystemExit(f"the daemon did not finish a round: {(tmp / 'daemon.log').read_text()}")


def _ready(sock: Path) -> bool:
    import socket

    if not sock.exists():
        return False
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(str(sock))
        except OSError:
            return False
        s.sendall(b"GET /readyz HTTP/1.0\r\nHost: localhost\r\n\r\n")
        return s.recv(64).split(b" ", 2)[1:2] == [b"200"]


def launcher(tmp: Path, base: Path) -> str:
    """The installed console script, pointed at the entry point the base checkout declares."""
    script = (Path(sys.executable).parent / "gpudiag").read_text()
    # The base's pyproject.toml, archived beside its gpudiag/; without it (a checkout older
    # than gpudiag.cli.entry) the click commands were the console script's target.
    declared = base / "pyproject.toml"
    entry = re.search(r'^gpudiag = "([\w.]+):(\w+)"',
                      declared.read_text() if declared.exists() else "", re.MULTILINE)
    module, attr = entry.groups() if entry else ("gpudiag.cli.commands", "main")
    path = tmp / "gpudiag-base"
    path.write_text(re.sub(r"^from \S+ import main$", f"from {module} import {attr} as main",
                           script, flags=re.MULTILINE))
    path.chmod(0o755)
    return str(path)


def cases(env: dict[str, str], sock: Path, base: Path | None, tmp: Path, floors: bool
          ) -> dict[str, Callable[[], float]]:
    """Each case's name and a function that runs it once and returns its wall ms."""
    sides = {"": (str(Path(sys.executable).parent / "gpudiag"), env)}
    if base is not None:
        sides[" [base]"] = (launcher(tmp, base), {**env, "PYTHONPATH": str(base)})
    out: dict[str, Callable[[], float]] = {
        PASS: lambda: wall_ms([sys.executable, "-c", "pass"], env, 0)}
    for name, code in FLOORS.items() if floors else ():
        out[name] = lambda c=code: wall_ms([sys.executable, "-c", c], env, 0)
    for tag, (gpudiag, side_env) in sides.items():
        preflight = [gpudiag, "preflight", "--require", "cuda", "--format", "kv",
                     "--daemon-url", f"unix:{sock}"]
        health = [gpudiag, "health", "--format", "json", "--daemon-url", f"unix:{sock}"]
        out[f"gpudiag --version{tag}"] = (
            lambda g=gpudiag, e=side_env: wall_ms([g, "--version"], e, 0))
        out[f"gpudiag preflight --require cuda --format kv (daemon){tag}"] = (
            lambda a=preflight, e=side_env: wall_ms(a, e, 0))
        out[f"gpudiag health --format json (daemon){tag}"] = (
            lambda a=health, e=side_env: wall_ms(a, e, 0))
        probe = [gpudiag, "probe", "--backend", "nvml,cuda", "--json"]
        out[f"gpudiag probe --backend nvml,cuda --json{tag}"] = (
            lambda a=probe, e=side_env: wall_ms(a, e, 0))
    return out


def in_process_ms(sock: Path, runs: int) -> float:
    """The median of the same question asked in this process: the HTTP answer alone."""
    from gpudiag.core.requirement import parse_requirement
    from gpudiag.engine.client import ask_daemon

    requirement = parse_requirement("cuda")
    samples = []
    for _ in range(runs):
        t = time.perf_counter()
        answer = ask_daemon(f"unix:{sock}", requirement, env={"GPUDIAG_DAEMON_USER": "0"})
        samples.append((time.perf_counter() - t) * 1000)
        assert answer.verdict is not None, answer.reason
    return statistics.median(samples)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--base", type=Path, help="a folder holding another checkout's gpudiag/")
    ap.add_argument("--floors", action="store_true",
                    help="also time bare interpreters importing the least a call needs")
    args = ap.parse_args()
    for tree in [ROOT, *([args.base] if args.base else [])]:
        compileall.compile_dir(str(tree / "gpudiag"), quiet=1)

    tmp = Path(tempfile.mkdtemp(prefix="gpudiag-bench-"))
    fakes = build_fakes(tmp / "fakes")
    dev, proc_dir = make_host_dirs(tmp / "host", gpus=8)
    env = clean_env()
    env.update(GPUDIAG_DEVICE_DIR=str(dev), GPUDIAG_DRIVER_PROC_DIR=str(proc_dir),
               GPUDIAG_DAEMON_USER=str(os.getuid()))
    env = fakes.env(base=env, FAKE_NVML_DEVICE_COUNT=8)
    daemon, sock = start_daemon(tmp, env)
    try:
        table = cases(env, sock, args.base, tmp, args.floors)
        for fn in table.values():  # one warm-up round: page cache, the daemon's first answer
            fn()
        samples: dict[str, list[float]] = {name: [] for name in table}
        for _ in range(args.runs):
            for name, fn in table.items():
                samples[name].append(fn())
        http = in_process_ms(sock, 50)
    finally:
        daemon.terminate()
        daemon.wait(10)
    load = os.getloadavg()[0]
    print(f"runs={args.runs} (fresh processes, in turn, one warm-up round; median and min); "
          f"load average {load:.1f} on {os.cpu_count()} cores")
    floor = statistics.median(samples[PASS])
    floor_min = min(samples[PASS])
    width = max(map(len, table))
    for name, values in samples.items():
        med, low = statistics.median(values), min(values)
        print(f"{name:<{width}}  {med:7.1f} ms (min {low:6.1f})  ratio {med / floor:5.2f} "
              f"(min {low / floor_min:5.2f}) vs {PASS}")
    print(f"{'the HTTP question in-process (ask_daemon)':<{width}}  {http:7.2f} ms")
    print(json.dumps({name: round(statistics.median(v), 1) for name, v in samples.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
