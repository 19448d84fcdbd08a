"""A prometheus_client Collector that renders the latest snapshot; it never runs probes.

Every scrape builds its metric families fresh from one immutable Snapshot, so no label set
goes stale and nothing is removed by hand. Every known blocker code is present as 0 or 1.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from gpudiag.core import registry
from gpudiag.core.catalog import BLOCKERS, WARNINGS, CatalogEntry
from gpudiag.core.identity import LastIdentities
from gpudiag.core.observations import (
    CudaObservation,
    Ecc,
    IreeObservation,
    JaxObservation,
    Memory,
)
from gpudiag.core.probe_run import ProbeRun
from gpudiag.core.verdict import Finding
from gpudiag.core.version import __version__
from gpudiag.daemon.collectors import StateCollector
from gpudiag.daemon.nvml_metrics import nvml_health_metrics
from gpudiag.daemon.recorder import HistoryHealth
from gpudiag.daemon.runtime_health import runtime_findings
from gpudiag.daemon.snapshot import OUTCOMES, ProbeKey, Snapshot


class SnapshotCollector(Collector):
    """Collects from ``snapshot()`` at scrape time (the seam: any callable returning one)."""

    def __init__(self, snapshot: Callable[[], Snapshot],
                 wall: Callable[[], float] = time.time) -> None:
        self._snapshot = snapshot
        self._wall = wall
        # The last identity NVML gave each GPU index: a lost GPU keeps its uuid, name and PCI
        # labels, so that its series do not churn and alerts keyed on uuid still match.
        self._known = LastIdentities().known

    def describe(self) -> list[Metric]:
        # Nothing to describe up front: registration must not call collect().
        return []

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        now = self._wall()
        yield from self._verdict(snap)
        yield from self._probes(snap)
        yield from self._gpus(snap)
        yield from self._occupancy(snap)
        yield from self._backend_readiness(snap)
        yield from self._runtimes(snap)
        yield from self._xids(snap, now)
        yield from nvml_health_metrics(snap, self._known)

    def _verdict(self, snap: Snapshot) -> Iterator[Metric]:
        ready = GaugeMetricFamily(
            "gpudiag_ready", "1 when the daemon's default requirement is met, else 0.")
        ready.add_metric([], 1.0 if snap.ready is not None and snap.ready.ready else 0.0)
        yield ready
        full = snap.full
        yield _codes("gpudiag_blocker", "blocker", BLOCKERS,
                     full.blockers if full is not None else ())
        yield _codes("gpudiag_warning", "warning", WARNINGS,
                     full.warnings if full is not None else ())
        up = GaugeMetricFamily("gpudiag_backend_up",
                               "1 when the backend initialized without a blocker, else 0.",
                               labels=["backend"])
        statuses = snap.full.backends if snap.full is not None else {}
        for key in _first_per_backend(snap):
            status = statuses.get(key.backend)
            up.add_metric([key.backend], 1.0 if status is not None and status.status == "ok"
                          else 0.0)
        yield up
        versions: dict[str, str] = {"version": __version__}
        nvml = snap.result("nvml")
        obs = nvml.run.nvml if nvml is not None else None
        versions["driver_version"] = str((obs.driver_version if obs else None) or "")
        versions["cuda_driver_version"] = str((obs.cuda_driver_version if obs else None) or "")
        # label <- the first version key the backend reports (IREE names its package).
        for spec in registry.specs():
            status = statuses.get(spec.name)
            for label, keys in spec.version_labels.items():
                found = [status.versions.get(k) for k in keys] if status is not None else []
                versions[f"{label}_version"] = str(next((v for v in found if v), ""))
        info = InfoMetricFamily("gpudiag_build", "gpudiag, driver and library versions.",
                                labels=list(versions))
        info.add_metric(list(versions.values()), {})
        yield info

    def _occupancy(self, snap: Snapshot) -> Iterator[Metric]:
        """Per-GPU occupancy, health and last proof (docs/design-notes.md "Busy GPUs"), from the
        node-health verdict, so that a busy GPU reads as healthy in use, never as broken."""
        occupancy = GaugeMetricFamily(
            "gpudiag_gpu_occupancy", "1 for the GPU's current occupancy: free (no other "
            "process), busy (others' processes or a gpudiag run lock), unknown (unreadable).",
            labels=["gpu", "uuid", "state"])
        healthy = GaugeMetricFamily(
            "gpudiag_gpu_healthy", "1 when the GPU has no fault (busy GPUs are healthy).",
            labels=["gpu", "uuid"])
        proven = GaugeMetricFamily(
            "gpudiag_gpu_last_proven_timestamp_seconds",
            "When an active probe (context and allocation, JAX, IREE) last succeeded on it.",
            labels=["gpu", "uuid", "backend"])
        ready_free = GaugeMetricFamily(
            "gpudiag_gpus_ready_free",
            "GPUs healthy and free now for the daemon's default requirement.")
        devices = snap.full.devices if snap.full is not None else ()
        index = {d.uuid: d.index for d in devices if d.uuid}
        for d in devices:
            labels = [str(d.index), self._known(d.index, d.uuid)[0]]
            for state in ("free", "busy", "unknown"):
                occupancy.add_metric([*labels, state], 1.0 if d.occupancy == state else 0.0)
            healthy.add_metric(labels, 1.0 if d.healthy else 0.0)
        for (uuid, backend), wall in sorted(snap.last_proven.items()):
            proven.add_metric([str(index.get(uuid, "")), uuid, backend], wall)
        ready = snap.ready
        host_wide = ready is None or any(b.device is None for b in ready.blockers)
        count = 0 if host_wide or ready is None else sum(
            1 for d in ready.devices if d.healthy and d.occupancy == "free")
        ready_free.add_metric([], float(count))
        yield from (occupancy, healthy, proven, ready_free)

    def _backend_readiness(self, snap: Snapshot) -> Iterator[Metric]:
        """Per requirement backend: proven on this node now, and when last (the fleet view).

        Every requirement backend is present as 0 or 1, so a fleet query needs no absent();
        a backend this daemon does not probe reads 0 (never proven here, never ready)."""
        ready = GaugeMetricFamily(
            "gpudiag_backend_ready",
            "1 when the node-health verdict proves the requirement backend (cuda, jax, iree) "
            "on this node now, with no host-wide blocker, else 0.", labels=["backend"])
        proven = GaugeMetricFamily(
            "gpudiag_backend_last_proven_timestamp_seconds",
            "When an active probe of the backend last succeeded on any GPU of this node.",
            labels=["backend"])
        for backend, ok in snap.backends_proven().items():
            ready.add_metric([backend], 1.0 if ok else 0.0)
            walls = [w for (_, b), w in snap.last_proven.items() if b == backend]
            if walls:
                proven.add_metric([backend], max(walls))
        yield from (ready, proven)

    def _runtimes(self, snap: Snapshot) -> Iterator[Metric]:
        """Per runtime (the job environments this node serves; docs/design-notes.md, "Whose
        environment is proven"): each backend it serves, up and proven, its blockers, and
        its probe children."""
        up = GaugeMetricFamily(
            "gpudiag_runtime_backend_up",
            "1 when the runtime's backend initialized without a blocker, else 0.",
            labels=["runtime", "backend"])
        ready = GaugeMetricFamily(
            "gpudiag_runtime_backend_ready",
            "1 when the runtime's backend is proven on this node now, with no host-wide "
            "blocker, else 0.", labels=["runtime", "backend"])
        blocker = GaugeMetricFamily(
            "gpudiag_runtime_blocker",
            "1 when this blocker code is the runtime's own (its probe children, the backends "
            "it serves), else 0; the node's own faults are gpudiag_blocker.",
            labels=["runtime", "code", "layer"])
        refused = GaugeMetricFamily(
            "gpudiag_runtime_refused",
            "1 when the daemon refuses to run the runtime's code (its import path may be "
            "written by another user), else 0.", labels=["runtime"])
        runs = CounterMetricFamily(
            "gpudiag_runtime_probe_runs", "Probe children run in the runtime, by outcome.",
            labels=["runtime", "backend", "outcome"])
        for (runtime, backend), ok in sorted(snap.runtime_backends_proven().items()):
            verdict = snap.runtime_health[runtime]
            status = verdict.backends.get(backend)
            up.add_metric([runtime, backend], 1.0 if status is not None
                          and status.status == "ok" else 0.0)
            ready.add_metric([runtime, backend], 1.0 if ok else 0.0)
        # Bounded: at most 17 runtimes x the probe, jax and iree codes (about 16), each
        # always present as 0 or 1 so alerts need no absent().
        layers = _runtime_layers()
        for runtime, verdict in sorted(snap.runtime_health.items()):
            present = {b.code for b in runtime_findings(verdict)}
            for code, row in BLOCKERS.items():
                if row.layer in layers:
                    blocker.add_metric([runtime, code, row.layer],
                                       1.0 if code in present else 0.0)
        for rt in snap.runtimes:
            if not rt.own or rt.require:
                refused.add_metric([rt.name], 1.0 if rt.name in snap.runtime_refused else 0.0)
        for key in snap.scheduled:
            if key.backend not in _environment_backends():
                continue
            stats = snap.stats.get(key)
            for outcome in OUTCOMES:
                n = stats.runs_by_outcome.get(outcome, 0) if stats is not None else 0
                runs.add_metric([key.runtime_name, key.backend, outcome], float(n))
        yield from (up, ready, blocker, refused, runs)

    def _probes(self, snap: Snapshot) -> Iterator[Metric]:
        duration = GaugeMetricFamily("gpudiag_probe_duration_seconds",
                                     "Wall time of the latest probe child.", labels=["backend"])
        runs = CounterMetricFamily("gpudiag_probe_runs", "Probe children run, by outcome.",
                                   labels=["backend", "outcome"])
        success = GaugeMetricFamily("gpudiag_probe_last_success_timestamp_seconds",
                                    "When the backend's probe last found it healthy.",
                                    labels=["backend"])
        init = GaugeMetricFamily("gpudiag_backend_init_seconds",
                                 "Time the backend's own initialization took in the probe.",
                                 labels=["backend"])
        for key in _first_per_backend(snap):
            stats = snap.stats.get(key)
            for outcome in OUTCOMES:
                n = stats.runs_by_outcome.get(outcome, 0) if stats is not None else 0
                runs.add_metric([key.backend, outcome], float(n))
            if stats is None:
                continue
            if stats.last_duration_s is not None:
                duration.add_metric([key.backend], stats.last_duration_s)
            if stats.last_success_wall is not None:
                success.add_metric([key.backend], stats.last_success_wall)
            result = snap.results.get(key)
            seconds = _init_seconds(result.run) if result is not None else None
            if seconds is not None:
                init.add_metric([key.backend], float(seconds))
        yield from (duration, runs, success, init)

    def _gpus(self, snap: Snapshot) -> Iterator[Metric]:
        nvml = snap.result("nvml")
        obs = nvml.run.nvml if nvml is not None else None
        devices = obs.devices if obs is not None else ()
        tele = snap.watcher.telemetry
        fresh = (snap.watcher.telemetry_wall is not None and nvml is not None
                 and snap.watcher.telemetry_wall > nvml.finished_wall)
        gl = ["gpu", "uuid"]
        info = GaugeMetricFamily("gpudiag_gpu_info", "One series per GPU NVML reports.",
                                 labels=["gpu", "uuid", "name", "pci_bus_id"])
        mem = {k: GaugeMetricFamily(f"gpudiag_gpu_memory_{k}_bytes", f"GPU memory {k}.",
                                    labels=gl) for k in ("total", "used", "free")}
        util = GaugeMetricFamily("gpudiag_gpu_utilization_ratio",
                                 "GPU busy fraction over NVML's sample period.", labels=gl)
        temp = GaugeMetricFamily("gpudiag_gpu_temperature_celsius", "GPU core temperature.",
                                 labels=gl)
        power = GaugeMetricFamily("gpudiag_gpu_power_watts", "GPU board power draw.",
                                  labels=gl)
        ecc = CounterMetricFamily("gpudiag_gpu_ecc_errors", "Aggregate ECC errors by type.",
                                  labels=[*gl, "type"])
        rows = GaugeMetricFamily("gpudiag_gpu_remapped_rows",
                                 "Remapped rows by state (pending/failure are 0 or 1).",
                                 labels=[*gl, "state"])
        for d in devices:
            uuid, name, pci = self._known(d.index, d.uuid, d.name, d.pci_bus_id)
            labels = [str(d.index), uuid]
            info.add_metric([*labels, name, pci], 1.0)
            if not d.ok:
                continue
            # The watcher's telemetry uses the probe's names: newer readings win one by one.
            now = d.readings.updated_by(tele.get(d.index) if fresh else None)
            m = now.memory or Memory()
            for k, value in (("total", m.total_bytes), ("used", m.used_bytes),
                             ("free", m.free_bytes)):
                _add(mem[k], labels, value)
            _add(util, labels, now.utilization_gpu_ratio)
            _add(temp, labels, now.temperature_c)
            _add(power, labels, now.power_w)
            e = d.ecc or Ecc()
            _add(ecc, [*labels, "corrected"], e.aggregate_corrected)
            _add(ecc, [*labels, "uncorrected"], e.aggregate_uncorrected)
            states = d.remapped_rows.states() if d.remapped_rows else {}
            for state, count in states.items():
                _add(rows, [*labels, state], count)
        yield from (info, *mem.values(), util, temp, power, ecc, rows)

    def _xids(self, snap: Snapshot, now: float) -> Iterator[Metric]:
        w = snap.watcher
        labels = ["gpu", "uuid", "xid"]
        total = CounterMetricFamily("gpudiag_gpu_xid_errors", "XID events seen by the watcher.",
                                    labels=labels)
        last = GaugeMetricFamily("gpudiag_gpu_xid_last_timestamp_seconds",
                                 "When the watcher last saw this XID.", labels=labels)
        folded = CounterMetricFamily(
            "gpudiag_xid_storm_folded", "XID events folded into an open storm window of their "
            "GPU and XID (counted, but no finding, log line or history row of their own).",
            labels=labels)
        for c in w.xid_counts:
            lv = ["" if c.gpu is None else str(c.gpu), c.uuid or "", str(c.xid)]
            total.add_metric(lv, float(c.count))
            last.add_metric(lv, c.last_timestamp)
            folded.add_metric(lv, float(c.folded))
        yield from (total, last, folded)
        yield GaugeMetricFamily("gpudiag_xid_watcher_up",
                                "1 while the XID watcher child runs and answers.",
                                value=1.0 if w.running else 0.0)
        yield CounterMetricFamily("gpudiag_xid_watcher_restarts",
                                  "Times the XID watcher child was restarted.",
                                  value=float(w.restarts))
        yield CounterMetricFamily("gpudiag_xid_watcher_gap_seconds",
                                  "Seconds during which no XID watcher was running.",
                                  value=w.gap_total_s(now) if w.enabled else 0.0)
        yield GaugeMetricFamily("gpudiag_snapshot_age_seconds",
                                "Seconds since the daemon last published a snapshot.",
                                value=max(0.0, now - snap.published_wall))


class HistoryCollector(StateCollector[HistoryHealth]):
    """The history's health: writable, write errors, changes waiting or dropped, damage."""

    def render(self, state: HistoryHealth) -> Iterable[Metric]:
        """The history's gauges and counters."""
        return (
            GaugeMetricFamily(
                "gpudiag_history_writable",
                "1 when the last write to the history database worked, 0 while writes fail.",
                value=1.0 if state.writable else 0.0),
            CounterMetricFamily(
                "gpudiag_history_write_errors",
                "Writes to the history database that failed (disk full, I/O error).",
                value=float(state.write_errors)),
            GaugeMetricFamily(
                "gpudiag_history_pending",
                "Verdict changes kept in memory until the history takes writes again.",
                value=float(state.pending)),
            CounterMetricFamily(
                "gpudiag_history_dropped",
                "Verdict changes dropped because too many waited for the history.",
                value=float(state.dropped)),
            GaugeMetricFamily(
                "gpudiag_history_damaged_files",
                "Damaged histories this daemon moved aside at start "
                "(history.sqlite3.damaged-*).",
                value=float(len(state.damaged))),
        )


def _environment_backends() -> frozenset[str]:
    return frozenset(s.name for s in registry.specs() if s.environment is not None)


def _runtime_layers() -> frozenset[str]:
    """The layers of a runtime's own blockers: its probe children and the backends it
    serves (each always present as 0 or 1, so alerts need no absent())."""
    return frozenset({"probe", *(s.layer for s in registry.specs() if s.environment)})


def _codes(name: str, kind: str, table: Mapping[str, CatalogEntry],
           found: Iterable[Finding]) -> GaugeMetricFamily:
    """Every code of ``table`` as 0 or 1 (1 when in ``found``), so alerts need no absent()."""
    present = {f.code for f in found}
    family = GaugeMetricFamily(
        name, f"1 when this {kind} code is present on the host, else 0.",
        labels=["code", "layer"])
    for code, row in table.items():
        family.add_metric([code, row.layer], 1.0 if code in present else 0.0)
    return family


def _init_seconds(run: ProbeRun) -> float | int | None:
    """How long the backend's own initialization took, as its probe measured it."""
    obs = run.parsed
    if isinstance(obs, CudaObservation):
        return obs.init_duration_s
    if isinstance(obs, (JaxObservation, IreeObservation)):
        return obs.init_duration_s if obs.init_duration_s is not None else obs.init_s
    return None


def _first_per_backend(snap: Snapshot) -> list[ProbeKey]:
    """One scheduled key per backend (a jax:cpu default requirement adds a second jax)."""
    seen: dict[str, ProbeKey] = {}
    for key in snap.scheduled:
        seen.setdefault(key.backend, key)
    return list(seen.values())


def _add(family: GaugeMetricFamily | CounterMetricFamily, labels: list[str],
         value: Any) -> None:
    """Add a sample only for a real number: a missing reading is an absent series, not NaN."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        family.add_metric(labels, float(value))
