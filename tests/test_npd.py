"""node-problem-detector on Kubernetes without a host install: the relay (`gpudiag npd-relay`,
a sidecar of NPD's pod) asks a real daemon on its unix socket and writes NPD's answer; the
plugin (deploy/kubernetes/npd/gpudiag-npd.sh) reads it with bash builtins only, run here with
an empty environment and no PATH: nothing of gpudiag, Python or coreutils is reachable."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpudiag.core import npd
from gpudiag.core.catalog import BLOCKERS
from gpudiag.core.limits import DEFAULT_DAEMON_WAIT_S
from tests.fakes.build import FakeDriver
from tests.support.daemon import Daemon, daemon_toml, host_env, wait_for, write_config
from tests.support.verdicts import verdict

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = ROOT / "deploy" / "kubernetes" / "npd" / "gpudiag-npd.sh"
BASH = shutil.which("bash", path="/usr/bin:/bin") or "/bin/bash"


def plugin(status_file: Path, **env: str) -> tuple[int, str]:
    """Run the plugin as NPD's container would, less even its PATH: (exit code, stdout)."""
    proc = subprocess.run([BASH, str(PLUGIN)], capture_output=True, text=True, timeout=30,
                          check=False, cwd="/",
                          env={"PATH": "/nonexistent", "GPUDIAG_NPD_STATUS_FILE":
                               str(status_file), **env})
    assert proc.stderr == "", proc.stderr  # a missing command would say so here
    return proc.returncode, proc.stdout


