"""A fake GPU host for tests and benchmarks: a clean environment, its /dev and driver /proc,
the real CLI run as a user runs it, and the processes a test left behind."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import psutil

# Variables of the developer's shell that would change what a probe sees.
_SCRUB = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "JAX_PLATFORMS",
          "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_ALLOCATOR",
          "XLA_PYTHON_CLIENT_USE_CUDA_HOST_ALLOCATOR", "FAKE_GPU_STATE_FILE",
          "GPUDIAG_DEVICE_DIR", "GPUDIAG_DRIVER_PROC_DIR", "GPUDIAG_DAEMON_URL",
          "GPUDIAG_SYSFS_PCI_DIR", "GPUDIAG_LOCK_DIR")

# Every fake GPU has the same UUID in every test and every test run on this machine: the
# GPU locks of this test session live in a folder of its own, so that the probes' and the
# runs' locks of another session (or of a real gpudiag) are never taken for a busy GPU.
SESSION_LOCKS = tempfile.mkdtemp(prefix="gpudiag-test-locks-")


def clean_env() -> dict[str, str]:
    """This process's environment without anything that steers GPUs or the fakes."""
    env = {k: v for k, v in os.environ.items()
           if k not in _SCRUB and not k.startswith("FAKE_")}
    # Never ask a daemon that happens to run on this machine's default port: port 1 refuses
    # at once. Tests that want a daemon pass its URL.
    env["GPUDIAG_DAEMON_URL"] = "http://127.0.0.1:1"
    # The machine's own PCI bus is not the fakes' host: tests that count GPUs on the bus
    # point this at a tree of tests/fakes/sysfs.py.
    env["GPUDIAG_SYSFS_PCI_DIR"] = ""
    env["GPUDIAG_LOCK_DIR"] = SESSION_LOCKS
    return env


def make_host_dirs(root: Path, gpus: int = 8, driver_loaded: bool = True,
                   nodes: bool = True) -> tuple[Path, Path]:
    """A /dev and a /proc/driver/nvidia look-alike for the host probe's seams."""
    dev, proc = root / "dev", root / "proc-driver-nvidia"
    dev.mkdir(parents=True, exist_ok=True)
    proc.mkdir(parents=True, exist_ok=True)
    if nodes:
        for name in ["nvidiactl", "nvidia-uvm", *(f"nvidia{i}" for i in range(gpus))]:
            (dev / name).write_text("")
    if driver_loaded:
        (proc / "version").write_text(
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.124.06  Fri Mar 14 2025\n"
            "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")
    return dev, proc


EnvFactory = Callable[..., dict[str, str]]


def bare_host_env(root: Path) -> dict[str, str]:
    """A GPU-less host: no driver libraries, no nodes, no kernel module (like this machine)."""
    dev, proc = make_host_dirs(root, driver_loaded=False, nodes=False)
    env = clean_env()
    env["GPUDIAG_DEVICE_DIR"] = str(dev)
    env["GPUDIAG_DRIVER_PROC_DIR"] = str(proc)
    # PATH without any nvidia-smi the machine might have.
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not (Path(p) / "nvidia-smi").exists())
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for tools that need a number)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def processes_with_env(marker: str, cmdline_has: str | None = None) -> list[int]:
    """Live processes (not this one) whose environment mentions ``marker`` (``NAME=VALUE`` or
    a value), and whose argv mentions ``cmdline_has`` when given: to find what a test left."""
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            # A zombie's environment cannot be read: it has ended, only its reaping is due.
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            environ = "\0".join(f"{k}={v}" for k, v in proc.environ().items())
            if marker not in environ:
                continue
            if cmdline_has is not None and cmdline_has not in " ".join(proc.cmdline()):
                continue
        except psutil.Error:
            continue
        found.append(proc.pid)
    return found


def run_gpudiag(args: list[str], env: Mapping[str, str], timeout: float = 120
                ) -> subprocess.CompletedProcess[str]:
    """Run the real CLI in a child, as a user would."""
    return subprocess.run([sys.executable, "-m", "gpudiag", *args], env=dict(env),
                          capture_output=True, text=True, timeout=timeout, check=False)


def entry_in_child(argv: list[str], env: Mapping[str, str], out: Path, timeout: float = 60
                   ) -> tuple[int, str, list[str]]:
    """Run the console entry (``gpudiag ARGV``) in a fresh interpreter: its exit code, its
    stdout and every module it had loaded by the end (what a call's path imports)."""
    code = ("import json, sys\n"
            f"sys.argv = ['gpudiag', *{argv!r}]\n"
            "from gpudiag.cli.entry import main\n"
            "rc = main()\n"
            f"open({str(out)!r}, 'w').write(json.dumps([rc, sorted(sys.modules)]))\n")
    proc = subprocess.run([sys.executable, "-c", code], env=dict(env), capture_output=True,
                          text=True, timeout=timeout, check=False)
    assert proc.returncode == 0 and out.exists(), proc.stderr
    rc, modules = json.loads(out.read_text())
    return rc, proc.stdout, modules


def verdict_of(args: list[str], env: Mapping[str, str], timeout: float = 120
               ) -> tuple[int, dict[str, Any]]:
    """Run ``gpudiag ARGS --format json`` (or --json) and return (exit code, record)."""
    proc = run_gpudiag(args, env, timeout)
    try:
        return proc.returncode, json.loads(proc.stdout)
    except json.JSONDecodeError as e:
        raise AssertionError(
            f"no JSON from gpudiag {args}: rc={proc.returncode}\nstdout={proc.stdout}\n"
            f"stderr={proc.stderr}") from e
