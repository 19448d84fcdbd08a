"""The unit under a real systemd: a Debian rootfs (mmdebstrap, cached in .cache/) booted with
`systemd-nspawn --boot`, gpudiag installed the way docs/operations.md says
(scripts/install-node.sh, which enables and starts the unit), on the fake driver.

One machine per test session; the tests run in file order (start, locks, a non-root job's
attested run, reload, watchdog, security, journal). Root only; as root a missing tool is a
failure (scripts/setup.sh).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.fakes.build import FakeDriver
from tests.support.daemon import wait_for
from tests.support.deploy import ROOT, debian_rootfs, one_builder, require_root_tools
from tests.support.host import make_host_dirs

# One machine per session: ~45 s to unpack, boot and install, ~80 s for the file; the rootfs
# (mmdebstrap, ~3 min) is made once and cached in .cache/rootfs.
# A cold first build (mmdebstrap, no .cache/ on a fresh CI machine: ~3 min alone) counts
# against the first test's timeout, and waits for another worker's build of the checkout
# (tests/support/deploy.one_builder): the suite's 300 s per test is too short for that.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
PACKAGES = "systemd,systemd-sysv,dbus,procps,python3,python3-venv"
INSIDE_PATH = "/opt/gpudiag/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DOCS = ROOT / "docs" / "operations.md"
# What an operator's /etc/gpudiag/gpudiag.toml says on a node without jax and iree, with
# the host probe every 30 s (the reload test shortens it).
CONFIG = """\
[backends.host]
interval_s = {host}
[backends.cuda]
interval_s = 5.0
[backends.jax]
enabled = false
[backends.iree]
enabled = false
"""
# A 2-GPU node on the fake driver (its device nodes and /proc/driver/nvidia in /srv/fakehost).
FAKE_HOST = {"FAKE_NVML_DEVICE_COUNT": "2", "GPUDIAG_DEVICE_DIR": "/srv/fakehost/dev",
             "GPUDIAG_DRIVER_PROC_DIR": "/srv/fakehost/proc-driver-nvidia",
             "GPUDIAG_SYSFS_PCI_DIR": ""}
# The test's drop-in: the fake driver's knobs, and a short watchdog so that a hung daemon is
# restarted within seconds (the shipped WatchdogSec=60s stays in the unit).
DROP_IN = ("[Service]\n" + "".join(f"Environment={k}={v}\n" for k, v in FAKE_HOST.items())
           + "WatchdogSec=4s\nRestartSec=1s\n")


@dataclass
class Machine:
    """A booted nspawn machine: its root folder, nspawn's process and the container's PID 1."""

    root: Path
    nspawn: subprocess.Popen[bytes]
    leader: int

    def run(self, *argv: str, timeout: float = 120, check: bool = True
            ) -> subprocess.CompletedProcess[str]:
        """Run a command inside the machine (its mount, pid, net, ipc and uts namespaces),
        with the fake driver's knobs that the unit's drop-in gives the daemon."""
        proc = subprocess.run(
            ["nsenter", "-t", str(self.leader), "-m", "-u", "-i", "-n", "-p", "--", *argv],
            env={"PATH": INSIDE_PATH, "LANG": "C.UTF-8", "SYSTEMD_PAGER": "",
                 "SYSTEMD_COLORS": "0", **FAKE_HOST},
            capture_output=True, text=True, timeout=timeout, check=False)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {proc.returncode}:\n"
                                 f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return proc

    def show(self, *props: str) -> dict[str, str]:
        out = self.run("systemctl", "show", "gpudiag", "-p", ",".join(props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def path(self, inside: str) -> Path:
        """A path as the machine sees it (its /run is a tmpfs of its own)."""
        return Path(f"/proc/{self.leader}/root{inside}")

    def metrics(self) -> str:
        return self.run("python3", "-c", "import urllib.request; print(urllib.request.urlopen("
                        "'http://127.0.0.1:9477/metrics', timeout=10).read().decode())").stdout

    def journal(self) -> str:
        return self.run("journalctl", "-u", "gpudiag", "--no-pager", "-o", "cat").stdout


def stage(root: Path, fakes: FakeDriver) -> None:
    """What an operator brings to the node: this checkout's files, the wheels, the driver."""
    src = root / "root" / "src"
    for part in ("systemd", "deploy", "scripts"):
        shutil.copytree(ROOT / part, src / part, ignore=shutil.ignore_patterns("__pycache__"))
    (src / "docs").mkdir(parents=True)
    shutil.copy(DOCS, src / "docs" / "operations.md")
    wheels = root / "root" / "wheels"
    for args in (["--no-deps", str(ROOT)], [str(ROOT)]):
        with one_builder("checkout-build"):  # another xdist worker may build it in place too
            subprocess.run([sys.executable, "-m", "pip", "wheel", "-q",
                            "--disable-pip-version-check", "-w", str(wheels), *args],
                           check=True, timeout=600, capture_output=True)
    # The driver's user space where its packages put it; the fake nvidia-smi needs pynvml.
    libdir = root / "usr" / "lib" / "x86_64-linux-gnu"
    for lib in fakes.lib_dir.iterdir():
        shutil.copy(lib, libdir / lib.name)
    smi = fakes.nvidia_smi.read_text().split("\n", 1)[1]
    (root / "usr" / "bin" / "nvidia-smi").write_text("#!/opt/gpudiag/bin/python3\n" + smi)
    (root / "usr" / "bin" / "nvidia-smi").chmod(0o755)
    dev, _ = make_host_dirs(root / "srv" / "fakehost", gpus=2)
    for node in dev.iterdir():
        node.chmod(0o666)
    etc = root / "etc"
    (etc / "gpudiag").mkdir(parents=True)
    (etc / "gpudiag" / "gpudiag.toml").write_text(CONFIG.format(host=30.0))
    (etc / "systemd" / "system" / "gpudiag.service.d").mkdir(parents=True)
    (etc / "systemd" / "system" / "gpudiag.service.d" / "test.conf").write_text(DROP_IN)
    (etc / "hostname").write_text("gpunode\n")


