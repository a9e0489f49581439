"""The package stays lint-clean (ruff) and fully typed (mypy --strict, py.typed)."""

from __future__ import annotations

import subprocess
import sys

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
    pkg = ROOT / "src" / "celery_singleton_lock"
    assert (pkg / "py.typed").exists()
    assert {p.stem for p in (pkg / "lua").glob("*.lua")} >= {"acquire", "release", "renew",
                                                             "handoff"}
