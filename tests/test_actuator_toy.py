"""A new platform for remediation is one ``ActuatorSpec`` and one registry line: a toy one,
appended at test time, is accepted by ``[remediation] scheduler``, drives the same policy
(drain once with gpudiag's reason, nothing while the fault stands) and its failures count
like Slurm's. docs/design-notes.md, "Remediation", lists the files a real platform touches.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from gpudiag.core.remediation import Decision, Fault, Fleet, NodeView
from gpudiag.core.remediation_config import RemediationConfig
from gpudiag.daemon import actuators
from gpudiag.daemon.actuator import ActuatorError, ActuatorSpec, NodeInfo
from gpudiag.daemon.config import ConfigError, from_mapping
from gpudiag.daemon.remediation import Remediator, check_node_once

GPU = "GPU-f00d0000-0000-0000-0000-000000000000"


class ToyPlatform:
    """A platform that keeps one node's state in memory and records each call."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.state, self.reason = "IDLE", ""
        self.calls: list[str] = []
        self.down = False

    def show_node(self) -> NodeInfo:
        self.calls.append("show")
        if self.down:
            raise ActuatorError("timeout", "the toy control plane did not answer")
        return NodeInfo(NodeView(self.state, self.reason), ("toys",))

    def fleet(self, partitions: Sequence[str], *, now_wall: float, window_s: float
              ) -> Fleet:
        self.calls.append("fleet")
        return Fleet(nodes=10, recent_own=0)

    def drain(self, reason: str) -> None:
        self.calls.append(f"drain {reason}")
        self.state, self.reason = "DRAIN", reason

    def resume(self) -> None:
        self.calls.append("resume")
        self.state, self.reason = "IDLE", ""


PLATFORMS: dict[str, ToyPlatform] = {}


def _make(cfg: RemediationConfig, node: str) -> ToyPlatform:
    return PLATFORMS.setdefault(node, ToyPlatform(node))


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The toy platform registered (one line), and one standing gpu_lost fault."""
    import gpudiag.daemon.remediation as mod

    monkeypatch.setattr(actuators, "ACTUATORS",
                        [*actuators.ACTUATORS, ActuatorSpec("toy", "Toy", make=_make)])
    now = time.time()
    fault = Fault("gpu_lost", GPU, now - 1)
    monkeypatch.setattr(mod, "snapshot_faults",
                        lambda snap, drain_on_nic=False: ((fault,), now - 10))
    PLATFORMS.clear()
    yield
    PLATFORMS.clear()


def config(tmp_path: Path) -> RemediationConfig:
    return from_mapping({"remediation": {"mode": "act", "scheduler": "toy", "node_name": "n1",
                                         "killswitch_file": str(tmp_path / "kill")}}
                        ).remediation


def test_an_unregistered_platform_is_refused_by_the_config() -> None:
    with pytest.raises(ConfigError, match="scheduler"):
        from_mapping({"remediation": {"scheduler": "toy"}})


def test_a_registered_toy_platform_drains_once_with_gpudiags_reason(
        tmp_path: Path, toy: None) -> None:
    r = Remediator(config(tmp_path), tmp_path)
    r.offer(object())  # type: ignore[arg-type]
    decision = r.cycle()
    assert isinstance(decision, Decision) and decision.acts
    platform = PLATFORMS["n1"]
    # Its view, the fleet guard's view (the drain would be refused blind), the drain.
    assert platform.calls == ["show", "fleet", "drain gpudiag:node:gpu_lost:GPU-f00d0000"]
    assert r.report().actions == {("drain", "act", "gpu_lost", "ok"): 1}
    r.offer(object())  # type: ignore[arg-type]
    r.cycle()  # the fault stands: no second action
    assert [c for c in platform.calls if c.startswith("drain")] == [
        "drain gpudiag:node:gpu_lost:GPU-f00d0000"]


def test_a_toy_platform_that_does_not_answer_is_counted_and_backed_off(
        tmp_path: Path, toy: None) -> None:
    r = Remediator(config(tmp_path), tmp_path)
    PLATFORMS["n1"].down = True
    r.offer(object())  # type: ignore[arg-type]
    assert r.cycle() is None and r.cycle() is None  # backing off after the failure
    assert PLATFORMS["n1"].calls == ["show"]
    assert r.report().command_failures and r.report().last_error


def test_check_config_asks_the_toy_platform(tmp_path: Path, toy: None) -> None:
    ok, said = check_node_once(config(tmp_path))
    assert ok and "IDLE" in said, said
