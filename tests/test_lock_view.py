"""One lock view: the shipped unit and DaemonSet give the daemon the GPU lock folder that jobs
use, /run/gpudiag/locks; a folder it cannot use is a warning and gpudiag_lock_dir_shared 0.

The unit is emulated in a private mount namespace: a fresh /run laid out by the unit's
tmpfiles.d file, made read-only (ProtectSystem=strict) except the unit's RuntimeDirectory=
and ReadWritePaths=, and a private /tmp (PrivateTmp=yes).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes.build import FakeDriver, build_fakes
from tests.support.daemon import Daemon, daemon_toml, wait_for, write_config
from tests.support.deploy import ROOT, UNIT, require_root_tools, unit_settings
from tests.support.host import clean_env, make_host_dirs

TMPFILES = ROOT / "systemd" / "gpudiag-tmpfiles.conf"
# Run as `sh -c SANDBOX sh RW_PATHS KEEP_PATHS ARGV...` in `unshare -m --propagation private`.
# KEEP_PATHS: folders under /tmp that the daemon needs (a checkout cloned there: its venv and
# fakes), bound back over the private /tmp, so that the tests pass wherever the clone is.
SANDBOX = r"""
set -eu
rw=$1; keep=$2; shift 2
mkdir -p /dev/shm/.lockview-keep.$$ 2>/dev/null || true
n=0
for p in $keep; do
    n=$((n + 1)); mkdir -p "/dev/shm/.lockview-keep.$$/$n"
    mount --bind "$p" "/dev/shm/.lockview-keep.$$/$n"
done
mount -t tmpfs -o mode=0755 tmpfs /run
systemd-tmpfiles --create "$TMPFILES_CONF" >/dev/null
for p in $rw; do mkdir -p "$p"; mount --bind "$p" "$p"; done
mount -o remount,bind,ro /run
mount -t tmpfs -o mode=1777 tmpfs /tmp
n=0
for p in $keep; do
    n=$((n + 1)); mkdir -p "$p"; mount --bind "/dev/shm/.lockview-keep.$$/$n" "$p"
