"""Fake NVIDIA driver boundary (NVML, CUDA driver, nvidia-smi) for gpudiag's tests."""

from tests.fakes.build import FakeDriver, build_fakes, write_state_file
from tests.fakes.jobs import DeviceEvent, FakeJob, FakeJobs, read_context_log

__all__ = ["DeviceEvent", "FakeDriver", "FakeJob", "FakeJobs", "build_fakes", "read_context_log",
           "write_state_file"]
