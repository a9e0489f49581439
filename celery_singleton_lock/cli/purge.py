"""What ``celery singleton purge`` does with each key of a task, and what it
says. A running lock whose holder may still run (alive on this host, or on
another host) is kept unless ``--force``, as ``release`` keeps it: the rule is
the one ``release`` uses, a holder not provably dead is left alone. So is a
key taken when a task was sent (its task waits in the queue, and freeing the
key lets a duplicate be sent beside it), again as ``release`` keeps it. The
record of replaced calls is kept unless ``--force`` too: each superseded
caller was told its call was replaced, so its message must still be skipped.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Callable, Sequence

import click

from .listing import Row, echo_json, table

WOULD_DELETE = "would delete"
WOULD_KEEP = "would keep: may run"
DELETED = "deleted"
KEPT_ALIVE = "kept: may run"
WOULD_KEEP_QUEUED = "would keep: queued"
KEPT_QUEUED = "kept: queued"
CHANGED = "changed hands: kept"
WOULD_KEEP_TOLD = "would keep: callers told"
KEPT_TOLD = "kept: callers told"


def needs_force(row: Row) -> bool:
    """A running lock whose holder is not provably dead: ``release`` refuses it
    without ``--force``, and so does ``purge``. With Redlock, a record on fewer
    than a majority of the masters is not held (a grant being given back, a
    master that missed a release): it goes without ``--force``."""
    return row.state == "run" and row.live != "dead" and row.held()


def queued(row: Row) -> bool:
    """A key taken when its task was sent: the task waits in the queue (or was
    lost with it; nothing here can tell). ``release`` frees it only with
    ``--force``, and so does ``purge``."""
    return row.state == "queued"


def purge_rows(rows: Sequence[Row], yes: bool, force: bool,
               free: Callable[[Row], bool]) -> list[dict[str, Any]]:
    """One entry per row with what was (or, without ``yes``, would be) done."""
    outcome: list[dict[str, Any]] = []
    for row in rows:
        keep = needs_force(row) and not force
        if row.state == "replaced" and not force:
            action = KEPT_TOLD if yes else WOULD_KEEP_TOLD
        elif queued(row) and not force:
            action = KEPT_QUEUED if yes else WOULD_KEEP_QUEUED
        elif not yes:
            action = WOULD_KEEP if keep else WOULD_DELETE
        elif keep:
            action = KEPT_ALIVE
        else:
            action = DELETED if free(row) else CHANGED
        outcome.append({**asdict(row), "action": action})
    return outcome


def report(task_name: str, outcome: list[dict[str, Any]], yes: bool, force: bool,
           as_json: bool) -> bool:
    """Print the outcome; True when a key was kept, or a dry run would keep one
    (exit code 1, as a refused ``release``): a dry run exits as ``--yes``
    would, and both name the keys that go and say when none does."""
    alive = [e for e in outcome if e["action"] in (KEPT_ALIVE, WOULD_KEEP)]
    told = [e for e in outcome if e["action"] in (KEPT_TOLD, WOULD_KEEP_TOLD)]
    waiting = [e for e in outcome if e["action"] in (KEPT_QUEUED, WOULD_KEEP_QUEUED)]
    kept = any(e["action"] in (KEPT_ALIVE, KEPT_QUEUED, CHANGED, WOULD_KEEP, WOULD_KEEP_QUEUED)
               for e in outcome)
    if as_json:
        echo_json({"task": task_name, "dry_run": not yes, "force": force, "keys": outcome})
        return kept
    if not outcome:
        click.echo(f"no keys of task {task_name!r}")
        return False
    click.echo(table(["ACTION", "KEY", "STATE", "HOLDER", "LIVE"],
                     [[e["action"], e["key"], e["state"], e["holder"], e["live"]]
                      for e in outcome]))
    if alive:
        click.echo(f"{'kept' if yes else 'would keep'} {len(alive)} lock(s) whose holder may "
                   "still run (alive on this host, or on another host): "
                   + ", ".join(e["key"] for e in alive)
                   + "; pass --force to free them too (their holders then see their locks lost)")
    if waiting:
        click.echo(f"{'kept' if yes else 'would keep'} {len(waiting)} key(s) taken when their "
                   "task was sent, which waits in the queue: "
                   + ", ".join(e["key"] for e in waiting)
                   + "; pass --force to free them too (a duplicate may then be sent beside "
                     "a queued task)")
    if told:
        click.echo(f"{'kept' if yes else 'would keep'} {len(told)} record(s) of replaced calls "
                   "until they expire: their callers were told, and a superseded message "
                   "reaching a worker is still skipped; --force deletes them (such a "
                   "message then runs with its old arguments)")
    goes = sum(e["action"] == (DELETED if yes else WOULD_DELETE) for e in outcome)
    if not goes:
        click.echo(f"{'' if yes else 'dry run: '}nothing to delete")
    elif yes:
        click.echo(f"deleted {goes} key(s)")
    else:
        click.echo(f"dry run: nothing deleted; pass --yes to delete these {goes} key(s)")
    return kept
