"""Mutation testing of the Lua scripts, through the engine tests.

mutmut mutates Python only. This makes the same kind of small bug in a script
of ``celery_singleton_lock/engine/lua/`` (a comparison flipped or loosened, ``and``
for ``or``, an off-by-one), one at a time, in a copy of the repository, and
runs the engine tests there against a real redis-server; a mutant no test
fails on survives and is printed with its line::

    python -m tests.lua_mutants acquire_slots release      # the scripts to mutate
    python -m tests.lua_mutants --all                       # every script (long)
    python -m tests.lua_mutants reclaim --lines 57,60       # those lines' mutants only
    python -m tests.lua_mutants --arguments release renew   # KEYS/ARGV swapped, TTLs longer

Each script is run against the tests that call it (:data:`TESTS`; the engine
tests, ``tests/engine/test_engine.py``, for a script not named there); arguments
after ``--`` go to pytest instead, for every script named. ``-x`` is always
passed: a mutant is killed by its first failed test, if that test fails again
alone (each kill names it). CONTRIBUTING.md has the last run's figures.
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
from typing import Callable, Optional, Union

ROOT = Path(__file__).resolve().parent.parent
LUA = Path("celery_singleton_lock") / "engine" / "lua"

#: what a match becomes: one text, or a function giving every text it may become
Replacement = Union[str, Callable[["re.Match[str]"], list[str]]]


def _neighbours(match: re.Match[str]) -> list[str]:
    """``KEYS[2]`` -> ``KEYS[3]`` and ``KEYS[1]``: an argument read from the
    wrong index, the bug a caller and a script that disagree on the order make."""
    table, n = match.group(1), int(match.group(2))
    return [f"{table}[{m}]" for m in (n + 1, n - 1) if m >= 1]


def _longer(match: re.Match[str]) -> list[str]:
    """A TTL argument made ten times longer (a lock or counter kept too long)."""
    return [f"{match.group(1)}({match.group(2)}) * 10"]


#: (pattern, replacement) of comparisons and logic: each match in a line of
#: code is one mutant
OPERATORS: list[tuple[str, Replacement]] = [
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

#: arguments: a KEYS or ARGV index swapped with its neighbour's, a TTL given to
#: PX or PEXPIRE made longer (``--arguments``)
ARGUMENTS: list[tuple[str, Replacement]] = [
    (r"\b(KEYS|ARGV)\[(\d+)\]", _neighbours),
    # a name, an index or a number, not a call's name
    (r"('PX',\s*)([A-Za-z_][\w.\[\]]*|\d+)(?![\w.\[\](])", _longer),
    (r"('PEXPIRE',\s*[^,]+,\s*)([A-Za-z_][\w.\[\]]*|\d+)(?![\w.\[\](])", _longer),
]


ENGINE = "tests/engine/test_engine.py"
#: the engine tests but the one that takes and renews 10,000 locks (it guards
#: the chunking in Python, not a script; the others call renew.lua too)
ENGINE_TESTS = [ENGINE, "--deselect",
                ENGINE + "::test_renewing_ten_thousand_locks_goes_in_calls_of_a_bounded_size",
                # the clock and the counter made to meet; a request arriving late
                "tests/engine/test_token_ties.py", "tests/engine/test_late_requests.py"]
_OVERLAP = "tests/beat/test_beat_overlap.py::"
_ROLLOUT = "tests/keys/test_keys_meaning.py::"

#: the tests each script is run against (pytest arguments), fastest first: a
#: mutant the engine tests kill costs only their run
TESTS: dict[str, list[str]] = {
    "acquire": [*ENGINE_TESTS, "tests/conflict/test_throttle.py", "tests/conflict/test_rate.py",
                "tests/conflict/test_replace.py", "tests/conflict/test_scopes.py"],
    "enqueue": [*ENGINE_TESTS, "tests/conflict/test_replace.py", "tests/conflict/test_scopes.py"],
    "fence": [*ENGINE_TESTS, "tests/engine/test_redlock.py"],
    "beat_arrive": [
        "tests/beat/test_buffer_all_scripts.py",
        _OVERLAP + "test_buffer_all_runs_each_overlapping_tick_in_order_one_at_a_time_"
        "and_survives_kill_9",
        _OVERLAP + "test_buffer_all_keeps_order_one_at_a_time_when_worker_children_die",
        "tests/beat/test_beat_logs.py::test_a_buffer_all_backlog_is_capped_outlives_every_"
        "beat_and_drains_oldest_first"],
    "old_take": [
        "tests/keys/test_old_locks.py",
        _ROLLOUT + "test_during_a_rollout_the_old_key_lives_as_long_as_the_run_and_frees_"
        "after_a_kill",
        _ROLLOUT + "test_a_rollout_beside_the_old_library_runs_no_call_twice_at_once"],
}
#: slots written back after an empty restart (engine calls on a server of their own)
_SLOTS_BACK = ["tests/conflict/test_limit_restart.py::test_every_slot_is_written_back_after_"
               "an_empty_restart_and_none_is_given_away",
               "tests/conflict/test_limit_restart.py::test_without_a_restart_a_released_slot_"
               "is_still_lost"]
TESTS["acquire_slots"] = [*ENGINE_TESTS, *_SLOTS_BACK]
TESTS["reclaim"] = [*ENGINE_TESTS, *_SLOTS_BACK]
TESTS["beat_take"] = TESTS["beat_arrive"]
#: the prelude every script begins with: its token floor, rate window and deadline
TESTS["_record"] = [*ENGINE_TESTS, "tests/conflict/test_rate.py"]
TESTS["old_keep"] = TESTS["old_take"]


@dataclass
class Mutant:
    file: str  # as printed: the script's or module's file name
    line: int
    before: str
    after: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.before.strip()}  ->  {self.after.strip()}"


def mutants(script: str, text: str,
            operators: list[tuple[str, Replacement]] = OPERATORS) -> list[Mutant]:
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        code = line.split("--", 1)[0]  # comments are not code
        for pattern, replacement in operators:
            for match in re.finditer(pattern, code):
                texts = [replacement] if isinstance(replacement, str) else replacement(match)
                for text_after in texts:
                    after = line[:match.start()] + text_after + line[match.end():]
                    out.append(Mutant(f"{script}.lua", n, line, after))
    return out


def pytest(copy: Path, args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-n", "0", "-x", *args], cwd=copy, capture_output=True, text=True,
                          timeout=900)


def failed_test(output: str) -> Optional[str]:
    """The test that failed first, from pytest's short summary."""
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" - ", 1)[0].split(" ", 1)[1]
    return None


