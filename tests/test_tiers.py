"""The test tiers: every module and test named slow in conftest exists (no silent rot)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from tests.conftest import SLOW_MODULES, SLOW_TESTS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 gets tomli from the project's dependencies
    import tomli as tomllib  # type: ignore[import-not-found,unused-ignore]  # not on 3.11+

TESTS = Path(__file__).parent


@pytest.mark.parametrize("module", sorted({*SLOW_MODULES, *SLOW_TESTS}))
def test_every_slow_name_is_a_test_module_and_its_tests(module: str) -> None:
    path = TESTS / f"{module}.py"
    assert path.is_file(), f"conftest names {module}, which is no test module"
    defined = {node.name for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.FunctionDef)}
    missing = [name for name in SLOW_TESTS.get(module, ()) if name not in defined]
    assert missing == [], f"conftest.SLOW_TESTS names tests {module} does not have"


def test_the_slow_marker_is_registered_and_ci_runs_every_tier() -> None:
    config = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())
    markers = config["tool"]["pytest"]["ini_options"]["markers"]
    assert any(m.startswith("slow:") for m in markers)
    ci = (TESTS.parent / ".ci" / "run").read_text()
    pytest_lines = [line for line in ci.splitlines() if "-m pytest" in line]
    assert pytest_lines and not any("slow" in line or " -k " in line or " -m " in
                                    line.replace("-m pytest", "") for line in pytest_lines)


def test_ci_runs_the_readme_s_test_command_spread_over_the_cores() -> None:
    readme = (TESTS.parent / "README.md").read_text()
    (command,) = [line for line in readme.splitlines()
                  if line.startswith("scripts/setup.sh --tests && ")]
    ci = (TESTS.parent / ".ci" / "run").read_text()
    (ci_line,) = [line for line in ci.splitlines() if "-m pytest" in line]
    # CI adds only -rs (skip reasons shown); the workers, one a core, with a module's shared
    # fixture on one of them (tests/conftest.py adds the groups).
    assert ci_line.replace(" -rs", "") == command
    assert " -n auto " in f"{command} " and " --dist loadgroup" in command
