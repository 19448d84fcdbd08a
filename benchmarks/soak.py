"""Soak: a real `gpudiag serve` on the fake driver, fast intervals, faults flapping.

The faults flap through FAKE_GPU_STATE_FILE (GPU 0 lost and back, cuInit failing and
recovering, cuInit hanging past the probe deadline) while the script polls the HTTP API. It
prints RSS growth (target <= 5 MB), leaked child processes and file descriptors (target none),
whether the history stays within its retention, and whether every injected fault was recorded
as a blocker episode with a start and an end:

    .venv/bin/python benchmarks/soak.py [--minutes 10]

Exit status 0 when every target is met, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import signal
import sqlite3
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fakes.build import build_fakes, write_state_file
from tests.support.daemon import Daemon, daemon_toml
from tests.support.host import clean_env, make_host_dirs, processes_with_env

RSS_TARGET_BYTES = 5 * 2**20
EPISODE_SLACK_S = 12.0
MARKER_VAR = "GPUDIAG_SOAK_MARKER"


@dataclass(frozen=True)
class Phase:
    """One stretch of the flapping schedule: the state-file knobs and the expected code."""

    name: str
    knobs: Mapping[str, str]
    code: str | None
    backend: str | None
    duration_s: float


def schedule(scale: float) -> list[Phase]:
    """One fault cycle; ``scale`` stretches every phase (1.0 for the 10-minute soak)."""
    return [
        Phase("healthy", {}, None, None, 6 * scale),
        Phase("gpu_lost", {"FAKE_NVML_DEVICE_ERRORS": "0:15"}, "gpu_lost", "nvml", 6 * scale),
        Phase("healthy", {}, None, None, 6 * scale),
        Phase("cuinit_failing", {"FAKE_CUDA_INIT_ERROR": "999"}, "cuda_init_failed", "cuda",
              6 * scale),
        Phase("healthy", {}, None, None, 6 * scale),
        Phase("probe_hang", {"FAKE_CUDA_INIT_HANG": "1"}, "probe_timeout", "cuda", 7 * scale),
    ]


# The shared test daemon config (tests/support/daemon.py), probing every second.
SOAK_CONFIG: dict[str, dict[str, float]] = {
    "backends.nvml": {"interval_s": 1, "deadline_s": 5},
    "backends.cuda": {"interval_s": 1, "deadline_s": 1.5},
    "xid": {"heartbeat_s": 0.5, "telemetry_s": 2, "gap_warning_s": 30},
}


def soak_config(retention_s: float) -> str:
    """The soak daemon's TOML, keeping history for ``retention_s``."""
    return daemon_toml({**SOAK_CONFIG, "history": {"retention_s": retention_s}})


@dataclass(frozen=True)
class Injected:
    """A fault phase as it really happened (wall clock)."""

    phase: Phase
    on_wall: float
    off_wall: float


