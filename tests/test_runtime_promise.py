"""What re-proves a runtime, what its config may promise, what the daemon logs of it (issue 48).

Only device-layer events re-prove runtimes (a GPU lost or back, a driver change, a fatal
XID, a clear), never a job's application XID; ``require = "jax:cpu"`` is a runtime that
serves CPU jobs; the scheduler's log lines name the runtime. The scheduler runs the real
probes' recorded answers (tests/support/daemon.py); nothing here starts a daemon.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from gpudiag.core.probe_run import ProbeRun
from gpudiag.core.requirement import parse_requirement
from gpudiag.daemon.config import BackendConfig, ConfigError, load_config
from gpudiag.daemon.scheduler import Scheduler, scheduled_keys
from gpudiag.daemon.snapshot import ProbeKey, WatcherState, XidCount
from tests.fakes.build import FakeDriver
from tests.support.daemon import Replay, host_env, quick_config, real_runs


class MutableWatcher:
    def __init__(self) -> None:
        self.value = WatcherState(enabled=True)

    def state(self) -> WatcherState:
        return self.value


def _config(tmp_path: Path, runtime: str) -> Path:
    path = tmp_path / "d.toml"
    path.write_text("[backends.jax]\nenabled = true\n" + runtime)
    return path


def test_a_runtime_may_promise_cpu_jobs_and_is_scheduled_on_the_cpu(tmp_path: Path) -> None:
    cfg = load_config(_config(tmp_path, f'[runtimes.cpujobs]\npython = "{sys.executable}"\n'
                                        'require = "jax:cpu"\n'))
    runtime = next(r for r in cfg.runtimes if r.name == "cpujobs")
    assert runtime.require == ("jax:cpu",)
    keys = scheduled_keys(cfg, parse_requirement(cfg.default_requirement, node_health=True))
    assert ProbeKey.of("jax", {"platform": "cpu"}, "cpujobs") in keys
    assert ProbeKey.of("jax", {"platform": "gpu"}, "cpujobs") not in keys
    assert ProbeKey.of("jax", {"platform": "gpu"}) in keys, "the daemon's own keeps its own"


@pytest.mark.parametrize(("require", "said"), [
    ('"jax:tpu"', "JAX platform 'tpu'"),
    ('"jax:cpu,jax"', "jax is named twice"),
    ('"cuda"', "cuda is not proven in a job's environment"),
])
def test_a_bad_runtime_promise_is_refused_naming_the_key(tmp_path: Path, require: str,
                                                          said: str) -> None:
    with pytest.raises(ConfigError, match="runtimes.x.require") as e:
        load_config(_config(tmp_path, f'[runtimes.x]\npython = "{sys.executable}"\n'
                                      f"require = {require}\n"))
    assert said in str(e.value)


@pytest.fixture
def scheduler(fakes: FakeDriver, tmp_path: Path) -> tuple[Scheduler, MutableWatcher, ProbeRun]:
    runs = real_runs(host_env(fakes, tmp_path / "host"), ("nvml",))
    watcher = MutableWatcher()
    backends = {**quick_config().backends, "jax": BackendConfig(True, 3600.0, 60.0)}
    sched = Scheduler(quick_config(backends=backends), runner=Replay(runs), env={},
                      watcher=watcher, runtimes_dir=tmp_path / "runtimes")
    return sched, watcher, runs["nvml"]


def _xids(*pairs: tuple[int, int]) -> WatcherState:
    return WatcherState(enabled=True, xid_counts=tuple(
        XidCount(0, "GPU-0", xid, count, 1_800_000_000.0) for xid, count in pairs))


def test_a_jobs_application_xid_proves_no_runtime_again_and_a_fatal_one_does(
        scheduler: tuple[Scheduler, MutableWatcher, ProbeRun],
        monkeypatch: pytest.MonkeyPatch) -> None:
    sched, watcher, nvml = scheduler
    again: list[object] = []
    monkeypatch.setattr(sched, "prove_again", lambda keys=None: again.append(keys))
    sched._proof_on_change(nvml)  # the first reading: no change
    for xid in (13, 31, 43, 45, 94):
        watcher.value = _xids((xid, 1))
        sched._proof_on_change(nvml)
    watcher.value = _xids((13, 5), (31, 2), (43, 1), (45, 9))
    sched._proof_on_change(nvml)
    assert again == [], "an application XID is the job's, not the device layer's"
    watcher.value = _xids((13, 5), (79, 1))
    sched._proof_on_change(nvml)
    assert len(again) == 1 and again[0], "a GPU fallen off the bus proves every runtime again"


def test_proving_again_names_what_it_proves_or_says_nothing(
        scheduler: tuple[Scheduler, MutableWatcher, ProbeRun],
        caplog: pytest.LogCaptureFixture) -> None:
    sched, _, _ = scheduler
    with caplog.at_level(logging.INFO, logger="gpudiag.daemon.scheduler"):
        sched.prove_again()  # not started: nothing is due, nothing to prove
        sched.start()
        try:
            sched.prove_again()
        finally:
            sched.stop()
    said = [r.getMessage() for r in caplog.records if "proving again" in r.getMessage()]
    assert said == ["proving again: jax@gpudiag"], said


def test_a_config_without_jax_says_nothing_when_a_clear_proves_again(
        fakes: FakeDriver, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    runs = real_runs(host_env(fakes, tmp_path / "host"), ("nvml",))
    sched = Scheduler(replace(quick_config()), runner=Replay(runs), env={})
    with caplog.at_level(logging.INFO, logger="gpudiag.daemon.scheduler"):
        sched.start()
        try:
            sched.prove_again()
        finally:
            sched.stop()
    assert not [r for r in caplog.records if "proving again" in r.getMessage()]


def test_a_runtime_whose_children_run_as_the_daemon_is_said_at_start(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from gpudiag.core.runtime import Runtime
    from gpudiag.daemon.runtime_proofs import RuntimeProofs

    own_uid = Runtime("same", python=sys.executable)  # no identity: the daemon's own
    nobody = Runtime("apart", python=sys.executable, uid=65534, gid=65534)
    with caplog.at_level(logging.WARNING, logger="gpudiag.daemon.runtimes"):
        RuntimeProofs((Runtime("gpudiag"), own_uid, nobody), {}, tmp_path)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith(
        "runtime same: its children run as this daemon's own uid"), said
