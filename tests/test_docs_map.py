"""The map of the code keeps up with the code (issue 50).

docs/design-notes.md opens with its contents, the layers and a feature table (every feature:
its modules, its docs); its module map shows five features layer by layer; docs/README.md
lists every page under docs/. Modules and pages are added every round, so these tests fail
naming the module, path, link or page that is missing, and the table it is missing from.
Pure text reads: no subprocess, no import of gpudiag.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "gpudiag"
DOCS = REPO / "docs"
NOTES = DOCS / "design-notes.md"
INDEX = DOCS / "README.md"
LAYERS = ("core", "probes", "engine", "daemon", "runner", "cli", "pytest_plugin")
FEATURE_HEADER = ["feature", "modules", "docs"]
MAP_HEADING = "### Where qualification, attribution, backends and runtimes live, layer by layer"
CODE = re.compile(r"`([^`]+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PAGE_SUFFIXES = (".md",)


@dataclass(frozen=True)
class Row:
    """One body row of a markdown table, its cells keyed by the header's names."""

    table: str
    cells: dict[str, str]

    @property
    def name(self) -> str:
        """The first cell, up to its first colon (the feature table's "nvml: every GPU's ...")."""
        return self.cells[next(iter(self.cells))].split(":", 1)[0]


def _prose(text: str) -> Iterator[str]:
    """The lines of a markdown text outside fenced code (where `# comment` is no heading)."""
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield line


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _headings(text: str) -> list[tuple[int, str]]:
    return [(len(m.group(1)), m.group(2)) for line in _prose(text)
            if (m := re.match(r"(#{1,6}) (.+)$", line))]


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    for _, heading in _headings(page.read_text()):
        slug = _slug(heading)
        seen[slug] = seen.get(slug, -1) + 1
    # A repeated heading's anchor gets -1, -2, ... as GitHub numbers them.
    return {slug if n == 0 else f"{slug}-{n}" for slug, count in seen.items()
            for n in range(count + 1)}


def _section(text: str, heading: str) -> list[str]:
    """The lines under `heading` up to the next heading of its level or above."""
    level = len(heading.split(" ", 1)[0])
    lines = list(_prose(text))
    assert heading in lines, f"docs/design-notes.md has no heading {heading!r}"
    out: list[str] = []
    for line in lines[lines.index(heading) + 1:]:
        m = re.match(r"(#{1,6}) ", line)
        if m and len(m.group(1)) <= level:
            break
        out.append(line)
    return out


def _cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def _tables(lines: list[str], where: str) -> Iterator[list[Row]]:
    block: list[str] = []
    for line in [*lines, ""]:
        if line.startswith("|"):
            block.append(line)
            continue
        if len(block) >= 2:
            header = _cells(block[0])
            yield [Row(where, dict(zip(header, _cells(body), strict=False)))
                   for body in block[2:]]
        block = []


def _feature_rows() -> list[Row]:
    text = NOTES.read_text()
    rows = [row for table in _tables(_section(text, "## Feature table"), "feature table")
            if table and list(table[0].cells) == FEATURE_HEADER for row in table]
    assert rows, ("docs/design-notes.md's '## Feature table' has no table whose header is "
                  f"{FEATURE_HEADER}")
    return rows


def _is_group(row: Row) -> bool:
    """A row that only names a group of the rows below it (`| **The daemon** | | |`)."""
    return row.name.startswith("**") and not row.cells["modules"] and not row.cells["docs"]


def _feature_paths() -> dict[str, list[str]]:
    """Module path (under gpudiag/) -> the feature rows naming it."""
    out: dict[str, list[str]] = {}
    for row in _feature_rows():
        for token in CODE.findall(row.cells["modules"]):
            out.setdefault(token, []).append(row.name)
    return out


def _module_map_paths() -> set[str]:
    """The modules the module map names: a bare `name.py` in a layer's column is LAYER/name.py;
    a column of two layers ("daemon, runner") says which with `daemon:` and `runner:`, and a
    path that starts with a layer (`pytest_plugin/session.py`) names its own."""
    text = NOTES.read_text()
    tables = list(_tables(_section(text, MAP_HEADING), "module map"))
    assert tables, f"docs/design-notes.md's {MAP_HEADING!r} holds no table"
    out: set[str] = set()
    for row in (row for table in tables for row in table):
        for column, cell in row.cells.items():
            layers = [layer for layer in LAYERS if re.search(rf"\b{layer}\b", column)]
            if not layers:
                continue
            # Split "daemon: a.py, b.py; runner: c.py" at each layer's label.
            parts = re.split(rf"\b({'|'.join(layers)}):", cell)
            current = layers[0]
            for part in parts:
                if part in layers:
                    current = part
                    continue
                for token in CODE.findall(part):
                    if token.endswith(".py"):
                        # `pytest_plugin/session.py` in the cli column names its own layer.
                        named = token.split("/", 1)[0] in LAYERS
                        out.add(token if named else f"{current}/{token}")
    return out


