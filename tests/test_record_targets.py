"""Issue 24 item 3: `--record PATH` never renames over what is not a regular file.

Device nodes, FIFOs and ttys are written in place (or refused, exit 2); a symlink, a block
device or a socket is refused with exit 2 and left as it was. Device nodes are made in the
test's own folder (mknod, as root): the machine's own /dev is never at stake.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
from pathlib import Path

import pytest

from tests.support.host import EnvFactory, run_gpudiag

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")


def _record(env: dict[str, str], target: Path | str) -> tuple[int, str, str]:
    proc = run_gpudiag(["preflight", "--no-daemon", "--record", str(target)], env)
    return proc.returncode, proc.stdout, proc.stderr


@as_root
def test_a_character_device_is_written_in_place_not_replaced(gpu_env: EnvFactory,
                                                             tmp_path: Path) -> None:
    null = tmp_path / "null"
    os.mknod(null, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    code, _, err = _record(gpu_env(), null)
    assert code == 0, err
    assert stat.S_ISCHR(null.lstat().st_mode)
    full = tmp_path / "full"
    os.mknod(full, 0o666 | stat.S_IFCHR, os.makedev(1, 7))
    code, _, err = _record(gpu_env(), full)
    assert code == 3 and "No space left on device" in err, err
    assert stat.S_ISCHR(full.lstat().st_mode)


def test_a_fifo_with_a_reader_gets_the_record_and_stays_a_fifo(gpu_env: EnvFactory,
                                                               tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    code, _, err = _record(gpu_env(), fifo)
    reader.join(10)
    assert code == 0, err
    assert json.loads(got[0])["gpu_validation_blocker"] == "none"
    assert stat.S_ISFIFO(fifo.lstat().st_mode)


def test_a_fifo_nobody_reads_is_exit_2_at_once(gpu_env: EnvFactory, tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    code, _, err = _record(gpu_env(), fifo)
    assert code == 2 and "nobody reads" in err, err
    assert stat.S_ISFIFO(fifo.lstat().st_mode)


def test_dev_stdout_gets_the_record_on_stdout(gpu_env: EnvFactory) -> None:
    code, out, err = _record(gpu_env(), "/dev/stdout")
    assert code == 0, err
    assert out.count('"schema": "gpudiag.verdict/1"') >= 1 and "gpu_validation_blocker" in out
    assert os.path.islink("/dev/stdout")


def test_a_symlink_a_socket_or_a_block_device_is_refused_and_left_alone(
        gpu_env: EnvFactory, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    link = tmp_path / "link"
    link.symlink_to(victim)
    sock_path = tmp_path / "sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(sock_path))
    targets = [link, sock_path]
    if os.geteuid() == 0:
        block = tmp_path / "block"
        os.mknod(block, 0o600 | stat.S_IFBLK, os.makedev(7, 200))
        targets.append(block)
    try:
        for target in targets:
            before = target.lstat()
            code, _, err = _record(gpu_env(), target)
            assert code == 2 and "neither follows nor replaces" in err, (target, err)
            after = target.lstat()
            assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)
    finally:
        server.close()
    assert victim.read_text() == "precious\n"
