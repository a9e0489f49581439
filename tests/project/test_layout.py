"""The repository has the shape its users know, and docker-compose.yml names
only modules, schedulers and scripts that exist (no container engine here:
the file is parsed and each thing it names is checked). The docs extra holds
what the site needs, and the examples' beat entries say their interval."""

from __future__ import annotations

import datetime as dt
import importlib
import importlib.util
import os
import re
import subprocess
import sys
from importlib.metadata import entry_points, packages_distributions
from pathlib import Path
from typing import Any

import pytest
import yaml
from celery import Celery
from packaging.requirements import Requirement

from tests.support import ROOT


def test_the_package_sits_at_the_repository_top_with_license_and_changelog():
    for path in ("pyproject.toml", "celery_singleton_lock/__init__.py", "tests", "examples",
                 "benchmarks", "docs", "docker-compose.yml", "LICENSE", "CHANGELOG.md"):
        assert (ROOT / path).exists(), path
    assert not (ROOT / "src").exists()
    assert "MIT" in (ROOT / "LICENSE").read_text()


def test_the_compose_stack_names_only_what_exists():
    spec = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = spec["services"]
    assert {"redis", "worker", "beat-1", "beat-2", "flower", "sender"} <= set(services)
    beats = [s for s in services.values() if "beat" in s.get("command", [])]
    assert len(beats) == 2
    for service in services.values():
        if "image" in service:  # redis; Prometheus and Grafana: tests/observe/test_dashboard.py
            continue
        build = service["build"]
        assert (ROOT / build["context"] / build["dockerfile"]).exists()
        assert service["environment"]["REDIS_URL"].startswith("redis://redis:")
        workdir = ROOT / "examples" / "compose"
        cmd = service["command"]
        if cmd[0] == "python":
            assert (workdir / cmd[1]).exists(), cmd
            continue
        assert cmd[:2] == ["celery", "-A"], cmd
        sys.path.insert(0, str(workdir))
        try:
            app = importlib.import_module(cmd[2]).app
        finally:
            sys.path.remove(str(workdir))
        assert app.main == "proj"
        if "-S" in cmd:
            module, _, attr = cmd[cmd.index("-S") + 1].partition(":")
            assert getattr(importlib.import_module(module), attr)


def test_the_compose_app_loads_as_celery_would_load_it():
    """`celery -A proj inspect --help` from the example's folder: the app imports."""
    out = subprocess.run([sys.executable, "-m", "celery", "-A", "proj", "report"],
                         cwd=ROOT / "examples" / "compose", capture_output=True, text=True,
                         timeout=60, env={**os.environ, "REDIS_URL": "redis://127.0.0.1:1"})
    assert out.returncode == 0, out.stderr
    assert "proj" in out.stdout and "singleton_redis_url" in out.stdout.lower()


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def docs_extra() -> dict[str, Requirement]:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {canonical(r.name): r for r in map(Requirement,
                                              project["optional-dependencies"]["docs"])}


def test_the_test_extra_brings_every_extra_a_test_skips_without():
    """`pip install -e '.[test]'`, the README's command, leaves no test skipped
    for a missing package: every extra a test's skip names ("extra 'green'")
    is one the test extra installs, and the README says so."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    brought: set[str] = set()
    for text in extras["test"]:
        req = Requirement(text)
        if canonical(req.name) == canonical(project["name"]):
            brought |= req.extras
    named = {m for path in sorted((ROOT / "tests").rglob("*.py"))
             for m in re.findall(r"extra '(\w+)'", path.read_text())}
    assert named, "no skip names an extra: this check looks for the wrong words"
    assert named <= set(extras), named - set(extras)
    assert named - brought == set(), "skipped with the test extra alone"
    readme = (ROOT / "README.md").read_text()
    for extra in sorted(brought):
        assert f"`[{extra}]`" in readme, f"the README does not say [test] brings [{extra}]"


class _MkdocsLoader(yaml.SafeLoader):
    """mkdocs.yml with its ``!!python/name:`` tags read as None."""


_MkdocsLoader.add_multi_constructor("tag:yaml.org,2002:python/", lambda *_: None)


def test_the_docs_extra_holds_what_mkdocs_yml_needs():
    """`pip install -e '.[docs]' && mkdocs build --strict`: the theme, every
    plugin, every handler of mkdocstrings and every third-party Markdown
    extension mkdocs.yml names comes from a distribution the extra names."""
    extra = docs_extra()
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_MkdocsLoader)
    needed: dict[str, str] = {"hooks (mkdocs itself)": "mkdocs"}
    themes = {e.name: e for e in entry_points(group="mkdocs.themes")}
    needed[f"theme {config['theme']['name']}"] = themes[config["theme"]["name"]].dist.name
    plugins = {e.name: e for e in entry_points(group="mkdocs.plugins")}
    for plugin in config["plugins"]:
        name = plugin if isinstance(plugin, str) else next(iter(plugin))
        needed[f"plugin {name}"] = plugins[name].dist.name
        if name == "mkdocstrings":
            options = plugin[name]
            for handler in {options.get("default_handler", "python"), *options["handlers"]}:
                assert handler in extra["mkdocstrings"].extras or (
                    f"mkdocstrings-{handler}" in extra), f"mkdocstrings handler {handler}"
    owners = packages_distributions()
    for extension in config["markdown_extensions"]:
        name = extension if isinstance(extension, str) else next(iter(extension))
        if "." in name:  # the short names are Markdown's own, which mkdocs brings
            needed[f"extension {name}"] = owners[name.split(".")[0]][0]
    missing = {what: dist for what, dist in needed.items() if canonical(dist) not in extra}
    assert missing == {}


def test_the_built_site_is_ignored_by_git():
    out = subprocess.run(["git", "check-ignore", "--no-index", "site/index.html"], cwd=ROOT,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, ".gitignore does not ignore site/"


def compose() -> dict[str, Any]:
    return dict(yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"])


def defaulted(text: str) -> str:
    """A compose value as it reads with no variable set: ``${X:-d}`` is d."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", text)