def leader_of(nspawn: subprocess.Popen[bytes]) -> int | None:
    """The container's PID 1 (systemd), a descendant of systemd-nspawn."""
    try:
        kids = psutil.Process(nspawn.pid).children(recursive=True)
    except psutil.Error:
        return None
    for kid in sorted(kids, key=lambda p: p.pid):
        try:
            if kid.name() == "systemd":
                return kid.pid
        except psutil.Error:
            continue
    return None


@pytest.fixture(scope="session")
def machine(tmp_path_factory: pytest.TempPathFactory, fakes: FakeDriver) -> Iterator[Machine]:
    require_root_tools("systemd-nspawn", "mmdebstrap", "nsenter")
    started = time.monotonic()
    tar = debian_rootfs("bookworm-systemd", PACKAGES)
    root = tmp_path_factory.mktemp("machine") / "root"
    root.mkdir()
    subprocess.run(["tar", "-xf", str(tar), "-C", str(root)], check=True, timeout=300)
    stage(root, fakes)
    log = open(root.parent / "nspawn.log", "wb")
    nspawn = subprocess.Popen(
        ["systemd-nspawn", "-D", str(root), "--register=no", "--keep-unit", "--boot",
         "--console=pipe", "--private-network", "--machine", "gpunode"],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        leader = wait_for(lambda: leader_of(nspawn) if nspawn.poll() is None else -1, 60)
        assert leader != -1, (root.parent / "nspawn.log").read_text(errors="replace")
        m = Machine(root, nspawn, leader)
        # systemd answers (the boot may still be "starting": no unit it waits for matters).
        wait_for(lambda: m.run("systemctl", "is-system-running", check=False).stdout.strip()
                 not in ("", "offline"), 60, interval=0.5)
        # docs/operations.md: scripts/install-node.sh, which enables and starts the unit.
        m.run("/root/src/scripts/install-node.sh", "--wheel",
              str(next((root / "root" / "wheels").glob("gpudiag-*.whl"))).replace(
                  str(root), ""), "--find-links", "/root/wheels", timeout=600)
        print(f"nspawn machine booted and gpudiag installed in {time.monotonic() - started:.1f} s")
        yield m
    finally:
        if nspawn.poll() is None:
            nspawn.send_signal(signal.SIGTERM)  # nspawn asks the machine to power off
            try:
                nspawn.wait(30)
            except subprocess.TimeoutExpired:
                nspawn.kill()
                nspawn.wait(10)
        log.close()
        shutil.rmtree(root, ignore_errors=True)


def test_start_reaches_ready_through_sd_notify(machine: Machine) -> None:
    s = machine.show("ActiveState", "SubState", "StatusText", "Type", "NRestarts")
    assert (s["ActiveState"], s["SubState"], s["Type"]) == ("active", "running", "notify"), s
    assert s["StatusText"] == ("serving on http://127.0.0.1:9477 and "
                               "unix:/run/gpudiag/daemon/gpudiag.sock"), s
    assert s["NRestarts"] == "0"
    # READY=1 comes once the sockets are bound; the first probe round follows.
    wait_for(lambda: "gpudiag_ready 1.0" in machine.metrics(), 30, interval=0.5)


def test_socket_and_locks_are_in_run_gpudiag_shared_with_gpudiag_run(machine: Machine) -> None:
    sock = machine.path("/run/gpudiag/daemon/gpudiag.sock")
    assert sock.is_socket() and oct(sock.stat().st_mode & 0o777) == "0o666"
    verdict = json.loads(machine.run("gpudiag", "preflight", "--require", "nvml",
                                     "--format", "json").stdout)
    assert verdict["source"] == "daemon"  # the socket's peer is the daemon's dynamic user
    locks = machine.path("/run/gpudiag/locks")
    assert oct(locks.stat().st_mode & 0o7777) == "0o1777" and locks.stat().st_uid == 0
    names = wait_for(lambda: sorted(p.name for p in locks.glob("GPU-*.lock")), 20)
    assert len(names) == 2, names  # the daemon's cuda probe locked both GPUs here
    assert "gpudiag_lock_dir_shared 1.0" in machine.metrics()
    # A job started on the node takes its locks in the same folder: the same files.
    job = machine.run("gpudiag", "run", "--gpus", "2", "--lock-timeout", "30", "--",
                      "sh", "-c", "cat /run/gpudiag/locks/GPU-*.lock")
    holders = [json.loads(line) for line in job.stdout.splitlines() if line.startswith("{")]
    assert {h["purpose"] for h in holders} == {"job"} and len(holders) == 2, job.stdout
    assert sorted(p.name for p in locks.glob("GPU-*.lock")) == names


def test_a_non_root_jobs_run_reaches_the_daemon_and_its_window_is_attested(
        machine: Machine) -> None:
    # Issue 38: a job of uid 65534 cannot write into the DynamicUser daemon's 0750 state
    # dir; its run hands its closeout to the daemon it asked, on the socket, where the
    # kernel says who it is (the daemon, under ProtectProc=invisible, cannot see the job's
    # /proc: it holds the peer's pidfd instead).
    job = machine.run("setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
                      "env", "HOME=/nonexistent", "SLURM_JOB_ID=4242", "gpudiag", "run",
                      "--gpus", "1", "--artifacts", "/tmp/nobody-runs", "--", "true")
    assert "Traceback" not in job.stderr, job.stderr
    closeout = json.loads(machine.run("sh", "-c", "cat /tmp/nobody-runs/*/closeout.json").stdout)
    assert closeout["verdict_source"] == "daemon", closeout
    assert closeout["job_record"]["attested"] == "socket", closeout["job_record"]
    kv = machine.run("gpudiag", "explain", "--slurm-job", "4242", "--job-uid", "65534",
                     "--format", "kv").stdout
    assert "attested=socket" in kv and "owner_uid=65534" in kv, kv
    assert "gpudiag_job_records_refused_total{reason=\"unattested\"} 0.0" in machine.metrics()


def host_runs(machine: Machine) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in machine.metrics().splitlines()
               if line.startswith("gpudiag_probe_runs_total{") and 'backend="host"' in line)


