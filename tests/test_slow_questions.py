"""Slow questions never hold fast ones: waiting /v1/health answers leave monitoring fast."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from gpudiag.daemon.httpserver import SLOW_PATHS
from tests.fakes.build import FakeDriver, write_state_file
from tests.support.daemon import Daemon, daemon_toml, host_env, write_config

WAITERS = 8


def test_every_endpoint_that_can_wait_is_a_slow_path() -> None:
    assert {"/v1/preflight", "/v1/health", "/v1/history"} <= SLOW_PATHS
    assert not {"/metrics", "/healthz", "/readyz"} & SLOW_PATHS


def test_eight_waiting_health_questions_leave_metrics_healthz_readyz_under_100_ms(
        fakes: FakeDriver, tmp_path: Path) -> None:
    state = tmp_path / "gpu-state"
    write_state_file(state, {"FAKE_NVML_DEVICE_COUNT": 2})
    env = host_env(fakes, tmp_path / "host", gpus=2, FAKE_GPU_STATE_FILE=str(state))
    # cuda runs rarely and may hang for 30 s: every waiting question joins one hung child.
    toml = daemon_toml({"backends.cuda": {"interval_s": 600, "deadline_s": 30}})
    daemon = Daemon(env, write_config(tmp_path / "gpudiag.toml", toml), tmp_path / "state")
    answered: list[int] = []
    try:
        daemon.wait_ready()
        write_state_file(state, {"FAKE_NVML_DEVICE_COUNT": 2, "FAKE_CUDA_INIT_HANG": 1})

        def ask() -> None:
            try:
                with urllib.request.urlopen(daemon.url + "/v1/health?require=cuda&max_age_s=0"
                                            "&wait_s=20", timeout=40) as r:
                    answered.append(r.status)
            except (OSError, urllib.error.URLError):
                answered.append(-1)  # the daemon stopped under it: the test is over

        waiters = [threading.Thread(target=ask, daemon=True) for _ in range(WAITERS)]
        for t in waiters:
            t.start()
        time.sleep(0.5)  # every waiter now holds a slow worker: the cuda child hangs in cuInit
        ms: dict[str, list[float]] = {p: [] for p in ("/metrics", "/healthz", "/readyz")}
        end = time.monotonic() + 4
        while time.monotonic() < end:
            for path, seen in ms.items():
                t0 = time.perf_counter()
                try:
                    status, _ = daemon.get(path, timeout=5)
                except TimeoutError:
                    raise AssertionError(f"{path} got no answer within 5 s while "
                                         f"{WAITERS} health questions waited") from None
                seen.append((time.perf_counter() - t0) * 1000)
                assert status == 200, path
            time.sleep(0.01)
        # The questions were really still waiting the whole time.
        assert answered == [], f"health answered early: {answered}"
        for path, seen in ms.items():
            seen.sort()
            p99 = seen[min(len(seen) - 1, int(len(seen) * 0.99))]
            print(f"{path}: p99 {p99:.1f} ms, max {seen[-1]:.1f} ms, n={len(seen)}")
            # Liveness, not a figure (issue 50): far under the seconds the waiting questions
            # hold; the latency itself is benchmarks/preflight_path.py's (docs/benchmarks.md).
            assert p99 < 1000, (f"{path}: p99 {p99:.1f} ms, max {seen[-1]:.1f} ms over "
                               f"{len(seen)} answers while {WAITERS} health questions waited")
    finally:
        assert daemon.stop() == 0
