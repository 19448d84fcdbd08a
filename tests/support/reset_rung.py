"""A real `gpudiag serve` with the GPU reset rung on, over the fake driver and the fake
nvidia-smi as its tool (tests/test_gpu_reset.py, tests/test_nvlink_domain.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpudiag.core.records import dataclass
from tests.fakes.build import FakeDriver, write_state_file
from tests.support.daemon import Daemon, daemon_toml, host_env, write_config


@dataclass(frozen=True)
class ResetNode:
    """A fake host whose GPUs a test changes through its state file."""

    gpus: int
    env: dict[str, str]
    state_file: Path  # FAKE_GPU_STATE_FILE: the knobs the fakes read at each call
    state: Path  # the daemon's state dir
    tmp: Path
    log: Path  # FAKE_NVIDIA_SMI_LOG: what the fake nvidia-smi changed
    contexts: Path  # FAKE_CUDA_CONTEXT_LOG: every context the fake libcuda made
    smi: str  # the fake nvidia-smi, the rung's tool


def reset_node(fakes: FakeDriver, tmp: Path, gpus: int) -> ResetNode:
    state_file = tmp / "gpu-state"
    write_state_file(state_file, {"FAKE_NVML_DEVICE_COUNT": gpus})
    log, contexts = tmp / "smi.log", tmp / "contexts.log"
    env = host_env(fakes, tmp / "host", gpus=gpus, FAKE_GPU_STATE_FILE=str(state_file),
                   FAKE_NVIDIA_SMI_LOG=str(log), FAKE_CUDA_CONTEXT_LOG=str(contexts))
    return ResetNode(gpus, env, state_file, tmp / "state", tmp, log, contexts,
                     str(fakes.nvidia_smi))


def start_reset_daemon(node: ResetNode, knobs: dict[str, str | int], *,
                       enabled: bool = True) -> Daemon:
    """The daemon, ready, its host set to ``knobs`` (XIDs held an hour, no qualification)."""
    write_state_file(node.state_file, {"FAKE_NVML_DEVICE_COUNT": node.gpus, **knobs})
    reset = {"enabled": enabled, "nvidia_smi": node.smi, "tick_s": 0.1,
             "verify_timeout_s": 60}
    toml = daemon_toml({"xid": {"hold_s": 3600}, "qualification": {"enabled": False},
                        "gpu_reset": reset})
    return Daemon.ready(node.env, write_config(node.tmp / "gpudiag.toml", toml), node.state)


def smi_calls(node: ResetNode) -> list[dict[str, Any]]:
    """What the fake nvidia-smi changed, in order."""
    try:
        text = node.log.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def smi_resets(node: ResetNode) -> list[dict[str, Any]]:
    """The resets among them (``-r -i BUS``)."""
    return [c for c in smi_calls(node) if "-r" in c["argv"]]
