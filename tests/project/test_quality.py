"""The package and its benchmarks stay lint-clean (ruff) and typed (mypy --strict, py.typed)."""

from __future__ import annotations

import ast
import contextlib
import re
import subprocess
import sys
from typing import Any

import pytest

from tests.support import ROOT


def run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *cmd], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_ruff_is_clean():
    out = run("ruff", "check", ".")
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy_strict_is_clean():
    out = run("mypy")
    assert out.returncode == 0, out.stdout + out.stderr


def test_package_ships_py_typed_and_lua():
    pkg = ROOT / "celery_singleton_lock"
    assert (pkg / "py.typed").exists()
    assert {p.stem for p in (pkg / "engine" / "lua").glob("*.lua")} >= {
        "acquire", "release", "renew", "handoff"}


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()]


def test_readme_opens_with_the_demo_and_test_commands_ci_runs():
    text = (ROOT / "README.md").read_text()
    assert text.index("```bash") < text.index("##"), "the commands come first"
    demo, tests = readme_commands()
    assert "examples/payment_callbacks/run_demo.py" in demo
    assert (ROOT / demo.split("&& python ", 1)[1].strip()).exists()
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().strip().splitlines()]
    # CI runs the README's test command, the long runs, then the oldest supported
    # stack, on the oldest Python declared where the machine has it
    start = ci.index(tests)
    assert ci[start + 1] == "python -m pytest -m long -n 1"
    rest = [line for line in ci[start + 2:] if not line.startswith("#")]
    assert ('python -m nox -s oldest --force-python "$oldest_python" --download-python never'
            in rest), rest
    assert rest[-3:] == ["else", "python -m nox -s oldest", "fi"], rest
    assert "`python -m pytest -m long -n 1`" in text


def test_ci_requires_every_service_and_installs_chromium_without_recommends():
    """CI fails, not skips, a test whose service, program or version is missing
    (RabbitMQ, PostgreSQL, chromium, a too-old redis-server or redis-py); it
    starts RabbitMQ and PostgreSQL when they are installed but stopped, and
    installs chromium without the desktop packages it recommends."""
    script = (ROOT / ".ci" / "run").read_text()
    assert "export SINGLETON_REQUIRE_SERVICES=1" in script
    assert "rabbitmq-server -detached" in script and "pg_ctlcluster" in script
    installs = [line for line in script.replace("\\\n", " ").splitlines()
                if "apt_install" in line and "chromium" in line]
    assert installs and all("--no-install-recommends" in line for line in installs)


def test_a_test_that_needs_a_service_or_version_skips_only_through_missing():
    """Every skip for a missing service, program or version goes through
    tests.support.missing, which the CI switch turns into a failure."""
    needs = re.compile(r"RabbitMQ|PostgreSQL|psycopg|chromium|redis-server|Redis before|"
                       r"redis-py|REDIS_PY|faketime|opentelemetry|otel|gevent|eventlet|"
                       r"green|django|sqlalchemy", re.IGNORECASE)
    bare = re.compile(r"pytest\.skip\(|skipif\(|importorskip\(")
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        lines = path.read_text().splitlines()
        for n, line in enumerate(lines):
            if bare.search(line) and needs.search(" ".join(lines[max(n - 1, 0):n + 2])):
                found.append(f"{path.relative_to(ROOT)}:{n + 1}: {line.strip()}")
    assert not found, found


def test_public_api_is_exactly_all():
    """Every public name of the package is in __all__ (submodules aside: importing
    one, as the CLI or the beat scheduler does, puts its name on the package)."""
    from types import ModuleType

    import celery_singleton_lock as pkg

    public = {n for n, v in vars(pkg).items()
              if not n.startswith("_") and not isinstance(v, ModuleType)} - {"annotations"}
    assert public == set(pkg.__all__) - {"__version__"}


