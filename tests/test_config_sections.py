"""The config sections read generically from their dataclasses (gpudiag.core.settings): every
declared key takes its bounds and refuses what lies past them with the words it always had,
and docs/daemon.md's configuration table agrees with the declarations (defaults and bounds).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest

from gpudiag.core.gpu_reset import GpuResetConfig
from gpudiag.core.job_watch import JobWatchPolicy
from gpudiag.core.nvml_health import NvmlHealthPolicy
from gpudiag.core.qualify_score import Thresholds
from gpudiag.core.remediation_config import RemediationConfig
from gpudiag.core.requirement import parse_size
from gpudiag.core.settings import Check, Choice, Count, Flag, Number, Setting, declared
from gpudiag.daemon.config import (
    ConfigError,
    DaemonConfig,
    HistoryConfig,
    QualificationConfig,
    XidConfig,
    from_mapping,
)

DOCS = (Path(__file__).resolve().parent.parent / "docs" / "daemon.md").read_text()
# Each record class read by its declarations, with its table in the file.
SECTIONS: list[tuple[str, type]] = [
    ("", DaemonConfig), ("jobs", JobWatchPolicy), ("gpu_reset", GpuResetConfig),
    ("remediation", RemediationConfig), ("history", HistoryConfig), ("xid", XidConfig),
    ("nvml", NvmlHealthPolicy), ("qualification", QualificationConfig),
    ("qualification", Thresholds)]
SHARE = "a ratio above 0 and at most 1 (0.8: at least 80% of the reference)"
FLAG = "true or false"
EXECUTABLE = "the absolute path of the executable (never looked up in PATH)"
# Today's words for a bad value of every declared key (as the hand-written readers said them).
REFUSED: list[tuple[str, Any, str]] = [
    ("jobs.enabled", 5, FLAG),
    ("jobs.interval_s", 101, "a number of seconds from 0.05 to 60"),
    ("jobs.stall_after_s", 100001, "a number of seconds from 0.01 to 86400"),
    ("jobs.stall_utilization", 0, SHARE),
    ("jobs.stall_power_ratio", 3, SHARE),
    ("jobs.link_flat_kbps", math.inf, "a throughput in kB/s, 0 or more"),
    ("jobs.straggler_after_s", 0.005, "a number of seconds from 0.01 to 86400"),
    ("jobs.straggler_ratio", True, SHARE),
    ("jobs.busy_utilization", "x", SHARE),
    ("gpu_reset.enabled", "yes", FLAG),
    ("gpu_reset.nvidia_smi", "/a\0b", EXECUTABLE),
    ("gpu_reset.command_timeout_s", 601, "a number of seconds from 1 to 600"),
    ("gpu_reset.max_attempts_per_gpu", 0, "a number of resets from 1 to 100"),
    ("gpu_reset.attempt_window_s", 0.5, "a number of seconds from 1 to 3.16224e+07"),
    ("gpu_reset.verify_timeout_s", 86401, "a number of seconds from 1 to 86400"),
    ("gpu_reset.tick_s", 0.04, "a number of seconds from 0.05 to 60"),
    ("scheduler.jitter_ratio", 0.51, "a number from 0 to 0.5"),
    ("scheduler.backoff_max_s", math.nan, "a number of seconds from 0.01 to 86400"),
    ("scheduler.tick_s", 5.5, "a number of seconds from 0.01 to 5"),
    ("scheduler.probe_busy_gpus", 1, FLAG),
    ("log.format", "yaml", "one of text, json"),
    ("log.level", 2, "one of debug, info, warning, error"),
    ("history.retention_s", 0.5, "a number of seconds from 1 to 3.1536e+08"),
    ("history.max_bytes", 4095, 'bytes (at least 4096) or a size such as "64MiB"'),
    ("remediation.mode", "on", "one of off, observe, act"),
    ("remediation.scheduler", "toy", "one of slurm"),
    ("remediation.scontrol", "scontrol", EXECUTABLE),
    ("remediation.sinfo", 2, EXECUTABLE),
    ("remediation.slurm_conf", "etc/slurm.conf", "an absolute path"),
    ("remediation.node_name", "n1,n2", "one Slurm node name (letters, digits, '.', '_', '-'; "
     "no list or host range: a daemon drains its own node only)"),
    ("remediation.partition", "p[1-2]", "a Slurm name (letters, digits, '.', '_', '-'; "
     "partitions comma-separated)"),
    ("remediation.killswitch_file", "", "an absolute path"),
    ("remediation.tick_s", 60.1, "a number of seconds from 0.05 to 60"),
    ("remediation.command_timeout_s", 0.05, "a number of seconds from 0.1 to 60"),
    ("remediation.retry_max_s", 3601, "a number of seconds from 0.1 to 3600"),
    ("remediation.fleet_window_s", 0.5, "a number of seconds from 1 to 86400"),
    ("remediation.fleet_min_nodes", -1, "a node count from 0 to 100000"),
    ("remediation.fleet_ratio", 1.5, "a share from 0 to 1"),
    ("remediation.max_attempts_per_gpu", 101, "a number of drains from 1 to 100"),
    ("remediation.attempt_window_s", -1, "a number of seconds from 1 to 3.16224e+07"),
    ("remediation.drain_on_nic", "false", FLAG),
    ("xid.enabled", 0, FLAG),
    ("xid.hold_s", 0, "a number of seconds from 0.01 to 3.16224e+07"),
    ("xid.gap_warning_s", "60", "a number of seconds from 0.01 to 3.16224e+07"),
    ("xid.heartbeat_s", 61, "a number of seconds from 0.01 to 60"),
    ("xid.telemetry_s", 3601, "a number of seconds from 0.01 to 3600"),
    ("xid.restart_backoff_max_s", 3601, "a number of seconds from 0.01 to 3600"),
    ("xid.storm_window_s", 0.5, "a number of seconds from 1 to 86400"),
    ("nvml.expected_nvlinks", 19, "the number of NVLink links each GPU must have active, an "
     "integer from 1 to 18 (leave it out to compare with the most links seen active)"),
    ("nvml.clock_event_dwell_s", -1, "a number of seconds from 0 to 86400"),
    ("nvml.pcie_block_below_width", 0, "a PCIe lane count from 1 to 32; a narrower link "
     "blocks (leave it out to only warn)"),
    ("qualification.enabled", "on", FLAG),
    ("qualification.tier", "slow", "one of quick, full, sdc"),
    ("qualification.idle_s", 604801, "a number of seconds from 0.01 to 604800"),
    ("qualification.max_age_s", 0.5, "a number of seconds from 1 to 3.16224e+07"),
    ("qualification.tick_s", 61, "a number of seconds from 0.01 to 60"),
    ("qualification.max_request_gpu_s", 9.9, "a number of seconds from 10 to 86400"),
    ("qualification.max_queued", 1025, "the most on-demand requests waiting at once, an "
     "integer from 1 to 1024"),
    ("qualification.table_ratio", 1.01, SHARE),
    ("qualification.peer_ratio", -0.5, SHARE),
    ("qualification.history_ratio", [0.8], SHARE),
    ("qualification.hysteresis", -0.01, "a number from 0 to 0.5"),
    ("qualification.block", "no", FLAG),
    ("qualification.reference_file", "table.json", "an absolute path to a JSON reference "
     "table"),
    ("tcp_read_only", "true", FLAG),
    ("expected_gpus", 1025, "the number of NVIDIA GPUs this node must show, an integer from 1 "
     "to 1024 (leave it out to compare the PCI bus with NVML only)"),
    ("nfd_expiry_s", 9, "a number of seconds from 10 to 604800"),
    ("preflight_wait_s", 601, "a number of seconds from 0.01 to 600"),
    ("socket", 2, 'a path string such as "/run/gpudiag/gpudiag.sock" (or "" for no socket)'),
    ("nfd_features_file", 2, "a path string such as "
     '"/etc/kubernetes/node-feature-discovery/features.d/gpudiag"'),
]


def file_keys() -> dict[str, tuple[type, str, Setting]]:
    """Every declared key by its name in the file: (class, field, declaration)."""
    out: dict[str, tuple[type, str, Setting]] = {}
    for section, cls in SECTIONS:
        for name, s in declared(cls).items():
            out[".".join(p for p in (section, s.at or name) if p)] = (cls, name, s)
    return out


def document(key: str, value: Any) -> dict[str, Any]:
    """A parsed config that sets the dotted ``key`` to ``value``."""
    *tables, last = key.split(".")
    raw: dict[str, Any] = {last: value}
    for table in reversed(tables):
        raw = {table: raw}
    return raw


def kept(cfg: DaemonConfig, key: str) -> Any:
    """The value the config keeps for the file's ``key``."""
    cls, name, _ = file_keys()[key]
    records = {DaemonConfig: cfg, JobWatchPolicy: cfg.jobs, GpuResetConfig: cfg.gpu_reset,
               RemediationConfig: cfg.remediation, HistoryConfig: cfg.history,
               XidConfig: cfg.xid, NvmlHealthPolicy: cfg.nvml,
               QualificationConfig: cfg.qualification, Thresholds: cfg.qualification.thresholds}
    return getattr(records[cls], name)


