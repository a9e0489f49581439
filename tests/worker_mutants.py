"""Mutation testing of the modules a worker, a beat or the command line runs,
through the tests that start them as real processes.

``mutmut run`` mutates the pure modules against the unit tests, and
``tests/engine_mutants.py`` the modules that talk to a server against the
tests that call them in-process; mutmut follows neither into a subprocess. The
modules here (what a worker does with a duplicate, the worker step, the
heartbeat, the beat schedulers, the monitor, the command line) are run by
``celery worker``, ``celery beat`` and ``celery singleton`` processes the
tests start. This makes the same kind of small bug in one of them (a
comparison flipped or loosened, ``and`` for ``or``, ``not`` dropped, ``is``
for ``is not``, a flag flipped, a number off by one), one at a time, in a copy
of the repository whose processes import the copy (``tests/support.py`` puts
it first on their ``PYTHONPATH``), and runs that module's tests
(:data:`MODULES`); a mutant no test fails on survives::

    python -m tests.worker_mutants conflict/outcomes             # every mutant
    python -m tests.worker_mutants worker/heartbeat --sample 40  # 40 drawn at random
    python -m tests.worker_mutants cli/purge --lines 61,70       # those lines only

A worker test takes seconds, so a module's every mutant takes hours:
``--sample N`` draws N of them (``--seed`` names the draw; the run prints it),
and the share killed estimates the module's score. Logging calls, strings and
comments are not mutated. A mutant is killed by the first test of the
selection that fails, if it fails again alone (``tests/lua_mutants.py``'s
rule; each kill names its test). CONTRIBUTING.md has the last run's figures.
"""

from __future__ import annotations

import argparse
import io
import random
import re
import sys
import tempfile
import tokenize
from pathlib import Path

from tests.lua_mutants import Mutant, repository_copy, score, try_each

PACKAGE = Path("celery_singleton_lock")

#: each module's tests (pytest arguments), fastest first: a mutant the first
#: ones kill costs only their run
MODULES: dict[str, list[str]] = {
    "conflict/outcomes": ["tests/conflict/test_duplicates.py", "tests/conflict/test_scopes.py",
                          "tests/conflict/test_backend_errors.py",
                          "tests/conflict/test_retry_clock.py",
                          "tests/conflict/test_throttle.py", "tests/conflict/test_rate.py",
                          "tests/conflict/test_rabbitmq_queues.py",
                          # a skip under worker events: Flower's SKIPPED, a chain sent on
                          "tests/observe/test_monitor.py", "tests/observe/test_flower.py"],
    "conflict/broker": ["tests/conflict/test_transport.py",
                        "tests/conflict/test_rabbitmq_queues.py"],
    "conflict/replacing": ["tests/conflict/test_replace.py"],
    "conflict/canvas": ["tests/conflict/test_duplicates.py", "tests/conflict/test_scopes.py"],
    "worker/step": ["tests/observe/test_monitor.py", "tests/checks/test_config_at_start.py",
                    "tests/lock/test_exit_paths.py"],
    "worker/heartbeat": ["tests/engine/test_engine.py", "tests/lock/test_exit_paths.py",
                         "tests/worker/test_freeze.py", "tests/engine/test_cluster.py", "-k",
                         "heartbeat or renewer or restarted or outage or exit_paths or freeze"
                         " or failed_round or renewed_nowhere or does_not_answer"],
    "worker/revoke": ["tests/lock/test_exit_paths.py", "tests/conflict/test_scopes.py",
                      "-k", "revoke"],
    "worker/signals": ["tests/lock/test_exit_paths.py", "tests/conflict/test_redelivery.py",
                       # a revoked or expired queued task frees its send-time key
                       "tests/conflict/test_scopes.py"],
    "beat/overlap": [
        # the virtual-clock tests of the overlap modes first (a second each)
        "tests/beat/test_beat.py::test_a_run_a_slow_worker_started_late_costs_the_next_tick_nothing",
        "tests/beat/test_beat.py::test_a_buffered_tick_older_than_a_tick_decided_since_is_dropped_not_sent",
        "tests/beat/test_beat.py::test_a_tick_waiting_for_a_late_run_is_skipped_if_that_run_outlasts_the_wait",
        "tests/beat/test_beat.py::test_a_late_ticks_run_a_worker_had_not_started_by_the_next_tick_costs_that_tick_nothing",
        "tests/beat/test_beat.py::test_a_late_ticks_run_granted_while_the_next_tick_looks_is_waited_for",
        "tests/beat/test_beat.py::test_a_late_ticks_run_granted_while_the_waiting_tick_looks_again_is_waited_for",
        "tests/beat/test_beat.py::test_a_run_in_the_way_without_a_run_marker_is_waited_for_until_it_ends",
        "tests/beat/test_beat.py::test_a_tick_decided_past_its_late_runs_wait_is_skipped_and_counted",
        "tests/beat/test_beat.py::test_a_late_note_redis_cannot_read_leaves_the_tick_decided_as_without_one",
        "tests/beat/test_beat.py::test_a_late_ticks_run_that_never_starts_holds_the_next_tick_until_the_one_after",
        "tests/beat/test_beat.py::test_a_late_ticks_run_that_ended_before_the_next_tick_costs_that_tick_no_wait",
        "tests/beat/test_beat_overlap.py", "tests/beat/test_buffer_all_scripts.py"],
    "beat/scheduler": ["tests/beat/test_beat.py", "tests/beat/test_beat_logs.py"],
    "beat/redbeat": ["tests/beat/test_beat_redbeat.py"],
    "observe/monitor": ["tests/observe/test_monitor.py", "tests/observe/test_counts_published.py",
                        "tests/observe/test_flower.py"],
    "observe/skiplog": ["tests/observe/test_log_lines.py"],
    "cli/purge": ["tests/cli/test_cli.py"],
    "cli/listing": ["tests/cli/test_cli.py"],
    "cli/commands": ["tests/cli/test_cli.py"],
}

