"""Fake NVIDIA driver boundary (NVML, CUDA driver, nvidia-smi) for gpudiag's tests."""

from tests.fakes.build import FakeDriver, build_fakes, write_state_file

__all__ = ["FakeDriver", "build_fakes", "write_state_file"]