def _modules() -> list[str]:
    return sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                  if p.name not in ("__init__.py", "__main__.py"))


def _link_problems(page: Path, text: str, where: str) -> list[str]:
    """Every relative link in `text` (of `page`) names a file, and its anchor a heading."""
    problems = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s):, mailto: ...
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.is_file():
            problems.append(f"{where}: the link ({target}) names no file ({file})")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            problems.append(f"{where}: the link ({target}) names no heading of "
                            f"{file.relative_to(REPO)}")
    return problems


def test_every_module_path_in_the_feature_table_is_a_file() -> None:
    wrong = [f"`{path}` (row {', '.join(repr(r) for r in rows)}) is not a file: "
             f"gpudiag/{path} does not exist"
             for path, rows in sorted(_feature_paths().items())
             if not (path.split("/", 1)[0] in LAYERS and path.endswith(".py")
                     and (PACKAGE / path).is_file())]
    assert wrong == [], ("docs/design-notes.md's feature table names modules as paths under "
                         "gpudiag/ (`core/nic.py`); fix or remove:\n" + "\n".join(wrong))


def test_every_module_is_in_the_feature_table_or_the_module_map() -> None:
    named = set(_feature_paths()) | _module_map_paths()
    missing = [f"gpudiag/{module}" for module in _modules() if module not in named]
    assert missing == [], (
        "modules in neither docs/design-notes.md's feature table nor its module map: add each "
        "as `LAYER/NAME.py` to the modules of its feature's row in the feature table (or a new "
        "row):\n" + "\n".join(missing))


def test_each_feature_row_lists_its_modules_lowest_layer_first() -> None:
    rank = {layer: i for i, layer in enumerate(("core", "probes", "engine"))}
    rank |= {"daemon": 3, "runner": 3, "cli": 4, "pytest_plugin": 4}
    unordered = []
    for row in _feature_rows():
        paths = CODE.findall(row.cells["modules"])
        ordered = sorted(paths, key=lambda p: rank.get(p.split("/", 1)[0], len(rank)))
        if paths != ordered:
            unordered.append(f"row {row.name!r}: " + ", ".join(f"`{p}`" for p in ordered))
    assert unordered == [], ("docs/design-notes.md's feature table lists modules lowest layer "
                             "first (core, probes, engine, daemon | runner, cli | "
                             "pytest_plugin); write these as:\n" + "\n".join(unordered))


def test_every_feature_row_names_its_modules_and_its_docs() -> None:
    rows = [row for row in _feature_rows() if not _is_group(row)]
    empty = [f"row {row.name!r} names no {column}" for row in rows
             for column, pattern in (("modules", CODE), ("docs", LINK))
             if not pattern.search(row.cells.get(column, ""))]
    assert empty == [], "docs/design-notes.md's feature table:\n" + "\n".join(empty)
    # The backends of the registry each have their row.
    backends = sorted(p.stem for p in (PACKAGE / "core" / "backends").glob("*.py")
                      if p.name != "__init__.py")
    paths = _feature_paths()
    unlisted = [b for b in backends if f"core/backends/{b}.py" not in paths]
    assert unlisted == [], f"backends without a row in the feature table: {unlisted}"


def test_every_link_of_the_feature_table_reaches_a_page_and_its_heading() -> None:
    problems = [p for row in _feature_rows()
                for p in _link_problems(NOTES, row.cells.get("docs", ""),
                                        f"docs/design-notes.md, feature table, row {row.name!r}")]
    assert problems == [], "\n".join(problems)


def test_the_contents_list_every_section_and_every_entry_reaches_it() -> None:
    text = NOTES.read_text()
    contents = "\n".join(_section(text, "## Contents"))
    listed = set(re.findall(r"\]\(#([^)]+)\)", contents))
    sections = [h for level, h in _headings(text) if level == 2 and h != "Contents"]
    unlisted = [f"## {h} (#{_slug(h)})" for h in sections if _slug(h) not in listed]
    assert unlisted == [], ("sections missing from docs/design-notes.md's '## Contents':\n"
                            + "\n".join(unlisted))
    problems = _link_problems(NOTES, contents, "docs/design-notes.md, contents")
    assert problems == [], "\n".join(problems)


def test_the_docs_index_lists_every_page_under_docs() -> None:
    text = INDEX.read_text()
    listed = {(INDEX.parent / target.partition("#")[0]).resolve()
              for target in LINK.findall(text)}
    pages = sorted(p for p in DOCS.rglob("*") if p.suffix in PAGE_SUFFIXES and p != INDEX)
    missing = [str(p.relative_to(REPO)) for p in pages if p.resolve() not in listed]
    assert missing == [], ("pages missing from docs/README.md (a row each: the page, what it "
                           "holds, who reads it):\n" + "\n".join(missing))
    problems = _link_problems(INDEX, text, "docs/README.md")
    assert problems == [], "\n".join(problems)


def test_the_readme_points_at_the_docs_index() -> None:
    assert "(docs/README.md)" in (REPO / "README.md").read_text(), \
        "README.md links to no docs/README.md"
