"""The house stays easy to take over: the tree says where each idea lives, no
import circle anywhere (imports inside functions included), no room over ~500
lines without a reason in its docstring, one door to Redis, and a README that
is a front page, not a second copy of the documentation site."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.support import ROOT

PACKAGE = ROOT / "celery_singleton_lock"
NAME = PACKAGE.name
#: a module past this many lines says why in its docstring ("Over 500 lines: ...")
MAX_LINES = 500
README_MAX_CHARS = 10_000
#: at most this many modules directly in the package: the public face and the
#: few core ideas; every other room is in a subpackage named for its idea
MAX_TOP_MODULES = 12
MIN_SUBPACKAGES = 6
#: the engine kinds: only the engine asks which one it has
ENGINE_KINDS = {"LockEngine", "RedlockEngine", "ClusterWire", "LazyCluster", "Wire"}
#: 0.1's paths, kept until 0.3 with a warning: no rooms, on the roof
SHIMS = {"overlap", "metrics", "masking", "replies"}
#: the rooms from the ground up: a room imports only rooms before it (the
#: package's face, ``""``, is the roof); rooms on one floor import neither
FLOORS = [
    {"exceptions", "process", "urls"},
    {"models"},
    {"keys"},
    {"config"},
    {"engine"},
    {"rollout", "observe"},
    {"lock"},
    {"checks", "conflict", "fencing"},
    {"worker"},
    {"beat", "task"},
    {"testing", "cli"},
    {"", *SHIMS},
]
#: the longest import chain, imports inside functions counted
MAX_CHAIN = 13


def module_name(path: Path, package: Path = PACKAGE) -> str:
    """``engine.server`` for celery_singleton_lock/engine/server.py; a package's
    ``__init__`` is the package (``beat``); the top ``__init__`` is ``""``."""
    parts = list(path.relative_to(package).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(p, package): p for p in sorted(package.rglob("*.py"))}


def imports_of(path: Path, name: str, known: set[str], top: str = NAME) -> set[str]:
    """The package modules ``path`` (module ``name``) imports, at the top or
    inside a function: each import names the module it reaches (a name imported
    from a package that is a module of it, ``from . import x``, reaches ``x``)."""
    is_package = path.name == "__init__.py"
    here = name.split(".") if name else []
    base = here if is_package else here[:-1]
    found: set[str] = set()

    def reach(target: list[str], names: list[str]) -> None:
        dotted = ".".join(target)
        for n in names:
            sub = f"{dotted}.{n}" if dotted else n
            if sub in known:
                found.add(sub)
            elif dotted in known:
                found.add(dotted)

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                target = base[:len(base) - node.level + 1] if node.level > 1 else list(base)
                target = target + (node.module.split(".") if node.module else [])
            elif (node.module or "").split(".")[0] == top:
                target = (node.module or "").split(".")[1:]
            else:
                continue
            reach(target, [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == top and ".".join(parts[1:]) in known:
                    found.add(".".join(parts[1:]))
    found.discard(name)
    return found


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    mods = modules(package)
    return {name: imports_of(path, name, set(mods), package.name) for name, path in
            mods.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle: a path from a module back to itself."""
    found: list[list[str]] = []
    seen: set[frozenset[str]] = set()

    def walk(start: str, node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
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
    pkg = tmp_path / NAME
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub.b import x\n")
    (pkg / "sub" / "b.py").write_text(f"def f():\n    from {NAME}.a import y\n")
    (pkg / "sub" / "c.py").write_text("from . import b\nfrom .. import a\n")
    graph = import_graph(pkg)
    assert graph["sub.c"] == {"sub.b", "a"}
    assert circles(graph) == [["a", "sub.b", "a"]]


def test_the_package_has_no_import_circle_anywhere() -> None:
    graph = import_graph()
    assert graph["task"] and graph["beat.scheduler"], "the reader found the imports"
    assert circles(graph) == []


def room(module: str) -> str:
    return module.split(".")[0]


def arrows_up(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a room on the same floor or above: ``config -> engine.servers``."""
    floor = {name: i for i, names in enumerate(FLOORS) for name in names}
    return sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                  if room(m) != room(d) and floor[room(d)] >= floor[room(m)])


def longest_chain(graph: dict[str, set[str]]) -> list[str]:
    """The longest path of imports (the graph has no circle: tested above)."""
    best: dict[str, list[str]] = {}

    def down(m: str) -> list[str]:
        if m not in best:
            best[m] = [m, *max((down(d) for d in graph[m]), key=len, default=[])]
        return best[m]

    return max((down(m) for m in graph), key=len)


def test_the_graph_reader_sees_an_arrow_up_and_measures_a_chain() -> None:
    graph = {"config": {"engine.servers"}, "engine.servers": {"urls"}, "urls": set()}
    assert arrows_up(graph) == ["config -> engine.servers"]
    assert longest_chain(graph) == ["config", "engine.servers", "urls"]


def test_every_room_is_on_a_floor_and_imports_only_rooms_below() -> None:
    graph = import_graph()
    assert {room(m) for m in graph} == set().union(*FLOORS), "a room with no floor"
    assert arrows_up(graph) == []


def test_the_longest_import_chain_is_short() -> None:
    chain = longest_chain(import_graph())
    assert len(chain) <= MAX_CHAIN, " -> ".join(chain)


def test_the_tree_says_where_each_idea_lives() -> None:
    """A few core modules at the top, every other room in a subpackage named for
    its idea, each saying in its docstring what it holds."""
    top = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in {"__init__", *SHIMS})
    assert len(top) <= MAX_TOP_MODULES, top
    subpackages = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
    assert len(subpackages) >= MIN_SUBPACKAGES, subpackages
    for sub in PACKAGE.rglob("__init__.py"):
        assert ast.get_docstring(ast.parse(sub.read_text())), sub


def test_a_shim_only_points_at_where_its_names_moved() -> None:
    """An old import path's module names where its names went, warns, and holds
    nothing else: a few lines, one import of the package, no definition, so no
    idea hides in one."""
    for stem in sorted(SHIMS):
        path = PACKAGE / f"{stem}.py"
        assert len(path.read_text().splitlines()) <= 15, path
        assert len(imports_of(path, stem, set(modules()))) == 1, path
        tree = ast.parse(path.read_text())
        assert not [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]


def test_no_module_is_over_500_lines_without_a_reason() -> None:
    long = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = len(path.read_text().splitlines())
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if lines > MAX_LINES and "Over 500 lines:" not in doc:
            long[str(path.relative_to(PACKAGE))] = lines
    assert long == {}


def test_only_the_engine_asks_which_kind_of_engine_it_has() -> None:
    """Outside engine/, code talks to the Engine interface: no isinstance on an
    engine kind, no reach into a Redlock engine's masters or an engine's wire."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "engine" in path.relative_to(PACKAGE).parts[:1]:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "isinstance":
                kinds = ast.dump(node.args[1]) if len(node.args) > 1 else ""
                if any(f"'{k}'" in kinds for k in ENGINE_KINDS):
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
            if isinstance(node, ast.Attribute) and node.attr in ("masters", "wire") and (
                    getattr(node.value, "id", "") == "engine"
                    or getattr(node.value, "attr", "") == "engine"
                    or ast.unparse(node.value).startswith("engine_for(")):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} .{node.attr}")
    assert found == []


def test_no_room_above_the_engine_reaches_redis_through_an_engines_client() -> None:
    """Beat's keys, the statistics and the CLI's reads go through the engine's
    named operations (a quorum call on Redlock), not ``engine.client``, which
    is one server's connection."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "engine" in path.relative_to(PACKAGE).parts[:1]:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "client":
                owner = ast.unparse(node.value)
                if owner.split(".")[-1] in ("engine", "_engine") or owner.startswith(
                        ("engine_for(", "connect(")):
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {owner}.client")
    assert found == []


def test_nothing_is_parked_on_the_engine_by_a_room_above_it() -> None:
    """The renewer keeps its own registry: no module sets an attribute on an
    engine for another module to read (``engine.heartbeat`` was one)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                            and t.value.id == "engine"):
                        found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert found == []


