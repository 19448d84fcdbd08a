"""The job's interpreter (issue 48): a daemon-answered call that reads the job's fingerprint.

Run: .venv/bin/python benchmarks/job_python.py [--runs 15] [--base DIR]

The node layout: gpudiag in its own venv (this suite's .venv), the job in another venv
(``train``, CPU-only JAX: tests/support/venvs.py) that is also the daemon's runtime ``train``,
activated (VIRTUAL_ENV and PATH). Side by side, interleaved, median wall time of:
- ``python -c pass`` (the job's interpreter);
- ``gpudiag preflight --require cuda --format kv`` (daemon-answered, no fingerprint);
- ``gpudiag preflight --require jax:cpu --format kv`` (daemon-answered from the runtime's
  proof, the job's fingerprint read by the job's interpreter: from the cache after the first
  call, engine/jobpython.py);
- the same with the cache emptied before each call (the job's interpreter started each time);
- with ``--base DIR`` (another checkout's gpudiag package: ``git archive REV gpudiag |
  tar -x -C DIR``), the same jax:cpu call from that package (before issue 48, 292dd21: the
  fingerprint of gpudiag's own interpreter), started as the console script starts it.
Each with its CPU time (the call's and its children's; the daemon's not counted), which a
loaded machine moves less than the wall time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.runtimes import runs_done, start_daemon  # noqa: E402
from tests.fakes.build import build_fakes  # noqa: E402
from tests.support.host import clean_env, make_host_dirs  # noqa: E402
from tests.support.venvs import make_venv  # noqa: E402


def side_by_side_cpu(cases: dict[str, tuple[list[str], dict[str, str]]], runs: int
                     ) -> tuple[dict[str, float], dict[str, float]]:
    """Median wall and CPU ms of each case, interleaved after a warm-up round: on a shared
    machine the CPU time (user + system of the call and its children) moves less with the
    load than the wall time does."""
    import resource
    import statistics
    import subprocess

    wall: dict[str, list[float]] = {name: [] for name in cases}
    cpu: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(runs + 1):
        for name, (argv, env) in cases.items():
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            started = time.perf_counter()
            subprocess.run(argv, env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, check=False)
            elapsed = time.perf_counter() - started
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            if i:
                wall[name].append(elapsed * 1000)
                cpu[name].append((after.ru_utime + after.ru_stime - before.ru_utime
                                  - before.ru_stime) * 1000)
    return ({n: statistics.median(v) for n, v in wall.items()},
            {n: statistics.median(v) for n, v in cpu.items()})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--base", type=Path, default=None)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gpudiag-bench-jobpython-"))
    fakes = build_fakes(tmp / "fakes")
    dev, proc_dir = make_host_dirs(tmp / "host")
    env = fakes.env(base={**clean_env(), "GPUDIAG_DEVICE_DIR": str(dev),
                          "GPUDIAG_DRIVER_PROC_DIR": str(proc_dir)})
    env.pop("GPUDIAG_JOB_PYTHON", None)
    job = make_venv(tmp / "train", with_jax=True)
    # A root daemon runs a runtime as nobody unless told (docs/operations.md), and this
    # suite's interpreter may sit where nobody cannot reach (a pyenv under /root): the
    # runtime's children run as root here, as in benchmarks/runtimes.py.
    user = 'user = "root"\n' if os.geteuid() == 0 else ""
    daemon, sock = start_daemon(tmp / "d", env, sys.executable,
                                f'[runtimes.train]\npython = "{job}"\n{user}')
    try:
        end = time.monotonic() + 300
        while not runs_done(sock, 2) and time.monotonic() < end:
            time.sleep(0.5)
        cache = tmp / "cache"
        asked = {**env, "GPUDIAG_DAEMON_URL": f"unix:{sock}", "GPUDIAG_DAEMON_USER": "0",
                 "VIRTUAL_ENV": str(job.parent.parent), "XDG_CACHE_HOME": str(cache),
                 "PATH": f"{job.parent}:/usr/bin:/bin"}
        cold = {**asked, "XDG_CACHE_HOME": str(tmp / "cold")}
        gpudiag = [str(ROOT / ".venv" / "bin" / "gpudiag")]
        jax = ["preflight", "--require", "jax:cpu", "--format", "kv"]
        cases = {
            "python -c pass (the job's)": ([str(job), "-c", "pass"], asked),
            "preflight --require cuda (daemon)": ([*gpudiag, "preflight", "--format", "kv"],
                                                  asked),
            "preflight --require jax:cpu (daemon, job fingerprint, cached)": (
                [*gpudiag, *jax], asked),
            "same, cache emptied each call": (
                ["sh", "-c", f'rm -rf "{tmp / "cold"}"; exec "$@"', "sh", *gpudiag, *jax],
                cold),
        }
        if args.base is not None:
            # The console script's own lines (pip's launcher imports re first), run with
            # the other checkout's package first on the path.
            launcher = "import re, sys; from gpudiag.cli.entry import main; sys.exit(main())"
            cases["base: the same call, the other checkout"] = (
                [sys.executable, "-c", launcher, *jax],
                {**asked, "PYTHONPATH": str(args.base)})
        import json
        import subprocess

        seen = json.loads(subprocess.run([*gpudiag, *jax[:-1], "json"], env=asked,
                                         capture_output=True, text=True, check=False).stdout)
        proof = seen["evidence"].get("proof", {}).get("jax", {})
        print(f"the jax:cpu call: source={seen['source']}, proof where={proof.get('where')} "
              f"runtime={proof.get('runtime')}, job_python={seen['evidence'].get('job_python')}")
        if seen["source"] != "daemon" or proof.get("runtime") != "train":
            # Not the daemon-answered call this measures (a hybrid one proves JAX here).
            print("the runtime train has no proof the jax:cpu call matches: "
                  f"{seen['evidence'].get('runtimes', {}).get('train')}")
            return 1
        medians, cpu = side_by_side_cpu(cases, args.runs)
        base = medians["python -c pass (the job's)"]
        cpu_base = cpu["python -c pass (the job's)"]
        print(f"daemon-answered CLI calls, median of {args.runs} (ms, ratio to python -c pass; "
              f"the call's own CPU time, the daemon's not counted), load average "
              f"{os.getloadavg()[0]:.1f}")
        for name, ms in medians.items():
            print(f"  {name:64s} {ms:8.1f} ms  {ms / base:5.2f}x   CPU {cpu[name]:5.1f} ms "
                  f"{cpu[name] / cpu_base:5.2f}x")
        if args.base is not None:
            today = medians["base: the same call, the other checkout"]
            now = medians["preflight --require jax:cpu (daemon, job fingerprint, cached)"]
            print(f"  this tree / the base: {now / today:5.2f}x")
    finally:
        daemon.terminate()
        daemon.wait(20)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