done
exec "$@"
"""


def kept_under_tmp(*paths: Path) -> list[str]:
    """The paths the emulated PrivateTmp would hide (those under /tmp), as real paths."""
    out = []
    for p in paths:
        real = os.path.realpath(p)
        if real == "/tmp" or real.startswith("/tmp/"):
            out.append(real)
    return out


@pytest.fixture(scope="module")
def outside_tmp() -> Iterator[tuple[FakeDriver, Path]]:
    """The fakes and a work folder outside /tmp, which the emulated PrivateTmp hides."""
    (ROOT / ".cache").mkdir(exist_ok=True)  # a fresh clone has none yet
    work = Path(tempfile.mkdtemp(prefix="lockview-", dir=ROOT / ".cache"))
    try:
        yield build_fakes(work / "fakes"), work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def unit_writable_paths() -> list[str]:
    s = unit_settings(UNIT.read_text())
    paths = [f"/run/{d}" for v in s.get("RuntimeDirectory", []) for d in v.split()]
    return paths + [p.lstrip("-") for v in s.get("ReadWritePaths", []) for p in v.split()]


def sandboxed_daemon(fakes: FakeDriver, work: Path, rw: list[str]) -> Daemon:
    env = clean_env()
    del env["GPUDIAG_LOCK_DIR"]  # what the unit runs with: the default lock folder
    dev, proc = make_host_dirs(work / "host", gpus=2)
    env.update(GPUDIAG_DEVICE_DIR=str(dev), GPUDIAG_DRIVER_PROC_DIR=str(proc),
               RUNTIME_DIRECTORY="/run/gpudiag/daemon", TMPFILES_CONF=str(TMPFILES))
    env.pop("XDG_RUNTIME_DIR", None)
    env = fakes.env(base=env, FAKE_NVML_DEVICE_COUNT=2)
    cfg = write_config(work / "gpudiag.toml", daemon_toml({"xid": {"enabled": False}}))
    state = work / f"state-{len(rw)}"
    keep = kept_under_tmp(ROOT, work, Path(sys.executable).parent)
    prefix = ("unshare", "-m", "--propagation", "private", "--", "sh", "-c", SANDBOX, "sh",
              " ".join(rw), " ".join(keep))
    return Daemon(env, cfg, state, prefix=prefix)


def metric(daemon: Daemon, name: str) -> float:
    text = str(daemon.get("/metrics")[1])
    (value,) = [line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")]
    return float(value)


def test_the_unit_gives_the_daemon_the_shared_lock_folder(
        outside_tmp: tuple[FakeDriver, Path]) -> None:
    require_root_tools("unshare", "systemd-tmpfiles")
    fakes, work = outside_tmp
    rw = unit_writable_paths()
    assert "/run/gpudiag/locks" in rw, f"{UNIT.name} does not let the daemon write the locks"
    daemon = sandboxed_daemon(fakes, work, rw)
    try:
        daemon.wait_ready()
        assert metric(daemon, "gpudiag_lock_dir_shared") == 1.0
        # The cuda round locked both GPUs there; the lock files stay (never unlinked).
        locks = Path(f"/proc/{daemon.proc.pid}/root/run/gpudiag/locks")
        names = wait_for(lambda: sorted(p.name for p in locks.glob("GPU-*.lock")), 10)
        assert len(names) == 2, names
        # Probes lock shared (siblings prove side by side) and leave the holder record to
        # exclusive holders: the daemon's claim shows as a lock file with no record, or a
        # record naming the daemon's probe (a GPU in an exclusive compute mode).
        text = (locks / names[0]).read_text()
        if text:
            holder = json.loads(text)
            assert holder["purpose"] == "probe" and holder["pid"] == daemon.proc.pid
        assert oct(os.stat(locks).st_mode & 0o7777) == "0o1777"
        assert not any("lock folder" in line for line in daemon.lines)
    finally:
        assert daemon.stop() == 0


def test_without_the_units_read_write_path_the_daemon_warns_and_says_so_in_a_metric(
        outside_tmp: tuple[FakeDriver, Path]) -> None:
    require_root_tools("unshare", "systemd-tmpfiles")
    fakes, work = outside_tmp
    rw = [p for p in unit_writable_paths() if p != "/run/gpudiag/locks"]
    daemon = sandboxed_daemon(fakes, work, rw)
    try:
        daemon.wait_ready()
        assert metric(daemon, "gpudiag_lock_dir_shared") == 0.0
        (warning,) = [json.loads(x) for x in daemon.lines if "lock folder" in x]
        assert warning["level"] == "warning" and warning["lock_dir_shared"] is False
        assert "/run/gpudiag/locks is not usable" in warning["msg"]
        assert warning["lock_dir"].startswith("/tmp/"), warning  # the private fallback
    finally:
        assert daemon.stop() == 0


def test_the_daemonset_mounts_the_nodes_lock_folder() -> None:
    yaml = pytest.importorskip("yaml")
    (ds,) = [d for d in yaml.safe_load_all(
        (ROOT / "deploy" / "kubernetes" / "daemonset.yaml").read_text()) if d]
    spec = ds["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    (container,) = [c for c in spec["containers"] if c["name"] == "gpudiag"]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/run/gpudiag/locks"]
    assert not mount.get("readOnly")
    assert volumes[mount["name"]]["hostPath"] == {"path": "/run/gpudiag/locks",
                                                  "type": "DirectoryOrCreate"}
    # The kubelet makes a missing hostPath root's 0755: the init container opens it to all.
    (init,) = spec["initContainers"]
    assert any(m["mountPath"] == "/run/gpudiag/locks" for m in init["volumeMounts"])
    assert "os.chmod('/run/gpudiag/locks', 0o1777)" in " ".join(init["command"])