def test_the_engine_imports_no_celery_and_the_worker_imports_no_beat() -> None:
    graph = import_graph()
    celery_users = set()
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                    else [])
            if any(m == "celery" or m.startswith(("celery.", "kombu", "billiard"))
                   for m in mods):
                celery_users.add(name)

    def reach(start: str) -> set[str]:
        seen: set[str] = set()
        todo = [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    engine = {m for m in graph if m == "engine" or m.startswith("engine.")}
    below_engine = set().union(*(reach(m) for m in engine)) | engine
    assert not below_engine & celery_users, below_engine & celery_users
    worker = {m for m in graph if m.startswith("worker.")} | {"task"}
    beat = {m for m in graph if m == "beat" or m.startswith("beat.")}
    assert not set().union(*(reach(m) for m in worker)) & beat


def test_the_readme_is_a_front_page() -> None:
    """Counted as it reads: a link's target is not read (the README's links are
    absolute, so they work on an index page, and each is a long URL)."""
    text = re.sub(r"\]\([^)]*\)", "]", (ROOT / "README.md").read_text())
    assert len(text) <= README_MAX_CHARS, len(text)


def test_the_tests_follow_the_packages_ideas() -> None:
    """Each idea's tests are in a folder named for it (its pure tests too,
    marked ``unit``), beside the cross-deployment contract suite: every
    subpackage, and the top modules with tests of their own, has one."""
    folders = {p.parent.name for p in (ROOT / "tests").glob("*/test_*.py")}
    subpackages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")} - {"testing"}
    assert subpackages | {"contract", "config", "keys", "lock", "project"} <= folders, folders
    assert "unit" not in folders, "pure tests go beside the others of their idea"
    assert not list((ROOT / "tests").glob("test_*.py")), "every test file is in a folder"
