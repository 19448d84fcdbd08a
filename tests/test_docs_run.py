"""Every shell and Python block of README.md and docs/*.md runs as written on the fake host.

A block that cannot run here says so in an HTML comment on the line before it:
``<!-- needs: gpu -->`` (a real GPU), ``<!-- needs: cluster -->`` (a Slurm, Kubernetes or
Prometheus fleet), ``<!-- needs: node -->`` (installs onto a machine: /etc, /opt, systemctl),
or ``<!-- not run: WHY -->``. ``<!-- run: pytest -->`` runs a Python block as a test module.
The try-without-a-gpu recipes (``<!-- setup -->``, ``<!-- recipe: NAME -->``) are run by
tests/test_ux.py. Lines ``# -> TEXT`` in a block are output that must appear.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.host import clean_env

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = ("sh", "python")
SKIP_MARKERS = re.compile(r"<!-- (needs: (gpu|cluster|node)|not run: \S.*) -->")
RUN_MARKERS = re.compile(r"<!-- (run: pytest|setup|recipe: [a-z]+) -->")
# A shell command that exits with one of these did not run as written (usage error, not
# executable, not found); 1 is an answer ("blocked", grep found nothing).
NOT_AS_WRITTEN = {2, 126, 127}


@dataclass(frozen=True)
class Block:
    """One fenced block of a document."""

    doc: str
    line: int
    lang: str
    marker: str
    text: str

    @property
    def name(self) -> str:
        return f"{self.doc}:{self.line}"


def doc_blocks() -> list[Block]:
    """Every fenced shell or Python block at the start of a line in the docs."""
    blocks = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            m = re.match(r"^```(\w*)$", lines[i])
            if not m:
                i += 1
                continue
            end = lines.index("```", i + 1)
            before = next((s.strip() for s in reversed(lines[:i]) if s.strip()), "")
            marker = before if before.startswith("<!--") else ""
            blocks.append(Block(path.relative_to(ROOT).as_posix(), i + 1, m.group(1), marker,
                                "\n".join(lines[i + 1:end]) + "\n"))
            i = end + 1
    return blocks


BLOCKS = [b for b in doc_blocks() if b.lang in RUNNABLE]
TO_RUN = [b for b in BLOCKS if not SKIP_MARKERS.fullmatch(b.marker)
          and not re.fullmatch(r"<!-- (setup|recipe: [a-z]+) -->", b.marker)]


def test_every_block_marker_is_one_the_doc_test_knows() -> None:
    unknown = [f"{b.name} {b.marker}" for b in BLOCKS if b.marker
               and not (SKIP_MARKERS.fullmatch(b.marker) or RUN_MARKERS.fullmatch(b.marker))]
    assert unknown == []
    # Most blocks run: a marker is for what truly needs a GPU, a cluster or a machine.
    skipped = [b for b in BLOCKS if SKIP_MARKERS.fullmatch(b.marker)]
    assert len(skipped) < len(BLOCKS) - len(skipped) and len(TO_RUN) >= 7


@pytest.fixture(scope="module")
def fake_host(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment after the reader's `eval "$(python -m tests.fakes DIR)"`."""
    folder = tmp_path_factory.mktemp("fake-host")
    base = clean_env()
    subprocess.run([sys.executable, "-m", "tests.fakes", str(folder)], cwd=ROOT, env=base,
                   check=True, capture_output=True, timeout=120)
    out = subprocess.run(["bash", "-c", f"source {folder}/env.sh && env -0"], env=base,
                         check=True, capture_output=True, text=True, timeout=30).stdout
    return dict(line.split("=", 1) for line in out.split("\0") if "=" in line)


def _environment(fake_host: dict[str, str], tmp: Path) -> dict[str, str]:
    """The fake host's environment, gpudiag on PATH, and a home and temp folder of its own."""
    env = dict(fake_host)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    for name in ("home", "tmp", "locks"):
        (tmp / name).mkdir()
    env.update(HOME=str(tmp / "home"), TMPDIR=str(tmp / "tmp"),
               GPUDIAG_LOCK_DIR=str(tmp / "locks"), COLUMNS="100")
    return env


def _run(argv: list[str], env: dict[str, str], cwd: Path, timeout: float
         ) -> subprocess.CompletedProcess[str]:
    """Run in a session of its own: whatever a block leaves running ends with it."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = "", f"ran past {timeout}s"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


@pytest.mark.parametrize("block", TO_RUN, ids=[b.name for b in TO_RUN])
def test_every_documented_block_runs_as_written(block: Block, fake_host: dict[str, str],
                                                tmp_path: Path) -> None:
    env = _environment(fake_host, tmp_path)
    # Paths under /tmp in a block are the reader's scratch space: this test's own folder.
    text = block.text.replace("/tmp/", f"{tmp_path / 'tmp'}/")
    if block.lang == "sh":
        trap = ('trap \'rc=$?; case $rc in 2|126|127) '
                'echo "doc-block: exit $rc: $BASH_COMMAND" >&2;; esac\' ERR\n')
        proc = _run(["bash", "-c", trap + text], env, ROOT, 240)
    elif block.marker == "<!-- run: pytest -->":
        (tmp_path / "test_block.py").write_text(text)
        proc = _run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                     "test_block.py"], env, tmp_path, 240)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    else:
        (tmp_path / "block.py").write_text(text)
        proc = _run([sys.executable, "block.py"], env, tmp_path, 240)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    said = proc.stdout + proc.stderr
    assert "doc-block: exit" not in proc.stderr, said
    assert "Traceback" not in said and "command not found" not in said, said
    for line in re.findall(r"^\s*# -> (.*)$", block.text, re.M):
        assert line in proc.stdout, f"{line!r} not in the output of {block.name}:\n{said}"
