"""The Slurm pieces tests share: the stand-in scontrol's node (`SlurmNode`, the `node`
fixture) and a real single-node cluster (`RealSlurm`, the module-scoped `real_slurm`
fixture: munged, slurmctld and slurmd on 127.0.0.1 with the gpudiag scripts configured).
A test module takes a fixture by naming it: ``node = slurm.node``."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.build import FakeDriver, write_state_file
from tests.support.host import clean_env, free_port, make_host_dirs

ROOT = Path(__file__).resolve().parents[2]
SLURM = ROOT / "deploy" / "slurm"
PROLOG = SLURM / "gpudiag-prolog.sh"
HEALTHCHECK = SLURM / "gpudiag-healthcheck.sh"
EPILOG = SLURM / "gpudiag-epilog.sh"
NODE = "gpu-node-1"
# Slurm kills a Prolog or health check at 60 s; these must end well inside it.
SLURM_LIMIT_S = 60.0


# A stand-in for scontrol: appends its argv to $SCONTROL_LOG (JSON lines) and keeps one
# node's State/Reason/Gres and the jobs' fields in $SCONTROL_STATE, printing `show node` in
# the layout of Slurm 22.05.
STANDIN = r'''
import json, os, sys, time
state_path, log_path = os.environ["SCONTROL_STATE"], os.environ["SCONTROL_LOG"]
args = sys.argv[1:]
if os.path.basename(sys.argv[0]) == "scancel":  # the same stand-in, as scancel JOBID
    args = ["scancel", *args]
with open(log_path, "a") as fh:
    fh.write(json.dumps(args) + "\n")
with open(state_path) as fh:
    st = json.load(fh)
if args[:1] == ["scancel"]:
    st["jobs"].setdefault(args[1], {})["cancelled"] = True
    with open(state_path, "w") as fh:
        json.dump(st, fh)
elif args[:2] == ["show", "node"]:
    reason = st["reason"]
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    print(f"NodeName={args[2]} Arch=x86_64 CoresPerSocket=1 \n"
          f"   CPUAlloc=0 CPUEfctv=2 CPUTot=2 CPULoad=0.05\n"
          f"   AvailableFeatures=(null)\n   ActiveFeatures=(null)\n"
          f"   Gres={st['gres']}\n"
          f"   NodeAddr=127.0.0.1 NodeHostName={args[2]} Version=22.05.8\n"
          f"   RealMemory=1 AllocMem=0 FreeMem=1000 Sockets=2 Boards=1\n"
          f"   State={st['state']} ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A\n"
          f"   Partitions=debug \n"
          f"   CfgTRES=cpu=2,mem=1M,billing=2\n   AllocTRES=\n   CapWatts=n/a\n"
          f"   CurrentWatts=0 AveWatts=0\n"
          + (f"   Reason={reason} [root@{stamp}]\n" if reason else ""))
elif args and args[0] == "update":
    fields = dict(a.split("=", 1) for a in args[1:])
    if "NodeName" in fields:
        if fields.get("State") == "DRAIN":
            st["state"], st["reason"] = "IDLE+DRAIN", fields["Reason"]
        elif fields.get("State") == "RESUME":
            st["state"], st["reason"] = "IDLE", ""
    elif "JobId" in fields:
        job = st["jobs"].setdefault(fields.pop("JobId"), {})
        job.update(fields)
    with open(state_path, "w") as fh:
        json.dump(st, fh)
else:
    print(f"scontrol stand-in: unsupported {args}", file=sys.stderr)
    sys.exit(1)
'''


@dataclass
class Outcome:
    """One script run: exit code, scontrol calls, resulting node and job state."""

    returncode: int
    calls: list[list[str]]
    state: dict[str, Any]
    stderr: str
    duration_s: float

    @property
    def updates(self) -> list[list[str]]:
        return [c for c in self.calls if c[:1] == ["update"]]


# Settings the scripts take from the site's defaults file only (gpudiag-common.sh).
SITE_ONLY = ("GPUDIAG", "SCONTROL", "SCANCEL", "GPUDIAG_DAEMON_URL", "PATH")


@dataclass
class SlurmNode:
    """The stand-in scontrol's files and a runner for the two scripts."""

    folder: Path
    make_env: Callable[..., dict[str, str]]

    def set(self, state: str = "IDLE", reason: str = "", gres: str = "gpu:8") -> None:
        (self.folder / "state.json").write_text(json.dumps(
            {"state": state, "reason": reason, "gres": gres, "jobs": {}}))
        (self.folder / "calls.jsonl").write_text("")

    def run(self, script: Path, knobs: Mapping[str, str] | None = None,
            extra: Mapping[str, str] | None = None) -> Outcome:
        env = self.make_env(**dict(knobs or {}))
        env.update({
            "SCONTROL": str(self.folder / "scontrol"),
            "SCANCEL": str(self.folder / "scancel"),
            "SCONTROL_STATE": str(self.folder / "state.json"),
            "SCONTROL_LOG": str(self.folder / "calls.jsonl"),
            "GPUDIAG": str(Path(sys.executable).with_name("gpudiag")),
            # No daemon listens here: preflight falls back to probing inline.
            "GPUDIAG_DAEMON_URL": f"http://127.0.0.1:{free_port()}",
            "SLURMD_NODENAME": NODE,
        })
        env.update(extra or {})
        # What runs as root (the binaries, PATH, the daemon to believe) comes only from the
        # site's root-owned defaults file, never from the environment (issue 38).
        site = {k: env.pop(k) for k in SITE_ONLY if k in env}
        defaults = self.folder / "defaults"
        defaults.write_text("".join(f"{k}={shlex.quote(v)}\n" for k, v in site.items() if v))
        defaults.chmod(0o644)
        env["GPUDIAG_DEFAULTS"] = str(defaults)
        (self.folder / "calls.jsonl").write_text("")
        start = time.monotonic()
        proc = subprocess.run([str(script)], env=env, capture_output=True, text=True,
                              timeout=SLURM_LIMIT_S, check=False)
        duration = time.monotonic() - start
        calls = [json.loads(line) for line in
                 (self.folder / "calls.jsonl").read_text().splitlines()]
        state = json.loads((self.folder / "state.json").read_text())
        return Outcome(proc.returncode, calls, state, proc.stderr, duration)


