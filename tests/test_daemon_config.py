"""The daemon's TOML config: defaults, every key validated, `serve --check-config`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from gpudiag.core.limits import DEFAULT_PORT
from gpudiag.core.xids import DEFAULT_PROMOTIONS, Promotion
from gpudiag.daemon.config import ConfigError, DaemonConfig, from_mapping, load_config, parse_listen
from tests.support.host import run_gpudiag

FULL = """
listen = "127.0.0.1:9999"
default_requirement = "cuda,jax"
preflight_wait_s = 5
[scheduler]
jitter_ratio = 0.2
backoff_max_s = 120
tick_s = 0.1
[backends.nvml]
interval_s = 0.25
deadline_s = 2
[backends.iree]
enabled = false
[xid]
hold_s = 600
gap_warning_s = 30
heartbeat_s = 0.5
[history]
retention_s = 86400
max_bytes = "16MiB"
[log]
format = "json"
level = "debug"
"""


def test_defaults_match_the_documented_ones() -> None:
    cfg = DaemonConfig()
    assert (cfg.listen_host, cfg.listen_port) == ("127.0.0.1", DEFAULT_PORT)
    assert DEFAULT_PORT not in (9400, 9835)
    assert {n: b.interval_s for n, b in cfg.backends.items()} == {
        "host": 60, "nvml": 15, "cuda": 60, "jax": 3600, "iree": 3600, "nic": 1}
    assert cfg.default_requirement == "cuda"
    assert cfg.enabled_backends == ("host", "nvml", "cuda", "jax", "iree")


def test_a_full_file_is_read(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(FULL)
    cfg = load_config(path)
    assert (cfg.listen_host, cfg.listen_port) == ("127.0.0.1", 9999)
    assert cfg.backends["nvml"].interval_s == 0.25 and cfg.backends["nvml"].deadline_s == 2
    assert cfg.enabled_backends == ("host", "nvml", "cuda", "jax")
    assert cfg.history.max_bytes == 16 * 2**20 and cfg.xid.hold_s == 600
    assert (cfg.log_format, cfg.log_level, cfg.jitter_ratio) == ("json", "debug", 0.2)


@pytest.mark.parametrize("raw, needle", [
    ({"listen": "localhost"}, "listen 'localhost' is not HOST:PORT"),
    ({"listen": "127.0.0.1:99999"}, "port '99999' is not 0-65535"),
    ({"default_requirement": "tpu"}, "default_requirement: unknown backend 'tpu'"),
    ({"default_requirement": 3}, "default_requirement"),
    ({"preflight_wait_s": "5"}, "preflight_wait_s = '5': expected a number of seconds"),
    ({"preflight_wait_s": 0}, "preflight_wait_s = 0"),
    ({"scheduler": {"jitter_ratio": 0.9}}, "scheduler.jitter_ratio = 0.9"),
    ({"scheduler": {"tick": 1}}, "unknown key(s) scheduler.tick"),
    ({"backends": {"nvml": {"interval_s": -1}}}, "backends.nvml.interval_s = -1"),
    ({"backends": {"nvml": {"enabled": "yes"}}}, "backends.nvml.enabled = 'yes': expected true"),
    ({"backends": {"gpu": {}}}, "unknown key(s) backends.gpu"),
    ({"backends": {"nvml": 5}}, "backends.nvml must be a table"),
    ({"xid": {"hold_s": float("inf")}}, "xid.hold_s = inf"),
    ({"xid": {"storm_window_s": 0}}, "xid.storm_window_s = 0"),
    ({"xid": {"promote": {"45": {"count": 3}}}}, "xid.promote.45: expected the number of an "
     "application-class XID"),
    ({"xid": {"promote": {"79": {"count": 3}}}}, "xid.promote.79: expected"),
    ({"xid": {"promote": {"x": {"count": 3}}}}, "xid.promote.x: expected"),
    ({"xid": {"promote": {"13": {}}}}, "xid.promote.13.count is required"),
    ({"xid": {"promote": {"13": {"count": -1}}}}, "xid.promote.13.count = -1"),
    ({"xid": {"promote": {"13": {"count": 2, "window": 5}}}},
     "unknown key(s) xid.promote.13.window"),
    ({"history": {"max_bytes": "lots"}}, "history.max_bytes: size 'lots'"),
    ({"history": {"max_bytes": 10}}, "history.max_bytes = 10: expected bytes"),
    ({"log": {"format": "xml"}}, "log.format = 'xml': expected one of text, json"),
    ({"prot": 1}, "unknown key(s) prot"),
])
def test_every_bad_key_is_named_with_the_accepted_form(raw: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        from_mapping(raw)
    assert needle in str(info.value)


def test_listen_forms() -> None:
    assert parse_listen("[::1]:9477") == ("::1", 9477)
    assert parse_listen(":0") == ("127.0.0.1", 0)
    assert DaemonConfig().with_listen("0.0.0.0:1").listen_host == "0.0.0.0"


def test_unreadable_and_invalid_toml_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("listen = \n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(bad)


def test_check_config_exits_0_or_2_without_a_traceback(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text(FULL)
    env = dict(os.environ)
    proc = run_gpudiag(["serve", "--config", str(good), "--check-config"], env)
    assert proc.returncode == 0 and "config OK: listen 127.0.0.1:9999" in proc.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text("[backends.nvml]\ninterval_s = \"fast\"\n")
    proc = run_gpudiag(["serve", "--config", str(bad), "--check-config"], env)
    assert proc.returncode == 2 and "backends.nvml.interval_s = 'fast'" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_gpudiag(["serve", "--listen", "nowhere", "--check-config"], env)
    assert proc.returncode == 2 and "--listen 'nowhere'" in proc.stderr


def test_serve_on_a_taken_port_is_a_clear_error(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        cfg = tmp_path / "c.toml"
        cfg.write_text("[xid]\nenabled = false\n[backends.jax]\nenabled = false\n"
                       "[backends.iree]\nenabled = false\n")
        proc = run_gpudiag(["serve", "--listen", f"127.0.0.1:{port}", "--config", str(cfg),
                            "--state-dir", str(tmp_path / "st")], dict(os.environ), timeout=30)
    assert proc.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_xid_promotions_default_to_the_catalog_and_are_set_per_xid() -> None:
    assert from_mapping({}).xid.rules.promotions == DEFAULT_PROMOTIONS
    cfg = from_mapping({"xid": {"storm_window_s": 30, "promote": {
        "13": {"count": 3, "window_s": 600}, "31": {"count": 0}, "8": {"count": 2}}}})
    promotions = cfg.xid.rules.promotions
    assert cfg.xid.storm_window_s == 30.0
    assert promotions[13] == Promotion(3, 600.0) and promotions[31].count == 0
    assert promotions[8] == Promotion(2) and promotions[43] == DEFAULT_PROMOTIONS[43]
