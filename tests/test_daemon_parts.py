"""The daemon's parts (gpudiag.daemon.part, the list in gpudiag.daemon.parts): each declares
its config section, metrics and routes, docs/reference.md documents them, the core names no
part, and a started daemon renders only the metric families its parts declare.
"""

from __future__ import annotations

import ast
import re
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpudiag.daemon.config import ConfigError, from_mapping
from gpudiag.daemon.part import Part
from gpudiag.daemon.parts import parts
from gpudiag.daemon.service import DaemonService

REPO = Path(__file__).resolve().parent.parent
DAEMON = REPO / "gpudiag" / "daemon"
REFERENCE = (REPO / "docs" / "reference.md").read_text()
# What the core may import of the daemon: itself, never a feature.
CORE = {"app", "config", "history", "lifecycle", "part", "parts", "reload", "scheduler",
        "sdnotify", "statedir", "store", "watcher", "snapshot", "httpserver", "answers",
        "envelope", "exporter", "runtime_health", "effective", "holds", "recorder", "nvlinks"}


def gpudiag_imports(path: Path) -> set[str]:
    """The gpudiag modules a file imports (TYPE_CHECKING ones too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gpudiag"):
            found.add(str(node.module))
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("gpudiag"))
    return found


def section_keys(section: str) -> list[str]:
    """The keys the config validator accepts in ``[section]`` (its own error lists them)."""
    with pytest.raises(ConfigError, match="accepted here: ") as caught:
        from_mapping({section: {"zz_not_a_key": 1}})
    return str(caught.value).split("accepted here: ", 1)[1].split(", ")


def documented(name: str) -> bool:
    return f"`{name}" in REFERENCE


@pytest.mark.parametrize("part", parts(), ids=lambda p: p.name)
def test_each_parts_metrics_routes_and_config_keys_are_in_the_reference(part: Part) -> None:
    missing = [m for m in part.metrics if not documented(m)]
    missing += [f"{method} {path}" for path, route in part.routes().items()
                for method in route.methods if not documented(f"{method} {path}")]
    keys = list(part.config_keys)
    if part.section is not None:
        keys += [f"{part.section}.{k}" for k in section_keys(part.section)]
    missing += [k for k in keys if not documented(k) and not documented(k.split(".")[-1])]
    assert not missing, f"docs/reference.md: document {missing} (part {part.name})"


def test_the_parts_have_distinct_names_and_no_route_twice() -> None:
    listed = parts()
    names = [p.name for p in listed]
    routes = [path for p in listed for path in p.routes()]
    assert len(set(names)) == len(names) and all(names), names
    assert len(set(routes)) == len(routes), routes


def test_the_reference_table_of_parts_lists_every_part() -> None:
    table = REFERENCE.split("## Daemon parts", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z_]+)` \|", table, flags=re.MULTILINE)
    assert rows == [p.name for p in parts()], rows


@pytest.mark.parametrize("hub", ["service.py", "app.py"])
def test_the_core_imports_no_feature_module(hub: str) -> None:
    imported = {m.removeprefix("gpudiag.daemon.") for m in gpudiag_imports(DAEMON / hub)
                if m.startswith("gpudiag.daemon.")}
    assert imported <= CORE, f"{hub} imports feature module(s) {sorted(imported - CORE)}"


def test_the_service_imports_fewer_than_fifteen_gpudiag_modules() -> None:
    imported = gpudiag_imports(DAEMON / "service.py")
    assert len(imported) < 15, sorted(imported)


@pytest.fixture
def switch_interval() -> Iterator[None]:
    """start() tunes the interpreter's switch interval for the daemon: undone for pytest."""
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def test_a_started_daemon_renders_only_the_metric_families_its_parts_declare(
        gpu_env: Callable[..., dict[str, str]], tmp_path: Path, switch_interval: None) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = from_mapping({"listen": f"127.0.0.1:{port}", "socket": "",
                        "scheduler": {"tick_s": 0.05},
                        "backends": {"jax": {"enabled": False}, "iree": {"enabled": False}},
                        "xid": {"heartbeat_s": 0.2}})
    service = DaemonService(cfg, tmp_path / "state", env=gpu_env())
    try:
        service.start()
        assert [p.name for p in service.parts] == [p.name for p in parts()]
        for part in service.parts:
            rendered = {family.name for collector in part.collectors()
                        for family in collector.collect()}
            assert rendered <= set(part.metrics), (part.name, rendered - set(part.metrics))
    finally:
        service.stop()