@pytest.fixture
def node(tmp_path: Path, gpu_env: Callable[..., dict[str, str]]) -> SlurmNode:
    folder = tmp_path / "slurm"
    folder.mkdir()
    standin = folder / "scontrol"
    standin.write_text(f"#!{sys.executable}\n{STANDIN}")
    standin.chmod(0o755)
    (folder / "scancel").symlink_to(standin)
    n = SlurmNode(folder, gpu_env)
    n.set()
    return n


SLURM_BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "scontrol", "sbatch", "scancel")


@dataclass
class RealSlurm:
    """munged + slurmctld + slurmd on 127.0.0.1, with the gpudiag scripts configured."""

    folder: Path
    host: str
    env: dict[str, str]
    gpu_state: Path

    def scontrol(self, *args: str) -> str:
        proc = subprocess.run(["scontrol", *args], env=self.env, capture_output=True,
                              text=True, timeout=30, check=False)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    def node_field(self, key: str) -> str:
        match = re.search(rf"(?:^|\s){key}=(.*?)(?:$|\s+\w+=)", self.scontrol("show", "node",
                                                                             self.host), re.M)
        return match.group(1).strip() if match else ""

    def reason(self) -> str:
        """The node's Reason without the [user@time] stamp."""
        text = self.scontrol("show", "node", self.host)
        match = re.search(r"^\s*Reason=(.*?)(?: \[[^]]*\])?$", text, re.M)
        return match.group(1) if match else ""

    def set_gpus(self, **knobs: str) -> None:
        write_state_file(self.gpu_state, knobs)

    def healthcheck(self, enabled: bool) -> None:
        flag = self.folder / "healthcheck-off"
        if enabled:
            flag.unlink(missing_ok=True)
            return
        flag.write_text("")
        # A run that started before the flag may still drain: wait until it is over.
        with (self.folder / "healthcheck.lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            fcntl.flock(lock, fcntl.LOCK_UN)

    def wait(self, what: str, check: Callable[[], bool], timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not check():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}: "
                                     f"{self.scontrol('show', 'node', self.host)}")
            time.sleep(0.3)


def _slurm_missing() -> str | None:
    missing = [b for b in SLURM_BINARIES if shutil.which(b) is None]
    if missing:
        return f"Slurm/munge not installed ({', '.join(missing)}): apt-get install slurm-wlm munge"
    if os.geteuid() != 0:
        return "a real slurmd with GPU GRES needs root (mknod of the device files)"
    return None


