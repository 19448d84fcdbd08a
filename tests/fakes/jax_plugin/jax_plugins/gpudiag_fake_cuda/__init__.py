"""A fake JAX CUDA plugin that fails the way jax-cuda12-plugin does, for tests.

Put ``tests/fakes/jax_plugin`` on PYTHONPATH: JAX discovers ``jax_plugins.*`` modules and
calls ``initialize()``. ``FAKE_JAX_PLUGIN`` picks the failure:

- ``cuinit``: registers a ``cuda`` backend whose factory calls the real ``cuInit`` through
  ctypes (the fake libcuda of tests/fakes when it is on LD_LIBRARY_PATH), logs XLA's
  ``failed call to cuInit: CUDA_ERROR_...`` line on stderr and raises what XLA raises:
  ``FAILED_PRECONDITION: No visible GPU devices.``
- ``pjrt_mismatch``: ``initialize()`` raises the PJRT API version mismatch; JAX logs it.
- ``cuda_libs``: the plugin's CUDA version check fails ("Unable to use CUDA because of the
  following issues with CUDA components") and the backend is not registered.
- ``cuda_missing``: the check cannot load CUDA ("Unable to load CUDA. Is it installed?").
- ``fallback``: nothing is registered; JAX itself then warns that a GPU may be present but a
  CUDA-enabled jaxlib is not installed, and falls back to the CPU.

Every mode except ``none`` makes JAX's own device-node check (/dev/nvidia0, /dev/nvidiactl)
answer yes, standing in for a host with GPU device nodes.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import time
from typing import Any

logger = logging.getLogger("jax_plugins.cuda")


def _pretend_device_nodes() -> None:
    from jax._src import hardware_utils

    hardware_utils.has_visible_nvidia_gpu = lambda: True


def _xla_log(text: str) -> None:
    """One line in absl's format, written to fd 2 as XLA's C++ logging does."""
    stamp = time.strftime("%m%d %H:%M:%S", time.gmtime())
    os.write(2, f"E{stamp}.000000 {os.getpid():>7} cuda_executor.cc:1228] {text}\n".encode())


def _cuinit_factory() -> Any:
    from jax._src.lib import xla_client  # type: ignore[attr-defined]  # as real plugins do

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        _xla_log(f"failed call to cuInit: could not load libcuda.so.1: {e}")
        raise xla_client.XlaRuntimeError("FAILED_PRECONDITION: No visible GPU devices.") from None
    code = lib.cuInit(0)
    if code != 0:
        name_p, text_p = ctypes.c_char_p(), ctypes.c_char_p()
        lib.cuGetErrorName(code, ctypes.byref(name_p))
        lib.cuGetErrorString(code, ctypes.byref(text_p))
        name = (name_p.value or b"UNKNOWN ERROR").decode()
        text = (text_p.value or b"").decode()
        _xla_log(f"failed call to cuInit: {name}: {text}")
        raise xla_client.XlaRuntimeError("FAILED_PRECONDITION: No visible GPU devices.")
    raise xla_client.XlaRuntimeError(
        "INTERNAL: fake JAX CUDA plugin: cuInit worked but this fake has no GPU client")


def initialize() -> None:
    mode = os.environ.get("FAKE_JAX_PLUGIN", "none")
    if mode == "none":
        return
    _pretend_device_nodes()
    if mode == "cuinit":
        import jax._src.xla_bridge as xb

        xb.register_backend_factory("cuda", _cuinit_factory, priority=500, fail_quietly=False)
    elif mode == "pjrt_mismatch":
        from jax._src.lib import xla_client  # type: ignore[attr-defined]  # as real plugins do

        raise xla_client.XlaRuntimeError(
            "INTERNAL: Mismatched PJRT plugin PJRT API version (0.54) and framework PJRT API "
            "version 0.67).")
    elif mode == "cuda_libs":
        logger.warning(
            "CUDA version check failed during initialization. CUDA backend will not be "
            "available. Error: %s",
            "Unable to use CUDA because of the following issues with CUDA components:\n"
            "Outdated cuDNN installation found.\nVersion JAX was built against: 91000\n"
            "Minimum supported: 9100\nInstalled version: 8907\n"
            "The local installation version must be no lower than 9100.")
    elif mode == "cuda_missing":
        logger.warning(
            "CUDA version check failed during initialization. CUDA backend will not be "
            "available. Error: %s", "Unable to load CUDA. Is it installed?")
    elif mode == "fallback":
        pass  # JAX's own _suggest_missing_backends() prints the warning
    else:
        print(f"gpudiag_fake_cuda: unknown FAKE_JAX_PLUGIN={mode!r}", file=sys.stderr)
