"""Where test code lives: every tests/test_*.py holds tests, every shared helper is under
tests/support/ (the fakes under tests/fakes/, the toy backend under tests/toy/), and nothing
imports a test module or conftest.py as a library; plus the helpers that touch the machine."""

from __future__ import annotations

import ast
import os
import subprocess
from pathlib import Path

import pytest

from tests.support.privatedev import in_private_dev, namespace_problem

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
# Only the tiers' own test reads conftest.py's tier lists (that is what it checks).
READS_CONFTEST = {TESTS / "test_tiers.py"}


def _imported(path: Path) -> set[str]:
    """Every module ``path`` imports (absolute imports; the repository has no relative ones)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def _python_files() -> list[Path]:
    return sorted(p for top in ("tests", "benchmarks", "scripts")
                  for p in (ROOT / top).rglob("*.py") if ".venv" not in p.parts)


@pytest.mark.parametrize("module", sorted(p.name for p in TESTS.glob("test_*.py")))
def test_every_test_module_holds_tests(module: str) -> None:
    tree = ast.parse((TESTS / module).read_text())
    tests = [n.name for n in tree.body
             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test")
             or isinstance(n, ast.ClassDef) and n.name.startswith("Test")]
    assert tests, f"tests/{module} holds no test: helpers belong in tests/support/"


def test_helper_modules_live_under_tests_support() -> None:
    loose = sorted(p.name for p in TESTS.glob("*.py")
                   if not p.name.startswith("test_") and p.name not in ("conftest.py",
                                                                         "__init__.py"))
    assert loose == [], f"move {loose} to tests/support/"


def test_nothing_imports_a_test_module_or_conftest() -> None:
    bad = []
    for path in _python_files():
        for name in _imported(path):
            parts = name.split(".")
            if parts[0] != "tests" or len(parts) < 2:
                continue
            if parts[1].startswith("test_") or (parts[1] == "conftest"
                                                and path not in READS_CONFTEST):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert bad == [], "import shared pieces from tests/support/ instead:\n" + "\n".join(bad)


def test_benchmarks_import_tests_only_from_support_and_fakes() -> None:
    bad = [f"{p.relative_to(ROOT)} imports {name}"
           for p in sorted((ROOT / "benchmarks").glob("*.py")) for name in _imported(p)
           if name.startswith("tests.") and not name.startswith(("tests.support", "tests.fakes"))]
    assert bad == []


@pytest.mark.skipif(namespace_problem() is not None, reason=str(namespace_problem()))
@pytest.mark.parametrize("gpus", [0, 2])
def test_a_private_dev_has_only_the_nodes_asked_for_and_leaves_dev_alone(gpus: int) -> None:
    before = sorted(os.listdir("/dev"))
    proc = subprocess.run(in_private_dev(["ls", "/dev"], gpus=gpus), capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    nodes = sorted(n for n in proc.stdout.split() if n.startswith("nvidia"))
    want = [] if gpus == 0 else sorted(["nvidia-uvm", "nvidiactl",
                                        *(f"nvidia{i}" for i in range(gpus))])
    assert nodes == want
    assert sorted(os.listdir("/dev")) == before

