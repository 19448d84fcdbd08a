"""Text rendering of a verdict for people: fits the terminal (80 columns and up), pipes too.

One status word per GPU, the readings a person checks first, where the verdict came from and
how old it is; codes and UUID prefixes are never cut (long text wraps at word boundaries).
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from typing import IO, Any

from rich import box
from rich.console import Console
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from gpudiag.core import registry
from gpudiag.core.ascii_ints import ascii_int
from gpudiag.core.catalog import caused_by
from gpudiag.core.requirement import format_size
from gpudiag.core.termsafe import terminal_safe_record
from gpudiag.core.verdict import BackendStatus, DeviceInfo, Finding, RecordError, Verdict

_STATUS_STYLE = {"ok": "green", "blocked": "red", "not_installed": "yellow", "unproven": "yellow"}
# Width of piped output when COLUMNS does not say: wide enough that nothing wraps needlessly.
PIPE_WIDTH = 120
# A GPU's one status word for the blocker (or warning) that concerns it.
STATUS_WORDS: Mapping[str, str] = {
    "gpu_lost": "lost", "gpu_reset_required": "reset required",
    "gpu_ecc_uncorrectable": "ECC", "gpu_inforom_corrupted": "inforom",
    "node_reboot_required": "reboot required", "gpu_missing": "missing",
    "cuda_devices_unavailable": "unavailable", "cuda_out_of_memory": "out of memory",
    "cuda_context_failed": "no context", "insufficient_free_memory": "low memory",
    "gpu_thermal_throttling": "hot", "gpu_power_throttling": "power capped",
    "gpu_ecc_correctable": "ECC corrected", "gpu_xid_application": "XID",
    "gpu_pcie_link_degraded": "PCIe narrowed", "gpu_persistence_off": "persistence off",
    "gpu_config_drift": "config drift",
}
_STATUS_WORD_STYLE = {"ready": "green", "selected": "bold green", "busy": "yellow",
                      "unknown": "dim"}
_VERSION_LABELS = {"driver": "driver", "cuda_driver": "CUDA", "nvml": "NVML"}


def cuda_version(value: Any) -> str:
    """CUDA's integer version for people: 12080 -> 12.8 (other values unchanged)."""
    text = str(value)
    n = ascii_int(text, strip=False)
    if n is not None and len(text) >= 4:
        return f"{n // 1000}.{(n % 1000) // 10}"
    return text


def short_pci(bus_id: str | None) -> str:
    """``00000000:18:00.0`` -> ``18:00.0`` (the domain only when it is not 0)."""
    if not bus_id:
        return "-"
    domain, sep, rest = bus_id.partition(":")
    if sep and rest.count(":") == 1 and all(c in "0123456789abcdefABCDEF" for c in domain):
        return rest if int(domain, 16) == 0 else f"{int(domain, 16):04x}:{rest}"
    return bus_id


# Past this many characters a unique prefix would crowd an 80-column table: the UUID is
# shown as its first 12 characters, an ellipsis and the shortest tail no other UUID shares.
_PREFIX_MAX = 17


def short_uuids(uuids: Sequence[str | None], minimum: int = 12) -> dict[str, str]:
    """Each UUID as short as it stays unique: the shortest prefix (at least GPU- plus 8 hex
    digits), or, when UUIDs share a long prefix, ``GPU-5f3a2b1c…0001`` (head and tail)."""
    known = [u for u in uuids if u]
    out: dict[str, str] = {}
    for u in known:
        others = [o for o in known if o != u]
        n = min(minimum, len(u))
        while n < len(u) and any(o.startswith(u[:n]) for o in others):
            n += 1
        if n <= _PREFIX_MAX or len(u) <= minimum + 5:
            out[u] = u[:n]
            continue
        t = 4
        while t < len(u) - minimum and any(o.endswith(u[-t:]) for o in others):
            t += 1
        out[u] = f"{u[:minimum]}…{u[-t:]}"
    return out


def _finding_word(f: Finding) -> str:
    code = f.code
    if code == "gpu_fault_outside_selection":  # the message starts with the fault's code
        code = f.message.split(" ", 1)[0]
    return STATUS_WORDS.get(code, code)