def test_every_published_compose_port_is_on_the_loopback_unless_told_and_movable():
    """Redis (no password here), Flower and Grafana are published on 127.0.0.1 only,
    unless BIND_ADDRESS says otherwise; a Redis of one's own on 6379 does not
    stop the stack: REDIS_PORT=6380."""
    published = [(name, str(port)) for name, service in compose().items()
                 for port in service.get("ports", [])]
    assert {name for name, _ in published} == {"redis", "flower", "grafana"}
    assert ("redis", "${BIND_ADDRESS:-127.0.0.1}:${REDIS_PORT:-6379}:6379") in published
    for name, port in published:
        parsed = re.fullmatch(r"(\$\{[^}]+\}|[^:]+):(\$\{[^}]+\}|\d+):(\d+)", port)
        assert parsed, (name, port)
        address, host_port, _ = parsed.groups()
        assert address == "${BIND_ADDRESS:-127.0.0.1}", (name, port)
        assert re.fullmatch(r"\$\{[A-Z_]+:-\d+\}", host_port), (name, port)
        assert defaulted(port).startswith("127.0.0.1:"), (name, port)


def test_flower_in_the_compose_stack_asks_for_a_password_from_the_environment():
    """Flower's pages and API answer only with basic auth, whose user:password
    comes from the environment (required: compose refuses to start without
    it), never from the file; its API is not opened without auth."""
    flower = compose()["flower"]
    env = flower["environment"]
    assert re.fullmatch(r"\$\{FLOWER_BASIC_AUTH:\?[^}]+\}", env["FLOWER_BASIC_AUTH"])
    assert "FLOWER_UNAUTHENTICATED_API" not in env
    assert not [arg for arg in flower["command"] if "auth" in arg]
    conf = flower["command"][flower["command"].index("flower") + 1:]
    assert "--conf=flowerconfig.py" in conf
    assert (ROOT / "examples" / "compose" / "flowerconfig.py").exists()


def dockerfile_stages() -> list[list[list[str]]]:
    """examples/compose/Dockerfile as stages, each a list of instructions (words)."""
    stages: list[list[list[str]]] = []
    for line in (ROOT / "examples" / "compose" / "Dockerfile").read_text().splitlines():
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if words[0].upper() == "FROM":
            stages.append([])
        stages[-1].append(words)
    return stages


def test_the_compose_image_installs_a_built_wheel_and_runs_as_a_user_without_privileges():
    """A stage builds the wheel; the image installs that wheel (no editable
    install, no source tree copied whole before an install), copies the
    example app, and runs as a user that is not root."""
    *builders, final = dockerfile_stages()
    assert builders, "the wheel is built in a stage of its own"
    assert any(w[0].upper() == "RUN" and "build" in w and "--wheel" in w
               for stage in builders for w in stage)
    for stage in dockerfile_stages():
        for words in stage:
            assert not (words[0].upper() == "RUN" and "-e" in words), words
            if words[0].upper() in ("COPY", "ADD"):
                assert [w for w in words[1:-1] if not w.startswith("--")] != ["."], words
    installs = [w for w in final if w[0].upper() == "RUN" and "install" in w]
    assert installs and all(any(a.endswith(".whl") for a in w) for w in installs), installs
    assert any(w[0].upper() == "COPY" and any(a.startswith("--from=") for a in w)
               for w in final)
    users = [w[1] for w in final if w[0].upper() == "USER"]
    assert users and users[-1] not in ("root", "0"), users


