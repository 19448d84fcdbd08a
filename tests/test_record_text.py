"""The daemon's record printed without the typed model (``gpudiag.core.recordtext``).

The console entry prints a daemon-answered verdict straight from its JSON when this gpudiag
version wrote it and it holds together; these tests hold that path to the typed model's
bytes and exit code, and show that anything else (another version, a record that does not
hold together) is read by the typed model, as before.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpudiag.core.recordtext import RECORD_KEYS, own_record_text
from gpudiag.core.verdict import Verdict
from gpudiag.core.version import __version__
from gpudiag.daemon.answers import EncodedAnswer
from tests.support.host import entry_in_child, run_gpudiag
from tests.support.verdicts import verdict, verdicts

PROPERTY = settings(max_examples=200, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def _typed(data: dict[str, Any], fmt: str) -> tuple[str, bool]:
    """What the typed path prints for a daemon's record, and whether it is ready."""
    v = Verdict.from_record(data)
    return (v.kv() if fmt == "kv" else v.json() + "\n"), v.ready


def _daemon_body(v: Verdict, age_s: float = 1.5, fresh: bool = True) -> dict[str, Any]:
    """The record as the daemon answers it (encoded once, age and freshness spliced in)."""
    data: dict[str, Any] = json.loads(EncodedAnswer.of(v).body(age_s, fresh))
    return data


def test_the_record_keys_are_the_typed_model_s_in_its_order() -> None:
    assert tuple(verdict().record()) == RECORD_KEYS


@PROPERTY
@given(verdicts(), st.floats(0, 1e6), st.booleans(), st.sampled_from(["kv", "json"]))
def test_own_records_print_as_the_typed_model_prints_them(
        v: Verdict, age_s: float, fresh: bool, fmt: str) -> None:
    data = _daemon_body(v, age_s, fresh)
    assert own_record_text(data, fmt, __version__) == _typed(data, fmt)


@pytest.mark.parametrize("fmt", ["kv", "json"])
def test_anything_else_is_left_to_the_typed_model(fmt: str) -> None:
    good = _daemon_body(verdict(("cuda_init_failed", "")))
    assert own_record_text(good, fmt, __version__) is not None
    reordered = {"ready": good["ready"], **{k: v for k, v in good.items() if k != "ready"}}
    odd: list[object] = [
        None, [], "ready", {**good, "gpudiag_version": "0.0.1"},
        {**good, "schema": "gpudiag.verdict/2"}, {**good, "extra": 1}, reordered,
        {k: v for k, v in good.items() if k != "evidence"},
        {**good, "ready": True},  # says ready while it lists a blocker
        {**good, "ready": "false"}, {**good, "gpu_validation_blocker": "none"},
        {**good, "gpu_validation_blocker": "nvml_init_failed"},  # not its root cause
        {**good, "blockers": [1]}, {**good, "blockers": "cuda_init_failed"},
        {**good, "requirement": {}}, {**good, "devices": 3},
    ]
    for data in odd:
        assert own_record_text(data, fmt, __version__) is None, data
    # The daemon's own freshness flag is not part of the record the CLI prints.
    assert "fresh" not in own_record_text(good, "json", __version__)[0]  # type: ignore[index]


# --- through the console entry, against a canned answer on a unix socket -------------------

@pytest.fixture
def canned() -> Iterator[tuple[Path, list[bytes]]]:
    """A unix socket that answers every GET with the next canned body (as our own user)."""
    top = Path(tempfile.mkdtemp(prefix="gpudiag-canned-"))
    path = top / "gpudiag.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen(8)
    bodies: list[bytes] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                head = b""
                while b"\r\n\r\n" not in head:
                    head += conn.recv(65536)
                body = bodies.pop(0)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
                             % (len(body), body))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield path, bodies
    finally:
        server.shutdown(socket.SHUT_RDWR)  # wakes the thread's accept(), which then ends
        server.close()
        thread.join(10)
        path.unlink(missing_ok=True)
        top.rmdir()


@pytest.mark.parametrize("fmt", ["kv", "json"])
def test_another_version_s_record_is_read_by_the_typed_model(
        canned: tuple[Path, list[bytes]], fmt: str) -> None:
    path, bodies = canned
    older = {**_daemon_body(verdict(("cuda_init_failed", ""))), "gpudiag_version": "0.0.1"}
    env = {**os.environ, "GPUDIAG_DAEMON_USER": str(os.getuid())}
    bodies.append(json.dumps(older).encode())
    proc = run_gpudiag(["preflight", "--format", fmt, "--daemon-url", f"unix:{path}"],
                       env, timeout=60)
    assert proc.stderr == ""
    assert (proc.stdout, proc.returncode) == (_typed(older, fmt)[0], 1)


@pytest.mark.parametrize("fmt", ["json", "kv"])
def test_a_record_that_does_not_hold_together_is_said_and_answered_here(
        canned: tuple[Path, list[bytes]], fmt: str) -> None:
    """Says ready while listing a blocker: not believed (engine/answercheck, issue 38)."""
    path, bodies = canned
    lying = {**_daemon_body(verdict(("cuda_init_failed", ""))), "ready": True}
    env = {**os.environ, "GPUDIAG_DAEMON_USER": str(os.getuid())}
    bodies.extend([json.dumps(lying).encode()] * 2)  # the fast path asks, then click's path
    proc = run_gpudiag(["preflight", "--format", fmt, "--daemon-url", f"unix:{path}"],
                       env, timeout=120)
    said = [line for line in proc.stderr.splitlines() if "does not hold" in line]
    assert len(said) == 1 and "ready with blockers" in said[0], proc.stderr
    assert ("source=inline" if fmt == "kv" else '"source": "inline"') in proc.stdout


def test_an_answer_without_the_memory_floor_asked_in_units_is_not_accepted(
        canned: tuple[Path, list[bytes]]) -> None:
    """``--min-free-memory 200GiB`` answered by a record without that floor: said, and
    answered here (the floor is compared in bytes, whatever unit it was typed in)."""
    path, bodies = canned
    unfloored = _daemon_body(verdict())
    assert unfloored["ready"] and unfloored["requirement"]["min_free_memory_bytes"] is None
    env = {**os.environ, "GPUDIAG_DAEMON_USER": str(os.getuid())}
    bodies.extend([json.dumps(unfloored).encode()] * 2)
    proc = run_gpudiag(["preflight", "--format", "kv", "--min-free-memory", "200GiB",
                        "--daemon-url", f"unix:{path}"], env, timeout=120)
    said = [line for line in proc.stderr.splitlines() if "does not hold" in line]
    assert len(said) == 1 and f"not {200 * 2**30}" in said[0], proc.stderr
    assert "source=inline" in proc.stdout


def test_this_version_s_record_is_printed_as_the_typed_model_would(
        canned: tuple[Path, list[bytes]], tmp_path: Path) -> None:
    path, bodies = canned
    data = _daemon_body(verdict(warnings=("gpu_persistence_off",)), fresh=False)
    env = {**os.environ, "GPUDIAG_DAEMON_USER": str(os.getuid())}
    bodies.append(json.dumps(data).encode())
    rc, stdout, modules = entry_in_child(
        ["preflight", "--format", "json", "--daemon-url", f"unix:{path}"], env,
        tmp_path / "modules.json")
    assert rc == 0 and "gpudiag.core.verdict" not in modules  # the typed model never loaded
    assert stdout == _typed(data, "json")[0]
