"""The node-feature-discovery local feature file: its contents follow the daemon's proven
readiness, it is rewritten atomically when readiness changes (and only then, or before it
expires), and a real `gpudiag serve` keeps it current as a GPU is lost and comes back."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpudiag.core import registry
from gpudiag.daemon.config import ConfigError, from_mapping
from gpudiag.daemon.nfd import NfdFeatureFile, feature_labels, render
from tests.fakes.build import FakeDriver, write_state_file
from tests.support.daemon import (
    Daemon,
    Runs,
    daemon_toml,
    real_runs,
    snapshot_of,
    wait_for,
    write_config,
)
from tests.support.prometheus import FLEET_CONFIG, node_env


def parse(text: str) -> dict[str, str]:
    """NFD's reading of a feature file: name=value lines; '#' lines are comments."""
    return dict(line.split("=", 1) for line in text.splitlines()
                if line and not line.startswith("#"))


@pytest.fixture(scope="module")
def healthy_runs(fakes: FakeDriver, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return real_runs(node_env(fakes, tmp_path_factory.mktemp("nfd-ok")))


@pytest.fixture(scope="module")
def no_driver_runs(fakes: FakeDriver, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return real_runs(node_env(fakes, tmp_path_factory.mktemp("nfd-bad"),
                              FAKE_NVML_INIT_ERROR="9"))


def test_labels_say_which_backends_are_proven(healthy_runs: Runs) -> None:
    labels = feature_labels(snapshot_of(healthy_runs))
    assert labels == {"gpudiag.ready": "true", "gpudiag.ready.cuda": "true",
                      "gpudiag.ready.jax": "false", "gpudiag.ready.iree": "false",
                      "gpudiag.ready.nic": "false", "gpudiag.gpus-healthy": "2"}
    assert {f"gpudiag.ready.{b}" for b in registry.published()} < set(labels)


def test_a_host_wide_blocker_makes_every_backend_false(no_driver_runs: Runs) -> None:
    labels = feature_labels(snapshot_of(no_driver_runs))
    assert {k: v for k, v in labels.items() if k.startswith("gpudiag.ready")} == {
        "gpudiag.ready": "false", "gpudiag.ready.cuda": "false",
        "gpudiag.ready.jax": "false", "gpudiag.ready.iree": "false",
        "gpudiag.ready.nic": "false"}


def test_the_file_is_rewritten_only_when_labels_change_or_expiry_nears(
        tmp_path: Path, healthy_runs: Runs, no_driver_runs: Runs) -> None:
    ok, bad = snapshot_of(healthy_runs), snapshot_of(no_driver_runs)
    now = [1_800_000_000.0]
    path = tmp_path / "features.d" / "gpudiag"
    path.parent.mkdir()
    nfd = NfdFeatureFile(path, expiry_s=600, wall=lambda: now[0])
    assert nfd.update(ok) and parse(path.read_text())["gpudiag.ready.cuda"] == "true"
    assert "# +expiry-time=2027-01-15T08:10:00Z" in path.read_text().splitlines()
    inode = os.stat(path).st_ino
    now[0] += 10
    assert not nfd.update(ok)  # same labels: the file is left alone
    assert os.stat(path).st_ino == inode and nfd.writes == 1
    assert nfd.update(bad)
    assert parse(path.read_text())["gpudiag.ready.cuda"] == "false"
    assert os.stat(path).st_ino != inode  # a new file renamed over the old: atomic
    now[0] += 301  # past half the lifetime: rewritten with a later expiry
    assert nfd.update(bad) and "2027-01-15T08:15:11Z" in path.read_text()
    assert sorted(p.name for p in path.parent.iterdir()) == ["gpudiag"]  # no temp files left


def test_an_unwritable_folder_is_logged_and_retried(tmp_path: Path, healthy_runs: Runs,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "missing" / "gpudiag"
    nfd = NfdFeatureFile(path)
    snap = snapshot_of(healthy_runs)
    assert not nfd.update(snap) and not nfd.update(snap)
    warnings = [r for r in caplog.records if "nfd feature file" in r.getMessage()]
    assert len(warnings) == 1 and "folder does not exist" in warnings[0].getMessage()
    path.parent.mkdir()
    assert nfd.update(snap) and parse(path.read_text())["gpudiag.ready"] == "true"


def test_render_is_what_nfd_reads() -> None:
    text = render({"gpudiag.ready.jax": "true"}, 0.0)
    assert text.splitlines() == [
        "# Written by gpudiag serve (nfd_features_file); rewritten when readiness changes.",
        "# +expiry-time=1970-01-01T00:00:00Z", "gpudiag.ready.jax=true"]


@pytest.mark.parametrize(("value", "needle"), [
    ("features.d/gpudiag", "not an absolute file path"),
    ("/etc/nfd/features.d/", "not an absolute file path"),
    ("/etc/nfd/features.d/.gpudiag", "hidden files"),
    (3, "expected a path string"),
])
def test_bad_nfd_paths_are_config_errors(value: object, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        from_mapping({"nfd_features_file": value})
    assert from_mapping({"nfd_features_file": ""}).nfd_features_file is None
    assert from_mapping({"nfd_features_file": "/x/gpudiag", "nfd_expiry_s": 60}
                        ).nfd_expiry_s == 60


def test_a_real_daemon_keeps_the_file_current_as_a_gpu_is_lost_and_repaired(
        fakes: FakeDriver, tmp_path: Path) -> None:
    state = tmp_path / "gpu-state"
    write_state_file(state, {})
    env = node_env(fakes, tmp_path / "host", FAKE_GPU_STATE_FILE=str(state))
    env["GPUDIAG_LOCK_DIR"] = str(tmp_path / "locks")
    features = tmp_path / "features.d" / "gpudiag"
    features.parent.mkdir()
    toml = daemon_toml({**FLEET_CONFIG, "": {"nfd_features_file": str(features)}})
    daemon = Daemon(env, write_config(tmp_path / "gpudiag.toml", toml), tmp_path / "state")
    try:
        def labels() -> dict[str, str]:
            return parse(features.read_text()) if features.exists() else {}

        wait_for(lambda: labels().get("gpudiag.gpus-healthy") == "2", 30, 0.2)
        assert labels()["gpudiag.ready.cuda"] == "true"
        write_state_file(state, {"FAKE_NVML_DEVICE_ERRORS": "1:15"})  # GPU 1 lost
        wait_for(lambda: labels().get("gpudiag.gpus-healthy") == "1", 30, 0.2)
        write_state_file(state, {})
        wait_for(lambda: labels().get("gpudiag.gpus-healthy") == "2", 30, 0.2)
        assert any("nfd labels changed" in line for line in daemon.lines)
    finally:
        daemon.stop()
