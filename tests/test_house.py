"""The house stays easy to take over: no import circle in the package, no room
over ~400 lines without a reason in its docstring, and a README that is a
front page, not a second copy of the documentation site."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.support import ROOT

PACKAGE = ROOT / "celery_singleton_lock"
#: a module past this many lines says why in its docstring ("Over 400 lines: ...")
MAX_LINES = 400
README_MAX_CHARS = 10_000


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports, at the top or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                names = [node.module.split(".")[0]] if node.module else [
                    a.name for a in node.names]
            elif node.level == 0 and (node.module or "").startswith("celery_singleton_lock."):
                names = [(node.module or "").split(".")[1]]
            elif node.level == 0 and node.module == "celery_singleton_lock":
                names = [a.name for a in node.names]
            else:
                names = []
            found.update(n for n in names if n in modules)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "celery_singleton_lock" and len(parts) > 1:
                    found.add(parts[1])
    found.discard(path.stem)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = {p.stem: p for p in PACKAGE.glob("*.py")}
    return {name: imports_of(path, set(paths)) for name, path in paths.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle: a path from a module back to itself."""
    found: list[list[str]] = []
    seen: set[frozenset[str]] = set()

    def walk(start: str, node: str, path: list[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt == start:
                if frozenset(path) not in seen:
                    seen.add(frozenset(path))
                    found.append([*path, start])
            elif nxt not in path and nxt > start:
                walk(start, nxt, [*path, nxt])

    for start in sorted(graph):
        walk(start, start, [start])
    return found


def test_the_graph_reader_sees_a_circle_when_there_is_one(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("from .b import x\n")
    (tmp_path / "b.py").write_text("def f():\n    from celery_singleton_lock.a import y\n")
    graph = {p.stem: imports_of(p, {"a", "b"}) for p in tmp_path.glob("*.py")}
    assert circles(graph) == [["a", "b", "a"]]


def test_the_package_has_no_import_circle() -> None:
    graph = import_graph()
    assert graph["task"] and graph["beat"], "the reader found the imports"
    assert circles(graph) == []


def test_no_module_is_over_400_lines_without_a_reason() -> None:
    long = {}
    for path in sorted(PACKAGE.glob("*.py")):
        lines = len(path.read_text().splitlines())
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if lines > MAX_LINES and "Over 400 lines:" not in doc:
            long[path.name] = lines
    assert long == {}


def test_the_readme_is_a_front_page() -> None:
    """Counted as it reads: a link's target is not read (the README's links are
    absolute, so they work on an index page, and each is a long URL)."""
    text = re.sub(r"\]\([^)]*\)", "]", (ROOT / "README.md").read_text())
    assert len(text) <= README_MAX_CHARS, len(text)