def device_status(verdict: Verdict, d: DeviceInfo) -> str:
    """One status word for a GPU: ready, selected, busy (pids), lost, reset required, ECC..."""
    labels = {d.uuid, f"index {d.index}"} - {None}
    faults = [b for b in verdict.blockers if b.device in labels and b.code != "devices_busy"]
    if faults:
        return _finding_word(faults[0])
    outside = [w for w in verdict.warnings if w.device in labels
               and w.code == "gpu_fault_outside_selection"]
    if outside:
        return _finding_word(outside[0])
    if d.occupancy == "busy":
        # The first pid, and how many more: the Processes table lists each (nvidia-smi's).
        pids = d.pids or ()
        more = f" +{len(pids) - 1}" if len(pids) > 1 else ""
        return f"busy pid {pids[0]}{more}" if pids else "busy"
    if d.healthy is False:
        return "fault"
    if d.occupancy == "unknown":
        return "unknown"
    word = "selected" if d.selected else "ready"
    notes = [STATUS_WORDS[w.code] for w in verdict.warnings
             if w.device in labels and w.code in STATUS_WORDS]
    return ", ".join([word, *dict.fromkeys(notes)])


def _facts(backend: BackendStatus) -> str:
    versions = ", ".join(
        f"{_VERSION_LABELS.get(k, k)} {cuda_version(v) if k == 'cuda_driver' else v}"
        for k, v in backend.versions.items() if v)
    detail = backend.detail
    bits = [versions] if versions else []
    for key in ("error", "init"):  # NVML's and cuInit's own error names
        err = detail.get(key)
        if isinstance(err, dict) and err.get("name") and not err.get("ok"):
            bits.append(f"{key}={err['name']}")
    for key in ("library", "nvidia_smi", "device_nodes", "kernel_module", "device_count",
                "default_backend", "platforms", "devices", "drivers", "init_s", "compute_s",
                "reason"):
        value = detail.get(key)
        if value not in (None, [], {}, ""):
            bits.append(f"{key}={value}")
    return "; ".join(bits)


def _age(seconds: float) -> str:
    if seconds < 1:
        return "just now"
    if seconds < 120:
        return f"{seconds:.0f} s old"
    return f"{seconds / 60:.0f} min old"


def source_line(verdict: Verdict) -> str:
    """Where the verdict came from and how old it is: ``host n1, inline, just now (...)``."""
    line = (f"host {verdict.host}, source {verdict.source}, {_age(verdict.age_s)} "
            f"(checked {verdict.checked_at})")
    return line + _proof_phrase(verdict)


def _proof_phrase(verdict: Verdict) -> str:
    """Where the environment-dependent backends were proven (evidence.proof), in words."""
    proof = verdict.evidence.get("proof")
    if not isinstance(proof, dict):
        return ""
    said = []
    for name, entry in proof.items():
        where = entry.get("where") if isinstance(entry, dict) else None
        if where == "daemon":
            said.append(f"{name} proven by the daemon in runtime {entry.get('runtime')}")
        elif where == "here":
            said.append(f"{name} proven here (no runtime of the daemon has this environment)")
        elif where == "prove_here":
            said.append(f"{name} left to this environment to prove")
    return f"; {'; '.join(said)}" if said else ""


def preallocation_line(verdict: Verdict) -> str | None:
    """What JAX's memory preallocation means for this requirement, in one line; None when
    the requirement has no JAX or the host shows no GPU (the field stays in the JSON and kv
    records)."""
    value = "yes" if verdict.preallocation_disabled else "no"
    if not any(b.name == "jax" for b in verdict.requirement.backends):
        return None
    if not verdict.devices:
        return None  # no GPU here: how JAX would share one says nothing (JSON and kv keep it)
    if verdict.preallocation_disabled:
        return (f"preallocation_disabled={value} (JAX allocates GPU memory as it needs it, "
                "so the GPU can be shared)")
    return (f"preallocation_disabled={value} (JAX will take 75% of each GPU's memory at start; "
            "set XLA_PYTHON_CLIENT_PREALLOCATE=false to share a GPU)")


def _width(stream: IO[str], color: bool | None) -> int | None:
    if color:
        return None  # a terminal: rich asks it
    columns = os.environ.get("COLUMNS", "")
    width = ascii_int(columns)
    return width if width is not None and 40 <= width <= 1000 else PIPE_WIDTH


