"""The package and its benchmarks stay lint-clean (ruff) and typed (mypy --strict, py.typed)."""

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
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci.strip() == tests


def test_public_api_is_exactly_all():
    import celery_singleton_lock as pkg

    public = {n for n in vars(pkg) if not n.startswith("_")} - {
        "config", "exceptions", "keys", "lock", "heartbeat", "policies", "results", "task",
        "signals", "bootsteps", "annotations",
    }
    assert public == set(pkg.__all__) - {"__version__"}
