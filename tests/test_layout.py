"""The repository has the shape its users know, and docker-compose.yml names
only modules, schedulers and scripts that exist (no container engine here:
the file is parsed and each thing it names is checked)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import yaml

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
