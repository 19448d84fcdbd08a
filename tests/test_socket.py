"""The unix socket for preflight and control: a real `gpudiag serve`, real sockets, and an
impostor running as another user (uid 65534) that the client refuses (SO_PEERCRED)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpudiag.core.requirement import parse_requirement
from gpudiag.daemon.config import ConfigError, from_mapping, load_config
from gpudiag.daemon.httpserver import SocketInUse, bind_unix
from gpudiag.engine.client import (
    DEFAULT_SOCKET,
    DEFAULT_URL,
    DaemonUrlError,
    DaemonUserError,
    ask_daemon,
    default_url,
    parse_daemon_url,
)
from tests.fakes.build import FakeDriver
from tests.support.daemon import Daemon, daemon_toml, host_env, wait_for, write_config
from tests.support.host import run_gpudiag, verdict_of
from tests.support.run import run_folder

NOBODY = 65534
# The impostor runs as uid 65534, which cannot read root's pyenv: the system interpreter.
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")
needs_root = pytest.mark.skipif(os.geteuid() != 0 or SYSTEM_PYTHON is None,
                                reason="needs root (to run an impostor as uid 65534) and "
                                "/usr/bin/python3")

# A server that answers every request on the socket with a forged verdict, and leaves a
# file behind for each request it received (the client should not even ask).
IMPOSTOR = r'''
import os, socket, sys
path, record_file, seen = sys.argv[1], sys.argv[2], sys.argv[3]
body = open(record_file, "rb").read()
s = socket.socket(socket.AF_UNIX)
s.bind(path)
os.chmod(path, 0o666)
s.listen(16)
print("listening", flush=True)
while True:
    c, _ = s.accept()
    try:
        c.settimeout(2)
        data = c.recv(65536)
        if data:
            with open(seen, "ab") as fh:
                fh.write(data.split(b"\r\n")[0] + b"\n")
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
    except OSError:
        pass
    finally:
        c.close()
'''


def _http_over(sock: socket.socket, host: str, method: str, target: str) -> tuple[int, Any]:
    """One HTTP/1.1 request on a connected socket; (status, JSON or text)."""
    sock.sendall(f"{method} {target} HTTP/1.1\r\nHost: {host}\r\n"
                 "Content-Length: 0\r\n\r\n".encode())
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body.decode()


def unix_http(path: str | Path, method: str, target: str, timeout: float = 30
              ) -> tuple[int, Any]:
    """One HTTP/1.1 request over a unix socket; (status, JSON or text)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        return _http_over(s, "localhost", method, target)