def dockerignore() -> list[tuple[bool, re.Pattern[str]]]:
    """The patterns as Docker reads them: anchored at the context's root, ``*``
    within one folder, ``**/`` any folders, ``!`` letting a path back in."""
    patterns = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        back_in = line.startswith("!")
        line = line.lstrip("!").strip("/")
        regex = re.escape(line).replace(r"\*\*/", "(.*/)?").replace(r"\*", "[^/]*")
        patterns.append((back_in, re.compile(regex.replace(r"\?", "[^/]"))))
    return patterns


def ignored(path: str, patterns: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """A path goes when the last pattern matching it, or a folder above it,
    is not a ``!`` one."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    out = False
    for back_in, pattern in patterns:
        if any(pattern.fullmatch(prefix) for prefix in prefixes):
            out = not back_in
    return out


def test_the_dockerignore_keeps_all_but_what_the_image_copies_out():
    """History, environments, caches, tests, docs and benchmarks stay out of
    the build context; every file a COPY names is in it, and nothing else is."""
    patterns = dockerignore()
    for junk in (".git/HEAD", ".venv/bin/python", "venv/bin/python", "venv-3.11/bin/python",
                 ".nox/oldest/bin/python", "site/index.html", "build/lib/x.py",
                 "dist/x.whl", "celery_singleton_lock.egg-info/PKG-INFO",
                 "celery_singleton_lock/__pycache__/task.cpython-311.pyc",
                 "tests/unit/x.pyc", ".pytest_cache/v", "tests/.mypy_cache/x",
                 ".ruff_cache/x", "tests/project/test_layout.py", "docs/index.md",
                 "benchmarks/results/results.json", "examples/beat/tasks.py"):
        assert ignored(junk, patterns), junk
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                             cwd=ROOT, capture_output=True, text=True, timeout=30,
                             check=True).stdout.splitlines()
    services = compose()
    dockerfiles = {(s["build"]["context"], s["build"]["dockerfile"])
                   for s in services.values() if "build" in s}
    assert dockerfiles
    copied: set[str] = set()
    for context, dockerfile in dockerfiles:
        assert context == ".", "the paths below are the repository's"
        for line in (ROOT / dockerfile).read_text().splitlines():
            words = line.split()
            if not words or words[0].upper() not in ("COPY", "ADD") or any(
                    w.startswith("--from=") for w in words):
                continue
            for source in (w for w in words[1:-1] if not w.startswith("--")):
                source = source.removeprefix("./").rstrip("/")
                files = [f for f in tracked if f == source or f.startswith(source + "/")]
                assert files, source
                assert [f for f in files if ignored(f, patterns)] == [], source
                copied.update(files)
    sent = {f for f in tracked if not ignored(f, patterns)}
    assert sent - copied == set(), "in the context, copied by nothing"
    for needed in ("pyproject.toml", "README.md", "LICENSE", "celery_singleton_lock/__init__.py",
                   "examples/compose/proj.py"):
        assert needed in copied and not ignored(needed, patterns), needed


#: a word in an entry's name that promises an interval, in seconds
PERIODS = {"minutely": 60, "hourly": 3600, "daily": 86400, "nightly": 86400,
           "weekly": 7 * 86400}
EVERY = re.compile(r"every-(\d+)(s|m|h|d)\b")
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def example_apps() -> list[tuple[Path, Celery]]:
    apps = []
    for path in sorted((ROOT / "examples").rglob("*.py")):
        if "beat_schedule" not in path.read_text():
            continue
        spec = importlib.util.spec_from_file_location(f"_example_{len(apps)}", path)
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        apps += [(path, app) for app in vars(module).values() if isinstance(app, Celery)]
    return apps


def seconds_of(schedule: Any) -> float:
    if isinstance(schedule, (int, float)):
        return float(schedule)
    if isinstance(schedule, dt.timedelta):
        return schedule.total_seconds()
    every = getattr(schedule, "run_every", None)
    assert isinstance(every, dt.timedelta), f"teach this test {type(schedule).__name__}"
    return every.total_seconds()


def test_every_example_beat_entry_runs_as_often_as_its_name_says():
    """An entry named hourly runs hourly; one named every-10s every 10 s."""
    apps = example_apps()
    assert {path.parent.name for path, _ in apps} >= {"compose", "beat"}
    checked = 0
    for path, app in apps:
        for name, entry in app.conf.beat_schedule.items():
            promised = [s for word, s in PERIODS.items() if word in name.lower()]
            promised += [int(n) * UNITS[u] for n, u in EVERY.findall(name.lower())]
            for seconds in promised:
                assert seconds_of(entry["schedule"]) == seconds, (str(path), name)
                checked += 1
    assert checked, "no entry says its interval"
