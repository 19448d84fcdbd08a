"""Text rendering of a verdict for people: rich tables on a terminal, plain text elsewhere."""

from __future__ import annotations

from typing import IO, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gpudiag.core.requirement import format_size
from gpudiag.core.verdict import Verdict

_STATUS_STYLE = {"ok": "green", "blocked": "red", "not_installed": "yellow", "skipped": "dim"}


def _facts(name: str, backend: dict[str, Any]) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in backend["versions"].items() if v)
    detail = backend["detail"]
    bits = [versions] if versions else []
    for key in ("error", "init"):  # NVML's and cuInit's own error names
        err = detail.get(key)
        if isinstance(err, dict) and err.get("name") and not err.get("ok"):
            bits.append(f"{key}={err['name']}")
    for key in ("nvidia_smi", "device_nodes", "kernel_module", "device_count",
                "default_backend", "platforms", "devices", "drivers", "init_s", "compute_s"):
        value = detail.get(key)
        if value not in (None, [], {}, ""):
            bits.append(f"{key}={value}")
    return "; ".join(bits)


def render_text(verdict: Verdict, stream: IO[str], *, color: bool | None = None) -> None:
    """Print backends, devices, blockers with remediation and the final blocker line."""
    record = verdict.record()
    console = Console(file=stream, force_terminal=color, no_color=color is False,
                      width=None if color else 120, soft_wrap=False)
    backends = Table(title="Backends", title_justify="left")
    for col in ("backend", "status", "duration", "facts"):
        backends.add_column(col)
    for name, b in record["backends"].items():
        style = _STATUS_STYLE.get(b["status"], "")
        duration = "-" if b["duration_s"] is None else f"{b['duration_s']:.2f}s"
        backends.add_row(name, f"[{style}]{b['status']}[/{style}]" if style else b["status"],
                         duration, escape(_facts(name, b)))
    console.print(backends)
    if record["devices"]:
        devices = Table(title="Devices", title_justify="left")
        for col in ("gpu", "uuid", "name", "pci bus", "memory total", "memory free"):
            devices.add_column(col)
        for d in record["devices"]:
            devices.add_row(str(d["index"]), d["uuid"] or "-", d["name"] or "-",
                            d["pci_bus_id"] or "-", format_size(d["memory_total_bytes"]),
                            format_size(d["memory_free_bytes"]))
        console.print(devices)
    for kind, style in (("blockers", "red"), ("warnings", "yellow")):
        items = record[kind]
        if not items:
            continue
        table = Table(title=kind.capitalize(), title_justify="left", show_lines=True)
        for col in ("code", "layer", "where", "message", "remediation"):
            table.add_column(col, overflow="fold")
        for item in items:
            where = "/".join(x for x in (item["backend"], item["device"]) if x) or "-"
            # Messages carry text like jax[cuda12] that rich would read as markup.
            table.add_row(f"[{style}]{item['code']}[/{style}]", item["layer"], escape(where),
                          escape(item["message"]), escape(item["remediation"]))
        console.print(table)
    console.print(f"preallocation_disabled={record['preallocation_disabled']}", highlight=False)
    console.print(f"gpu_validation_blocker={record['gpu_validation_blocker']}", highlight=False,
                  style="bold green" if verdict.ready else "bold red")
