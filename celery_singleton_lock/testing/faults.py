"""A fault kit for your own tests: prove at-most-once for your tasks, on a real
Redis and a real worker, through the faults that break it elsewhere.

* :class:`FaultWorker`: ``celery -A <your app> worker`` as a subprocess that
  records every execution of a ``SingletonTask``'s body (its key, task id,
  fencing token, process, start and end) in a file, and can kill with
  ``kill -9`` the pool process running a given task.
* :func:`frozen` and :func:`restart`: the lock Redis stopped with SIGSTOP for a
  while, or killed and started again empty.
* :func:`assert_at_most_once` (:func:`assert_no_overlap`): fails when two runs
  of one key overlapped (more than ``limit``, with ``singleton_limit``),
  listing them; or of the same work, as a function of the call's arguments
  says (``by=``), whatever key the task was given; and when no run was
  recorded at all (``expect_runs=0`` says none should run).

The recording wraps each singleton task's body in the worker's processes
(``task.run``, inside the lock: what is recorded is what ran under it), with
the call's arguments as the body got them (in kombu's JSON; the record file is
the test's own: nothing of them reaches Redis, a log or an event). A run
whose process was killed through the kit ends when it was killed; one whose
process died otherwise without ending is taken as still running, so a
violation is never hidden. Times are the host's clock (one machine).

Imported from :mod:`celery_singleton_lock.testing` too.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

from .processes import CeleryWorker, RedisServer, wait_for

#: the worker's environment variable naming the file it records runs in
RECORD_ENV = "SINGLETON_RECORD_FILE"


@dataclass(frozen=True)
class Run:
    """One execution of a singleton task's body."""

    key: str  #: the lock key (``task.singleton.key``)
    task: str  #: the task's name
    task_id: str
    token: int  #: its fencing token (0: it ran without a lock)
    slot: int
    pid: int
    start: float  #: time.time() when the body started
    end: Optional[float]  #: when it ended (returned, raised, or was killed); None: running
    outcome: str  #: "returned", "raised", "killed" or "running"
    #: the call's positional and keyword arguments, as the body got them
    args: tuple[Any, ...] = field(default=(), hash=False)
    kwargs: dict[str, Any] = field(default_factory=dict, hash=False)
    #: False when they could not be written in JSON (``by=`` cannot group it)
    call_recorded: bool = field(default=True, hash=False)

    def overlaps(self, other: Run) -> bool:
        inf = float("inf")
        return self.start < (other.end or inf) and other.start < (self.end or inf)

    def __str__(self) -> str:
        end = "still running" if self.end is None else f"{self.end:.3f}"
        return (f"{self.task}[{self.task_id}] key {self.key} token {self.token} pid {self.pid}: "
                f"{self.start:.3f} .. {end} ({self.outcome})")


# -- in the worker: recording -----------------------------------------------------------


