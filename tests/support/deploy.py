"""Helpers for the deployment tiers (no tests here): who may run them, the image build, and the
node-problem-detector patch's pieces.

The tiers need root (buildah, podman, mount namespaces). As root a missing tool is a failure,
not a skip: scripts/setup.sh --tests installs them, so CI never passes without running them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
IMAGE_TAG = "localhost/gpudiag:test"


def require_root_tools(*tools: str) -> None:
    """Skip as a plain user; as root fail when a tool is missing (setup.sh installs them)."""
    if os.geteuid() != 0:
        pytest.skip("the deployment tiers need root (buildah, podman, mount namespaces)")
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} missing: run scripts/setup.sh --tests as root (it "
                    "installs buildah, podman, runc, mmdebstrap and systemd-container)")


@contextlib.contextmanager
def one_builder(name: str) -> Iterator[None]:
    """One builder of ``name`` at a time on this machine: the suite's xdist workers (and
    sessions side by side) share .cache/ and the image's tag, and two mmdebstraps writing one
    tarball or two builds of one tag would race. The others wait, then find its result.
    "checkout-build": whatever builds this checkout in place (pip wheel, python -m build,
    scripts/build-image.sh write build/ and *.egg-info in it) builds it alone."""
    folder = ROOT / ".cache"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f".{name}.lock", "w", encoding="utf-8") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def build_image(tag: str = IMAGE_TAG) -> tuple[str, float]:
    """scripts/build-image.sh (Debian rootfs base, cached under .cache/image); (tag, seconds)."""
    with one_builder("image"), one_builder("checkout-build"):
        return _build_image(tag)


def _build_image(tag: str) -> tuple[str, float]:
    started = time.monotonic()
    proc = subprocess.run([str(ROOT / "scripts" / "build-image.sh"), "--base", "debian",
                           "--tag", tag], capture_output=True, text=True, timeout=900,
                          check=False, cwd=ROOT,
                          env={**os.environ, "PYTHON": sys.executable})
    if proc.returncode != 0:
        pytest.fail(f"scripts/build-image.sh failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    assert proc.stdout.strip().splitlines()[-1] == tag, proc.stdout
    return tag, time.monotonic() - started


def debian_rootfs(name: str, packages: str) -> Path:
    """A Debian bookworm rootfs tarball from mmdebstrap, made once and cached in .cache/."""
    with one_builder(f"rootfs-{name}"):
        return _debian_rootfs(name, packages)


def _debian_rootfs(name: str, packages: str) -> Path:
    cache = ROOT / ".cache" / "rootfs"
    tar = cache / f"{name}.tar"
    if tar.is_file():
        return tar
    cache.mkdir(parents=True, exist_ok=True)
    sources = Path("/etc/apt/sources.list.d/debian.sources")
    proc = subprocess.run(
        ["mmdebstrap", "--quiet", "--format=tar", "--variant=minbase", f"--include={packages}",
         "--dpkgopt=path-exclude=/usr/share/doc/*", "--dpkgopt=path-exclude=/usr/share/man/*",
         "--dpkgopt=path-exclude=/usr/share/locale/*", "bookworm", f"{tar}.tmp",
         *([str(sources)] if sources.is_file() else [])],
        capture_output=True, text=True, timeout=900, check=False)
    if proc.returncode != 0:
        pytest.fail(f"mmdebstrap failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    Path(f"{tar}.tmp").rename(tar)
    return tar


UNIT = ROOT / "systemd" / "gpudiag.service"


def unit_settings(text: str) -> dict[str, list[str]]:
    """``Key=value`` lines of a unit file, per key in order (keys may repeat)."""
    out: dict[str, list[str]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        out.setdefault(key.strip(), []).append(value.strip())
    return out


NPD_PATCH = ROOT / "deploy" / "kubernetes" / "npd" / "daemonset-patch.yaml"


def npd_patch() -> dict[str, Any]:
    """deploy/kubernetes/npd/daemonset-patch.yaml, the strategic-merge patch for NPD's pod."""
    import yaml

    (patch,) = [d for d in yaml.safe_load_all(NPD_PATCH.read_text()) if d]
    found: dict[str, Any] = patch
    return found


def npd_pod_container(name: str) -> dict[str, Any]:
    """A container (or init container) the patch puts into NPD's pod, by name."""
    spec = npd_patch()["spec"]["template"]["spec"]
    (c,) = [c for c in spec["containers"] + spec["initContainers"] if c["name"] == name]
    found: dict[str, Any] = c
    return found