def _backends(verdict: Verdict) -> Table:
    table = Table(title="Backends", title_justify="left", box=box.SIMPLE_HEAD,
                  pad_edge=False, show_edge=False)
    table.add_column("backend", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("time", no_wrap=True, justify="right")
    table.add_column("facts", overflow="fold", ratio=1)
    for name in sorted(verdict.backends, key=lambda n: (registry.order(n), n)):
        b = verdict.backends[name]
        duration = "-" if b.duration_s is None else f"{b.duration_s:.2f}s"
        table.add_row(name, Text(b.status, style=_STATUS_STYLE.get(b.status, "")), duration,
                      Text(_facts(b)))
    return table


def _uuid_labels(verdict: Verdict, wide: bool) -> dict[str, str]:
    """How the UUIDs are shown: full with ``--wide``, else as short as they stay unique."""
    uuids = [d.uuid for d in verdict.devices]
    return {u: u for u in uuids if u} if wide else short_uuids(uuids)


def _devices(verdict: Verdict, wide: bool = False) -> Table:
    devices = verdict.devices
    names = {d.name for d in devices if d.name}
    totals = {d.memory_total_bytes for d in devices if d.memory_total_bytes}
    uniform = len(names) <= 1 and len(totals) <= 1
    title = "Devices"
    if uniform and names:
        title += f": {len(devices)} x {next(iter(names))}"
        if totals:
            title += f", {format_size(next(iter(totals)))} each"
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  show_edge=False)
    for col, right in (("gpu", True), ("status", False), ("uuid", False), ("pci", False),
                       ("util", True), ("temp", True), ("memory used", True)):
        table.add_column(col, justify="right" if right else "left",
                         no_wrap=col != "status", overflow="fold")
    if wide:  # what nvidia-smi users scan for; 80 columns cannot hold it
        for col in ("power", "clocks", "pstate", "fan", "ECC c/u"):
            table.add_column(col, justify="right", no_wrap=True)
    if not uniform:
        table.add_column("name", overflow="fold")
    short = _uuid_labels(verdict, wide)
    for d in devices:
        status = device_status(verdict, d)
        style = _STATUS_WORD_STYLE.get(status.split(" ")[0].rstrip(","), "red")
        used = format_size(d.memory_used_bytes)
        if not uniform and d.memory_total_bytes:
            used += f" / {format_size(d.memory_total_bytes)}"
        util = "-" if d.utilization_ratio is None else f"{d.utilization_ratio * 100:.0f}%"
        temp = "-" if d.temperature_c is None else f"{d.temperature_c:.0f}C"
        row: list[str | Text] = [str(d.index), Text(status, style=style),
                                 short.get(d.uuid or "", "-"), short_pci(d.pci_bus_id), util,
                                 temp, used]
        if wide:
            row.extend(_smi_cells(d))
        if not uniform:
            row.append(d.name or "-")
        table.add_row(*row)
    remembered = [str(d.index) for d in devices if d.uuid_source == "last_seen"]
    if remembered:
        table.caption = (f"uuid of GPU {', '.join(remembered)}: as last seen (NVML cannot "
                         "read it now)")
        table.caption_justify = "left"
    return table


def _smi_cells(d: DeviceInfo) -> list[str | Text]:
    """power draw/cap, SM/memory clocks, P-state, fan, volatile ECC corrected/uncorrected."""
    def num(value: float | int | None, fmt: str = "{:.0f}") -> str:
        return "-" if value is None else fmt.format(value)

    power = ("-" if d.power_w is None and d.power_limit_w is None
             else f"{num(d.power_w)}/{num(d.power_limit_w)}W")
    clocks = ("-" if d.sm_clock_mhz is None and d.memory_clock_mhz is None
              else f"{num(d.sm_clock_mhz)}/{num(d.memory_clock_mhz)}MHz")
    ecc = ("-" if d.ecc_volatile_corrected is None and d.ecc_volatile_uncorrected is None
           else f"{num(d.ecc_volatile_corrected)}/{num(d.ecc_volatile_uncorrected)}")
    fan = "-" if d.fan_ratio is None else f"{d.fan_ratio * 100:.0f}%"
    return [power, clocks, "-" if d.pstate is None else f"P{d.pstate}", fan, ecc]