def status(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "status"
    path.write_text(text)
    return path


# --- the mapping: every code of the catalog ------------------------------------------------

@pytest.mark.parametrize("code", sorted(BLOCKERS))
def test_every_blocker_is_a_problem_unless_nothing_known_is_broken(code: str) -> None:
    answer = npd.from_verdict(verdict((code, "0")))
    if code in npd.NOT_BROKEN_CODES:
        assert answer == npd.NpdAnswer(npd.NPD_UNKNOWN,
                                       f"gpudiag: {code} (nothing known broken)")
    else:
        assert answer == npd.NpdAnswer(npd.NPD_PROBLEM, f"gpudiag: {code}")
    assert len(answer.message) <= npd.MAX_MESSAGE_CHARS


def test_a_ready_verdict_is_ok() -> None:
    assert npd.from_verdict(verdict()) == npd.NpdAnswer(npd.NPD_OK, "gpudiag: ready")


def test_the_not_broken_codes_are_the_slurm_scripts_defaults() -> None:
    common = (ROOT / "deploy" / "slurm" / "gpudiag-common.sh").read_text()
    found = re.search(r'GPUDIAG_NOT_BROKEN_CODES:-"([^"]*)"', common)
    assert found is not None
    assert set(found.group(1).split()) == npd.NOT_BROKEN_CODES <= set(BLOCKERS)


@pytest.mark.parametrize(("reason", "flags", "words"), [
    ("no daemon at unix:/run/gpudiag/daemon/gpudiag.sock: No such file or directory", {},
     "not answering"),
    ("refused the answer at unix:/x: the peer runs as uid 65534 (pid 9)", {"refused": True},
     "refused"),
    ("daemon at unix:/x gave an answer that does not hold: ...", {"untrusted": True},
     "did not hold"),
    ("daemon at unix:/x answered 503 not_ready: no snapshot yet", {}, "no answer yet"),
    ("daemon at unix:/x did not answer: timed out", {}, "in time"),
    ("daemon at unix:/x sent an unusable verdict: " + "x" * 200, {}, "relay's log"),
], ids=["down", "impostor", "untrusted", "starting", "timeout", "other"])
def test_no_daemon_answer_is_unknown_with_a_stable_short_message(
        reason: str, flags: dict[str, bool], words: str) -> None:
    answer = npd.without_answer(reason, **flags)
    assert answer.exit_code == npd.NPD_UNKNOWN and words in answer.message
    assert len(answer.message) <= npd.MAX_MESSAGE_CHARS and "/" not in answer.message


def test_the_status_file_is_one_schema_line_and_one_printable_line_of_at_most_80() -> None:
    text = npd.status_text(npd.NpdAnswer(1, "gpudiag: x\n\x1b[2J" + "y" * 200), 1733000000.7)
    first, second, rest = text.split("\n")
    assert first == "gpudiag.npd/1 1733000000 1" and rest == ""
    assert len(second) == npd.MAX_MESSAGE_CHARS and second.isprintable()


# --- the plugin alone: bash builtins, every way a status file can be -------------------------

@pytest.mark.parametrize(("written_ago_s", "rc", "message"), [
    (0, 0, "gpudiag: ready"), (5, 1, "gpudiag: gpu_lost"),
    (30, 2, "gpudiag: backend_unproven (nothing known broken)")])
def test_the_plugin_passes_on_a_fresh_answer(tmp_path: Path, written_ago_s: int, rc: int,
                                            message: str) -> None:
    path = status(tmp_path, npd.status_text(npd.NpdAnswer(rc, message),
                                            time.time() - written_ago_s))
    assert plugin(path) == (rc, message + "\n")


@pytest.mark.parametrize(("text", "words"), [
    (None, "no answer from the npd-relay sidecar yet"),
    ("gpudiag.npd/1 {old} 0\ngpudiag: ready\n", "stale (over 60s)"),
    ("gpudiag.npd/1 {future} 0\ngpudiag: ready\n", "stale (over 60s)"),
    ("gpudiag.npd/2 {now} 0\ngpudiag: ready\n", "unreadable answer"),
    ("gpudiag.npd/1 {now} 3\ngpudiag: ready\n", "unreadable answer"),
    ("gpudiag.npd/1 {now} 1\n", "unreadable answer"),
    ("gpudiag.npd/1 soon 1\ngpudiag: gpu_lost\n", "unreadable answer"),
    ("", "unreadable answer"),
], ids=["missing", "stale", "from-the-future", "other-schema", "bad-code", "no-message",
        "bad-time", "empty"])
def test_the_plugin_says_unknown_for_anything_but_a_fresh_answer(
        tmp_path: Path, text: str | None, words: str) -> None:
    now = int(time.time())
    path = tmp_path / "status"
    if text is not None:
        path.write_text(text.format(now=now, old=now - 61, future=now + 3600))
    rc, out = plugin(path)
    assert rc == npd.NPD_UNKNOWN and words in out, out
    assert out.startswith("gpudiag: ") and len(out.rstrip("\n")) <= npd.MAX_MESSAGE_CHARS


def test_the_plugin_cuts_its_message_where_npd_does(tmp_path: Path) -> None:
    path = status(tmp_path, f"gpudiag.npd/1 {int(time.time())} 1\n" + "z" * 500 + "\n")
    rc, out = plugin(path)
    assert (rc, out) == (1, "z" * npd.MAX_MESSAGE_CHARS + "\n")
    rc, out = plugin(tmp_path / ("d" * 200) / "status")
    assert rc == 2 and len(out.rstrip("\n")) <= npd.MAX_MESSAGE_CHARS


def test_the_relay_asks_often_enough_for_the_plugin_s_max_age() -> None:
    """Every round (its interval plus the longest wait for the daemon) rewrites the file well
    within the plugin's max age: a stale file means the relay stopped."""
    from tests.support.deploy import npd_pod_container

    args = npd_pod_container("gpudiag-npd-relay")["args"]
    every = float(args[args.index("--every") + 1])
    max_age = int(re.search(r"GPUDIAG_NPD_MAX_AGE_S:-([0-9]+)",  # type: ignore[union-attr]
                            PLUGIN.read_text()).group(1))
    assert every + DEFAULT_DAEMON_WAIT_S < max_age


# --- end to end: a real daemon on the fake host, the relay, the plugin ---------------------

@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A folder like the node's /run/gpudiag/daemon (short path: a socket's is at most 107
    bytes), in a parent only its owner writes, so that its owner is trusted as the daemon."""
    top = Path(tempfile.mkdtemp(prefix="gpudiag-npd-"))
    top.chmod(0o755)
    (top / "daemon").mkdir(mode=0o755)
    (top / "npd").mkdir(mode=0o755)
    try:
        yield top
    finally:
        shutil.rmtree(top, ignore_errors=True)


def relay_argv(top: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "gpudiag", "npd-relay", "--daemon-url",
            f"unix:{top / 'daemon' / 'gpudiag.sock'}", "--status-file",
            str(top / "npd" / "status"), *extra]


def _pattern(message: str) -> str:
    """``message`` as a regular expression; ``{incident}`` stands for any incident id."""
    return re.escape(message).replace(re.escape("{incident}"), r"gpudiag-\d{8}T\d{6}Z-[a-z0-9]+")


def _said(answer: tuple[int, str], rc: int, message: str) -> bool:
    """The plugin's (exit code, output) is ``rc`` and ``message`` (one line)."""
    return answer[0] == rc and re.fullmatch(_pattern(message) + "\n", answer[1]) is not None