#: operator tokens and what each becomes
SWAPS: dict[str, list[str]] = {
    "==": ["!="], "!=": ["=="], "<": ["<="], "<=": ["<"], ">": [">="], ">=": [">"],
    "and": ["or"], "or": ["and"], "True": ["False"], "False": ["True"],
    "+": ["-"], "-": ["+"],
}
#: a logical line beginning so says what happened; its wording is no promise
LOGGING = re.compile(r"^(logger|log|logging)\.(debug|info|warning|error|exception|log)$")


def _logical_lines(text: str) -> list[list[tokenize.TokenInfo]]:
    lines: list[list[tokenize.TokenInfo]] = [[]]
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
            lines.append([])
        elif tok.type not in (tokenize.NL, tokenize.COMMENT, tokenize.INDENT,
                              tokenize.DEDENT):
            lines[-1].append(tok)
    return [line for line in lines if line]


def mutants(name: str, text: str) -> list[Mutant]:
    """Every mutant of ``text`` (the module ``name``), one token changed each."""
    source = text.splitlines()
    out: list[Mutant] = []

    def change(start: tokenize.TokenInfo, end: tokenize.TokenInfo, after: str) -> None:
        row = start.start[0]
        if end.end[0] != row:
            return
        line = source[row - 1]
        out.append(Mutant(f"{name}.py", row, line,
                          line[:start.start[1]] + after + line[end.end[1]:]))

    for toks in _logical_lines(text):
        head = "".join(t.string for t in toks[:3])
        if LOGGING.match(head) or toks[0].string in ("import", "from", "def", "class", "@"):
            continue  # a def's annotations and defaults are kept: its body is not
        for i, tok in enumerate(toks):
            before = toks[i - 1] if i else None
            after = toks[i + 1] if i + 1 < len(toks) else None
            if tok.type in (tokenize.OP, tokenize.NAME) and tok.string in SWAPS:
                if tok.string in ("+", "-") and (before is None or (
                        before.type == tokenize.OP and before.string not in (")", "]", "}"))):
                    continue  # a sign, not a sum
                for text_after in SWAPS[tok.string]:
                    change(tok, tok, text_after)
            elif tok.string == "not" and after is not None:
                if after.string == "in":
                    change(tok, after, "in")
                elif before is None or before.string != "is":
                    change(tok, tok, "")  # "not x" -> " x"
            elif tok.string == "is" and after is not None:
                if after.string == "not":
                    change(tok, after, "is")
                else:
                    change(tok, tok, "is not")
            elif tok.type == tokenize.NUMBER and re.fullmatch(r"\d+", tok.string):
                change(tok, tok, str(int(tok.string) + 1))
    return out


def main() -> int:
    argv = sys.argv[1:]
    ours, pytest_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if (
        "--" in argv) else (argv, [])
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("modules", nargs="+", help=f"of {', '.join(MODULES)}")
    parser.add_argument("--sample", type=int, default=0,
                        help="draw this many mutants of each module at random")
    parser.add_argument("--seed", type=int, default=None, help="the draw (printed)")
    parser.add_argument("--lines", default="", help="only the mutants of these lines "
                        "(comma-separated numbers): a survivor tried again")
    parser.add_argument("--list", action="store_true", help="print the mutants, run nothing")
    args = parser.parse_args(ours)
    unknown = [m for m in args.modules if m not in MODULES]
    if unknown:
        parser.error(f"name modules of {', '.join(MODULES)} (not {', '.join(unknown)})")
    only = frozenset(int(n) for n in args.lines.split(",") if n.strip())
    seed = args.seed if args.seed is not None else random.randrange(1 << 32)
    killed = survived = 0
    with tempfile.TemporaryDirectory(prefix="worker-mutants-") as tmp:
        copy = repository_copy(tmp)
        for module in args.modules:
            path = copy / PACKAGE / f"{module}.py"
            found = mutants(module, path.read_text())
            if only:
                found = [m for m in found if m.line in only]
            if args.sample and args.sample < len(found):
                print(f"{module}.py: {args.sample} of {len(found)} mutants, seed {seed}")
                found = sorted(random.Random(f"{seed}:{module}").sample(found, args.sample),
                               key=lambda m: m.line)
            if args.list:
                print("\n".join(str(m) for m in found))
                continue
            selection = pytest_args or MODULES[module]
            print(f"{module}.py against {' '.join(selection)}", flush=True)
            k, s = try_each(copy, path, found, selection)
            killed, survived = killed + k, survived + s
    return 0 if args.list else score(killed, survived)


if __name__ == "__main__":
    sys.exit(main())
