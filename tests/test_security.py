"""What docs/security.md claims, checked: no shell anywhere, planted lock files refused,
option-looking images refused, secrets never recorded, loopback by default."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest

from gpudiag.daemon.config import DaemonConfig
from gpudiag.engine.locks import LockFailed, try_lock
from tests.support.host import EnvFactory, run_gpudiag

PACKAGE = Path(__file__).resolve().parent.parent / "gpudiag"
GPU0 = "GPU-f00d0000-0000-4000-8000-000000000000"


def _calls(tree: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)]


def _name(func: ast.expr) -> str:
    if isinstance(func, ast.Attribute):
        return f"{_name(func.value)}.{func.attr}"
    return func.id if isinstance(func, ast.Name) else ""


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: p.name)
def test_no_module_ever_uses_a_shell(path: Path) -> None:
    tree = ast.parse(path.read_text(), str(path))
    for call in _calls(tree):
        name = _name(call.func)
        assert name not in ("os.system", "os.popen", "eval", "exec"), \
            f"{path.name}:{call.lineno}: {name}"
        for kw in call.keywords:
            if kw.arg == "shell":
                assert isinstance(kw.value, ast.Constant) and kw.value.value is False, \
                    f"{path.name}:{call.lineno}: shell= in {name}"
        if name.startswith("subprocess.") and call.args:
            # argv is a list or a name, never a string built by formatting.
            assert not isinstance(call.args[0], (ast.JoinedStr, ast.BinOp, ast.Constant)), \
                f"{path.name}:{call.lineno}: {name} with a command string"


def test_a_symlink_planted_as_a_lock_file_is_refused_and_its_target_untouched(
        tmp_path: Path) -> None:
    victim = tmp_path / "victims-file"
    victim.write_text("precious\n")
    locks = tmp_path / "locks"
    locks.mkdir()
    (locks / f"{GPU0}.lock").symlink_to(victim)
    with pytest.raises(LockFailed, match="not a symlink"):
        try_lock(locks, GPU0)
    assert victim.read_text() == "precious\n"


def test_a_fifo_or_hard_link_planted_as_a_lock_file_is_refused(tmp_path: Path) -> None:
    locks = tmp_path / "locks"
    locks.mkdir()
    os.mkfifo(locks / f"{GPU0}.lock")
    with pytest.raises(LockFailed, match="not a plain regular file"):
        try_lock(locks, GPU0)
    other = "GPU-f00d0001-0000-4000-8000-000000000001"
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    os.link(victim, locks / f"{other}.lock")
    with pytest.raises(LockFailed, match="not a plain regular file"):
        try_lock(locks, other)
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize("image", ["--privileged", "-v/:/host", "img:1 --rm", "img\n1", ""])
def test_an_image_that_is_not_an_image_reference_is_refused_before_anything_runs(
        gpu_env: EnvFactory, tmp_path: Path, image: str) -> None:
    marker = tmp_path / "ran"
    env = gpu_env(GPUDIAG_LOCK_DIR=str(tmp_path / "locks"),
                  GPUDIAG_DAEMON_URL="http://127.0.0.1:9")
    proc = run_gpudiag(["run", "--artifacts", str(tmp_path / "a"), "--image", image, "--",
                        "touch", str(marker)], env, timeout=60)
    assert proc.returncode == 125 and "is not an image reference" in proc.stderr
    assert "Traceback" not in proc.stderr and not marker.exists()


def test_secrets_in_the_environment_never_reach_a_record(gpu_env: EnvFactory,
                                                         tmp_path: Path) -> None:
    env = gpu_env(AWS_SECRET_ACCESS_KEY="s3cr3t-aws", GITHUB_TOKEN="ghp_s3cr3t",
                  HF_TOKEN="hf_s3cr3t", CUDA_VISIBLE_DEVICES="0")
    record = tmp_path / "v.json"
    proc = run_gpudiag(["preflight", "--no-daemon", "--require", "nvml", "--record",
                        str(record)], env, timeout=60)
    assert proc.returncode in (0, 1), proc.stderr
    for text in (proc.stdout, record.read_text()):
        assert "s3cr3t" not in text
    recorded = json.loads(record.read_text())["evidence"]["environment"]
    assert recorded.get("CUDA_VISIBLE_DEVICES") == "0"
    assert not {"AWS_SECRET_ACCESS_KEY", "GITHUB_TOKEN", "HF_TOKEN"} & set(recorded)


def test_the_daemon_listens_on_loopback_unless_told_otherwise() -> None:
    assert DaemonConfig().listen_host == "127.0.0.1"


def test_a_tmp_lock_folder_someone_else_could_write_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gpudiag.engine.locks as locks

    root = tmp_path / "gpudiag-uid"
    monkeypatch.setattr(locks, "_private_tmp_root", lambda: root)
    lock_dir = root / "gpudiag" / "locks"  # what default_lock_dir() falls back to
    root.mkdir(mode=0o700)
    lock = try_lock(lock_dir, GPU0)  # this user's own private folder: fine
    assert lock is not None
    locks.release([lock])
    root.chmod(0o777)  # as if another user had made it first, open to all
    with pytest.raises(LockFailed, match="closed to others"):
        try_lock(lock_dir, GPU0)