@pytest.mark.parametrize(("knobs", "rc", "message"), [
    ({}, 0, "gpudiag: ready"),
    # A fault is the node's incident: its id (core.incident) and its reason.
    ({"FAKE_CUDA_INIT_ERROR": "999"}, 1, "{incident}: cuda_init_failed"),
    (None, 2, "gpudiag: daemon not answering on its socket"),
], ids=["ready", "blocked", "daemon-down"])
def test_npd_gets_the_daemon_s_node_health_through_the_relay_without_gpudiag(
        fakes: FakeDriver, tmp_path: Path, socket_dir: Path, knobs: dict[str, str] | None,
        rc: int, message: str) -> None:
    env = host_env(fakes, tmp_path / "host", gpus=2, **(knobs or {}))
    daemon = None
    if knobs is not None:
        daemon = Daemon(env, write_config(tmp_path / "gpudiag.toml", daemon_toml()),
                        tmp_path / "state",
                        extra_args=("--socket", str(socket_dir / "daemon" / "gpudiag.sock")))
        daemon.wait_ready()
    status_file = socket_dir / "npd" / "status"
    relay = subprocess.Popen(relay_argv(socket_dir, "--every", "0.5"), env=env,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        wait_for(status_file.exists, 30)
        assert _said(plugin(status_file), rc, message)
        # The relay keeps it fresh: a later round rewrites it.
        first = status_file.read_text().split()[1]
        wait_for(lambda: status_file.read_text().split()[1] != first, 10)
        assert _said(plugin(status_file), rc, message)
    finally:
        relay.terminate()
        _, log = relay.communicate(timeout=10)
        if daemon is not None:
            daemon.stop()
    assert "Traceback" not in log
    # One log line per change of answer, with the reason NPD's short message leaves out.
    assert log.count("gpudiag npd-relay: ") == 1, log
    assert re.search(f"gpudiag npd-relay: {_pattern(message)} \\(NPD exit {rc}\\): ", log), log
    if knobs is None:
        assert "no daemon at unix:" in log
    # The relay stopped: its last answer goes stale, and NPD is told Unknown, not a fault.
    time.sleep(1.1)
    assert plugin(status_file, GPUDIAG_NPD_MAX_AGE_S="0") == (
        2, "gpudiag: the npd-relay answer is stale (over 0s)\n")


def test_a_daemon_going_away_turns_the_answer_unknown_and_back(
        fakes: FakeDriver, tmp_path: Path, socket_dir: Path) -> None:
    """A rollout of the gpudiag DaemonSet: Unknown meanwhile, never GPUBlocked."""
    env = host_env(fakes, tmp_path / "host", gpus=2)
    sock = socket_dir / "daemon" / "gpudiag.sock"
    cfg = write_config(tmp_path / "gpudiag.toml", daemon_toml())
    status_file = socket_dir / "npd" / "status"
    daemon = Daemon(env, cfg, tmp_path / "state", extra_args=("--socket", str(sock)))
    daemon.wait_ready()
    relay = subprocess.Popen(relay_argv(socket_dir, "--every", "0.3"), env=env,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: status_file.exists() and plugin(status_file)[0] == 0, 30)
        daemon.stop()
        wait_for(lambda: plugin(status_file) == (
            2, "gpudiag: daemon not answering on its socket\n"), 10)
        daemon = Daemon(env, cfg, tmp_path / "state", extra_args=("--socket", str(sock)))
        daemon.wait_ready()
        wait_for(lambda: plugin(status_file) == (0, "gpudiag: ready\n"), 15)
    finally:
        relay.terminate()
        relay.communicate(timeout=10)
        daemon.stop()


def test_once_prints_npd_s_message_and_exits_with_npd_s_code(
        fakes: FakeDriver, tmp_path: Path, socket_dir: Path) -> None:
    env = host_env(fakes, tmp_path / "host", gpus=2, FAKE_NVML_INIT_ERROR="18")
    down = subprocess.run(relay_argv(socket_dir, "--once"), env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert (down.returncode, down.stdout) == (2, "gpudiag: daemon not answering on its "
                                              "socket\n"), down.stderr
    daemon = Daemon(env, write_config(tmp_path / "gpudiag.toml", daemon_toml()),
                    tmp_path / "state",
                    extra_args=("--socket", str(socket_dir / "daemon" / "gpudiag.sock")))
    try:
        daemon.wait_ready()
        proc = subprocess.run(relay_argv(socket_dir, "--once"), env=env, capture_output=True,
                              text=True, timeout=60, check=False)
    finally:
        daemon.stop()
    assert _said((proc.returncode, proc.stdout), 1, "{incident}: driver_library_mismatch")
    assert _said(plugin(socket_dir / "npd" / "status"), 1,
                 "{incident}: driver_library_mismatch")


@pytest.mark.parametrize(("extra", "words"), [
    (("--require", "nonsense"), "nonsense"),
    (("--every", "0"), "--every"),
    (("--daemon-url", "ftp://x"), "--daemon-url"),
], ids=["require", "every", "url"])
def test_a_relay_that_could_never_answer_is_a_usage_error_at_start(
        tmp_path: Path, socket_dir: Path, extra: tuple[str, ...], words: str) -> None:
    proc = subprocess.run([*relay_argv(socket_dir), *extra], capture_output=True, text=True,
                          timeout=60, check=False, env=dict(os.environ))
    assert proc.returncode == 2 and words in proc.stderr, proc.stderr
    assert not (socket_dir / "npd" / "status").exists()


def test_a_status_file_in_a_missing_folder_or_behind_a_link_is_refused(
        tmp_path: Path) -> None:
    base = [sys.executable, "-m", "gpudiag", "npd-relay", "--daemon-url", "unix:/nonexistent/s"]
    proc = subprocess.run([*base, "--status-file", str(tmp_path / "no" / "status")],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and "folder does not exist" in proc.stderr, proc.stderr
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    proc = subprocess.run([*base, "--status-file", str(tmp_path / "link")],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and "symlink" in proc.stderr, proc.stderr
    assert not (tmp_path / "elsewhere").exists()
