"""Installing gpudiag as an operator would: the sdist and wheel build and pass `twine check`;
the wheel installs into a fresh venv and its `gpudiag probe` answers as the checkout's does;
scripts/install-node.sh lays out /opt/gpudiag, the unit, tmpfiles.d and the config."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from gpudiag.core.version import __version__
from tests.fakes.build import FakeDriver
from tests.support.daemon import host_env
from tests.support.deploy import ROOT, one_builder
from tests.support.host import run_gpudiag

# The build waits for another worker's build of this checkout (an image's, a machine's wheel:
# tests/support/deploy.one_builder), which a cold CI machine makes minutes long.
pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`python -m build` of this checkout: one sdist and one wheel."""
    out = tmp_path_factory.mktemp("dist")
    with one_builder("checkout-build"):  # another xdist worker may build it in place too
        proc = subprocess.run([sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir",
                               str(out), str(ROOT)], capture_output=True, text=True,
                              timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_sdist_and_wheel_build_and_pass_twine_check(dist: Path) -> None:
    names = sorted(p.name for p in dist.iterdir())
    assert names == [f"gpudiag-{__version__}-py3-none-any.whl", f"gpudiag-{__version__}.tar.gz"]
    proc = subprocess.run([sys.executable, "-m", "twine", "check", "--strict",
                           *map(str, sorted(dist.iterdir()))], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0 and proc.stdout.count("PASSED") == 2, proc.stdout + proc.stderr
    with zipfile.ZipFile(dist / names[0]) as whl:
        files = whl.namelist()
    assert "gpudiag/py.typed" in files and "gpudiag/probes/__main__.py" in files
    assert not any(f.startswith("tests/") for f in files)


@pytest.mark.slow  # a fresh venv and a pip install of the wheel's dependencies: ~25 s
def test_the_wheel_in_a_fresh_venv_probes_like_the_checkout(
        dist: Path, fakes: FakeDriver, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    (wheel,) = dist.glob("*.whl")
    proc = subprocess.run([str(venv / "bin" / "pip"), "install", "-q",
                           "--disable-pip-version-check", str(wheel)], capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    env = host_env(fakes, tmp_path / "host", gpus=2, FAKE_NVML_DEVICE_COUNT=2)
    # The wheel without extras: the NVIDIA stack's probes (jax and iree are extras).
    args = ["probe", "--backend", "host,nvml,cuda", "--format", "json"]
    installed = subprocess.run([str(venv / "bin" / "gpudiag"), *args], env=env,
                               capture_output=True, text=True, timeout=120, check=False,
                               cwd=tmp_path)
    checkout = run_gpudiag(args, env)
    assert installed.returncode == checkout.returncode == 0, installed.stderr[-2000:]
    mine, theirs = json.loads(installed.stdout), json.loads(checkout.stdout)
    assert mine["gpu_validation_blocker"] == theirs["gpu_validation_blocker"] == "none"
    assert [d["uuid"] for d in mine["devices"]] == [d["uuid"] for d in theirs["devices"]]
    assert mine["gpudiag_version"] == __version__


@pytest.mark.slow  # install-node.sh twice (a venv and a pip install each): ~35 s
def test_install_node_lays_out_the_prefix_unit_tmpfiles_config_and_slurm_scripts(
        dist: Path, fakes: FakeDriver, tmp_path: Path) -> None:
    prefix, root = tmp_path / "opt" / "gpudiag", tmp_path / "root"
    (wheel,) = dist.glob("*.whl")
    proc = subprocess.run([str(ROOT / "scripts" / "install-node.sh"), "--wheel", str(wheel),
                           "--prefix", str(prefix), "--root", str(root)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    unit = (root / "etc/systemd/system/gpudiag.service").read_text()
    assert f"ExecStart={prefix}/bin/gpudiag serve --config /etc/gpudiag/gpudiag.toml" in unit
    assert (root / "usr/lib/tmpfiles.d/gpudiag.conf").read_text() == (
        ROOT / "systemd/gpudiag-tmpfiles.conf").read_text()
    assert (root / "etc/gpudiag/gpudiag.toml").read_text() == (
        ROOT / "systemd/gpudiag.toml").read_text()
    assert (root / "usr/share/doc/gpudiag/operations.md").is_file()  # the unit's Documentation=
    assert (prefix / "share/gpudiag/slurm/gpudiag-healthcheck.sh").is_file()
    # node-problem-detector's plugin is not a host's: it comes from the image (test_npd.py).
    assert not (prefix / "share/gpudiag/npd").exists()
    env = host_env(fakes, tmp_path / "host", gpus=2, FAKE_NVML_DEVICE_COUNT=2)
    # The installed gpudiag answers the node-health question on the (fake) host.
    ran = subprocess.run([str(prefix / "bin/gpudiag"), "health", "--require", "nvml",
                          "--format", "kv"], env=env, capture_output=True, text=True,
                         timeout=120, check=False)
    assert ran.returncode == 0 and "gpu_validation_blocker=none" in ran.stdout, ran.stderr
    # Run again: the operator's edited config is kept.
    (root / "etc/gpudiag/gpudiag.toml").write_text('listen = "0.0.0.0:9477"\n')
    again = subprocess.run([str(ROOT / "scripts" / "install-node.sh"), "--wheel", str(wheel),
                            "--prefix", str(prefix), "--root", str(root)],
                           capture_output=True, text=True, timeout=600, check=False)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (root / "etc/gpudiag/gpudiag.toml").read_text() == 'listen = "0.0.0.0:9477"\n'


@pytest.mark.parametrize("script", ["install-node.sh", "build-image.sh", "setup.sh"])
def test_the_deployment_scripts_pass_shellcheck(script: str) -> None:
    shellcheck = Path(sys.executable).with_name("shellcheck")
    proc = subprocess.run([str(shellcheck), str(ROOT / "scripts" / script)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout


def _fake_bin(folder: Path, log: Path) -> Path:
    """A PATH with the few tools setup.sh runs and an apt-get that records its arguments:
    every package setup.sh looks for is missing there."""
    import os
    import shutil

    folder.mkdir()
    for tool in ("bash", "id", "dirname", "cat", "sed"):
        found = shutil.which(tool)
        assert found, tool
        (folder / tool).symlink_to(found)
    (folder / "python3").symlink_to(sys.executable)  # not a shim (pyenv) needing its PATH
    apt = folder / "apt-get"
    apt.write_text(f"#!/bin/sh\necho \"$*\" >> {log}\n")
    apt.chmod(0o755)
    assert os.access(apt, os.X_OK)
    return folder


@pytest.mark.parametrize(("args", "wanted", "not_wanted"), [
    ([], {"gcc", "libc6-dev"}, {"slurm-wlm", "munge", "podman", "prometheus", "buildah"}),
    (["--tests"], {"gcc", "prometheus", "systemd", "slurm-wlm", "munge", "buildah", "podman",
                   "runc", "mmdebstrap", "systemd-container"}, set()),
])
def test_setup_installs_for_probing_only_what_probing_needs(
        tmp_path: Path, args: list[str], wanted: set[str], not_wanted: set[str]) -> None:
    import os

    if os.geteuid() != 0:
        pytest.skip("setup.sh installs Debian packages only as root")
    log = tmp_path / "apt.log"
    path = _fake_bin(tmp_path / "bin", log)
    proc = subprocess.run([str(path / "bash"), str(ROOT / "scripts" / "setup.sh"), *args],
                          env={"PATH": str(path), "SETUP_APT_WAIT_S": "30"},
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    (install,) = [line.split() for line in log.read_text().splitlines() if " install " in line]
    assert "DPkg::Lock::Timeout=30" in install  # apt waits for another apt's lock, bounded
    assert wanted <= set(install) and not set(install) & not_wanted, install


def test_apt_lock_waits_for_another_holder_then_gives_up_naming_it(tmp_path: Path) -> None:
    from scripts.apt_lock import wait

    lock = tmp_path / "lock-frontend"
    lock.write_text("")
    said: list[str] = []
    assert wait([str(lock), str(tmp_path / "absent")], 0.1, said.append) and said == []
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time\n"
        f"f = open({str(lock)!r}, 'r+'); fcntl.lockf(f, fcntl.LOCK_EX)\n"
        "print('held', flush=True); time.sleep(30)")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        assert not wait([str(lock)], 0.5, said.append)
        assert "another apt or dpkg holds" in said[0] and "at most 0.5 s" in said[0]
        assert f"process {holder.pid} (python" in said[0]
        assert said[-1].startswith("setup: gave up after 0.5 s") and "SETUP_APT_WAIT_S" in said[-1]
    finally:
        holder.kill()
        holder.wait()
    assert wait([str(lock)], 5.0, said.append)
