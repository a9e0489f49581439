"""The release as a stranger gets it: sdist and wheel built, checked, and the
wheel (not this checkout) installed in a fresh venv that runs the payment demo."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import venv
import zipfile
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

from celery_singleton_lock import __version__
from tests.support import ROOT

pytestmark = pytest.mark.worker


def run(*cmd: str, cwd: Path, timeout: float = 300, env: dict[str, str] | None = None) -> str:
    out = subprocess.run(list(cmd), cwd=cwd, capture_output=True, text=True, timeout=timeout,
                         env=env)
    assert out.returncode == 0, f"{cmd}:\n{out.stdout}\n{out.stderr}"
    return out.stdout


def source_files() -> list[str]:
    """The files of the source tree: tracked by git, or new and not ignored."""
    return subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                          cwd=ROOT, capture_output=True, text=True, timeout=30,
                          check=True).stdout.splitlines()


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``python -m build``: an sdist and a wheel, from a copy of the source
    tree as a fresh clone has it (no build leftovers such as an egg-info, whose
    file list setuptools would reuse); what the build printed in build.log."""
    pytest.importorskip("build")
    out = tmp_path_factory.mktemp("dist")
    tree = tmp_path_factory.mktemp("source")
    for name in source_files():
        if (ROOT / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tree / name)
    done = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(tree)],
                          cwd=out, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    (out / "build.log").write_text(done.stdout + done.stderr)
    return out


def project() -> dict[str, Any]:
    tomllib = pytest.importorskip("tomllib")
    parsed: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return parsed


def test_the_build_warns_of_no_deprecation_and_pins_the_setuptools_it_was_checked_with(
        dist: Path) -> None:
    """No deprecation from setuptools (a TOML-table license and a license
    classifier stop being supported in 2027); the build backend is a closed
    range with 77 (the SPDX license expression) at the bottom."""
    log = (dist / "build.log").read_text()
    assert not re.search(r"deprecat|superseded|no longer supported", log, re.IGNORECASE), log
    [requirement] = project()["build-system"]["requires"]
    spec = Requirement(requirement)
    assert spec.name == "setuptools" and "77.0.3" in spec.specifier
    assert {s.operator for s in spec.specifier} == {">=", "<"}, requirement


def test_the_metadata_names_the_license_by_spdx_and_the_projects_home(dist: Path) -> None:
    """METADATA says License-Expression: MIT, ships the LICENSE file and no
    license classifier, and has Project-URLs, the same home as mkdocs.yml's
    repo_url and the README's links."""
    wheel = next(dist.glob("*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        meta = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA")))
        assert any(n.endswith(".dist-info/licenses/LICENSE") for n in zf.namelist())
    fields = [line.split(": ", 1) for line in meta.decode().split("\n\n", 1)[0].splitlines()
              if ": " in line]
    assert ["License-Expression", "MIT"] in fields
    assert not [v for k, v in fields if k == "Classifier" and v.startswith("License ::")]
    urls = dict(v.split(", ", 1) for k, v in fields if k == "Project-URL")
    assert {"Homepage", "Documentation", "Source", "Issues", "Changelog"} <= set(urls)
    home = urls["Homepage"]
    assert re.fullmatch(r"https://github\.com/[\w.-]+/celery-singleton-lock", home), home
    assert f"repo_url: {home}\n" in (ROOT / "mkdocs.yml").read_text()
    for name, url in urls.items():
        assert url.startswith(home), (name, url)
        if "/blob/main/" in url:
            assert (ROOT / url.split("/blob/main/", 1)[1]).exists(), url


def test_the_readmes_links_work_on_an_index_page() -> None:
    """PyPI renders the README away from the repository: every link in it is
    absolute, and each one into the repository names a file that exists."""
    home = project()["project"]["urls"]["Homepage"]
    links = re.findall(r"\]\(([^)]+)\)", (ROOT / "README.md").read_text())
    assert links
    relative = [link for link in links if not re.match(r"https?://", link)]
    assert relative == [], relative
    into_repository = [link for link in links if link.startswith(f"{home}/blob/main/")]
    assert into_repository
    for link in into_repository:
        path = link.split("/blob/main/", 1)[1].split("#", 1)[0]
        assert (ROOT / path).exists(), link


def test_the_sdist_holds_every_file_git_tracks(dist: Path) -> None:
    """The sdist ships the tests, so it ships what they read too: the docs,
    the examples, the benchmarks, the compose stack, the CI script (every file
    git tracks)."""
    [sdist] = list(dist.glob("*.tar.gz"))
    with tarfile.open(sdist) as tar:
        shipped = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    missing = sorted(set(source_files()) - shipped)
    assert missing == [], missing


def test_sdist_and_wheel_pass_twine_check_and_carry_scripts_and_types(dist: Path) -> None:
    pytest.importorskip("twine")
    wheels = list(dist.glob("*.whl"))
    sdists = list(dist.glob("*.tar.gz"))
    assert [w.name for w in wheels] == [f"celery_singleton_lock-{__version__}-py3-none-any.whl"]
    assert [s.name for s in sdists] == [f"celery_singleton_lock-{__version__}.tar.gz"]
    run(sys.executable, "-m", "twine", "check", "--strict", *map(str, wheels + sdists), cwd=dist)
    names = zipfile.ZipFile(wheels[0]).namelist()
    lua = {n.rsplit("/", 1)[1] for n in names if n.startswith("celery_singleton_lock/engine/lua/")}
    shipped = {p.name for p in (ROOT / "celery_singleton_lock" / "engine" / "lua").glob("*.lua")}
    assert lua == shipped and shipped
    assert "celery_singleton_lock/py.typed" in names
    assert not [n for n in names if n.startswith(("tests/", "examples/", "benchmarks/"))]


@pytest.mark.long
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


@pytest.mark.long
def test_the_testing_pages_example_runs_green_with_only_the_package_and_pytest(
        dist: Path, tmp_path: Path) -> None:
    """docs/testing.md's test suite, written out as its blocks say, in a fresh
    venv holding the wheel and pytest and nothing else (no pytest-celery): it
    passes, printing what the page shows, and nothing of ours gets into
    pytest's own output."""
    from tests.project.test_docs import scenarios, shape

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


def test_getting_started_says_how_to_install_from_the_source_too() -> None:
    """Before a release reaches the index, `pip install celery-singleton-lock`
    finds nothing: the page's first install block is followed by the clone of
    the project's home and an install of that checkout."""
    page = (ROOT / "docs" / "getting-started.md").read_text()
    home = project()["project"]["urls"]["Homepage"]
    blocks = re.findall(r"```bash\n(.*?)```", page, flags=re.S)
    assert "pip install celery-singleton-lock" in blocks[0]
    assert f"git clone {home}.git\n" in blocks[1]
    assert "python -m pip install ./celery-singleton-lock" in blocks[1]
