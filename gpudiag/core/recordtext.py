"""The verdict record as text, without the typed model: its schema name and its ``kv`` lines.

``gpudiag.core.verdict`` renders its records with these, and the console entry's fast path
(``gpudiag.cli.entry``) prints a daemon's record with the same functions without building a
``Verdict``: importing dataclasses and generating the record's classes would cost a
daemon-answered ``gpudiag preflight`` more than the answer itself (docs/benchmarks.md).
Only ``json`` and ``re`` are imported here, both already loaded by any console script.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (see gpudiag/__init__)
if TYPE_CHECKING:
    from typing import Any

    JSONValue = Any  # as in gpudiag.core.verdict: a record's values are free-form JSON

SCHEMA = "gpudiag.verdict/1"

# Backslash, newline and carriage return as before; every other control character (ESC,
# C1, bidirectional overrides: gpudiag.core.termsafe's set) as \xHH or \uHHHH, so that a
# record read on a terminal cannot drive it (docs/security.md, "Terminal injection").
_KV_UNSAFE = re.compile("[\\\\\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_KV_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r"}


def _kv_escape(m: re.Match[str]) -> str:
    char = m.group()
    if char in _KV_ESCAPES:
        return _KV_ESCAPES[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def kv_value(value: Any, *, lenient: bool = False) -> str:
    """One ``key=value`` value: "" for None, true/false, compact JSON, escaped text.

    ``lenient`` renders non-JSON objects inside a dict or list with str() (the closeout);
    a verdict record must be JSON, so there they raise TypeError (from_record relies on it).
    """
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True, separators=(",", ":"),
                          default=str if lenient else None)
    # One record line per key: newlines inside values are escaped, never emitted raw; the
    # backslash is escaped too, so a reader can undo it (a literal "\\n" stays itself).
    return _KV_UNSAFE.sub(_kv_escape, str(value))


def render_kv(record: Mapping[str, JSONValue]) -> str:
    """Flatten a verdict record into ``key=value`` lines (stable order, one per key)."""
    lines = [
        f"gpu_validation_blocker={kv_value(record['gpu_validation_blocker'])}",
        f"ready={kv_value(record['ready'])}",
        f"preallocation_disabled={kv_value(record['preallocation_disabled'])}",
    ]
    for key in ("schema", "host", "checked_at", "age_s", "source", "gpudiag_version"):
        lines.append(f"{key}={kv_value(record[key])}")
    req = record["requirement"]
    lines.append(f"requirement.backends={kv_value(','.join(req['backends']))}")
    lines.append(f"requirement.devices={kv_value(','.join(req['devices'] or []))}")
    lines.append(f"requirement.min_devices={kv_value(req['min_devices'])}")
    lines.append(f"requirement.min_free_memory_bytes={kv_value(req['min_free_memory_bytes'])}")
    lines.append(f"requirement.gpus={kv_value(req.get('gpus'))}")
    lines.append(f"requirement.question={kv_value(req.get('question', 'job'))}")
    lines.append(f"blockers={kv_value(','.join(b['code'] for b in record['blockers']))}")
    for kind in ("blockers", "warnings"):
        for i, item in enumerate(record[kind]):
            for k in ("code", "layer", "backend", "device", "message", "remediation"):
                lines.append(f"{kind}.{i}.{k}={kv_value(item[k])}")
    lines.append(f"devices.count={len(record['devices'])}")
    for dev in record["devices"]:
        for k, v in dev.items():
            if k != "index":
                lines.append(f"devices.{kv_value(dev['index'])}.{kv_value(k)}={kv_value(v)}")
    for name, backend in record["backends"].items():
        name = kv_value(name)
        lines.append(f"backends.{name}.status={kv_value(backend['status'])}")
        lines.append(f"backends.{name}.duration_s={kv_value(backend['duration_s'])}")
        for k, v in backend["versions"].items():
            lines.append(f"backends.{name}.versions.{kv_value(k)}={kv_value(v)}")
    driver = record["evidence"].get("driver") or {}
    for k, v in driver.items():
        lines.append(f"evidence.driver.{kv_value(k)}={kv_value(v)}")
    lines += _runtime_lines(record["evidence"].get("runtimes"))
    return "\n".join(lines) + "\n"


def _runtime_lines(runtimes: JSONValue) -> list[str]:
    """The daemon's runtime section (node health): what the Slurm scripts read to answer
    ``jax``/``iree`` from the node's configured runtimes (deploy/slurm/gpudiag-common.sh)."""
    if not isinstance(runtimes, Mapping):
        return []
    lines = [f"runtimes={kv_value(','.join(sorted(runtimes)))}"]
    for name, entry in sorted(runtimes.items()):
        if not isinstance(entry, Mapping):
            continue
        key = f"runtimes.{kv_value(name)}"
        for field in ("state", "blocker"):
            lines.append(f"{key}.{field}={kv_value(entry.get(field))}")
        serves = entry.get("serves")
        said = ",".join(str(s) for s in serves) if isinstance(serves, list) else ""
        lines.append(f"{key}.serves={kv_value(said)}")
        backends = entry.get("backends")
        for b, status in sorted(backends.items()) if isinstance(backends, Mapping) else ():
            lines.append(f"{key}.backends.{kv_value(b)}={kv_value(status)}")
    return lines


# The verdict record's keys in the order Verdict.record() writes them (tests/test_verdict.py
# checks the two agree).
RECORD_KEYS = ("schema", "gpu_validation_blocker", "ready", "blockers", "warnings",
               "requirement", "devices", "backends", "evidence", "preallocation_disabled",
               "host", "checked_at", "age_s", "source", "gpudiag_version")
# What the daemon's answer adds to the record: whether it was proven within max_age_s
# (docs/daemon.md). The typed model reads no such field, so the CLI never printed it.
DAEMON_ONLY_KEYS = ("fresh",)


def own_record_text(data: object, fmt: str, version: str) -> tuple[str, bool] | None:
    """``(text, ready)``: a daemon's answer printed as ``Verdict.from_record(data)`` would
    print it, without building the typed verdict.

    Only for a record this gpudiag ``version`` wrote (with ``Verdict.record()``, which the
    typed model reads back unchanged: tests/test_properties.py) that holds together: its keys
    in order, its schema, ``ready`` and ``gpu_validation_blocker`` agreeing with its blockers,
    and renderable. None otherwise: the caller then reads it with the typed model, which
    checks everything (an older or newer daemon, or anything odd).
    """
    if not isinstance(data, dict):
        return None
    record = {k: v for k, v in data.items() if k not in DAEMON_ONLY_KEYS}
    if (tuple(record) != RECORD_KEYS or record["schema"] != SCHEMA
            or record["gpudiag_version"] != version):
        return None
    blockers, ready, code = record["blockers"], record["ready"], record["gpu_validation_blocker"]
    if not isinstance(blockers, list) or ready is not (not blockers):
        return None
    primary = blockers[0].get("code") if blockers and isinstance(blockers[0], dict) else "none"
    if code != primary:
        return None
    try:
        kv = render_kv(record)  # as from_record: a record that cannot be rendered is not one
    except (KeyError, TypeError, AttributeError, ValueError):
        return None
    return (kv if fmt == "kv" else json.dumps(record, indent=2) + "\n"), ready