@pytest.fixture(scope="module")
def real_slurm(fakes: FakeDriver, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[RealSlurm]:
    reason = _slurm_missing()
    if reason and os.environ.get("CI") == "true" and os.geteuid() == 0:
        # .ci/run's scripts/setup.sh --tests installs slurm-wlm and munge: in CI, as root, their
        # absence is a broken set-up, not a reason to skip the real cluster.
        pytest.fail(f"CI: {reason} (scripts/setup.sh --tests should have installed them)")
    if reason:
        pytest.skip(reason)
    d = Path(tempfile.mkdtemp(prefix="gds"))  # short: the munge socket path has a length cap
    os.chmod(d, 0o755)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for sub in ("state", "spool", "dev", "munge", "jobs", "gpudiag-state"):
            (d / sub).mkdir()
        (d / "munge").chmod(0o755)
        for i in range(2):
            subprocess.run(["mknod", str(d / f"dev/nvidia{i}"), "c", "195", str(i)],
                           check=True)
        host = socket.gethostname().split(".")[0]
        log = (d / "daemons.log").open("wb")
        subprocess.run(["mungekey", "-c", "-k", str(d / "munge.key")], check=True,
                       capture_output=True)
        procs.append(subprocess.Popen(
            ["munged", "-F", f"--key-file={d}/munge.key", f"--socket={d}/munge/munge.socket.2",
             f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log",
             f"--seed-file={d}/munged.seed"], stdout=log, stderr=log))
        host_dirs = tmp_path_factory.mktemp("slurm-host")
        dev, proc_dir = make_host_dirs(host_dirs, gpus=2)
        gpu_state = d / "gpu-state"
        write_state_file(gpu_state, {})
        fake_env = fakes.env(base={})
        # What a site puts in /etc/default/gpudiag (sourced, every assignment exported).
        (d / "defaults").write_text("\n".join([
            f"SLURM_CONF={d}/slurm.conf",
            f"GPUDIAG={Path(sys.executable).with_name('gpudiag')}",
            f"GPUDIAG_DAEMON_URL=http://127.0.0.1:{free_port()}",
            f"PATH={fake_env['PATH']}:/usr/sbin:/usr/bin:/sbin:/bin",
            f"LD_LIBRARY_PATH={fake_env['LD_LIBRARY_PATH']}",
            f"GPUDIAG_DEVICE_DIR={dev}", f"GPUDIAG_DRIVER_PROC_DIR={proc_dir}",
            f"FAKE_GPU_STATE_FILE={gpu_state}", "FAKE_NVML_DEVICE_COUNT=2",
            "FAKE_CUDA_DEVICE_COUNT=2", ""]))
        for name, script in (("prolog", PROLOG), ("healthcheck", HEALTHCHECK),
                             ("epilog", EPILOG)):
            # The health check runs under a lock so that pausing it can wait out a run.
            guard = (f"exec 9>{d}/healthcheck.lock\nflock 9\n"
                     f"[[ -e {d}/healthcheck-off ]] && exit 0\n") if name == "healthcheck" else ""
            # The Epilog reads the runs' job records from the daemon's state dir.
            extra = (f"GPUDIAG_STATE_DIR={d}/gpudiag-state GPUDIAG_RECORD_DIR={d}/jobs "
                     if name == "epilog" else "")
            log_to = f" 2>>{d}/epilog.log" if name == "epilog" else ""
            (d / name).write_text(f"#!/bin/bash\n{guard}"
                                  f"{extra}GPUDIAG_DEFAULTS={d}/defaults exec {script}{log_to}\n")
            (d / name).chmod(0o755)
        (d / "slurm.conf").write_text(f"""\
ClusterName=gpudiagtest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={d}/munge/munge.socket.2
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
MailProg=/bin/true
ReturnToService=2
Prolog={d}/prolog
Epilog={d}/epilog
HealthCheckProgram={d}/healthcheck
HealthCheckInterval=1
HealthCheckNodeState=ANY
GresTypes=gpu
NodeName={host} NodeAddr=127.0.0.1 CPUs=2 Gres=gpu:2 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
""")
        (d / "gres.conf").write_text(
            f"AutoDetect=off\nNodeName={host} Name=gpu File={d}/dev/nvidia[0-1]\n")
        env = {**clean_env(), "SLURM_CONF": str(d / "slurm.conf")}
        for daemon in ("slurmctld", "slurmd"):
            procs.append(subprocess.Popen([daemon, "-D", "-f", str(d / "slurm.conf")],
                                          env=env, stdout=log, stderr=log, cwd=d))
        cluster = RealSlurm(d, host, env, gpu_state)
        cluster.wait("the node to come up idle",
                     lambda: cluster.node_field("State").startswith("IDLE")
                     and "DRAIN" not in cluster.node_field("State"))
        yield cluster
    finally:
        subprocess.run(["scancel", "--user=root"], env={**clean_env(),
                       "SLURM_CONF": str(d / "slurm.conf")}, capture_output=True, check=False)
        subprocess.run(["scontrol", "shutdown"], env={**clean_env(),
                       "SLURM_CONF": str(d / "slurm.conf")}, capture_output=True, check=False)
        # slurmctld and slurmd end on `scontrol shutdown`; munged needs a signal.
        for proc in reversed(procs):
            if isinstance(proc.args, list) and proc.args[0] == "munged":
                proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(d, ignore_errors=True)


def job_field(s: RealSlurm, job: str, key: str) -> str:
    text = s.scontrol("show", "job", job)
    if key == "AdminComment":  # free text (ours has key=value pairs): the rest of its line
        match = re.search(r"^\s*AdminComment=(.*)$", text, re.M)
    else:
        match = re.search(rf"(?:^|\s){key}=(\S*)", text, re.M)
    return match.group(1).strip() if match else ""
