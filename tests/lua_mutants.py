"""Mutation testing of the Lua scripts, through the engine tests.

mutmut mutates Python only. This makes the same kind of small bug in a script
of ``celery_singleton_lock/engine/lua/`` (a comparison flipped or loosened, ``and``
for ``or``, an off-by-one), one at a time, in a copy of the repository, and
runs the engine tests there against a real redis-server; a mutant no test
fails on survives and is printed with its line::

    python -m tests.lua_mutants acquire_slots release      # the scripts to mutate
    python -m tests.lua_mutants --all                       # every script (long)

Arguments after ``--`` go to pytest (default: ``tests/engine/test_engine.py -x``).
CONTRIBUTING.md has the last run's figures.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LUA = Path("celery_singleton_lock") / "engine" / "lua"

#: (pattern, replacement): each match in a line of code is one mutant
OPERATORS: list[tuple[str, str]] = [
    (r"==", "~="),
    (r"~=", "=="),
    (r"(?<![<>=~])<(?!=)", "<="),
    (r"<=", "<"),
    (r"(?<![<>=~-])>(?!=)", ">="),
    (r">=", ">"),
    (r"\band\b", "or"),
    (r"\bor\b", "and"),
    (r"\+ 1\b", "+ 0"),
    (r"- 1\b", "- 0"),
    (r"\bnot ", ""),
]


@dataclass
class Mutant:
    script: str
    line: int
    before: str
    after: str

    def __str__(self) -> str:
        return f"{self.script}.lua:{self.line}: {self.before.strip()}  ->  {self.after.strip()}"


def mutants(script: str, text: str) -> list[Mutant]:
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        code = line.split("--", 1)[0]  # comments are not code
        for pattern, replacement in OPERATORS:
            for match in re.finditer(pattern, code):
                after = line[:match.start()] + replacement + line[match.end():]
                out.append(Mutant(script, n, line, after))
    return out


def run(scripts: list[str], pytest_args: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="lua-mutants-") as tmp:
        copy = Path(tmp) / "repo"
        shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(
            ".git", "mutants", "site", ".nox", "__pycache__", "*.egg-info", ".*_cache"))
        killed = survived = 0
        for script in scripts:
            path = copy / LUA / f"{script}.lua"
            original = path.read_text()
            lines = original.splitlines(keepends=True)
            for mutant in mutants(script, original):
                mutated = lines.copy()
                mutated[mutant.line - 1] = mutant.after + (
                    "\n" if lines[mutant.line - 1].endswith("\n") else "")
                path.write_text("".join(mutated))
                try:
                    done = subprocess.run(
                        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                         "-n", "0", *pytest_args], cwd=copy, capture_output=True, text=True,
                        timeout=900)
                finally:
                    path.write_text(original)
                if done.returncode == 0:
                    survived += 1
                    print(f"SURVIVED {mutant}", flush=True)
                else:
                    killed += 1
                    print(f"killed   {mutant}", flush=True)
        total = killed + survived
        print(f"{killed} of {total} mutants killed"
              + (f" ({100 * killed / total:.1f}%)" if total else ""))
        return 1 if survived else 0


def main() -> int:
    argv = sys.argv[1:]
    ours, pytest_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if (
        "--" in argv) else (argv, [])
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("scripts", nargs="*", help="script names, without .lua")
    parser.add_argument("--all", action="store_true", help="every script of lua/")
    args = parser.parse_args(ours)
    scripts = (sorted(p.stem for p in (ROOT / LUA).glob("*.lua")) if args.all
               else args.scripts)
    if not scripts:
        parser.error("name the scripts to mutate, or --all")
    return run(scripts, pytest_args or ["tests/engine/test_engine.py", "-x"])


if __name__ == "__main__":
    sys.exit(main())
