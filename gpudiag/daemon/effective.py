"""The effective configuration as TOML (``serve --check-config``), derived from the dataclasses.

Every field of DaemonConfig and of the records inside it is printed: at its own name in its
own table unless ``PLACES`` puts it elsewhere in the file's layout, as a comment where
``NOT_IN_FILE`` says the file cannot set it, and as a comment when it is unset (TOML has no
null). A field in neither table prints at its own name, so a new setting shows up by itself;
the printed file loads back into the same configuration (tests/test_ux.py). The unix socket
in effect (``default_socket_path``) also depends on systemd's $RUNTIME_DIRECTORY.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from gpudiag.core.settings import SETTING
from gpudiag.daemon.config import DaemonConfig

# Class.field -> where the file has it, relative to the class's table ("a.b": table a, key b;
# "": its fields go into the parent's table), where its setting's ``at`` does not say
# (gpudiag.core.settings: ``scheduler.tick_s``, ``log.format``, ``socket``, ...).
PLACES: Mapping[str, str] = {
    "QualificationConfig.thresholds": "",
    "XidConfig.rules": "promote",
    "XidRules.promotions": "",
}
# Class.field -> why the file does not set it (printed as a comment with its value).
NOT_IN_FILE: Mapping[str, str] = {
    "DaemonConfig.listen_host": "",   # both are the one key `listen`, printed first
    "DaemonConfig.listen_port": "",
    "Runtime.name": "",               # the table's own name
    "Runtime.uid": "its children's uid, from user (a root daemon's default: 65534)",
    "Runtime.gid": "its children's gid, from user",
    "BackendConfig.settings": "",     # a backend's own keys, printed in its table
    "QualificationConfig.table": "read from reference_file",
    "NvmlHealthPolicy.held_memory_floor_bytes": "fixed",
    "NvmlHealthPolicy.held_memory_share": "fixed",
    "Thresholds.min_peers": "fixed",
    "Thresholds.history_window": "fixed",
    "Thresholds.min_history": "fixed",
}


SOCKET_NAME = "gpudiag.sock"


def default_socket_path(cfg: DaemonConfig, env: Mapping[str, str] | None = None) -> str | None:
    """--socket / ``socket =``, else $RUNTIME_DIRECTORY/gpudiag.sock (systemd), else none."""
    if cfg.socket_path is not None:
        return cfg.socket_path or None
    environ = os.environ if env is None else env
    runtime = environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    return str(Path(runtime) / SOCKET_NAME) if runtime else None


def toml_value(v: Any) -> str:
    """One TOML value: booleans in TOML's spelling, numbers and strings as JSON writes them,
    a table of strings inline (``{ A = "b" }``), a tuple as an array."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, Mapping):
        return "{ " + ", ".join(f"{k} = {json.dumps(x)}" for k, x in v.items()) + " }" \
            if v else "{}"
    if isinstance(v, tuple):
        return json.dumps(list(v))
    return json.dumps(v)


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _walk(obj: Any, table: str, tables: dict[str, list[str]]) -> None:
    """Put each field of the dataclass ``obj`` (in table ``table``) into ``tables``."""
    for f in fields(obj):
        qual = f"{type(obj).__name__}.{f.name}"
        value = getattr(obj, f.name)
        place = PLACES.get(qual, f.metadata[SETTING].at or f.name if SETTING in f.metadata
                           else f.name)
        if is_dataclass(value) and not isinstance(value, type):
            _walk(value, _join(table, place), tables)
            continue
        if isinstance(value, Mapping) and value and all(is_dataclass(v) for v in value.values()):
            for name, sub in value.items():
                _walk(sub, _join(table, place, str(name)), tables)
            continue
        if isinstance(value, tuple) and value and all(
                is_dataclass(v) and hasattr(v, "name") for v in value):
            for sub in value:  # named records (runtimes): a table each, by name
                _walk(sub, _join(table, place, str(sub.name)), tables)
            continue
        where, _, key = _join(table, place).rpartition(".")
        lines = tables.setdefault(where, [])
        if qual == "BackendConfig.settings":  # a backend's own keys, in its own table
            lines += [f"{k} = {toml_value(v)}" for k, v in value.items()]
            continue
        if qual in NOT_IN_FILE:
            if NOT_IN_FILE[qual]:
                shown = ("not set" if value is None else f"{len(value)} rows"
                         if isinstance(value, tuple) else toml_value(value))
                lines.append(f"# {key} = {shown}  ({NOT_IN_FILE[qual]})")
        elif value is None:
            lines.append(f"# {key} is not set")
        else:
            lines.append(f"{key} = {toml_value(value)}")


def effective_lines(cfg: DaemonConfig) -> list[str]:
    """Every setting of ``cfg``, as TOML in the config file's own layout."""
    listen = f"{cfg.listen_host}:{cfg.listen_port}"
    tables: dict[str, list[str]] = {"": [f"listen = {toml_value(listen)}"]}
    _walk(cfg, "", tables)
    out = list(tables.pop(""))
    for name, lines in tables.items():
        out += ["", f"[{name}]", *lines]
    return out


def effective_config(cfg: DaemonConfig, state_dir: str) -> list[str]:
    """Every setting the daemon would run with, as TOML in the config file's own layout."""
    return [*effective_lines(cfg), "", f"# not in the file: --state-dir {state_dir}, socket in "
            f"effect {default_socket_path(cfg) or 'none'}"]
