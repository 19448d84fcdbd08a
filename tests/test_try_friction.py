"""Issue 30: docs/try-without-a-gpu.md as a reader meets it: one variable for the folder, waits
that end (a taken port says so instead of hanging), no advice that closes the terminal."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.support.docs import TRY_DOC, doc_blocks
from tests.support.host import clean_env

ROOT = Path(__file__).resolve().parent.parent


def test_the_folder_is_named_once_and_every_recipe_uses_the_variable() -> None:
    blocks = doc_blocks()
    assert "".join(blocks.values()).count("/tmp/gpudiag-try") == 1
    assert "TRY=/tmp/gpudiag-try" in blocks["setup"] and "$TRY" in blocks["xids"]


def test_no_wait_in_the_docs_is_unbounded() -> None:
    # `until`/`while` loops without a bound hang the reader's shell when a daemon never
    # answers; the recipes wait with a bounded `for` that also checks the daemon lives.
    text = TRY_DOC.read_text() + (ROOT / "README.md").read_text()
    assert re.findall(r"^\s*(until|while)\b", text, re.M) == []


def test_the_undo_advice_never_closes_the_readers_terminal() -> None:
    text = " ".join(TRY_DOC.read_text().split())
    assert "Undo with `exit`" not in text
    assert "start a sub-shell first (`bash`" in text


def test_the_fakes_command_says_an_8_gpu_host(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "tests.fakes", str(tmp_path / "f")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0 and "an 8-GPU host" in proc.stderr, proc.stderr
    assert (tmp_path / "f" / "gpudiag.toml").is_file()


def test_the_xid_recipe_on_a_taken_port_says_the_daemon_ended_instead_of_hanging(
        tmp_path: Path) -> None:
    blocks = doc_blocks()
    # Bound, not listening: the daemon cannot have the port, and nothing answers on it (a
    # listener that never answers would hold `gpudiag preflight --daemon-url` for its 60 s
    # read timeout, which this test is not about).
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = str(taken.getsockname()[1])
        script = (blocks["setup"] + blocks["xids"]).replace("/tmp/gpudiag-try",
                                                           str(tmp_path / "try"))
        env = clean_env()
        env.pop("GPUDIAG_LOCK_DIR")
        started = time.monotonic()
        proc = subprocess.run(["bash", "-c", script.replace("19477", port)], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=120,
                              check=False, start_new_session=True)
    assert time.monotonic() - started < 60
    assert "the daemon ended:" in proc.stdout, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
