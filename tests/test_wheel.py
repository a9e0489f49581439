"""The release as a stranger gets it: sdist and wheel built, checked, and the
wheel (not this checkout) installed in a fresh venv that runs the payment demo."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from celery_singleton_lock import __version__
from tests.support import ROOT

pytestmark = pytest.mark.worker


def run(*cmd: str, cwd: Path, timeout: float = 300, env: dict[str, str] | None = None) -> str:
    out = subprocess.run(list(cmd), cwd=cwd, capture_output=True, text=True, timeout=timeout,
                         env=env)
    assert out.returncode == 0, f"{cmd}:\n{out.stdout}\n{out.stderr}"
    return out.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``python -m build``: an sdist and a wheel, from a copy of the sources
    (the build leaves nothing in the checkout)."""
    pytest.importorskip("build")
    out = tmp_path_factory.mktemp("dist")
    run(sys.executable, "-m", "build", "--outdir", str(out), str(ROOT), cwd=out)
    return out


def test_sdist_and_wheel_pass_twine_check_and_carry_scripts_and_types(dist: Path) -> None:
    pytest.importorskip("twine")
    wheels = list(dist.glob("*.whl"))
    sdists = list(dist.glob("*.tar.gz"))
    assert [w.name for w in wheels] == [f"celery_singleton_lock-{__version__}-py3-none-any.whl"]
    assert [s.name for s in sdists] == [f"celery_singleton_lock-{__version__}.tar.gz"]
    run(sys.executable, "-m", "twine", "check", "--strict", *map(str, wheels + sdists), cwd=dist)
    names = zipfile.ZipFile(wheels[0]).namelist()
    lua = {n.rsplit("/", 1)[1] for n in names if n.startswith("celery_singleton_lock/lua/")}
    shipped = {p.name for p in (ROOT / "celery_singleton_lock" / "lua").glob("*.lua")}
    assert lua == shipped and shipped
    assert "celery_singleton_lock/py.typed" in names
    assert not [n for n in names if n.startswith(("tests/", "examples/", "benchmarks/"))]


def test_the_installed_wheel_runs_the_payment_demo(dist: Path, tmp_path: Path) -> None:
    """A fresh venv gets the wheel and its dependencies from the index; the demo
    is copied out and run from a temporary directory, so nothing of the
    checkout can be imported."""
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = str(env_dir / "bin" / "python")
    wheel = next(dist.glob("*.whl"))
    clean = {k: v for k, v in os.environ.items()
             if k not in ("PYTHONPATH", "REDIS_URL", "VIRTUAL_ENV")}
    clean["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    run(python, "-m", "pip", "install", "-q", str(wheel), cwd=tmp_path, env=clean, timeout=600)
    demo = tmp_path / "demo"
    shutil.copytree(ROOT / "examples" / "payment_callbacks", demo)
    where = run(python, "-c", "import celery_singleton_lock as m; print(m.__file__)",
                cwd=demo, env=clean)
    assert str(env_dir) in where and str(ROOT) not in where
    output = run(python, "run_demo.py", cwd=demo, env=clean, timeout=180)
    assert "Every order was paid exactly once." in output, output


def test_the_testing_pages_example_runs_green_with_only_the_package_and_pytest(
        dist: Path, tmp_path: Path) -> None:
    """docs/testing.md's test suite, written out as its blocks say, in a fresh
    venv holding the wheel and pytest and nothing else (no pytest-celery): it
    passes, printing what the page shows, and nothing of ours gets into
    pytest's own output."""
    from tests.test_docs import scenarios, shape

    [sc] = [s for s in scenarios() if s.id == "testing.md:user-tests"]
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = str(env_dir / "bin" / "python")
    clean = {k: v for k, v in os.environ.items()
             if k not in ("PYTHONPATH", "REDIS_URL", "VIRTUAL_ENV")}
    clean["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    run(python, "-m", "pip", "install", "-q", str(next(dist.glob("*.whl"))), "pytest",
        cwd=tmp_path, env=clean, timeout=600)
    installed = run(python, "-m", "pip", "list", "--format=freeze", cwd=tmp_path, env=clean)
    assert "pytest-celery" not in installed.lower() and "pytest_celery" not in installed.lower()
    suite = tmp_path / "suite"
    suite.mkdir()
    for name, text in sc.files.items():
        (suite / name).write_text(text)
    [code], [expected] = sc.runs, sc.outputs
    assert shape(run(python, "-c", code, cwd=suite, env=clean)) == shape(expected)
    out = subprocess.run([python, "-m", "pytest", "-p", "no:cacheprovider", *sc.files],
                         cwd=suite, env=clean, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    progress = out.stdout + out.stderr
    assert "lock Redis" not in progress and "celery_singleton_lock" not in progress, progress
