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
- with ``--base DIR`` (another checkout's gpudiag package: ``git archive 292dd21 gpudiag |
  tar -x -C DIR``), today's call: the fingerprint of gpudiag's own interpreter.
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

from benchmarks.runtimes import runs_done, side_by_side, start_daemon  # noqa: E402
from tests.fakes.build import build_fakes  # noqa: E402
from tests.support.host import clean_env, make_host_dirs  # noqa: E402
from tests.support.venvs import make_venv  # noqa: E402


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
            cases["today's (base): own interpreter's fingerprint"] = (
                [sys.executable, "-m", "gpudiag.cli.entry", *jax],
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
        medians = side_by_side(cases, args.runs)
        base = medians["python -c pass (the job's)"]
        print(f"daemon-answered CLI calls, median of {args.runs} (ms, ratio to python -c pass)")
        for name, ms in medians.items():
            print(f"  {name:64s} {ms:8.1f} ms  {ms / base:5.2f}x")
        if args.base is not None:
            today = medians["today's (base): own interpreter's fingerprint"]
            now = medians["preflight --require jax:cpu (daemon, job fingerprint, cached)"]
            print(f"  this tree / today's: {now / today:5.2f}x")
    finally:
        daemon.terminate()
        daemon.wait(20)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
