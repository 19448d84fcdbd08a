"""The backend registry: one spec per backend, every backend table derived from the list.

A toy backend (tests/toy/toy_backend.py: one module) and one registry line (a generated
sitecustomize.py that appends its spec) make it appear in `gpudiag probe`, `preflight
--require`, the verdict record, the daemon's /metrics and the generated docs, with no other
file changed.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpudiag.core import registry
from gpudiag.core.catalog import LAYER_ORDER
from tests.fakes.build import FakeDriver
from tests.support.daemon import Daemon, daemon_toml, host_env, wait_for, write_config
from tests.support.toy import REPO, toy_registered, toy_registered_env


@pytest.fixture
def toy_env(fakes: FakeDriver, tmp_path: Path) -> dict[str, str]:
    """A healthy fake host whose Python processes have the toy backend registered."""
    return toy_registered_env(host_env(fakes, tmp_path / "host"), tmp_path / "site")


def gpudiag(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpudiag", *args], env=env, text=True,
                          capture_output=True, timeout=120, check=False)


def test_every_spec_names_a_catalog_layer_and_an_importable_probe() -> None:
    for spec in registry.specs():
        assert spec.layer in LAYER_ORDER, spec.name
        assert importlib.util.find_spec(spec.probe_module) is not None, spec.name
    assert registry.probe_names() == ("host", "nvml", "cuda", "jax", "iree", "nic")
    assert registry.requirable() == ("nvml", "cuda", "jax", "iree", "nic")


def test_the_registry_line_registers_the_toy_in_this_process_until_undone() -> None:
    with toy_registered():
        assert registry.probe_names()[-1] == "toy" and "toy" in registry.requirable()
        spec = registry.spec("toy")
        assert spec is not None and spec.probe_module == "tests.toy.toy_backend"
    assert registry.probe_names() == ("host", "nvml", "cuda", "jax", "iree", "nic")


def test_the_toy_backend_is_unknown_without_its_registry_line(fakes: FakeDriver,
                                                               tmp_path: Path) -> None:
    out = gpudiag(host_env(fakes, tmp_path), "preflight", "--require", "toy", "--no-daemon")
    assert out.returncode == 2 and "unknown backend 'toy'" in out.stderr


def test_a_toy_backend_shows_in_probe_preflight_and_the_verdict(toy_env: dict[str, str]
                                                                ) -> None:
    help_text = " ".join(gpudiag(toy_env, "probe", "--help").stdout.split())  # unwrapped
    assert "host,nvml,cuda,jax,iree,nic,toy" in help_text
    probe = gpudiag(toy_env, "probe", "--backend", "host,nvml,cuda,toy", "--format", "json")
    assert probe.returncode == 0, probe.stderr
    toy = json.loads(probe.stdout)["backends"]["toy"]
    assert toy["status"] == "ok" and toy["detail"]["answer"] == 42
    pre = gpudiag(toy_env, "preflight", "--require", "toy", "--no-daemon", "--format", "json")
    assert pre.returncode == 0, pre.stderr
    record = json.loads(pre.stdout)
    assert record["gpu_validation_blocker"] == "none"
    assert record["requirement"]["backends"] == ["toy"]
    assert list(record["backends"]) == ["host", "nvml", "cuda", "toy"]
    assert record["backends"]["toy"]["versions"] == {"toy": "0.1"}


def test_a_toy_backend_shows_in_the_generated_docs(toy_env: dict[str, str]) -> None:
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_backend_docs.py"),
                          "--print"], env=toy_env, text=True, capture_output=True,
                         timeout=60, check=True)
    assert "| `toy` | A toy backend: answers 42. | `toy` | `requirement` | 1 s | 20 s |" \
        in out.stdout


def test_a_toy_backend_shows_in_the_daemons_metrics(toy_env: dict[str, str],
                                                    tmp_path: Path) -> None:
    config = write_config(tmp_path / "gpudiag.toml", daemon_toml())
    daemon = Daemon(toy_env, config, tmp_path / "state")
    try:
        daemon.wait_ready()

        def toy_up() -> str | None:
            text = str(daemon.get("/metrics")[1])
            return text if 'gpudiag_backend_up{backend="toy"} 1.0' in text else None

        metrics = wait_for(toy_up, 20)
        assert 'gpudiag_probe_runs_total{backend="toy",outcome="ok"}' in metrics
        assert 'gpudiag_backend_ready{backend="toy"} 1.0' in metrics
    finally:
        daemon.stop()


def test_the_generated_backend_table_is_current() -> None:
    from scripts.gen_backend_docs import rewrite

    doc = REPO / "docs" / "reference.md"
    assert doc.read_text() == rewrite(doc.read_text()), \
        "run: .venv/bin/python scripts/gen_backend_docs.py"