def _ports(verdict: Verdict) -> Table | None:
    """The nic backend's ports (``--wide``): state, rate, whether expected, PCI place, and the
    GPUs behind the same PCIe switch (by index where the verdict has them)."""
    nic = verdict.backends.get("nic")
    ports = nic.detail.get("ports") if nic is not None else None
    if not isinstance(ports, list) or not ports:
        return None
    expected = nic.detail.get("expected") if nic is not None else None
    wanted = set(expected) if isinstance(expected, list) else set()
    index = {short_pci(d.pci_bus_id).lower(): str(d.index) for d in verdict.devices
             if d.pci_bus_id}
    table = Table(title="Ports", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  show_edge=False)
    for col in ("port", "link", "rate", "expected", "pci", "numa", "gpus (PCIe switch)"):
        table.add_column(col, no_wrap=col != "gpus (PCIe switch)", overflow="fold")
    for port in ports:
        if not isinstance(port, dict):
            continue
        raw = port.get("gpus")
        gpus: dict[str, str] = raw if isinstance(raw, dict) else {}
        near = [f"GPU {index[short_pci(b).lower()]}" if short_pci(b).lower() in index
                else short_pci(b) for b, rel in sorted(gpus.items()) if rel in ("PIX", "PXB")]
        rate = port.get("rate_gbps")
        up = port.get("up")
        table.add_row(str(port.get("port")),
                      Text("up" if up else "down", style="green" if up else "red"),
                      "-" if rate is None else f"{rate:g} Gb/s",
                      "yes" if port.get("port") in wanted else "no",
                      short_pci(port.get("pci_bus_id")), str(port.get("numa_node", "-")),
                      ", ".join(near) or "-")
    return table


def _processes(verdict: Verdict) -> Table | None:
    """nvidia-smi's process table: every compute process on a GPU, its memory, user, name."""
    rows = [(d, p) for d in verdict.devices for p in d.processes or ()]
    if not rows:
        return None
    table = Table(title="Processes", title_justify="left", box=box.SIMPLE_HEAD,
                  pad_edge=False, show_edge=False)
    for col, right in (("gpu", True), ("pid", True), ("user", False), ("gpu memory", True),
                       ("command", False)):
        table.add_column(col, justify="right" if right else "left",
                         no_wrap=col != "command", overflow="fold")
    for d, p in rows:
        # Text, not markup: a command may be named "[red]x" (its owner chooses it).
        table.add_row(str(d.index), str(p.pid), Text(p.user or "-"),
                      format_size(p.used_memory_bytes), Text(p.name or "-"))
    if any(p.name is None for _, p in rows):
        table.caption = ("-: hidden from gpudiag by /proc (another PID namespace, hidepid, "
                         "systemd's ProtectProc=)")
        table.caption_justify = "left"
    return table


def _where(f: Finding, verdict: Verdict, short: Mapping[str, str]) -> str:
    bits = [f.layer]
    if f.backend and f.backend != f.layer:  # [cuda], not [cuda, cuda]
        bits.append(f.backend)
    if f.device:
        by_uuid = {d.uuid: d.index for d in verdict.devices if d.uuid}
        if f.device in by_uuid:
            bits.append(f"GPU {by_uuid[f.device]} {short.get(f.device, f.device)}")
        elif f.device.startswith("index "):
            bits.append("GPU " + f.device.removeprefix("index "))
        else:
            bits.append(f.device)
    return ", ".join(bits)


def _folded(items: Sequence[Finding]) -> list[tuple[Finding, list[Finding]]]:
    """Each finding shown in full with the blockers it brings about (catalog.caused_by):
    a finding follows the first one shown in full whose layer the catalog declares a cause
    of its code; any other (a busy GPU, a package not installed) stands on its own."""
    groups: list[tuple[Finding, list[Finding]]] = []
    for f in items:
        cause = next((g for g in groups if caused_by(f.code, g[0].layer)), None)
        if cause is None:
            groups.append((f, []))
        else:
            cause[1].append(f)
    return groups


def _findings(console: Console, title: str, items: Sequence[Finding], style: str,
              verdict: Verdict, wide: bool = False, fold: bool = False) -> None:
    """Each finding with its message and fix. ``fold``: a blocker the catalog declares a
    consequence of one above it is one line under it (``--wide``: in full)."""
    short = _uuid_labels(verdict, wide)
    console.print(Text(f"{title} ({len(items)})", style="italic"))
    groups = _folded(items) if fold and not wide else [(f, []) for f in items]
    for f, consequences in groups:
        head = Text("  ")
        head.append(f.code, style=style)
        head.append(f"  [{_where(f, verdict, short)}]")
        console.print(head)
        _indented(console, f.message, "")
        _indented(console, f"fix: {f.remediation}", "dim")
        if not consequences:
            continue
        _indented(console, f"then, because of it ({len(consequences)}; --wide shows each "
                  "in full):", "italic")
        for c in consequences:
            line = Text("      ")
            line.append(c.code, style=style)
            line.append(f"  [{_where(c, verdict, short)}]")
            console.print(line)


