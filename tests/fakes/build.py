"""Builds the fake NVIDIA driver boundary used by gpudiag's tests.

``build_fakes(dest)`` compiles, with gcc, into ``dest``::

    dest/lib/libnvidia-ml.so.1   fake NVML      (fake_nvml.c)
    dest/lib/libcuda.so.1        fake CUDA      (fake_cuda.c)
    dest/lib/libcuda.so          -> libcuda.so.1 (IREE loads the unversioned name)
    dest/bin/nvidia-smi          fake nvidia-smi (real pynvml on the fake NVML)

and returns a :class:`FakeDriver` whose :meth:`FakeDriver.env` gives the
environment a child process needs to see the fakes.  The fakes are steered by
``FAKE_*`` environment variables and, when ``FAKE_GPU_STATE_FILE`` names a
file, by its ``KEY=VALUE`` lines, which override the environment and are
re-read while a process runs (see fake_common.h for the contract).

Busy GPUs (the fake libcuda follows the GPU's state as the fake NVML reports it; details in
fake_cuda.c):

* ``FAKE_NVML_COMPUTE_MODE=IDX:3`` (EXCLUSIVE_PROCESS) with a PID other than the caller's in
  ``FAKE_NVML_PROCESSES=IDX[.J]:PID:MIB`` on that GPU: context creation there fails with
  CUDA_ERROR_DEVICE_UNAVAILABLE (46); ``IDX:2`` (PROHIBITED) fails it always.
* ``FAKE_CUDA_CONTEXT_MIB`` (default 500): the device memory a new context needs. When
  ``FAKE_NVML_MEMORY_USED_MIB=IDX[.J]:MIB`` leaves less free, context creation fails with
  CUDA_ERROR_OUT_OF_MEMORY (2).
* ``FAKE_CUDA_CONTEXT_LOG=PATH``: every context creation attempt (cuCtxCreate*,
  cuDevicePrimaryCtxRetain) and every device allocation appends one JSON line to PATH (pid,
  ordinal, physical ``gpu``, ``mig``, full ``uuid``, ``result``, ``time``,
  ``cuda_visible_devices``; ``bytes`` for allocations), from every process.

Qualification (gpudiag qualify): ``FAKE_CUDA_COPY_GBPS=IDX:GBPS`` makes synchronous copies on
GPU IDX take the time that rate says (a device-to-device copy moves 2 x its size),
``FAKE_CUDA_CORRUPT_COPY=IDX:OFFSET`` flips the byte at OFFSET of every device-to-host copy,
and the context log gains an ``"event": "copy"`` line per copy.

``tests.fakes.jobs`` has ``FakeJobs`` (real sleeping processes as other people's jobs, published
through the state file) and ``read_context_log``.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["FakeDriver", "build_fakes", "write_state_file"]

SOURCE_DIR = Path(__file__).resolve().parent

#: Compiler flags shared by both libraries.  -O0 keeps building both well under a
#: second; the test suite separately compiles them at -Og -Werror so that gcc's
#: flow-based warnings are checked too.
CFLAGS: tuple[str, ...] = (
    "-std=c11",
    "-O0",
    "-g0",
    "-Wall",
    "-Wextra",
    "-Wpedantic",
    "-fPIC",
    "-shared",
    "-fvisibility=hidden",
)

#: (source, output file name, soname)
LIBRARIES: tuple[tuple[str, str, str], ...] = (
    ("fake_nvml.c", "libnvidia-ml.so.1", "libnvidia-ml.so.1"),
    ("fake_cuda.c", "libcuda.so.1", "libcuda.so.1"),
)


@dataclass(frozen=True)
class FakeDriver:
    """A built fake driver tree."""

    root: Path
    lib_dir: Path
    bin_dir: Path

    def env(
        self, base: Mapping[str, str] | None = None, **knobs: str | int | None
    ) -> dict[str, str]:
        """Environment for a child process that should see the fake driver.

        ``base`` (default: ``os.environ``) plus ``LD_LIBRARY_PATH=lib_dir[:old]``,
        ``PATH=bin_dir:old`` and the given knobs.  Knobs use their full
        variable names (``FAKE_NVML_DEVICE_COUNT=2``, ``CUDA_VISIBLE_DEVICES="1"``);
        values are converted with ``str``; ``None`` removes the variable.
        """
        env = dict(os.environ if base is None else base)
        old_ld = env.get("LD_LIBRARY_PATH")
        env["LD_LIBRARY_PATH"] = (
            f"{self.lib_dir}{os.pathsep}{old_ld}" if old_ld else str(self.lib_dir)
        )
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH') or os.defpath}"
        for key, value in knobs.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = str(value)
        return env

    @property
    def nvidia_smi(self) -> Path:
        """Absolute path of the fake nvidia-smi."""
        return self.bin_dir / "nvidia-smi"


def write_state_file(path: Path, knobs: Mapping[str, str | int]) -> None:
    """Atomically replaces the FAKE_GPU_STATE_FILE at ``path`` with ``knobs``.

    The fakes re-read the file while they run; writing a temporary file and
    renaming it means a reader never sees a half-written file.
    """
    path = Path(path)
    lines = [f"{key}={value}\n" for key, value in knobs.items()]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("# gpudiag fake driver state\n" + "".join(lines), encoding="utf-8")
    tmp.replace(path)


def _compile_command(
    source: Path, output: Path, soname: str, extra_cflags: Sequence[str]
) -> list[str]:
    return [
        os.environ.get("CC", "gcc"),
        *CFLAGS,
        *extra_cflags,
        f"-Wl,-soname,{soname}",
        "-o",
        str(output),
        str(source),
        "-lpthread",
    ]


def _install_nvidia_smi(bin_dir: Path, lib_dir: Path) -> Path:
    """Writes bin_dir/nvidia-smi: the script with this interpreter as shebang."""
    text = (SOURCE_DIR / "nvidia-smi").read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    if lines and lines[0].startswith("#!"):
        lines = lines[1:]
    body = "".join(lines).replace(
        "FAKE_LIB_DIR: str | None = None  # replaced by build.py",
        f"FAKE_LIB_DIR: str | None = {str(lib_dir)!r}",
        1,
    )
    target = bin_dir / "nvidia-smi"
    tmp = target.with_name(".nvidia-smi.tmp")
    tmp.write_text(f"#!{sys.executable}\n{body}", encoding="utf-8")
    tmp.chmod(tmp.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    tmp.replace(target)
    return target


def build_fakes(dest: Path, *, extra_cflags: Sequence[str] = ()) -> FakeDriver:
    """Compiles the fakes into ``dest`` and returns the resulting tree.

    Both libraries are compiled concurrently.  Raises ``RuntimeError`` carrying
    gcc's stderr when a compilation fails (or gcc is missing).
    ``extra_cflags`` are appended to the compiler flags (e.g. ``-Werror``).
    """
    dest = Path(dest).resolve()
    lib_dir = dest / "lib"
    bin_dir = dest / "bin"
    lib_dir.mkdir(parents=True, exist_ok=True)
    bin_dir.mkdir(parents=True, exist_ok=True)

    procs: list[tuple[list[str], subprocess.Popen[bytes]]] = []
    try:
        for source, output, soname in LIBRARIES:
            cmd = _compile_command(SOURCE_DIR / source, lib_dir / output, soname, extra_cflags)
            proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
            procs.append((cmd, proc))
    except OSError as exc:
        for _, proc in procs:
            proc.kill()
            proc.wait()
        raise RuntimeError(f"cannot run the C compiler: {exc}") from exc

    failures: list[str] = []
    for cmd, proc in procs:
        out, err = proc.communicate()
        if proc.returncode != 0:
            output = (err + out).decode(errors="replace")
            failures.append(f"{' '.join(cmd)} exited {proc.returncode}:\n{output}")
    if failures:
        raise RuntimeError("building the fake driver failed:\n" + "\n".join(failures))

    link = lib_dir / "libcuda.so"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to("libcuda.so.1")
    _install_nvidia_smi(bin_dir, lib_dir)
    return FakeDriver(root=dest, lib_dir=lib_dir, bin_dir=bin_dir)


def main(argv: Sequence[str] | None = None) -> int:
    """Build the fakes into DEST (prefer ``python -m tests.fakes``: a whole fake host)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: build.py DEST", file=sys.stderr)
        return 2
    driver = build_fakes(Path(args[0]))
    print(f"export LD_LIBRARY_PATH={driver.lib_dir}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}")
    print(f"export PATH={driver.bin_dir}:$PATH")
    return 0


if __name__ == "__main__":
    sys.exit(main())

