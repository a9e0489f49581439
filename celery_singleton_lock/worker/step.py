"""The worker step: checks every setting at start, wires the signals and the
revoke command, reports the lock backend and the held locks in ``celery
inspect stats`` (Flower's worker page), and answers ``celery inspect
singleton_locks``; and the request class that tells a pool process whether
task events are on now."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from typing import Any, Optional

import redis
from celery import bootsteps
from celery import signals as celery_signals
from celery.worker.control import inspect_command
from celery.worker.request import Request

from ..checks import doctor as checks
from ..config import get_config
from ..conflict.outcomes import CLOCK_HEADER
from ..engine.registry import engine_for
from ..exceptions import ConfigurationError
from ..observe import masking, monitor
from ..urls import mode_of
from . import signals
from .revoke import watch_revoke_command

logger = logging.getLogger("celery_singleton_lock")

#: how the start-up line names each kind of lock Redis (docs/deployments.md)
MODES = {"standalone": "standalone", "sentinel": "Sentinel", "cluster": "Cluster",
         "redlock": "Redlock"}


def validate_app(app: Any) -> None:
    """Raise ConfigurationError for the first bad app setting or task option."""
    get_config(app, reload=True)
    for task in list(app.tasks.values()):
        if signals.is_singleton(task):
            task.singleton_settings(reload=True)


def check_served(app: Any, engine: Any) -> None:
    """Raise ConfigurationError for the first task whose options the lock
    Redis cannot serve (one that runs no script: options only a script
    carries out), naming the task and its settings. A Redis that does not
    answer yet is not asked: every task's calls then follow
    ``singleton_on_backend_error`` anyway."""
    try:
        how, scripts = engine.lock_path()
    except redis.RedisError:
        return
    if scripts:
        return
    for task in sorted(app.tasks.values(), key=lambda t: str(t.name)):
        if not signals.is_singleton(task):
            continue
        names = engine.unserved(task.singleton_settings().config)
        if names:
            raise ConfigurationError(
                names[0], f"task {task.name!r}: the lock Redis runs no script ({how}), and "
                          f"{', '.join(names)} {'needs' if len(names) == 1 else 'need'} one: "
                          "allow EVALSHA and SCRIPT LOAD to its user, or drop the option "
                          "(docs/deployments.md#native-commands)")


#: the longest ``celery inspect stats`` (Flower polls it) waits for the lock
#: Redis: the worker's main loop answers it, and must not stall on a slow Redis
MONITOR_WAIT = 0.5

_reading: Optional[Future[dict[str, Any]]] = None
_reading_lock = threading.Lock()


def _read_held(app: Any, hostname: str) -> dict[str, Any]:
    config = get_config(app)
    engine = engine_for(app)
    try:
        locks = monitor.read_held(engine, config.key_prefix, hostname)
        totals = monitor.worker_totals(engine, config.key_prefix, hostname)
    except redis.RedisError as exc:
        return {"held": None, "locks": [], "error": f"lock Redis: {type(exc).__name__}"}
    return {"held": len(locks), "locks": locks, **totals}


def held_locks(app: Any, hostname: str, wait: float = MONITOR_WAIT) -> dict[str, Any]:
    """What ``hostname`` holds: its pool children publish their held locks to
    the lock Redis each :data:`monitor.PUBLISH_INTERVAL`; read in one call.

    Read in a thread and waited for at most ``wait`` seconds: a lock Redis
    that does not answer gives ``held: None`` ("unknown") with the reason,
    and while an earlier read is still waiting no second one starts.
    """
    global _reading
    if engine_for(app).down:
        return {"held": None, "locks": [], "error": "lock Redis: not answering"}
    with _reading_lock:
        reading = _reading
        if reading is None or reading.done():
            reading = _reading = Future()
            threading.Thread(target=_fill, args=(reading, app, hostname),
                             name="singleton-stats-read", daemon=True).start()
    try:
        return reading.result(timeout=wait)
    except FutureTimeout:
        return {"held": None, "locks": [],
                "error": f"lock Redis: no answer within {wait} s"}


def _fill(future: Future[dict[str, Any]], app: Any, hostname: str) -> None:
    try:
        future.set_result(_read_held(app, hostname))
    except BaseException as exc:
        future.set_exception(exc)


#: how long this process trusts its estimate of the lock Redis's clock offset
OFFSET_FOR = 60.0
_offsets: dict[int, tuple[float, Optional[float]]] = {}


def clock_offset_of(app: Any) -> Optional[float]:
    """The lock Redis's clock less this host's (seconds), asked of the app's
    engine at most every :data:`OFFSET_FOR` seconds (the first time, a
    connection of the engine reads the server's clock); None when it cannot
    be had."""
    now = time.monotonic()
    cached = _offsets.get(id(app))
    if cached is not None and now - cached[0] < OFFSET_FOR:
        return cached[1]
    try:
        offset = engine_for(app).clock_offset(ask=True)
    except redis.RedisError:
        offset = None
    _offsets[id(app)] = (now, offset)
    return offset


class SingletonRequest(Request):  # type: ignore[misc]
    """A singleton task's request in the worker's main process
    (``SingletonTask.Request``).

    Task events can be switched on after the pool forked: Flower sends
    ``enable_events`` to every worker it sees, ``celery control enable_events``
    does the same. The main process then sends ``task-succeeded`` for every
    task, while a pool process still knows only whether ``-E`` was given.
    Handing a task to the pool, this tells it whether its own task events
    would go out now, so a skip ends as SKIPPED in Flower whenever Celery
    would have sent its ``task-succeeded``."""

    @property
    def eta(self) -> Any:
        """Celery's ETA, timed on the lock Redis's clock where the sender said
        how far its own clock was from it (``singleton_clock``, on every
        request the library sends again to wait): the ETA moved by the
        difference of the two offsets. A sender or a worker whose clock is off
        by 30 s then waits the wait asked for, not 30 s more or none."""
        eta = super().eta
        sent = self._request_dict.get(CLOCK_HEADER) if eta is not None else None
        if sent is None:
            return eta
        mine = clock_offset_of(self.task.app)
        if mine is None:
            return eta
        try:
            return eta + timedelta(seconds=float(sent) - mine)
        except (TypeError, ValueError, OverflowError):
            return eta

    @property
    def request_dict(self) -> dict[str, Any]:
        request: dict[str, Any] = self._request_dict
        eventer = self._eventer
        request[monitor.EVENTS_FIELD] = bool(
            eventer is not None and eventer.enabled and self.task.send_events
            and (not eventer.groups or "task" in eventer.groups))
        return request


class SingletonStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Added to every app that has a SingletonTask; runs in the main worker process
    (pool children fork from it, so they inherit the wiring).

    A StartStopStep (with nothing to start) because only those are listed in the
    worker's steps, and only listed steps have their ``info()`` in ``stats``."""

    name = "celery_singleton_lock"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        masking.install()
        try:
            validate_app(parent.app)
            # Made here, in the main thread, before the pool forks: the reaper
            # thread then only looks it up.
            engine = engine_for(parent.app)
            # A wrong password or a missing ACL permission would fail every lock
            # call for as long as the worker runs: say so now, and stop.
            checks.startup_check(engine, rate=checks.uses_rate(parent.app))
            check_served(parent.app, engine)
        except ConfigurationError as exc:
            logger.critical("celery-singleton-lock: %s", exc)
            raise SystemExit(f"celery-singleton-lock configuration error: {exc}") from None
        config = engine.config
        logger.info("celery-singleton-lock: locks in %s (%s), lease %g s",
                    masking.mask_url(config.redis_url), MODES[mode_of(config.redis_url)],
                    config.ttl)
        signals.connect()
        watch_revoke_command()
        # Before the pool forks: children label their counts with this node
        # name and send task-skipped only when task events are on (-E).
        monitor.configure_worker(parent.hostname, getattr(parent, "task_events", False))
        celery_signals.worker_process_shutdown.connect(
            _flush_stats, weak=False, dispatch_uid="celery_singleton_lock.flush_stats")

    def info(self, parent: Any) -> dict[str, Any]:
        config = get_config(parent.app)
        return stats_rows(held_locks(parent.app, parent.hostname),
                          masking.mask_url(config.redis_url), config.ttl)


#: the ``stats`` entry that sums up a worker's locks (the others are one per lock)
SUMMARY_ROW = "singleton locks"


def stats_rows(held: dict[str, Any], url: str, ttl: float) -> dict[str, str]:
    """What ``celery inspect stats`` carries of the locks, laid out for
    Flower's worker page, whose tab Other shows each top-level entry as a
    row of text (and a nested value as its Python repr): one row summing up
    the worker's locks, then one per held lock, ordered by key and slot and
    labelled by them, with its task, holder id, token, age and pid.

    ``celery inspect singleton_locks`` gives the same as data, for scripts."""
    if held["held"] is None:
        summary = f"unknown ({held.get('error', 'lock Redis: no answer')}); locks in {url}"
    else:
        summary = (f"{held['held']} held, in {url}, lease {ttl:g} s; since the counters "
                   f"began: {held.get('lost', 0)} lost, {held.get('renew_failed', 0)} "
                   "renewals failed")
    rows = {SUMMARY_ROW: summary}
    for lock in sorted(held["locks"], key=lambda lock: (lock["key"], lock.get("slot", 1))):
        rows[f"{lock['key']} slot {lock.get('slot', 1)}"] = (
            f"{lock['task']}, held by {lock['id']}, token {lock['token']}, "
            f"age {lock['age']:.1f} s, pid {lock.get('pid')}"
            + (", LOST" if lock.get("lost") else ""))
    return rows


def _flush_stats(**_: Any) -> None:
    """A pool child exits without atexit: write its last counts."""
    try:
        monitor.PUBLISHER.flush()
    except Exception as exc:
        logger.debug("Could not publish singleton lock stats at exit: %r", exc)


@inspect_command()  # type: ignore[untyped-decorator]
def singleton_locks(state: Any) -> dict[str, Any]:
    """The singleton locks this worker's processes hold (task, id, key, token, age)."""
    return held_locks(state.app, state.hostname)