def _indented(console: Console, text: str, style: str) -> None:
    """Text wrapped at words to the console's width, indented by four spaces."""
    console.print(Padding(Text(text, style=style, overflow="fold"), (0, 0, 0, 4)))


# With --wide nothing is shortened: lines may be wider than the terminal (as nvidia-smi's).
WIDE_WIDTH = 160


def terminal_verdict(verdict: Verdict) -> Verdict:
    """The verdict with every control character in its text written out (core/termsafe):
    messages, stderr tails, names and argv may come from another user or a forged record."""
    try:
        return Verdict.from_record(terminal_safe_record(verdict.record(), one_line=False))
    except RecordError:
        return verdict  # not a record from_record reads back: shown as it is (JSON escapes)


def _runtime_lines(verdict: Verdict) -> list[tuple[str, str]]:
    """The daemon's runtime section (evidence.runtimes): each runtime's own state, said
    apart from the node's blockers (a broken environment is not a broken node)."""
    section = verdict.evidence.get("runtimes")
    if not isinstance(section, Mapping) or not section:
        return []
    out = [("Runtimes (the job environments this node serves; not the node's blockers):",
            "bold")]
    for name, entry in sorted(section.items()):
        if not isinstance(entry, Mapping):
            continue
        state = str(entry.get("state", "unknown"))
        backends = entry.get("backends")
        said = " ".join(f"{b} {st}" for b, st in sorted(backends.items())) \
            if isinstance(backends, Mapping) else ""
        if state == "refused":
            said = f"refused: {entry.get('refused')}"
        elif state == "blocked":
            said = f"{entry.get('blocker')}  ({said})"
        style = {"ok": "green", "blocked": "yellow", "refused": "bold red"}.get(state, "dim")
        out.append((f"  {name:<14} {state:<9} {said}  {entry.get('python') or ''}".rstrip(),
                    style))
    return out


def render_text(verdict: Verdict, stream: IO[str], *, color: bool | None = None,
                wide: bool = False, width: int | None = None) -> None:
    """Print source, backends, devices, blockers with remediation and the final blocker line.

    ``wide``: full UUIDs; ``width``: the terminal's width when ``stream`` is not the terminal
    itself (a frame of ``--watch`` drawn into a buffer).
    """
    verdict = terminal_verdict(verdict)
    # Plain text (a pipe, a file) without the spaces rich pads lines with.
    buffer = None if color else io.StringIO()
    out: IO[str] = stream if buffer is None else buffer
    width = width or _width(stream, color)
    if wide:
        width = max(width or Console().width, WIDE_WIDTH)
    # markup=False: no text from a record is read as rich markup ("[link=...]" is text).
    console = Console(file=out, force_terminal=color, no_color=color is False,
                      width=width, soft_wrap=False, highlight=False, markup=False)
    console.print(Text(source_line(verdict), style="dim"))
    console.print(_backends(verdict))
    if verdict.devices:
        console.print(_devices(verdict, wide))
        processes = _processes(verdict)
        if processes is not None:
            console.print(processes)
    ports = _ports(verdict) if wide else None
    if ports is not None:
        console.print(ports)
    if verdict.blockers:
        _findings(console, "Blockers", verdict.ordered_blockers(), "bold red", verdict, wide,
                  fold=True)
    if verdict.warnings:
        _findings(console, "Warnings", verdict.warnings, "yellow", verdict, wide)
    for line, style in _runtime_lines(verdict):
        console.print(line, style=style, markup=False)
    prealloc = preallocation_line(verdict)
    if prealloc is not None:
        console.print(prealloc, markup=False)
    console.print(f"gpu_validation_blocker={verdict.gpu_validation_blocker}", markup=False,
                  style="bold green" if verdict.ready else "bold red")
    if buffer is not None:
        stream.write("".join(line.rstrip() + "\n" for line in buffer.getvalue().splitlines()))
