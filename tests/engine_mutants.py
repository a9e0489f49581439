"""Mutation testing of the modules that speak to Redis, through the tests that
run them against real servers.

``mutmut run`` at the top of the repository mutates the pure modules against
the pure tests (``[tool.mutmut]`` in ``pyproject.toml``). This runs mutmut on
one module that talks to a server (:data:`MODULES`) against the tests that
call it in-process against real ``redis-server`` processes, in a copy of the
repository whose ``[tool.mutmut]`` names that module and those tests::

    python -m tests.engine_mutants engine/native        # one module
    python -m tests.engine_mutants --all                # every module (long)
    python -m tests.engine_mutants engine/native --out build/mutants-native

mutmut runs, for each mutant, only the tests that called the mutated
function (it records them in a first run of the whole selection), so a
function reached only in a worker subprocess counts as "not checked" here:
its mutants are the worker tests' to kill (``tests/lua_mutants.py`` runs
those for the scripts). Logging calls are not mutated (a log line's wording
is not a promise of the engine). The copy is kept in ``--out`` (default
``build/engine-mutants/<module>``): ``cd`` there and ``mutmut show <name>``
gives a survivor's diff; ``survivors.txt`` there holds them all.
CONTRIBUTING.md has the last run's figures and what each survivor is.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "celery_singleton_lock"

ENGINE = "tests/engine/test_engine.py"
#: module (under the package, no ``.py``) -> the tests that run it in-process
MODULES: dict[str, list[str]] = {
    "engine/native": ["tests/engine/test_native.py", "tests/engine/test_valkey.py",
                      "tests/engine/test_late_requests.py", "tests/engine/test_token_ties.py",
                      "tests/engine/test_native_races.py"],
    "engine/calls": [ENGINE, "tests/engine/test_scripts.py",
                     "tests/engine/test_late_requests.py", "tests/checks/test_checks.py"],
    "engine/server": [ENGINE, "tests/engine/test_late_requests.py",
                      "tests/engine/test_token_ties.py", "tests/engine/test_wait.py",
                      "tests/engine/test_restart_race.py", "tests/engine/test_native.py",
                      "tests/engine/test_fork_and_outage.py",
                      "tests/engine/test_release_answer.py", "tests/engine/test_kv_ops.py"],
    "engine/wire": ["tests/engine/test_wire_in_step.py", "tests/engine/test_reply_errors.py",
                    "tests/engine/test_link.py", "tests/engine/test_fork_and_outage.py",
                    "tests/engine/test_clock_drift.py", "tests/engine/test_sentinel.py"],
    "engine/outage": ["tests/engine/test_fork_and_outage.py", "tests/engine/test_link.py",
                      "tests/engine/test_wire_in_step.py", "tests/engine/test_sentinel.py"],
    "engine/redlock/quorum": ["tests/engine/test_redlock.py"],
    "engine/redlock/engine": ["tests/engine/test_redlock.py"],
}

#: lines never mutated: what a log line says
DO_NOT_MUTATE = [r"^\s*(logger|log)\.(debug|info|warning|error|exception|log)\("]


def configure(copy: Path, module: str, tests: list[str]) -> None:
    """Point the copy's ``[tool.mutmut]`` at ``module`` and ``tests``."""
    path = copy / "pyproject.toml"
    text = path.read_text()
    block = "\n".join([
        "[tool.mutmut]",
        f'source_paths = ["{PACKAGE}"]',
        f"only_mutate = {json.dumps([f'{PACKAGE}/{module}.py'])}",
        f"do_not_mutate_patterns = {json.dumps(DO_NOT_MUTATE)}",
        'also_copy = ["docs"]',
        'pytest_add_cli_args = ["-n", "0", "-p", "no:cacheprovider", "-p", "no:randomly"]',
        f"pytest_add_cli_args_test_selection = {json.dumps(tests)}",
        "",
    ])
    text, n = re.subn(r"\[tool\.mutmut\]\n.*?(?=\n\[)", lambda _: block, text, flags=re.S)
    assert n == 1, "pyproject.toml has no [tool.mutmut] table"
    path.write_text(text)


def tally(copy: Path) -> dict[str, int]:
    """mutmut's verdicts, counted (``mutmut results --all true``: one
    ``name: status`` line per mutant)."""
    out = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"],
                         cwd=copy, capture_output=True, text=True, check=True).stdout
    counts: dict[str, int] = {}
    for line in out.splitlines():
        if ": " in line:
            status = line.rsplit(": ", 1)[1].strip()
            counts[status] = counts.get(status, 0) + 1
    return counts


def survivors(copy: Path) -> str:
    out = subprocess.run([sys.executable, "-m", "mutmut", "results"], cwd=copy,
                         capture_output=True, text=True, check=True).stdout
    names = [line.split(":")[0].strip() for line in out.splitlines()
             if line.strip().endswith(": survived")]
    shown = [subprocess.run([sys.executable, "-m", "mutmut", "show", name], cwd=copy,
                            capture_output=True, text=True).stdout for name in names]
    return "\n".join(shown)


def run(module: str, out: Path) -> int:
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(ROOT, out, ignore=shutil.ignore_patterns(
        ".git", "mutants", "site", "build", ".nox", "__pycache__", "*.egg-info", ".*_cache"))
    configure(out, module, MODULES[module])
    print(f"{module}.py against {' '.join(MODULES[module])} (in {out})", flush=True)
    subprocess.run([sys.executable, "-m", "mutmut", "run"], cwd=out, check=False)
    counts = tally(out)
    (out / "survivors.txt").write_text(survivors(out))
    total = sum(counts.values())
    print(f"{module}.py: {total} mutants, " +
          ", ".join(f"{n} {status}" for status, n in sorted(counts.items())), flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help=f"of {', '.join(MODULES)}")
    parser.add_argument("--all", action="store_true", help="every module")
    parser.add_argument("--out", type=Path, help="the copy (one module only)")
    args = parser.parse_args()
    modules = list(MODULES) if args.all else args.modules
    unknown = [m for m in modules if m not in MODULES]
    if not modules or unknown:
        parser.error(f"name modules of {', '.join(MODULES)}"
                     + (f" (not {', '.join(unknown)})" if unknown else ""))
    if args.out and len(modules) > 1:
        parser.error("--out takes one module")
    for module in modules:
        run(module, args.out or ROOT / "build" / "engine-mutants" / module.replace("/", "-"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