def _write(path: str, event: dict[str, Any]) -> None:
    """One line, appended in one write: lines of processes never interleave."""
    line = (json.dumps(event) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def _call_of(args: Sequence[Any], kwargs: dict[str, Any]) -> Optional[str]:
    """The call's arguments in kombu's JSON (dates, UUIDs, decimals come back as
    such); None when a value has no JSON form."""
    from kombu.utils.json import dumps

    try:
        return str(dumps([list(args), kwargs]))  # type: ignore[no-untyped-call]
    except (TypeError, ValueError):
        return None


def _lock_of(task: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[str, int, int]:
    """(key, token, slot) of the execution running now; token 0 without a lock."""
    from ..lock import REQUEST_ATTR

    lock = getattr(task.request, REQUEST_ATTR, None)
    if lock is not None and getattr(lock, "held", False):
        return str(lock.key), int(lock.token), int(getattr(lock, "slot", 1) or 1)
    return str(task.singleton_keys(*args, **kwargs).base), 0, 0


def record_task(task: Any, path: str) -> None:
    """Wrap ``task``'s body so each execution is recorded in ``path`` (once per task)."""
    if getattr(task.run, "_singleton_recorded", False):
        return
    body = task.run

    @functools.wraps(body)
    def run(*args: Any, **kwargs: Any) -> Any:
        key, token, slot = _lock_of(task, args, kwargs)
        event = {"key": key, "task": task.name, "id": task.request.id, "token": token,
                 "slot": slot, "pid": os.getpid()}
        _write(path, {**event, "ev": "start", "at": time.time(),
                      "call": _call_of(args, kwargs)})
        outcome = "raised"
        try:
            result = body(*args, **kwargs)
            outcome = "returned"
            return result
        finally:
            _write(path, {**event, "ev": "end", "outcome": outcome, "at": time.time()})

    run._singleton_recorded = True  # type: ignore[attr-defined]
    task.run = run


def install_recorder(path: str) -> None:
    """Record every singleton task this process runs (and the processes it forks)."""
    from celery import signals

    from ..worker.signals import is_singleton

    def wrap(sender: Any = None, task: Any = None, **_: Any) -> None:
        if task is not None and is_singleton(task):
            record_task(task, path)

    signals.task_prerun.connect(wrap, weak=False)


def main() -> None:
    """``python -m celery_singleton_lock.testing.faults <celery's arguments>``: Celery's
    command line, recording runs in the file ``SINGLETON_RECORD_FILE`` names."""
    path = os.environ.get(RECORD_ENV)
    if path:
        install_recorder(path)
    from celery.__main__ import main as celery_main

    sys.argv[0] = "celery"
    celery_main()


# -- in the test: reading -------------------------------------------------------------


def _events(path: Union[str, Path]) -> list[dict[str, Any]]:
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    # a line cut short (its process killed in the write) is left out
    out = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def recorded_runs(path: Union[str, Path]) -> list[Run]:
    """The runs recorded in ``path``, in the order they started."""
    starts: dict[tuple[str, int], dict[str, Any]] = {}
    ends: dict[tuple[str, int], dict[str, Any]] = {}
    killed: dict[int, float] = {}
    order: list[tuple[str, int]] = []
    for event in _events(path):
        if event["ev"] == "killed":
            killed.setdefault(int(event["pid"]), float(event["at"]))
            continue
        ident = (str(event["id"]), int(event["pid"]))
        if event["ev"] == "start":
            # the same task id again in the same process: a retry, a run of its own
            while ident in starts:
                ident = (ident[0] + "'", ident[1])
            starts[ident] = event
            order.append(ident)
        elif event["ev"] == "end":
            open_ids = [i for i in order if i[1] == ident[1] and i[0].rstrip("'") == ident[0]
                        and i not in ends]
            if open_ids:
                ends[open_ids[0]] = event
    from kombu.utils.json import loads

    runs = []
    for ident in order:
        s, e = starts[ident], ends.get(ident)
        if e is not None:
            end, outcome = float(e["at"]), str(e["outcome"])
        elif s["pid"] in killed and killed[s["pid"]] >= s["at"]:
            end, outcome = killed[s["pid"]], "killed"
        else:
            end, outcome = None, "running"
        call = s.get("call")
        args, kwargs = loads(call) if call else ((), {})  # type: ignore[no-untyped-call]
        runs.append(Run(key=s["key"], task=s["task"], task_id=s["id"], token=s["token"],
                        slot=s["slot"], pid=s["pid"], start=float(s["at"]), end=end,
                        outcome=outcome, args=tuple(args), kwargs=dict(kwargs),
                        call_recorded=call is not None))
    return runs


RunSource = Union["FaultWorker", str, Path, Iterable[Run]]


def _runs_of(source: RunSource) -> list[Run]:
    if isinstance(source, FaultWorker):
        return source.runs()
    if isinstance(source, (str, Path)):
        return recorded_runs(source)
    return list(source)


def _work_of(run: Run, by: Callable[..., Any]) -> Any:
    """What ``by`` says ``run`` worked on, as a dict key."""
    if not run.call_recorded:
        raise AssertionError(f"by= cannot group {run}: its arguments had no JSON form")
    try:
        work = by(*run.args, **run.kwargs)
    except TypeError as exc:
        raise AssertionError(f"by= does not take the arguments of {run} ({exc}); "
                             "task= checks one task's runs") from exc
    try:
        hash(work)
    except TypeError:
        return repr(work)
    return work


def assert_at_most_once(source: RunSource, *, limit: int = 1,
                        by: Optional[Callable[..., Any]] = None,
                        task: Optional[str] = None,
                        expect_runs: Optional[int] = None) -> list[Run]:
    """No more than ``limit`` runs of one key at any moment (1: no two overlap).

    ``source``: a :class:`FaultWorker`, a record file, or runs. ``by``: a
    function of a call's arguments (called as the task is, ``by(*args,
    **kwargs)``) saying which work it does; runs are then grouped by its value
    instead of by their lock key, so a key that names the wrong argument fails
    too. ``task``: only the runs of the task of that name. ``expect_runs``: how
    many runs there must be; by default at least one, since a check of no run
    proves nothing (a task without ``base=SingletonTask`` is not recorded).

    Returns the runs checked; raises AssertionError listing every group of
    runs that overlapped.
    """
    runs = [r for r in _runs_of(source) if task is None or r.task == task]
    of = f" of {task}" if task else ""
    if expect_runs is None and not runs:
        raise AssertionError(
            f"no run{of} was recorded, so nothing was checked: is the task a SingletonTask "
            "(base=SingletonTask) run by a FaultWorker? (expect_runs=0 says none should run)")
    if expect_runs is not None and len(runs) != expect_runs:
        raise AssertionError(f"{len(runs)} run(s){of} recorded, expected {expect_runs}")
    groups: dict[Any, list[Run]] = {}
    for run in runs:
        groups.setdefault(run.key if by is None else _work_of(run, by), []).append(run)
    found: list[tuple[Any, list[Run]]] = []
    for group, group_runs in groups.items():
        group_runs.sort(key=lambda r: r.start)
        for i, run in enumerate(group_runs):
            # the runs under way when this one started, this one included
            under_way = [r for r in group_runs[:i + 1] if r.overlaps(run) or r is run]
            if len(under_way) > limit:
                found.append((group, under_way))
    if found:
        what = "one key" if by is None else "the same work"
        lines = []
        for group, under_way in found:
            lines.append("  overlapping:" if by is None else f"  overlapping, work {group!r}:")
            lines.extend(f"    {r}" for r in under_way)
        raise AssertionError(f"{len(found)} time(s) more than {limit} run(s) of {what} at "
                             f"once:\n" + "\n".join(lines))
    return runs


def assert_no_overlap(source: RunSource, *, by: Optional[Callable[..., Any]] = None,
                      task: Optional[str] = None,
                      expect_runs: Optional[int] = None) -> list[Run]:
    """No two runs of one key (or of the same work, ``by``) overlapped:
    :func:`assert_at_most_once` with limit 1."""
    return assert_at_most_once(source, limit=1, by=by, task=task, expect_runs=expect_runs)


# -- in the test: faults ----------------------------------------------------------------


class FaultWorker(CeleryWorker):
    """:class:`CeleryWorker` that records every singleton run (:func:`recorded_runs`)
    and kills the pool process of a given run.

    ``record``: the file runs are recorded in (a new temporary file by default).
    The rest is :class:`CeleryWorker`'s: ``app`` as ``-A`` takes it, ``env``
    added to the worker's environment (your app's Redis URLs, say).
    """

    def __init__(self, app: str, queue: str = "celery", *, record: Optional[str] = None,
                 **kwargs: Any) -> None:
        super().__init__(app, queue, **kwargs)
        self.record = Path(record or tempfile.mkstemp(prefix="singleton-runs-",
                                                      suffix=".jsonl")[1])
        self.env[RECORD_ENV] = str(self.record)
        # this interpreter's flags (-S, -I) hold for the worker too
        flags = ["-S"] if sys.flags.no_site else []
        self.cmd[1:3] = [*flags, "-m", "celery_singleton_lock.testing.faults"]

    def runs(self) -> list[Run]:
        return recorded_runs(self.record)

    def running(self, task_id: Optional[str] = None) -> list[Run]:
        """The runs under way now (of ``task_id`` only, if given)."""
        return [r for r in self.runs() if r.end is None
                and (task_id is None or r.task_id == task_id)]

    def note_killed(self, pid: int) -> None:
        """Record that ``pid`` was killed now (for a kill made without the kit)."""
        _write(str(self.record), {"ev": "killed", "pid": pid, "at": time.time()})

    def kill_running(self, task_id: Optional[str] = None, timeout: float = 30.0) -> Run:
        """``kill -9`` the pool process running ``task_id`` (or any run), once
        it has started; returns that run."""
        run: Run = wait_for(lambda: next(iter(self.running(task_id)), None), timeout,
                            what=f"a run of {task_id or 'any task'} to start")
        os.kill(run.pid, signal.SIGKILL)
        self.note_killed(run.pid)
        return run

    def kill_all(self) -> None:
        """kill -9 the whole worker, its runs ending now."""
        for pid in self.children():
            self.note_killed(pid)
        if self.proc is not None:
            self.note_killed(self.pid)
        super().kill_all()


@contextlib.contextmanager
def frozen(server: RedisServer) -> Iterator[RedisServer]:
    """The Redis stopped with SIGSTOP for the block (connections stay open,
    nothing answers), then SIGCONT."""
    server.pause()
    try:
        yield server
    finally:
        server.resume()


def restart(server: RedisServer) -> RedisServer:
    """Kill the Redis (``kill -9``) and start it again on its port, empty."""
    server.stop()
    return server.start()


if __name__ == "__main__":
    main()
