"""No dead code in gpudiag/: every name it defines is read somewhere (package, tests, scripts).

An AST check in the spirit of vulture, without the dependency: a module-level function, class
or constant, a method or property, a class field or an attribute a method sets on ``self`` is
dead when no file reads that name (a load, an attribute read, an import, or a string that is
exactly the name, as getattr and entry points use). Writes (assignments, keyword arguments)
do not count: a field only ever set is dead. Names that outside code calls are listed below
with why.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
READERS = ("gpudiag", "tests", "scripts", "benchmarks")
# name -> why it is alive although nothing here reads it
CALLED_FROM_OUTSIDE = {
    "collect": "prometheus_client's Collector protocol calls it on every scrape",
    "install_hook": "the generated sitecustomize.py of a job's child calls it (core/child.py)",
    "formatTime": "logging.Formatter.format calls it for %(asctime)s (cli/daemon.py)",
}
# pytest calls its hooks by name (the pytest11 entry point loads gpudiag.pytest_plugin).
HOOK = re.compile(r"pytest_[a-z_]+")
IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_.:]*")


def _reads(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Store):
            yield node.id
        elif isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Store):
            yield node.attr
        elif isinstance(node, ast.alias):
            yield node.name.split(".")[-1]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and IDENT.fullmatch(node.value):
            yield from re.split(r"[.:]", node.value)


def _class_members(cls: ast.ClassDef) -> Iterator[tuple[str, int]]:
    for sub in cls.body:
        if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
            decorators = {ast.unparse(d) for d in sub.decorator_list}
            if decorators <= {"property", "classmethod", "staticmethod"}:
                yield sub.name, sub.lineno
            for node in ast.walk(sub):
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                        and isinstance(node.value, ast.Name) and node.value.id == "self":
                    yield node.attr, node.lineno
        elif isinstance(sub, ast.AnnAssign) and isinstance(sub.target, ast.Name):
            yield sub.target.id, sub.lineno


def _definitions(tree: ast.Module) -> Iterator[tuple[str, int]]:
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if not node.decorator_list:  # decorated: registered (click, pytest fixtures)
                yield node.name, node.lineno
            if isinstance(node, ast.ClassDef):
                yield from _class_members(node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            yield from ((t.id, node.lineno) for t in targets if isinstance(t, ast.Name))


def test_gpudiag_defines_nothing_that_nothing_reads() -> None:
    reads: Counter[str] = Counter()
    trees: dict[Path, ast.Module] = {}
    for folder in READERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            reads.update(_reads(tree))
            if folder == "gpudiag":
                trees[path] = tree
    dead = sorted({f"{path.relative_to(REPO)}:{line} {name}"
                   for path, tree in trees.items() for name, line in _definitions(tree)
                   if not name.startswith("__") and not reads[name]
                   and name not in CALLED_FROM_OUTSIDE and not HOOK.fullmatch(name)})
    assert dead == [], "dead code (remove it, or say in CALLED_FROM_OUTSIDE who calls it)"


def test_the_check_finds_a_field_that_is_only_written() -> None:
    tree = ast.parse("class A:\n    def __init__(self):\n        self.only_written_x = 1\n")
    assert ("only_written_x", 3) in set(_definitions(tree))
    assert "only_written_x" not in set(_reads(tree))
