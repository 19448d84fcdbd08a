"""Overhead of `gpudiag probe --backend nvml,cuda` over a bare NVML child, against the fakes.

Prints, in one run, the median wall time of each and their ratio (target <= 1.5): the
command as typed (text output), the same with --json, with its fork server exec'd instead
of forked from the CLI (GPUDIAG_PROBE_FORK_SERVER=exec, the path before issue 31's third
pass) and with every probe
spawned (GPUDIAG_PROBE_FORK_SERVER=0, the path before the probe fork server); and each
command's CPU time, its whole process tree's (a forked server saves CPU, not wall time, where
a spare core starts the exec'd one beside the CLI's imports):
    .venv/bin/python benchmarks/probe_overhead.py [--runs 15] [--base DIR]

With ``--base DIR`` (a folder holding another checkout's ``gpudiag`` package, e.g. from
``git archive OLD gpudiag | tar -x -C DIR``) the probe command also runs with that package
first on ``PYTHONPATH``, in the same rounds: before and after side by side. Every package is
byte-compiled first (``compileall``), as an installed wheel is: a development shell with
PYTHONDONTWRITEBYTECODE=1 would otherwise compile every gpudiag module on every start, where
the bare child's pynvml, installed by pip, is compiled already.
"""

from __future__ import annotations

import argparse
import compileall
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fakes.build import build_fakes
from tests.support.host import clean_env, make_host_dirs

BARE = ("import pynvml; pynvml.nvmlInit(); pynvml.nvmlDeviceGetCount(); "
        "pynvml.nvmlShutdown()")


def wall_s(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall time of one fresh process, and the CPU time (user + system) of its whole tree
    (every descendant is reaped by its parent, so RUSAGE_CHILDREN counts it)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, check=False)
    elapsed = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{argv} failed with {proc.returncode}: {proc.stderr[-2000:]!r}")
    return elapsed, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


# The probe engine alone, in this process (no CLI start): nvml then cuda under the busy-GPU
# rule, with the fork server (one interpreter start, two forks; exec'd, since this process
# asks in another environment than its own) and without (two spawns).
ENGINE = {"engine only: nvml then cuda, forked": True,
          "engine only: nvml then cuda, spawned": False}


def engine_s(env: dict[str, str], fork: bool) -> float:
    """Wall time of one inline nvml-then-cuda round (``gpudiag.engine.inline.run_inline``)."""
    from gpudiag.core.requirement import parse_requirement
    from gpudiag.engine.inline import run_inline

    run_env = env if fork else {**env, "GPUDIAG_PROBE_FORK_SERVER": "0"}
    started = time.perf_counter()
    done = run_inline(parse_requirement("cuda"), env=run_env, only=("nvml", "cuda"))
    elapsed = time.perf_counter() - started
    if not all(run.ok for run in done.runs.values()):
        raise SystemExit(f"engine round failed: {[r.error for r in done.runs.values()]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--base", metavar="DIR", type=Path,
                        help="another checkout's gpudiag package folder's parent")
    args = parser.parse_args()
    py = sys.executable
    # The command as a person types it (text, the default), and as a script reads it (--json).
    probe = [py, "-m", "gpudiag", "probe", "--backend", "nvml,cuda"]
    probe_json = [*probe, "--json"]
    here = Path(__file__).resolve().parent.parent
    for folder in [here / "gpudiag", *([args.base / "gpudiag"] if args.base else [])]:
        compileall.compile_dir(str(folder), quiet=1)
    with tempfile.TemporaryDirectory() as tmp:
        fakes = build_fakes(Path(tmp) / "fakes")
        dev, proc = make_host_dirs(Path(tmp) / "host", gpus=args.devices)
        # PYTHONPATH names the checkout measured, and every command runs in an empty folder:
        # ``python -m`` puts its working folder first on sys.path, so run from a checkout it
        # would import that checkout's gpudiag whatever PYTHONPATH says (--base did, before).
        env = fakes.env(base={**clean_env(), "GPUDIAG_DEVICE_DIR": str(dev),
                              "GPUDIAG_DRIVER_PROC_DIR": str(proc), "PYTHONPATH": str(here)},
                        FAKE_NVML_DEVICE_COUNT=args.devices)
        os.chdir(tmp)
        # name -> (argv, env); "spawned" is the path before the probe fork server.
        cases = {
            "bare pynvml init + device count": ([py, "-c", BARE], env),
            "gpudiag probe --backend nvml,cuda": (probe, env),
            "  the same, --json": (probe_json, env),
            "  the same, fork server exec'd": (
                probe, {**env, "GPUDIAG_PROBE_FORK_SERVER": "exec"}),
            "  the same, every probe spawned": (
                probe, {**env, "GPUDIAG_PROBE_FORK_SERVER": "0"}),
            "gpudiag --version (CLI start)": ([py, "-m", "gpudiag", "--version"], env),
            "nvml probe child alone (spawned)": ([py, "-m", "gpudiag.probes", "nvml"], env),
        }
        if args.base:
            cases["gpudiag probe --backend nvml,cuda, base"] = (
                probe, {**env, "PYTHONPATH": str(args.base)})
        for _argv, case_env in cases.values():
            case_env.pop("PYTHONDONTWRITEBYTECODE", None)  # read the compiled files
        times: dict[str, list[float]] = {name: [] for name in [*cases, *ENGINE]}
        cpu: dict[str, list[float]] = {name: [] for name in cases}
        # Interleaved rounds after a warm-up one: a busy machine slows every case alike.
        for i in range(args.runs + 1):
            for name, (argv, case_env) in cases.items():
                elapsed, cpu_s = wall_s(argv, case_env)
                if i:
                    times[name].append(elapsed)
                    cpu[name].append(cpu_s)
            for name, fork in ENGINE.items():
                elapsed = engine_s(env, fork)
                if i:
                    times[name].append(elapsed)
    med = {name: statistics.median(t) for name, t in times.items()}
    low = {name: min(t) for name, t in times.items()}
    bare = "bare pynvml init + device count"
    print(f"devices={args.devices} runs={args.runs} (interleaved; median and min) "
          f"cpus={os.cpu_count()} load average {os.getloadavg()[0]:.1f}")
    cpu_med = {name: statistics.median(t) for name, t in cpu.items()}
    for name in times:
        used = (f"  CPU {cpu_med[name] * 1000:6.1f} ms ({cpu_med[name] / cpu_med[bare]:4.2f}x)"
                if name in cpu_med else "")
        print(f"{name:<37} median {med[name] * 1000:7.1f} ms (min {low[name] * 1000:6.1f})  "
              f"ratio {med[name] / med[bare]:5.2f} (min {low[name] / low[bare]:5.2f}) vs bare"
              f"{used}")
    ratio = med["gpudiag probe --backend nvml,cuda"] / med[bare]
    print(f"ratio {ratio:.2f} (target <= 3, on the way to 1.5)")
    if args.base:
        base = med["gpudiag probe --backend nvml,cuda, base"] / med[bare]
        print(f"base ratio {base:.2f}: this checkout {ratio / base:.2f}x the base's time")


if __name__ == "__main__":
    main()