def test_importing_the_package_opens_no_connection_and_starts_no_thread():
    """Importing the package (and SingletonTask on an app) has no side effect a
    process could trip over: no thread, no socket, no signal handler connected."""
    code = (
        "import os, threading\n"
        "from celery import Celery, signals\n"
        "before = len(signals.task_failure.receivers)\n"
        "import celery_singleton_lock\n"
        "from celery_singleton_lock import SingletonTask\n"
        "app = Celery('q', broker='redis://127.0.0.1:1/0', set_as_current=False)\n"
        "@app.task(base=SingletonTask)\n"
        "def t(x): return x\n"
        "t.singleton_keys(1)\n"
        "def link(f):\n"
        "    try: return os.readlink(f'/proc/self/fd/{f}')\n"
        "    except OSError: return ''\n"
        "socks = [f for f in os.listdir('/proc/self/fd') if link(f).startswith('socket:')]\n"
        "print(threading.active_count(), len(socks),"
        " len(signals.task_failure.receivers) - before)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "0", "0"]


def test_no_import_circle_between_the_package_modules():
    """Wiring flows one way: Celery wiring on top, the Redis engine at the
    bottom. Module-level imports between our modules form no cycle, and the
    engine and everything under it import no Celery."""
    import ast

    pkg = ROOT / "celery_singleton_lock"
    graph: dict[str, set[str]] = {}
    celery_users: set[str] = set()
    for path in pkg.glob("*.py"):
        name = path.stem
        graph[name] = set()
        for node in ast.parse(path.read_text()).body:  # module level only
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    graph[name].add(node.module.split(".")[0])
                else:
                    graph[name].update(a.name for a in node.names)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [
                    node.module or ""]
                if any(m == "celery" or m.startswith(("celery.", "kombu", "billiard"))
                       for m in mods):
                    celery_users.add(name)

    def reach(start: str) -> set[str]:
        seen: set[str] = set()
        todo = list(graph.get(start, ()))
        while todo:
            mod = todo.pop()
            if mod not in seen:
                seen.add(mod)
                todo.extend(graph.get(mod, ()))
        return seen

    circles = sorted(m for m in graph if m in reach(m))
    assert circles == [], circles
    below_engine = reach("engine") | {"engine"}
    assert not below_engine & celery_users, below_engine & celery_users


def noxfile_names() -> tuple[dict[str, Any], dict[str, str]]:
    """noxfile.py read, not imported (nox need not be installed): its literal
    assignments by name, and each session function's source by name."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    values: dict[str, Any] = {}
    functions: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and node.value is not None:
                    with contextlib.suppress(ValueError):
                        values[target.id] = ast.literal_eval(node.value)
        elif isinstance(node, ast.FunctionDef):
            functions[node.name] = ast.unparse(node)
    return values, functions


def test_the_declared_lower_bounds_are_the_stack_nox_oldest_installs_and_tests():
    """docs/compatibility.md:8: "The declared lower bounds in `pyproject.toml`
    are exactly the oldest versions that passed." Celery, kombu and redis-py:
    each dependency's lower bound is the version `nox -s oldest` (the cell
    OLDEST) installs pinned with `==`, and the page's "oldest tested" column
    says the same. Python is checked, not run (the page's "Python, checked"
    row): requires-python's bound is the target of `nox -s pythons`."""
    from packaging.requirements import Requirement

    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    values, functions = noxfile_names()
    assert "run_cell(session, OLDEST)" in functions["oldest"]
    celery, kombu, redis_py, _server = values["CELLS"][values["OLDEST"]]
    pins = {"celery": celery, "kombu": kombu, "redis": redis_py}
    installs = re.search(r"session\.install\((.*?)\)\n", functions["run_cell"], re.S)
    assert installs is not None
    assert all(f"{name}=={{{var}}}" in installs.group(1) for name, var in (
        ("celery[redis]", "celery"), ("kombu", "kombu"), ("redis", "redis_py"))), installs[0]

    declared: dict[str, str] = {}
    for text in pyproject["dependencies"]:
        requirement = Requirement(text)
        if requirement.name in pins:
            lower = [s.version for s in requirement.specifier if s.operator in (">=", ">", "==")]
            assert len(lower) == 1, f"{text}: one lower bound"
            declared[requirement.name] = lower[0]
    assert declared == pins, f"pyproject.toml {declared} but nox -s oldest installs {pins}"

    page = (ROOT / "docs" / "compatibility.md").read_text()
    oldest_column = dict(re.findall(r"^\| ([^|]+?) \| ([0-9.]+) \| [0-9.]+ \|", page, re.M))
    assert [oldest_column[row] for row in ("Celery (`celery[redis]`)", "kombu", "redis-py")
            ] == [celery, kombu, redis_py], oldest_column

    python = pyproject["requires-python"]
    assert re.fullmatch(r">=3\.\d+", python), python
    assert f"--target={python[2:]}-" in functions["pythons"], functions["pythons"]
    assert oldest_column["Python, checked"] == python[2:]