@dataclass
class SoakReport:
    """Every figure the soak prints."""

    duration_s: float = 0.0
    rss_baseline_bytes: int = 0
    rss_end_bytes: int = 0
    rss_max_bytes: int = 0
    fds_baseline: int = 0
    fds_end: int = 0
    threads_baseline: int = 0
    threads_end: int = 0
    children_end: int = 0  # besides the residents
    residents_end: int = 0  # the XID watcher and the probe fork server
    zombies_end: int = 0
    leftover_processes: list[int] = field(default_factory=list)
    http_requests: int = 0
    http_5xx: int = 0
    http_errors: int = 0
    log_lines: int = 0
    retention_s: float = 0.0
    verdict_rows: int = 0
    rows_past_retention: int = 0
    oldest_row_age_s: float = 0.0
    integrity: str = ""
    injected: int = 0
    matched: int = 0
    unmatched: list[str] = field(default_factory=list)
    still_open: list[str] = field(default_factory=list)
    daemon_exit: int | None = None

    @property
    def rss_growth_bytes(self) -> int:
        return self.rss_end_bytes - self.rss_baseline_bytes

    @property
    def fds_leaked(self) -> int:
        return max(0, self.fds_end - self.fds_baseline)

    def problems(self) -> list[str]:
        """Every target missed, as text (empty: the soak passed)."""
        out = []
        if self.rss_growth_bytes > RSS_TARGET_BYTES:
            out.append(f"RSS grew {self.rss_growth_bytes / 2**20:.2f} MiB (target <= 5)")
        if self.fds_leaked:
            out.append(f"{self.fds_leaked} file descriptors leaked")
        if self.children_end or self.zombies_end:
            out.append(f"{self.children_end} children ({self.zombies_end} zombies) at rest; "
                       "expected only the XID watcher and the probe fork server")
        if self.leftover_processes:
            out.append(f"processes left after the daemon stopped: {self.leftover_processes}")
        if self.http_5xx or self.http_errors:
            out.append(f"{self.http_5xx} HTTP 5xx answers, {self.http_errors} failed requests")
        if self.rows_past_retention:
            out.append(f"{self.rows_past_retention} history rows older than the retention")
        if self.integrity != "ok":
            out.append(f"integrity_check: {self.integrity}")
        if self.unmatched:
            out.append(f"faults without a closed episode: {', '.join(self.unmatched)}")
        if self.still_open:
            out.append(f"episodes still open after recovery: {', '.join(self.still_open)}")
        if self.daemon_exit not in (0, None):
            out.append(f"daemon exited {self.daemon_exit}")
        return out

    def lines(self) -> list[str]:
        mib = 2**20
        return [
            f"duration                 {self.duration_s:.0f} s",
            f"RSS                      baseline {self.rss_baseline_bytes / mib:.2f} MiB, end "
            f"{self.rss_end_bytes / mib:.2f} MiB, max {self.rss_max_bytes / mib:.2f} MiB, "
            f"growth {self.rss_growth_bytes / mib:+.2f} MiB (target <= 5)",
            f"file descriptors         baseline {self.fds_baseline}, end {self.fds_end}, "
            f"leaked {self.fds_leaked}",
            f"threads                  baseline {self.threads_baseline}, end {self.threads_end}",
            f"children at rest         {self.residents_end} resident (the XID watcher and "
            f"the probe fork server), {self.children_end} other, zombies "
            f"{self.zombies_end}",
            f"left after stop          {len(self.leftover_processes)} processes",
            f"HTTP                     {self.http_requests} requests, {self.http_5xx} 5xx, "
            f"{self.http_errors} failed",
            f"daemon log               {self.log_lines} lines "
            f"({self.log_lines / max(self.duration_s / 60, 1e-9):.1f}/min)",
            f"history                  {self.verdict_rows} verdict rows, oldest "
            f"{self.oldest_row_age_s:.0f} s, retention {self.retention_s:.0f} s, "
            f"past retention {self.rows_past_retention}, integrity {self.integrity}",
            f"episodes                 {self.injected} faults injected, {self.matched} "
            f"recorded with start and end, {len(self.unmatched)} missing, "
            f"{len(self.still_open)} still open",
            f"daemon exit              {self.daemon_exit}",
        ]


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid``."""
    return int(psutil.Process(pid).memory_info().rss)


def fd_count(pid: int) -> int:
    """Open file descriptors of ``pid``."""
    return int(psutil.Process(pid).num_fds())


def thread_count(pid: int) -> int:
    return int(psutil.Process(pid).num_threads())


# The daemon's children for its whole life: the XID watcher and the probe fork server.
RESIDENTS = ("gpudiag.probes.xid_watch", "gpudiag.probes.forkserver")


def children_of(pid: int) -> list[tuple[int, str]]:
    """(pid, state letter: Z for a zombie, L for a resident) of the direct children of
    ``pid``."""
    found = []
    for kid in psutil.Process(pid).children():
        try:
            if kid.status() == psutil.STATUS_ZOMBIE:
                found.append((kid.pid, "Z"))
                continue
            resident = any(r in " ".join(kid.cmdline()) for r in RESIDENTS)
            found.append((kid.pid, "L" if resident else "R"))
        except psutil.NoSuchProcess:
            continue
    return found


class Poller(threading.Thread):
    """Polls /metrics, /v1/preflight and /v1/history; keeps every episode it sees by id."""

    def __init__(self, daemon: Daemon, interval_s: float = 0.5) -> None:
        super().__init__(daemon=True, name="poller")
        self.d = daemon
        self.interval_s = interval_s
        self.stop_event = threading.Event()
        self.episodes: dict[int, dict[str, Any]] = {}
        self.requests = self.http_5xx = self.errors = 0
        self.lock = threading.Lock()

    def poll_history(self) -> None:
        status, body = self.d.get("/v1/history?limit=1000")
        self._count(status)
        if status == 200 and isinstance(body, dict):
            with self.lock:
                for ep in body.get("episodes", []):
                    self.episodes[int(ep["id"])] = ep

    def _count(self, status: int) -> None:
        self.requests += 1
        if status >= 500 and status != 503:
            self.http_5xx += 1

    def run(self) -> None:
        n = 0
        while not self.stop_event.wait(self.interval_s):
            n += 1
            try:
                self._count(self.d.get("/metrics")[0])
                # 503 not_ready is a documented answer while probes run, not a failure.
                self._count(self.d.get("/v1/preflight?wait_s=0")[0])
                if n % 4 == 0:
                    self.poll_history()
            except (OSError, ValueError):
                self.errors += 1


def match_episodes(injected: Sequence[Injected], episodes: Mapping[int, Mapping[str, Any]],
                   slack_s: float = EPISODE_SLACK_S) -> tuple[int, list[str]]:
    """How many faults have a closed episode of their code inside their window."""
    matched, missing = 0, []
    for inj in injected:
        ok = any(
            ep["code"] == inj.phase.code and ep.get("backend") == inj.phase.backend
            and inj.on_wall - 1.0 <= float(ep["started"]) <= inj.off_wall + slack_s
            and ep.get("ended") is not None
            and inj.off_wall - 1.0 <= float(ep["ended"]) <= inj.off_wall + slack_s
            for ep in episodes.values())
        if ok:
            matched += 1
        else:
            missing.append(f"{inj.phase.name}@{inj.on_wall:.0f}")
    return matched, missing


def run_soak(total_s: float, *, scale: float = 1.0, warmup_s: float | None = None,
             retention_s: float = 120.0, workdir: Path | None = None,
             progress: bool = False) -> SoakReport:
    """Run the daemon under flapping faults for ``total_s`` seconds; measure everything."""
    tmp = tempfile.TemporaryDirectory(prefix="gpudiag-soak-") if workdir is None else None
    root = Path(tmp.name) if tmp is not None else Path(workdir)  # type: ignore[arg-type]
    try:
        return _soak(root, total_s, scale, warmup_s, retention_s, progress)
    finally:
        if tmp is not None:
            tmp.cleanup()


def _soak(root: Path, total_s: float, scale: float, warmup_s: float | None,
          retention_s: float, progress: bool) -> SoakReport:
    fakes = build_fakes(root / "fakes")
    dev, proc_dir = make_host_dirs(root / "host", gpus=2)
    state_file = root / "gpu-state"
    write_state_file(state_file, {})
    marker = uuid.uuid4().hex
    env = clean_env()
    env.update({"GPUDIAG_DEVICE_DIR": str(dev), "GPUDIAG_DRIVER_PROC_DIR": str(proc_dir),
                MARKER_VAR: marker})
    env = fakes.env(base=env, FAKE_NVML_DEVICE_COUNT=2, FAKE_GPU_STATE_FILE=str(state_file))
    config = root / "gpudiag.toml"
    config.write_text(soak_config(retention_s))
    report = SoakReport(retention_s=retention_s)
    cycle = schedule(scale)
    warmup = sum(p.duration_s for p in cycle) if warmup_s is None else warmup_s

    daemon = Daemon(env, config, root / "state")
    pid = daemon.proc.pid
    poller = Poller(daemon)
    injected: list[Injected] = []
    started = time.monotonic()
    try:
        wait_until = time.monotonic() + 30
        while daemon.get("/readyz")[0] != 200 and time.monotonic() < wait_until:
            time.sleep(0.1)
        poller.start()
        baseline_taken = False
        i = 0
        while True:
            elapsed = time.monotonic() - started
            phase = cycle[i % len(cycle)]
            # Always end on a healthy phase, long enough for every episode to close.
            if elapsed + phase.duration_s > total_s and phase.code is not None:
                break
            if elapsed >= total_s:
                break
            write_state_file(state_file, dict(phase.knobs))
            on = time.time()
            time.sleep(phase.duration_s)
            if phase.code is not None:
                injected.append(Injected(phase, on, time.time()))
            i += 1
            if not baseline_taken and time.monotonic() - started >= warmup:
                report.rss_baseline_bytes = rss_bytes(pid)
                report.fds_baseline = min(fd_count(pid) for _ in range(3))
                report.threads_baseline = thread_count(pid)
                baseline_taken = True
            report.rss_max_bytes = max(report.rss_max_bytes, rss_bytes(pid))
            if progress:
                print(f"  {time.monotonic() - started:6.0f} s  {phase.name:<15} RSS "
                      f"{rss_bytes(pid) / 2**20:.2f} MiB  fds {fd_count(pid)}  "
                      f"threads {thread_count(pid)}", flush=True)
        # Healthy until every episode is closed (or the slack is spent).
        write_state_file(state_file, {})
        settle_end = time.monotonic() + EPISODE_SLACK_S
        while time.monotonic() < settle_end:
            poller.poll_history()
            with poller.lock:
                if not any(ep.get("ended") is None for ep in poller.episodes.values()):
                    break
            time.sleep(0.5)
        poller.stop_event.set()
        poller.join(30)
        poller.poll_history()
        if not baseline_taken:
            report.rss_baseline_bytes = rss_bytes(pid)
            report.fds_baseline = fd_count(pid)
            report.threads_baseline = thread_count(pid)
        # At rest: the minimum over a few samples, since a probe child may be in flight.
        samples = []
        for _ in range(10):
            kids = children_of(pid)
            samples.append((sum(1 for _, s in kids if s != "L"),
                            sum(1 for _, s in kids if s == "Z"), fd_count(pid),
                            sum(1 for _, s in kids if s == "L")))
            time.sleep(0.2)
        report.children_end = min(s[0] for s in samples)
        report.zombies_end = min(s[1] for s in samples)
        report.residents_end = min(s[3] for s in samples)
        report.fds_end = min(s[2] for s in samples)
        report.rss_end_bytes = rss_bytes(pid)
        report.rss_max_bytes = max(report.rss_max_bytes, report.rss_end_bytes)
        report.threads_end = thread_count(pid)
    finally:
        poller.stop_event.set()
        report.daemon_exit = daemon.stop()
    report.duration_s = time.monotonic() - started
    # Probe children die at their deadlines at the latest.
    end = time.monotonic() + 5
    while processes_with_env(marker) and time.monotonic() < end:
        time.sleep(0.2)
    report.leftover_processes = processes_with_env(marker)
    for p in report.leftover_processes:  # never leave them behind, even when reporting them
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    report.http_requests, report.http_5xx = poller.requests, poller.http_5xx
    report.http_errors = poller.errors
    report.log_lines = daemon.log_lines
    _check_history(root / "state" / "history.sqlite3", report, poller.episodes)
    report.injected = len(injected)
    report.matched, report.unmatched = match_episodes(injected, poller.episodes)
    report.still_open = sorted({f"{ep['code']}/{ep.get('backend')}"
                                for ep in poller.episodes.values() if ep.get("ended") is None})
    return report


def _check_history(db_path: Path, report: SoakReport,
                   episodes: dict[int, dict[str, Any]]) -> None:
    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        now = time.time()
        report.integrity = "; ".join(r[0] for r in db.execute("PRAGMA integrity_check"))
        rows = db.execute("SELECT id, ts FROM verdicts ORDER BY id").fetchall()
        report.verdict_rows = len(rows)
        if rows:
            report.oldest_row_age_s = now - float(rows[0][1])
        # The store prunes on a write at most retention/10 after the previous prune, and
        # keeps the newest verdict whatever its age (it is the current state): so at the
        # newest write nothing older than 1.1 x retention may remain.
        if rows:
            limit = float(rows[-1][1]) - 1.1 * report.retention_s - 1.0
            report.rows_past_retention = sum(1 for _, ts in rows[:-1] if float(ts) < limit)
        for row in db.execute("SELECT id, code, layer, backend, device, started, ended "
                              "FROM episodes"):
            episodes.setdefault(int(row[0]), {"id": row[0], "code": row[1], "layer": row[2],
                                              "backend": row[3], "device": row[4],
                                              "started": row[5], "ended": row[6]})
    finally:
        db.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0,
                        help="How long to soak (default 10).")
    parser.add_argument("--retention-s", type=float, default=120.0,
                        help="History retention given to the daemon (default 120 s).")
    parser.add_argument("--quiet", action="store_true", help="No progress lines.")
    args = parser.parse_args(argv)
    if not args.minutes > 0:
        parser.error(f"--minutes {args.minutes!r}: expected a positive number")
    print(f"soak: {args.minutes:g} min, faults flapping: "
          f"{', '.join(p.name for p in schedule(1.0))}", flush=True)
    report = run_soak(args.minutes * 60, retention_s=args.retention_s,
                      progress=not args.quiet)
    for line in report.lines():
        print(line)
    problems = report.problems()
    print("result                   " + ("PASS" if not problems else "FAIL: " +
                                         "; ".join(problems)))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
