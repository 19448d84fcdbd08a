"""What a child process really saw: its GPU environment and, when JAX was imported, its backend.

Standard library only and self-contained: ``gpudiag run`` copies this file's source into a
generated ``sitecustomize.py`` on the child's PYTHONPATH, so the record is written even where
gpudiag is not importable. A child may also call ``gpudiag.core.child.report()`` itself.
Each Python process writes ``child-<pid>.json`` into ``$GPUDIAG_CHILD_REPORT_DIR``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

REPORT_DIR_VAR = "GPUDIAG_CHILD_REPORT_DIR"
SCHEMA = "gpudiag.child/1"
KEYS = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "JAX_PLATFORMS",
        "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_ALLOCATOR",
        "XLA_PYTHON_CLIENT_USE_CUDA_HOST_ALLOCATOR")
_FALSE = ("false", "0", "no", "off")
_startup: dict[str, Any] | None = None


def env_sha256(env: Mapping[str, str]) -> str:
    """A hash of a whole environment (names and values), to compare without recording it."""
    import hashlib  # here: OpenSSL's load is most of a probe parent's imports of this module

    h = hashlib.sha256()
    for key in sorted(env):
        h.update(key.encode("utf-8", "surrogateescape") + b"=" +
                 env[key].encode("utf-8", "surrogateescape") + b"\0")
    return h.hexdigest()


def preallocation_off(env: Mapping[str, str]) -> bool:
    """Whether ``env`` disables XLA preallocation (gpudiag.core.environment uses this rule too).

    XLA_PYTHON_CLIENT_PREALLOCATE decides it. The allocator (platform, or XLA's own BFC
    allocator, which grows and keeps what it took) is another choice, recorded apart
    (``xla_allocator`` in a closeout): ``gpudiag run --xla-allocator keep`` leaves it to the job.
    """
    return env.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").strip().lower() in _FALSE


def xla_allocator(env: Mapping[str, str]) -> str:
    """The XLA GPU allocator a child with ``env`` uses: the variable's value, else "default"
    (XLA's BFC allocator)."""
    return env.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").strip().lower() or "default"


def snapshot(env: Mapping[str, str]) -> dict[str, Any]:
    """The GPU-relevant values, every variable name (no other value) and the whole hash."""
    return {"values": {k: env.get(k) for k in KEYS}, "keys": sorted(env),
            "sha256": env_sha256(env), "preallocation_disabled": preallocation_off(env)}


def _jax_state() -> dict[str, Any] | None:
    jax = sys.modules.get("jax")
    if jax is None:
        return None
    state: dict[str, Any] = {"version": getattr(jax, "__version__", None)}
    try:
        state["default_backend"] = jax.default_backend()
        state["platforms"] = sorted({d.platform for d in jax.devices()})
    except Exception as e:  # a failing backend is the finding, not a crash of the report
        state["error"] = f"{type(e).__name__}: {e}"
    return state


def report(path: str | None = None, *, final: bool = False) -> dict[str, Any]:
    """Record what this process sees now (and JAX's backend if imported); returns the record.

    Written to ``path``, else to ``$GPUDIAG_CHILD_REPORT_DIR/child-<pid>.json`` when set.
    """
    now = snapshot(os.environ)
    record = {
        "schema": SCHEMA, "pid": os.getpid(), "ppid": os.getppid(),
        "argv": list(sys.argv), "executable": sys.executable,
        "startup": _startup if _startup is not None else now, "now": now,
        "jax": _jax_state(), "final": final, "reported_at": time.time(),
    }
    folder = os.environ.get(REPORT_DIR_VAR)
    target = path or (os.path.join(folder, f"child-{os.getpid()}.json") if folder else None)
    if target:
        tmp = f"{target}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(record, fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, target)
        except OSError:
            # The report is evidence; it must never break the child, nor leave half a file
            # behind (a full disk fails the write after the temporary was created).
            try:
                os.unlink(tmp)
            except OSError:
                pass
    return record


def _final_report() -> None:
    report(final=True)


def _chain(own_dir: str) -> None:
    """Run the sitecustomize this hook shadows (Debian and venvs may ship one)."""
    import importlib.machinery
    import importlib.util

    paths = [p for p in sys.path if os.path.realpath(p or ".") != os.path.realpath(own_dir)]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", paths)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception:
        pass


def install_hook(own_dir: str | None = None) -> None:
    """Record the startup environment now and a final report at exit (sitecustomize entry)."""
    global _startup
    import atexit

    _startup = snapshot(os.environ)
    if os.environ.get(REPORT_DIR_VAR):
        report()
        atexit.register(_final_report)
    if own_dir:
        _chain(own_dir)


def sitecustomize_source() -> str:
    """The source of the generated sitecustomize.py: this module plus the hook call."""
    with open(__file__, encoding="utf-8") as fh:
        source = fh.read()
    return source + "\n\ninstall_hook(os.path.dirname(os.path.abspath(__file__)))\n"