@pytest.mark.parametrize(("key", "value", "expected"), REFUSED, ids=[r[0] for r in REFUSED])
def test_a_bad_value_is_refused_with_the_words_it_always_had(
        key: str, value: Any, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        from_mapping(document(key, value))
    assert str(caught.value) == f"{key} = {value!r}: expected {expected}"


def test_every_declared_key_has_its_refusal_in_the_table() -> None:
    assert set(file_keys()) - {"default_requirement"} <= {key for key, _, _ in REFUSED}


def bounds(s: Setting) -> list[Any]:
    """The values at the edges of what ``s`` accepts (none for a rule that is not a bound)."""
    kind = s.kind
    if isinstance(kind, Number):
        return [v for v in (kind.minimum, kind.maximum)
                if math.isfinite(v) and not (kind.above and v == kind.minimum)]
    if isinstance(kind, Count):
        return [kind.low, kind.high]
    if isinstance(kind, Choice):
        return [c.upper() for c in kind.choices]
    return [True, False] if isinstance(kind, Flag) else []


@pytest.mark.parametrize("key", sorted(file_keys()))
def test_each_key_takes_its_bounds_and_refuses_past_them(key: str) -> None:
    s = file_keys()[key][2]
    for edge in bounds(s):
        want = edge.lower() if isinstance(edge, str) else edge
        assert kept(from_mapping(document(key, edge)), key) == want, (key, edge)
    past = ([s.kind.maximum * 2 + 1] if isinstance(s.kind, Number) and math.isfinite(
        s.kind.maximum) else [s.kind.high + 1] if isinstance(s.kind, Count) else [])
    # A check of its own (the default requirement) says the key and then its own words.
    for value in [*past, [1]]:
        said = re.escape(f"{key} = {value!r}: expected") + (
            "|" + re.escape(f"{key}: ") if isinstance(s.kind, Check) else "")
        with pytest.raises(ConfigError, match=f"^({said})"):
            from_mapping(document(key, value))


@pytest.mark.parametrize(("section", "cls"), SECTIONS[1:-1], ids=[s for s, _ in SECTIONS[1:-1]])
def test_an_empty_section_gives_the_records_defaults(section: str, cls: type) -> None:
    cfg = from_mapping({section: {}})
    assert all(kept(cfg, f"{section}.{s.at or n}") == getattr(cls(), n)
               for n, s in declared(cls).items())


def test_an_unknown_key_lists_the_sections_keys() -> None:
    with pytest.raises(ConfigError) as caught:
        from_mapping({"gpu_reset": {"enable": True}})
    assert str(caught.value) == (
        "unknown key(s) gpu_reset.enable; accepted here: attempt_window_s, command_timeout_s, "
        "enabled, max_attempts_per_gpu, nvidia_smi, tick_s, verify_timeout_s")


def documented_rows() -> dict[str, tuple[str, str]]:
    """docs/daemon.md's configuration table: key -> (default, meaning); a row naming several
    keys (``a.x``, ``y``) gives each its own default from the comma list."""
    table = DOCS.split("## Configuration (TOML)", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, tuple[str, str]] = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        keys = re.findall(r"`([a-zA-Z_.]+)`", cells[0])
        prefix = keys[0].rpartition(".")[0]
        defaults = cells[1].split(", ") if len(keys) > 1 else [cells[1]]
        for i, key in enumerate(keys):
            full = key if "." in key or not prefix else f"{prefix}.{key}"
            rows[full] = (defaults[i] if len(defaults) == len(keys) else "",
                          cells[2] if len(keys) == 1 else "")
    return rows


def documented_default(text: str) -> Any:
    """A default as the docs write it: a number, true/false, "a string", "64MiB"; None for
    unset or words."""
    text = text.strip("`")
    if text in ("true", "false"):
        return text == "true"
    if text.startswith('"'):
        quoted = text.split('"')[1]
        return parse_size(quoted) if re.fullmatch(r"\d+[KMG]iB", quoted) else quoted
    number = re.match(r"-?\d+(\.\d+)?", text)
    return float(number.group()) if number else None


@pytest.mark.parametrize("key", sorted(file_keys()))
def test_the_docs_table_gives_each_keys_default_and_bounds(key: str) -> None:
    rows = documented_rows()
    assert key in rows, f"docs/daemon.md's configuration table lacks `{key}`"
    cls, name, s = file_keys()[key]
    default, meaning = rows[key]
    value = getattr(cls(), name)
    said = documented_default(default)
    assert said == value or (said is None and value is None) or (
        value is None and default.startswith(("unset", "the "))), (key, default, value)
    stated = re.search(r"\((-?[\d.]+) to ([\d.]+)\)|\(?max ([\d.]+)\)?", meaning)
    if stated and isinstance(s.kind, (Number, Count)):
        low, high = ((s.kind.minimum, s.kind.maximum) if isinstance(s.kind, Number)
                     else (s.kind.low, s.kind.high))
        if stated.group(3) is not None:
            assert float(stated.group(3)) == high, (key, meaning)
        else:
            assert (float(stated.group(1)), float(stated.group(2))) == (low, high), key