def test_reload_applies_a_changed_interval_without_a_restart(machine: Machine) -> None:
    pid = machine.show("MainPID")["MainPID"]
    before = host_runs(machine)
    machine.path("/etc/gpudiag/gpudiag.toml").write_text(CONFIG.format(host=0.5))
    machine.run("systemctl", "reload", "gpudiag")
    wait_for(lambda: host_runs(machine) >= before + 4, 20, interval=0.5)
    s = machine.show("MainPID", "ActiveState", "NRestarts")
    assert (s["MainPID"], s["ActiveState"], s["NRestarts"]) == (pid, "active", "0"), s
    assert "config reloaded: backends.host.interval_s 30.0 -> 0.5" in machine.journal()


def test_the_watchdog_restarts_a_daemon_that_stops_answering(machine: Machine) -> None:
    pid = machine.show("MainPID")["MainPID"]
    machine.run("kill", "-STOP", pid)
    wait_for(lambda: machine.show("NRestarts")["NRestarts"] != "0", 40, interval=0.5)
    wait_for(lambda: machine.show("ActiveState")["ActiveState"] == "active", 40, interval=0.5)
    s = machine.show("MainPID", "NRestarts", "Result")
    assert s["MainPID"] != pid and s["NRestarts"] == "1", s
    assert "Watchdog timeout" in machine.run("journalctl", "-u", "gpudiag", "--no-pager").stdout


def test_security_score_is_at_most_the_documented_one(machine: Machine) -> None:
    out = machine.run("systemd-analyze", "security", "--no-pager", "gpudiag").stdout
    match = re.search(r"Overall exposure level for gpudiag.service: (\d+\.\d+)", out)
    assert match, out[-2000:]
    print(f"systemd-analyze security gpudiag (nspawn): {match.group(1)}")
    documented = re.search(r"[Uu]nder a real systemd[^*]*?\*\*(\d+\.\d+)", DOCS.read_text())
    assert documented, f"{DOCS} does not record the score under a real systemd"
    assert float(match.group(1)) <= float(documented.group(1))


def test_the_journal_holds_no_traceback(machine: Machine) -> None:
    journal = machine.journal()
    assert "listening on http://127.0.0.1:9477" in journal
    assert "Traceback" not in journal, journal[-4000:]
    assert os.path.exists(machine.path("/var/lib/gpudiag/history.sqlite3"))
