"""The IREE probe's compiled-module cache: only our own regular file is ever loaded (issue 31).

A module planted by another local user (a link in its place, a file they own or may write,
a FIFO) is refused, never loaded, recompiled and replaced; the key changes with the compiler
library's file identity; the daemon keeps the cache in its own state directory.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from gpudiag.core.environment import CACHE_VARIABLE
from gpudiag.daemon.service import PROBE_CACHE, probe_cache_environment
from gpudiag.probes import iree_probe
from gpudiag.probes.iree_probe import read_cached, write_cached

MODULE = b"a compiled module"


def _ours(path: Path, data: bytes = MODULE, mode: int = 0o600) -> Path:
    path.write_bytes(data)
    path.chmod(mode)
    return path


def test_our_own_private_module_is_read(tmp_path: Path) -> None:
    assert read_cached(_ours(tmp_path / "m.vmfb")) == (MODULE, None)


def test_an_absent_module_is_no_refusal(tmp_path: Path) -> None:
    assert read_cached(tmp_path / "m.vmfb") == (None, None)


def test_a_link_in_the_modules_place_is_refused_even_to_our_own_file(tmp_path: Path) -> None:
    target = _ours(tmp_path / "elsewhere.vmfb")
    (tmp_path / "m.vmfb").symlink_to(target)
    data, why = read_cached(tmp_path / "m.vmfb")
    assert data is None and why is not None and "cannot open" in why


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_a_module_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    path = _ours(tmp_path / "m.vmfb")
    os.chown(path, 65534, 65534)
    data, why = read_cached(path)
    assert data is None and why is not None and "owned by uid 65534" in why


@pytest.mark.parametrize("mode", [0o620, 0o602, 0o666])
def test_a_module_others_may_write_is_refused(tmp_path: Path, mode: int) -> None:
    data, why = read_cached(_ours(tmp_path / "m.vmfb", mode=mode))
    assert data is None and why is not None and "writable by others" in why


def test_a_fifo_in_the_modules_place_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "m.vmfb", 0o600)
    data, why = read_cached(tmp_path / "m.vmfb")
    assert data is None and why is not None and "not a regular file" in why


def test_an_empty_module_is_refused(tmp_path: Path) -> None:
    data, why = read_cached(_ours(tmp_path / "m.vmfb", b""))
    assert data is None and why is not None and "0 bytes" in why


def test_writing_replaces_a_planted_link_and_never_writes_through_it(tmp_path: Path) -> None:
    victim = _ours(tmp_path / "victim", b"not yours")
    (tmp_path / "m.vmfb").symlink_to(victim)
    write_cached(tmp_path / "m.vmfb", MODULE)
    st = (tmp_path / "m.vmfb").lstat()
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert victim.read_bytes() == b"not yours"
    assert read_cached(tmp_path / "m.vmfb") == (MODULE, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.vmfb", "victim"]  # no temp left


def test_a_temporary_file_left_by_a_dead_writer_does_not_block_writing(
        tmp_path: Path) -> None:
    left = _ours(tmp_path / f".m.vmfb.{os.getpid()}.tmp", b"half a module")
    write_cached(tmp_path / "m.vmfb", MODULE)
    assert read_cached(tmp_path / "m.vmfb") == (MODULE, None)
    assert left.read_bytes() == b"half a module"  # a fresh temporary: never another's file
    assert sorted(p.name for p in tmp_path.iterdir()) == [left.name, "m.vmfb"]


def test_the_key_follows_the_compiler_librarys_file_identity(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    library = _ours(tmp_path / "libIREECompiler.so", b"v1")
    monkeypatch.setattr(iree_probe, "COMPILER_LIBRARY", library)  # absolute: joined as is
    flags = ["--iree-llvmcpu-target-cpu=host"]
    first = iree_probe._cache_key("llvm-cpu", flags)
    assert iree_probe._cache_key("llvm-cpu", flags) == first
    os.utime(library, ns=(1, 1))  # same bytes, another mtime: a reinstall
    assert iree_probe._cache_key("llvm-cpu", flags) != first
    assert iree_probe._cache_key("cuda", ["--iree-cuda-target=sm_80"]) != first


def test_a_planted_module_is_recompiled_and_replaced(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("iree.compiler")
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path / "cache"))
    flags = ["--iree-llvmcpu-target-cpu=host"]
    compiled, info = iree_probe._compile("llvm-cpu", flags, use_cache=True)
    assert info["cached"] is False
    cached = Path(info["path"])
    assert read_cached(cached) == (compiled, None)
    assert iree_probe._compile("llvm-cpu", flags, use_cache=True)[1]["cached"] is True
    doctored = _ours(tmp_path / "doctored.vmfb", b"a doctored module")
    cached.unlink()
    cached.symlink_to(doctored)
    again, info = iree_probe._compile("llvm-cpu", flags, use_cache=True)
    assert info["cached"] is False and "cannot open" in info["cache_refused"]
    assert again == compiled and read_cached(cached) == (compiled, None)
    assert doctored.read_bytes() == b"a doctored module"


def test_the_daemon_keeps_the_probe_cache_in_its_state_dir(tmp_path: Path) -> None:
    env = probe_cache_environment({"PATH": "/bin"}, tmp_path / "state")
    assert env == {"PATH": "/bin", CACHE_VARIABLE: str(tmp_path / "state" / PROBE_CACHE)}
    named = {CACHE_VARIABLE: "/srv/cache"}
    assert probe_cache_environment(named, tmp_path / "state") == named  # the operator's


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="planting as a second user needs root and setpriv")
@pytest.mark.parametrize("plant", ["folder", "link"])
def test_a_cache_folder_another_user_planted_in_tmp_is_not_used(
        monkeypatch: pytest.MonkeyPatch, plant: str) -> None:
    """nobody (uid 65534) makes the default cache folder first, in a shared /tmp."""
    shared = Path(tempfile.mkdtemp(prefix="gpudiag-shared-tmp-"))  # nobody can reach it
    try:
        shared.chmod(0o1777)
        theirs = shared / "theirs"
        target = shared / f"gpudiag-{os.getuid()}"
        as_nobody = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
        if plant == "folder":
            subprocess.run([*as_nobody, "mkdir", "-m", "0755", str(target)], check=True)
        else:
            subprocess.run([*as_nobody, "mkdir", "-m", "0777", str(theirs)], check=True)
            subprocess.run([*as_nobody, "ln", "-s", str(theirs), str(target)], check=True)
        monkeypatch.delenv(CACHE_VARIABLE, raising=False)
        monkeypatch.setattr(tempfile, "tempdir", str(shared))
        assert iree_probe.cache_dir() is None  # no cache rather than theirs
    finally:
        shutil.rmtree(shared, ignore_errors=True)
