"""`serve --check-config` prints every setting, derived from the config dataclasses."""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from gpudiag.core.settings import declared
from gpudiag.daemon.config import DaemonConfig, load_config
from gpudiag.daemon.effective import NOT_IN_FILE, PLACES, effective_lines

# Every key the file may set, none at its default.
EVERY_KEY = """
listen = "127.0.0.2:9998"
default_requirement = "cuda,jax"
preflight_wait_s = 5
socket = "/run/gpudiag-test/g.sock"
tcp_read_only = true
expected_gpus = 4
nfd_features_file = "/etc/kubernetes/node-feature-discovery/features.d/gpudiag"
nfd_expiry_s = 120
[scheduler]
jitter_ratio = 0.2
backoff_max_s = 120
tick_s = 0.1
probe_busy_gpus = true
[backends.nvml]
interval_s = 0.25
deadline_s = 2
[backends.iree]
enabled = false
[backends.nic]
enabled = true
expect = ["mlx5_0/1", "eth2"]
min_rate_gbps = 400
[xid]
enabled = false
hold_s = 600
gap_warning_s = 30
heartbeat_s = 0.5
telemetry_s = 2
restart_backoff_max_s = 30
storm_window_s = 60
[xid.promote.13]
count = 3
window_s = 600
[xid.promote.31]
count = 0
[history]
retention_s = 86400
max_bytes = "16MiB"
[nvml]
expected_nvlinks = 12
clock_event_dwell_s = 30
pcie_block_below_width = 8
[qualification]
enabled = false
tier = "full"
idle_s = 60
max_age_s = 3600
tick_s = 1
max_request_gpu_s = 120
max_queued = 4
table_ratio = 0.4
peer_ratio = 0.7
history_ratio = 0.6
hysteresis = 0.1
block = true
[log]
format = "json"
level = "debug"
[jobs]
enabled = false
interval_s = 2
stall_after_s = 60
stall_utilization = 0.95
stall_power_ratio = 0.3
link_flat_kbps = 512
straggler_after_s = 600
straggler_ratio = 0.8
busy_utilization = 0.6

[gpu_reset]
enabled = true
nvidia_smi = "/opt/nvidia/bin/nvidia-smi"
command_timeout_s = 30
max_attempts_per_gpu = 2
attempt_window_s = 3600
verify_timeout_s = 120
tick_s = 0.5

[runtimes.gpudiag]
require = "jax"

[runtimes.train]
python = "/usr/bin/python3"
env = { LD_LIBRARY_PATH = "/usr/local/cuda/compat", XLA_FLAGS = "--xla_gpu_autotune_level=0" }
require = ["jax", "iree"]
"""


def _names(obj: Any) -> set[str]:
    """Every field name of a dataclass and of the records inside it."""
    out: set[str] = set()
    for f in fields(obj):
        value = getattr(obj, f.name)
        out.add(f.name)
        if is_dataclass(value):
            out |= _names(value)
        elif isinstance(value, dict):
            out |= {n for v in value.values() if is_dataclass(v) for n in _names(v)}
    return out


def _classes(obj: Any) -> set[type]:
    """The record classes of a dataclass and of the records inside it."""
    out: set[type] = {type(obj)}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if is_dataclass(value) and not isinstance(value, type):
            out |= _classes(value)
    return out


def test_every_key_round_trips_through_the_printed_configuration(tmp_path: Path) -> None:
    given = tmp_path / "given.toml"
    given.write_text(EVERY_KEY)
    cfg = load_config(given)
    assert cfg.nfd_features_file is not None and cfg.nfd_expiry_s == 120
    printed = tmp_path / "printed.toml"
    printed.write_text("\n".join(effective_lines(cfg)) + "\n")
    assert load_config(printed) == cfg


def test_every_field_is_printed_or_said_why_not() -> None:
    text = "\n".join(effective_lines(DaemonConfig()))
    places = [*PLACES.values(), *(s.at for cls in _classes(DaemonConfig())
                                  for s in declared(cls).values() if s.at)]
    keys = {place.rpartition(".")[2] for place in places}
    shown = {line.lstrip("# ").split(" ")[0] for line in text.splitlines()}
    for name in _names(DaemonConfig()) - {"backends", "xid", "history", "nvml",
                                          "qualification", "thresholds", "runtimes",
                                          "remediation", "jobs", "gpu_reset"}:
        qual = [q for q in (*PLACES, *NOT_IN_FILE) if q.endswith(f".{name}")] + [
            s.at for cls in _classes(DaemonConfig()) for n, s in declared(cls).items()
            if n == name and s.at]
        assert name in shown or qual, f"{name} is missing from serve --check-config"
    assert {"nfd_features_file", "nfd_expiry_s", "clock_event_dwell_s"} <= shown
    assert "[runtimes.gpudiag]" in shown  # a table per runtime, the daemon's own always
    tables = {part for line in text.splitlines() if line.startswith("[")
              for part in line.strip("[]").split(".")}
    assert keys - {""} <= shown | tables  # a place may be a table ([xid.promote.13])
