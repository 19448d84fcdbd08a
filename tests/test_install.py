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
from tests.support.deploy import ROOT
from tests.support.host import run_gpudiag


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`python -m build` of this checkout: one sdist and one wheel."""
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run([sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir",
                           str(out), str(ROOT)], capture_output=True, text=True, timeout=600,
                          check=False)
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
