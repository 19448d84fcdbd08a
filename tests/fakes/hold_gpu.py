"""Someone else's job on fake GPU 0, for scripts/gpu-validate.sh's occupancy section.

    python -m tests.fakes.hold_gpu STATE_FILE [MIB]

The fake driver's stand-in for ``scripts/gpu_validate.py hold``: it publishes its own PID as a
compute process of GPU 0 using MIB MiB through the FAKE_GPU_STATE_FILE (which the fake NVML
and nvidia-smi re-read while they run), prints ``holding pid=... bytes=...`` like the real
helper, and on SIGTERM (or after 240 s) takes itself off the GPU and exits. ``STATE_FILE.held``
gets two lines, the Unix times from which and until which the GPU was busy, so that a test can
tell a context made on the busy GPU from one made before or after.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from tests.fakes.build import write_state_file


def main(argv: list[str]) -> int:
    state, mib = Path(argv[0]), int(argv[1]) if len(argv) > 1 else 1024
    stop = {"now": False}

    def on_signal(signum: int, frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    write_state_file(state, {"FAKE_NVML_PROCESSES": f"0:{os.getpid()}:{mib}",
                             "FAKE_NVML_MEMORY_USED_MIB": f"0:{mib}"})
    held = state.with_name(state.name + ".held")
    held.write_text(f"{time.time()}\n")
    try:
        print(f"holding pid={os.getpid()} bytes={mib << 20}", flush=True)
        deadline = time.monotonic() + 240
        while not stop["now"] and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        with held.open("a") as f:  # before the GPU is free: anything earlier met a busy GPU
            f.write(f"{time.time()}\n")
        write_state_file(state, {"FAKE_NVML_PROCESSES": "", "FAKE_NVML_MEMORY_USED_MIB": ""})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
