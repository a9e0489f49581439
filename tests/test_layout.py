"""The repository has the shape its users know, and docker-compose.yml names
only modules, schedulers and scripts that exist (no container engine here:
the file is parsed and each thing it names is checked). The docs extra holds
what the site needs."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from importlib.metadata import entry_points, packages_distributions

import pytest
import yaml
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
    for name, service in services.items():
        if name == "redis":
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