def tcp_http(url: str, method: str, target: str) -> tuple[int, Any]:
    """One HTTP request over TCP without urllib's redirects or retries."""
    host, _, port = url.removeprefix("http://").rpartition(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        return _http_over(s, host, method, target)


@pytest.fixture
def run_dir() -> Iterator[Path]:
    """A socket folder like /run/gpudiag/daemon: root's, in a parent only root writes.

    Under /tmp rather than pytest's tmp_path (0700 folders): the impostor, uid 65534, must
    be able to reach it.
    """
    top = Path(tempfile.mkdtemp(prefix="gpudiag-sock-"))
    top.chmod(0o755)
    folder = top / "daemon"
    folder.mkdir(mode=0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(top, ignore_errors=True)


@pytest.fixture
def serve(fakes: FakeDriver, tmp_path: Path) -> Iterator[Any]:
    """``serve(socket, extra_toml)``: a real `gpudiag serve` on the fakes, TCP port 0 too."""
    daemons: list[Daemon] = []
    env = host_env(fakes, tmp_path / "host", gpus=2)

    def start(sock: Path, extra: str = "") -> Daemon:
        cfg = write_config(tmp_path / f"gpudiag{len(daemons)}.toml",
                           extra + daemon_toml())
        daemon = Daemon(env, cfg, tmp_path / f"state{len(daemons)}",
                        extra_args=("--socket", str(sock)))
        daemons.append(daemon)
        daemon.wait_ready()
        return daemon

    start.env = env  # type: ignore[attr-defined]
    yield start
    for d in daemons:
        d.stop()


# --- URLs and configuration --------------------------------------------------------------

def test_the_default_daemon_url_is_the_unix_socket_not_tcp() -> None:
    assert default_url({}) == DEFAULT_URL == f"unix:{DEFAULT_SOCKET}"
    assert default_url({"GPUDIAG_DAEMON_URL": "http://127.0.0.1:9477"}) == (
        "http://127.0.0.1:9477")
    assert parse_daemon_url(DEFAULT_URL).socket_path == DEFAULT_SOCKET


@pytest.mark.parametrize("url,path", [("unix:/run/x.sock", "/run/x.sock"),
                                      ("unix:///run/x.sock", "/run/x.sock")])
def test_unix_urls_name_an_absolute_socket_path(url: str, path: str) -> None:
    assert parse_daemon_url(url).socket_path == path


@pytest.mark.parametrize("url", ["unix:relative.sock", "unix:", "unix:/" + "x" * 120,
                                 "ftp://x", "http://"])
def test_bad_daemon_urls_are_refused_with_the_accepted_forms(url: str) -> None:
    with pytest.raises(DaemonUrlError, match="unix:/") as info:
        parse_daemon_url(url)
    assert "http://HOST:PORT" in str(info.value)


def test_socket_config_key_and_read_only_flag_are_validated(tmp_path: Path) -> None:
    cfg = from_mapping({"socket": "/run/gpudiag/daemon/gpudiag.sock", "tcp_read_only": True})
    assert cfg.socket_path == "/run/gpudiag/daemon/gpudiag.sock" and cfg.tcp_read_only
    assert from_mapping({}).socket_path is None and not from_mapping({}).tcp_read_only
    assert from_mapping({"socket": ""}).socket_path == ""
    for bad, words in (({"socket": "gpudiag.sock"}, "absolute"),
                       ({"socket": "/" + "x" * 200}, "at most 107"),
                       ({"socket": 5}, "path string"),
                       ({"tcp_read_only": "yes"}, "true or false")):
        with pytest.raises(ConfigError, match=words):
            from_mapping(bad)
    example = load_config(Path(__file__).resolve().parent.parent / "systemd" / "gpudiag.toml")
    assert example.socket_path is None  # the default: $RUNTIME_DIRECTORY/gpudiag.sock


def test_serve_check_config_names_the_socket(tmp_path: Path) -> None:
    proc = run_gpudiag(["serve", "--check-config", "--socket", str(tmp_path / "g.sock")],
                       os.environ)
    assert proc.returncode == 0 and f"socket {tmp_path / 'g.sock'}" in proc.stdout
    proc = run_gpudiag(["serve", "--check-config", "--socket", "rel.sock"], os.environ)
    assert proc.returncode == 2 and "absolute" in proc.stderr and "Traceback" not in proc.stderr


# --- the socket itself ---------------------------------------------------------------------

def test_bind_unix_replaces_a_stale_socket_and_refuses_a_live_one_or_a_file(
        tmp_path: Path) -> None:
    path = str(tmp_path / "g.sock")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)
    stale.close()  # a socket file nobody listens on: what a killed daemon leaves
    live = bind_unix(path)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o666  # any local user may connect
        with pytest.raises(SocketInUse, match="another process already serves"):
            bind_unix(path)
    finally:
        live.close()
    other = tmp_path / "not-a-socket"
    other.write_text("keep me")
    with pytest.raises(SocketInUse, match="not a socket"):
        bind_unix(str(other))
    assert other.read_text() == "keep me"


def test_a_second_daemon_on_the_same_socket_exits_2_and_the_first_keeps_it(
        serve: Any, run_dir: Path) -> None:
    sock = run_dir / "gpudiag.sock"
    serve(sock)
    proc = run_gpudiag(["serve", "--listen", "127.0.0.1:0", "--socket", str(sock),
                        "--state-dir", str(run_dir.parent / "state2")], serve.env, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "another process already serves" in proc.stderr and "Traceback" not in proc.stderr
    assert unix_http(sock, "GET", "/healthz")[0] == 200


def test_the_daemon_removes_its_socket_when_it_stops(serve: Any, run_dir: Path) -> None:
    sock = run_dir / "gpudiag.sock"
    daemon = serve(sock)
    assert stat.S_ISSOCK(os.lstat(sock).st_mode)
    assert daemon.stop() == 0
    assert not sock.exists()


# --- preflight through the socket ----------------------------------------------------------

def test_preflight_through_the_socket_says_source_daemon(serve: Any, run_dir: Path) -> None:
    sock = run_dir / "gpudiag.sock"
    daemon = serve(sock)
    env = {**serve.env, "GPUDIAG_DAEMON_URL": f"unix:{sock}"}
    code, rec = verdict_of(["preflight", "--format", "json"], env)
    assert code == 0 and rec["source"] == "daemon", rec
    assert "daemon" not in rec["evidence"]
    # The Python API and the in-process client take the same route.
    answer = ask_daemon(f"unix:{sock}", parse_requirement("cuda"), env=env)
    assert answer.verdict is not None and answer.verdict.source == "daemon"
    # The socket serves the whole API, control included.
    status, body = unix_http(sock, "POST", "/v1/probe?backend=nvml")
    assert status == 202 and body["accepted"] == ["nvml"]
    # The daemon's log names who connected on the socket (pid and uid from SO_PEERCRED).
    assert any(f"unix:{sock}" in line for line in daemon.lines)


def test_gpudiag_run_asks_the_daemon_on_the_socket(serve: Any, run_dir: Path,
                                                   tmp_path: Path) -> None:
    sock = run_dir / "gpudiag.sock"
    serve(sock)
    env = {**serve.env, "GPUDIAG_DAEMON_URL": f"unix:{sock}",
           "GPUDIAG_LOCK_DIR": str(tmp_path / "locks")}
    art = tmp_path / "run"
    proc = run_gpudiag(["run", "--require", "cuda", "--artifacts", str(art), "--", "true"], env)
    assert proc.returncode == 0, proc.stderr
    closeout = dict(line.split("=", 1) for line in
                    (run_folder(art) / "closeout.txt").read_text().splitlines() if "=" in line)
    assert closeout["verdict_source"] == "daemon", closeout


def test_a_daemon_user_that_does_not_exist_is_a_usage_error(run_dir: Path) -> None:
    env = {**os.environ, "GPUDIAG_DAEMON_URL": f"unix:{run_dir / 'gpudiag.sock'}",
           "GPUDIAG_DAEMON_USER": "no-such-user-gpudiag"}
    proc = run_gpudiag(["preflight", "--no-daemon", "--require", "nvml"], env)
    assert proc.returncode != 2  # --no-daemon never looks at it
    proc = run_gpudiag(["preflight", "--require", "nvml"], env)
    assert proc.returncode == 2 and "GPUDIAG_DAEMON_USER='no-such-user-gpudiag'" in proc.stderr
    assert "Traceback" not in proc.stderr
    with pytest.raises(DaemonUserError):
        ask_daemon(f"unix:{run_dir / 'gpudiag.sock'}", parse_requirement("nvml"), env=env)


def test_no_daemon_on_the_socket_falls_back_inline_with_the_reason_in_evidence(
        serve: Any, run_dir: Path) -> None:
    env = {**serve.env, "GPUDIAG_DAEMON_URL": f"unix:{run_dir / 'gpudiag.sock'}"}
    code, rec = verdict_of(["preflight", "--format", "json", "--require", "nvml"], env)
    assert code == 0 and rec["source"] == "inline"
    note = rec["evidence"]["daemon"]
    assert note["used"] is False and note["refused"] is False
    assert note["reason"].startswith(f"no daemon at unix:{run_dir / 'gpudiag.sock'}")


# --- an impostor ---------------------------------------------------------------------------

def _start_impostor(folder: Path, record: dict[str, Any]) -> tuple[subprocess.Popen[str], Path]:
    assert SYSTEM_PYTHON is not None
    record_file = folder.parent / "forged.json"
    record_file.write_text(json.dumps(record))
    record_file.chmod(0o644)
    seen = folder / "requests-seen"
    sock = folder / "gpudiag.sock"

    def become_nobody() -> None:
        os.setgid(NOBODY)
        os.setgroups([])
        os.setuid(NOBODY)

    proc = subprocess.Popen([SYSTEM_PYTHON, "-I", "-c", IMPOSTOR, str(sock), str(record_file),
                             str(seen)], preexec_fn=become_nobody, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd="/")
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "listening", proc.stderr.read() if proc.stderr else ""
    assert os.stat(sock).st_uid == NOBODY  # it owns the socket path
    return proc, seen


@needs_root
def test_an_impostor_on_the_socket_is_refused_and_preflight_runs_inline(
        serve: Any, run_dir: Path) -> None:
    """While the daemon is down, another user binds the socket path and forges "ready"."""
    env = dict(serve.env)
    code, forged = verdict_of(["preflight", "--format", "json", "--no-daemon"], env)
    assert code == 0 and forged["ready"] is True
    forged["source"] = "daemon"
    run_dir.chmod(0o1777)  # as if the folder let others in: the peer check must still hold
    impostor, seen = _start_impostor(run_dir, forged)
    try:
        # The real host is blocked: the forged "ready" must not be believed.
        env.update(GPUDIAG_DAEMON_URL=f"unix:{run_dir / 'gpudiag.sock'}",
                   FAKE_CUDA_INIT_ERROR="999")
        t = time.monotonic()
        proc = run_gpudiag(["preflight", "--format", "json"], env)
        assert proc.returncode == 1, proc.stderr
        rec = json.loads(proc.stdout)
        assert rec["source"] == "inline" and rec["gpu_validation_blocker"] != "none"
        note = rec["evidence"]["daemon"]
        assert note["refused"] is True and note["used"] is False
        why = f"the peer runs as uid {NOBODY} (pid {impostor.pid})"
        assert why in note["reason"] and f"the owner of {run_dir}" in note["reason"]
        assert why in proc.stderr  # said on stderr too, not only in the record
        assert time.monotonic() - t < 30
        # The question (with the job's visibility) never reached the impostor.
        assert not seen.exists()

        # The Python API falls back the same way.
        import gpudiag

        verdict = gpudiag.preflight("nvml", env=env)
        assert verdict.source == "inline" and verdict.evidence["daemon"]["refused"] is True

        # Naming the impostor's user as the daemon's makes it trusted: the check is the uid.
        env["GPUDIAG_DAEMON_USER"] = "nobody"
        code, rec = verdict_of(["preflight", "--format", "json"], env)
        assert code == 0 and rec["source"] == "daemon"
        assert seen.exists()
    finally:
        impostor.kill()
        impostor.wait(10)


@needs_root
def test_a_socket_folder_anyone_could_have_made_is_not_trusted_by_default(
        serve: Any, run_dir: Path) -> None:
    """An impostor that made the folder itself (its parent is world-writable) owns it."""
    shared = run_dir.parent / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o1777)
    folder = shared / "daemon"
    folder.mkdir()
    os.chown(folder, NOBODY, NOBODY)
    code, forged = verdict_of(["preflight", "--format", "json", "--no-daemon",
                               "--require", "nvml"], serve.env)
    forged["source"] = "daemon"
    impostor, _seen = _start_impostor(folder, forged)
    try:
        answer = ask_daemon(f"unix:{folder / 'gpudiag.sock'}", parse_requirement("nvml"),
                            env={})
        assert answer.verdict is None and answer.refused
        assert "not trusted" in answer.reason and "GPUDIAG_DAEMON_USER" in answer.reason
    finally:
        impostor.kill()
        impostor.wait(10)


# --- TCP read-only -------------------------------------------------------------------------

def test_tcp_in_read_only_mode_answers_metrics_and_refuses_post_probe(
        serve: Any, run_dir: Path) -> None:
    sock = run_dir / "gpudiag.sock"
    daemon = serve(sock, "tcp_read_only = true\n")
    status, text = tcp_http(daemon.url, "GET", "/metrics")
    assert status == 200 and "gpudiag_ready" in text
    assert tcp_http(daemon.url, "GET", "/healthz")[0] == 200
    status, body = tcp_http(daemon.url, "POST", "/v1/probe")
    assert status == 403 and body["error"]["code"] == "read_only", body
    assert "unix socket" in body["error"]["message"]
    status, body = tcp_http(daemon.url, "GET", "/v1/preflight")
    assert status == 403 and body["error"]["code"] == "read_only"
    # The socket serves what TCP refuses.
    assert unix_http(sock, "POST", "/v1/probe?backend=host")[0] == 202
    assert unix_http(sock, "GET", "/v1/preflight")[0] == 200
    text = wait_for(lambda: (t := tcp_http(daemon.url, "GET", "/metrics")[1]) and
                    'gpudiag_http_rejected_total{reason="read_only"} 2.0' in t and t, 10)
    assert 'reason="read_only"' in text


def test_security_doc_names_only_tests_that_exist() -> None:
    """docs/security.md closes the port-squatting risk by naming tests: they must be real."""
    import re

    root = Path(__file__).resolve().parent.parent
    doc = (root / "docs" / "security.md").read_text()
    section = doc[doc.index("## Trusting the answer"):doc.index("## What runs as whom")]
    named = set(re.findall(r"`(?:tests/\w+\.py::)?(test_\w+)`", section))
    assert len(named) >= 8
    defined = set()
    for path in (root / "tests").glob("test_*.py"):
        defined |= set(re.findall(r"^def (test_\w+)", path.read_text(), re.M))
    assert named <= defined, named - defined
