"""A real Prometheus for the tests and benchmarks: the tools, and the nodes it scrapes.

``start_prometheus`` runs one scraping real `gpudiag serve` daemons (``start_daemon`` on a
``node_env`` host of two fake GPUs, at a scrape-friendly pace) every second with gpudiag's
rules loaded; ``promtool`` runs the rules' checks and unit tests.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

from tests.fakes.build import FakeDriver
from tests.support.daemon import Daemon, daemon_toml, host_env, write_config
from tests.support.host import free_port

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "prometheus" / "gpudiag.rules.yml"
RULE_TESTS = ROOT / "prometheus" / "gpudiag.rules.test.yml"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    """Run promtool in the rules' folder (the rule tests name their files relative to it)."""
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60,
                          check=False, cwd=RULES.parent)


def http_json(url: str, timeout: float = 5.0) -> Any:
    """GET ``url`` and parse its JSON (Prometheus's HTTP API)."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


# The shared test daemon config at a scrape-friendly pace (scheduler and watcher defaults).
FLEET_CONFIG: dict[str, dict[str, Any]] = {
    "scheduler": {"tick_s": 0.2, "jitter_ratio": None, "backoff_max_s": None},
    "backends.nvml": {"interval_s": 1.0, "deadline_s": None},
    "xid": {"heartbeat_s": None, "gap_warning_s": None},
    # Each fake GPU qualified once, against a table of this machine's fakes (no alert fires).
    "qualification": {"idle_s": 0.5, "tick_s": 0.2, "reference_file": None},
}
FAKE_REFERENCE = {"models": [{"model": "fake", "names": ["h200"],
                              "source": "tests/support/prometheus.py",
                              "peaks": {"memory_bandwidth": 1e6, "host_to_device_bandwidth": 1e6,
                                        "device_to_host_bandwidth": 1e6}}]}


def start_daemon(folder: Path, env: dict[str, str], extra_args: tuple[str, ...] = ()
                 ) -> Daemon:
    """A real `gpudiag serve` in ``folder`` at FLEET_CONFIG's pace, qualified on the fakes."""
    folder.mkdir(parents=True)
    table = folder / "reference.json"
    table.write_text(json.dumps(FAKE_REFERENCE))
    config = daemon_toml({**FLEET_CONFIG, "qualification": {
        **FLEET_CONFIG["qualification"], "reference_file": str(table)}})
    return Daemon(env, write_config(folder / "gpudiag.toml", config),
                  folder / "state", extra_args=extra_args)


def node_env(fakes: FakeDriver, root: Path, **knobs: str) -> dict[str, str]:
    """A scraped node's host: two healthy fake GPUs, plus ``knobs``."""
    two = {"FAKE_NVML_DEVICE_COUNT": "2", "FAKE_CUDA_DEVICE_COUNT": "2"}
    return host_env(fakes, root, gpus=2, **{**two, **knobs})


def start_prometheus(root: Path, targets: list[str]) -> subprocess.Popen[bytes]:
    """A real Prometheus scraping ``targets`` every second with gpudiag's rules; ``.port``."""
    assert PROMETHEUS is not None
    port = free_port()
    rules = root / "gpudiag.rules.yml"
    shutil.copy(RULES, rules)
    (root / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"rule_files: [{rules}]\n"
        "scrape_configs:\n  - job_name: gpudiag\n    static_configs:\n"
        f"      - targets: {json.dumps(targets)}\n")
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={root / 'prometheus.yml'}",
         f"--storage.tsdb.path={root / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=(root / "prometheus.log").open("w"))
    proc.port = port  # type: ignore[attr-defined]
    return proc
