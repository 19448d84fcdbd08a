"""A short soak (about 45 s): the real daemon on the fakes while faults flap.

The same run and the same targets as ``benchmarks/soak.py`` (10 minutes), shortened: RSS
growth, leaked children and file descriptors, history retention, and every injected fault
recorded as a blocker episode with its start and end.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.soak import RSS_TARGET_BYTES, run_soak


def test_a_short_soak_with_flapping_faults_meets_every_target(tmp_path: Path) -> None:
    report = run_soak(42.0, scale=0.8, warmup_s=8.0, retention_s=15.0, workdir=tmp_path)
    summary = "\n".join(report.lines())
    assert report.problems() == [], summary
    # The same figures, asserted one by one so that a failure names its target.
    assert report.rss_growth_bytes <= RSS_TARGET_BYTES, summary
    assert report.fds_leaked == 0 and report.leftover_processes == [], summary
    # At rest: the XID watcher and the probe fork server, nothing else, no zombie.
    assert report.residents_end == 2 and report.children_end == 0, summary
    assert report.zombies_end == 0, summary
    assert report.http_5xx == 0 and report.http_errors == 0, summary
    assert report.injected >= 3 and report.matched == report.injected, summary
    assert report.still_open == [] and report.rows_past_retention == 0, summary
    assert report.integrity == "ok" and report.daemon_exit == 0, summary


def test_a_probe_killed_while_the_daemon_stops_is_not_published() -> None:
    """Found by the soak: the kill on the way out was recorded as an open probe_crashed."""
    import threading
    from collections.abc import Mapping
    from typing import Any

    from gpudiag.core.probe_run import ProbeRun
    from gpudiag.daemon.scheduler import Scheduler
    from tests.support.daemon import quick_config, wait_for

    started, release = threading.Event(), threading.Event()

    def runner(backend: str, env: Mapping[str, str], timeout_s: float,
               options: Mapping[str, Any] | None) -> ProbeRun:
        started.set()
        release.wait(10)
        return ProbeRun(backend, None, 0.1, signal=9, error="killed by signal 9 (SIGKILL)")

    sched = Scheduler(quick_config(), runner=runner, env={})
    published: list[int] = []
    sched.on_snapshot(lambda snap: published.append(snap.seq))
    sched.start()
    wait_for(started.is_set, 5)
    sched.stop()
    release.set()
    wait_for(lambda: not any(sched.running(k) for k in sched.scheduled), 5)
    assert published == [] and sched.snapshot().results == {}