def verdict(copy: Path, selection: list[str]) -> Optional[str]:
    """None when the mutant in ``copy`` survives ``selection``; else what
    killed it. A failed test kills it only if it fails again alone: a test
    that measures time can fail on a loaded machine, mutant or not; when it
    passes alone the whole selection runs once more."""
    test = None
    for _ in range(2):
        done = pytest(copy, selection)
        if done.returncode == 0:
            return None
        test = failed_test(done.stdout)
        if test is None:  # no test ran to fail: an error at collection, a crash
            lines = done.stdout.strip().splitlines()
            return lines[-1] if lines else f"pytest exited {done.returncode}"
        if pytest(copy, [test]).returncode != 0:
            return test
    return f"{test}, failing beside the others only (twice)"


def try_each(copy: Path, path: Path, found: list[Mutant], selection: list[str],
             only: frozenset[int] = frozenset()) -> tuple[int, int]:
    """Each mutant of ``found`` written into ``path`` (a file of ``copy``, a copy
    of the repository) in turn, run against ``selection`` and taken out again; those
    of the lines ``only`` names when given. Prints each verdict; returns
    (killed, survived)."""
    original = path.read_text()
    lines = original.splitlines(keepends=True)
    killed = survived = 0
    for mutant in found:
        if only and mutant.line not in only:
            continue
        mutated = lines.copy()
        mutated[mutant.line - 1] = mutant.after + (
            "\n" if lines[mutant.line - 1].endswith("\n") else "")
        path.write_text("".join(mutated))
        try:
            by = verdict(copy, selection)
        finally:
            path.write_text(original)
        if by is None:
            survived += 1
            print(f"SURVIVED {mutant}", flush=True)
        else:
            killed += 1
            print(f"killed   {mutant}  [{by}]", flush=True)
    return killed, survived


def score(killed: int, survived: int) -> int:
    total = killed + survived
    print(f"{killed} of {total} mutants killed"
          + (f" ({100 * killed / total:.1f}%)" if total else ""))
    return 1 if survived else 0


def repository_copy(tmp: str) -> Path:
    """A copy of the repository to mutate, without what git and caches hold."""
    copy = Path(tmp) / "repo"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(
        ".git", "mutants", "site", "build", ".nox", "__pycache__", "*.egg-info", ".*_cache"))
    return copy


def run(scripts: list[str], pytest_args: list[str], only: frozenset[int] = frozenset(),
        operators: list[tuple[str, Replacement]] = OPERATORS) -> int:
    """Every mutant of ``scripts`` (of the lines ``only`` names, when given), each
    against its tests (``pytest_args`` when given, else :data:`TESTS`)."""
    with tempfile.TemporaryDirectory(prefix="lua-mutants-") as tmp:
        copy = repository_copy(tmp)
        killed = survived = 0
        for script in scripts:
            path = copy / LUA / f"{script}.lua"
            selection = pytest_args or TESTS.get(script, ENGINE_TESTS)
            print(f"{script}.lua against {' '.join(selection)}", flush=True)
            k, s = try_each(copy, path, mutants(script, path.read_text(), operators),
                            selection, only)
            killed, survived = killed + k, survived + s
        return score(killed, survived)


def main() -> int:
    argv = sys.argv[1:]
    ours, pytest_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if (
        "--" in argv) else (argv, [])
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("scripts", nargs="*", help="script names, without .lua")
    parser.add_argument("--all", action="store_true", help="every script of lua/")
    parser.add_argument("--lines", default="", help="only the mutants of these lines "
                        "(comma-separated numbers): a survivor tried again")
    parser.add_argument("--arguments", action="store_true", help="swap KEYS/ARGV indexes "
                        "and lengthen TTL arguments instead of flipping comparisons")
    args = parser.parse_args(ours)
    scripts = (sorted(p.stem for p in (ROOT / LUA).glob("*.lua")) if args.all
               else args.scripts)
    if not scripts:
        parser.error("name the scripts to mutate, or --all")
    only = frozenset(int(n) for n in args.lines.split(",") if n.strip())
    return run(scripts, pytest_args, only, ARGUMENTS if args.arguments else OPERATORS)


if __name__ == "__main__":
    sys.exit(main())
