"""What the locks do, made visible: task events for Flower, counters, held locks.

Three audiences, one module:

* **Flower** learns of skips, waits and refused sends through task events
  (:func:`send_task_event`), sent only where events are on: a worker started
  with ``-E`` (``worker_send_task_events``) or whose events Flower switched on
  since, a caller with ``task_send_sent_event``.
* **``celery inspect stats``** (and Flower's worker page) and ``celery inspect
  singleton_locks`` show the locks a worker holds. Those live in its pool
  children, while the worker step answers in the main process: every child
  publishes what it holds to one hash in the lock Redis (:func:`held_key`),
  and the main process reads it when asked (:func:`read_held`).
* **Prometheus** reads counters that every process adds to another hash
  (:func:`stats_key`), so counts from any number of children, workers and
  callers meet in one place that Flower's ``/metrics`` or ``celery singleton
  metrics`` serves (see :mod:`.metrics`).

Counting is a dict update under a mutex in the process that counts. A daemon
thread, started with the first count of a process, writes the deltas and the
held locks once per :data:`PUBLISH_INTERVAL` in one pipeline: no task run
waits on a round trip for it. Counts not yet written when a process dies are
lost; a Redis that cannot be reached keeps them for the next round.
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import json
import logging
import os
import socket
import threading
import time
from typing import Any, Callable, Iterable, Optional

import redis

from ..exceptions import describe
from ..process import ForkSafeLock, at_fork_in_child

logger = logging.getLogger("celery_singleton_lock")

#: seconds between two writes of a process's counts and held locks
PUBLISH_INTERVAL = 1.0
#: a process's held-locks entry older than this is a dead process's: ignored
HELD_MAX_AGE = 5 * PUBLISH_INTERVAL
#: counters of a deployment silent for this long expire from Redis
STATS_TTL = 7 * 24 * 3600
#: upper bounds of the lock hold time histogram, seconds
HOLD_BUCKETS = (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0, float("inf"))
#: upper bounds of the acquire latency histogram (the grant's round trip), seconds
ACQUIRE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, float("inf"))

#: counter names (the Prometheus series are ``celery_singleton_<name>_total``)
COUNTERS = ("acquired", "skipped", "refused", "waited", "lost", "renew_failed",
            "backend_errors")
_SEP = "|"


def stats_key(prefix: str) -> str:
    """Hash of every counter: field ``counter|task|hostname|reason``."""
    return f"{prefix}stats"


def held_key(prefix: str) -> str:
    """Hash of held locks: field ``hostname|pid``, value JSON (``ts``, ``locks``)."""
    return f"{prefix}held"


class _Node:
    """Who counts: the worker's node name in a worker (set by the worker step
    before the pool forks, so children inherit it), the host name elsewhere."""

    hostname: str = socket.gethostname()
    #: task events are on in this worker (``-E``); children inherit it
    task_events: bool = False
    worker: bool = False


NODE = _Node()


def configure_worker(hostname: str, task_events: bool) -> None:
    """Called by the worker step in the main worker process."""
    NODE.hostname = hostname
    NODE.task_events = bool(task_events)
    NODE.worker = True


# -- task events -----------------------------------------------------------------

#: the request field by which the worker's main process tells a pool process
#: whether task events go out now (:class:`..worker.step.SingletonRequest`)
EVENTS_FIELD = "singleton_task_events"


def worker_events_on(task: Any) -> bool:
    """Whether a task running on this worker should send our task events.

    As the main process handed the task over: events switched on after the
    pool forked (by Flower, or ``celery control enable_events``) count. A
    request without that word (a task class with a ``Request`` of its own):
    as the worker step said at start (``-E`` or the setting); reading the
    app's settings costs more than the rest of a skip's decision."""
    if NODE.worker:
        now = getattr(task.request, EVENTS_FIELD, None)
        return NODE.task_events if now is None else bool(now)
    return bool(task.app.conf.worker_send_task_events)


def send_task_event(task: Any, type_: str, **fields: Any) -> None:
    """``task.send_event`` that never fails the task (an event is a courtesy)."""
    try:
        task.send_event(type_, retry=False, **fields)
    except Exception as exc:
        logger.debug("Could not send %s for %s[%s]: %r", type_, task.name,
                     task.request.id, exc)


def send_caller_event(app: Any, type_: str, task_id: str, **fields: Any) -> None:
    """A task event from the process that sends tasks (a refused send), only
    when that process sends task events (``task_send_sent_event``)."""
    if not app.conf.task_send_sent_event:
        return
    try:
        with app.events.default_dispatcher() as dispatcher:
            dispatcher.send(type_, uuid=task_id, retry=False, **fields)
    except Exception as exc:
        logger.debug("Could not send %s for %s: %r", type_, task_id, exc)


# -- counting --------------------------------------------------------------------

class Publisher:
    """This process's counts not yet written, and the thread that writes them.

    Counts are kept per engine and written through it: a process that talks to
    two lock Redis deployments (two apps, or an app made again with another
    URL) writes each one's counts to its own. A count with no engine (a lock
    lost, told by the lock itself) goes to the first engine this process
    counted with. An engine with nothing left to write is forgotten."""

    def __init__(self) -> None:
        self._mutex = ForkSafeLock()
        #: pending counts by engine (its id; 0: the counts of no engine)
        self._counts: dict[int, dict[str, float]] = {}
        self._engines: dict[int, Any] = {}
        self._first = 0
        self._thread: Optional[threading.Thread] = None
        self._wake = threading.Event()
        #: the engines this process's held locks were last written through
        self._held_written: set[int] = set()
        self._warned = False
        #: where the held locks are read, per engine: the renewers say (held_from)
        self._held_sources: dict[int, Callable[[], Iterable[Any]]] = {}

    def held_from(self, engine: Any, source: Callable[[], Iterable[Any]]) -> None:
        """Publish the locks ``source()`` gives as ``engine``'s held locks (the
        worker's renewer of that engine registers itself here)."""
        with self._mutex:
            self._held_sources[id(engine)] = source
            self._engines[id(engine)] = engine

    def reset(self) -> None:
        """After fork: the parent's pending counts are the parent's to write."""
        self.__init__()  # type: ignore[misc]

    def add(self, engine: Optional[Any], field: str, amount: float = 1,
            field2: Optional[str] = None, amount2: float = 0) -> None:
        """Add ``amount`` to ``field`` (and ``amount2`` to ``field2``), in one
        hold of the mutex: this runs for every task."""
        with self._mutex.lock:
            key = 0 if engine is None else id(engine)
            counts = self._counts.get(key)  # flush takes it, under the mutex
            if counts is None:
                counts = self._counts[key] = {}
                if engine is not None:
                    self._engines[key] = engine
                    self._first = self._first or key
            counts[field] = counts.get(field, 0) + amount
            if field2 is not None:
                counts[field2] = counts.get(field2, 0) + amount2
            if self._thread is None and self._engines:
                self._thread = threading.Thread(target=self._run, name="singleton-stats",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                self._wake.wait(PUBLISH_INTERVAL)
                self._wake.clear()
                try:
                    self.flush()
                except Exception:  # never let the publisher die
                    logger.exception("Publishing singleton lock stats failed")
        finally:  # only a BaseException ends it: the next add starts another
            with self._mutex:
                self._thread = None

    def flush(self, quiet: bool = False) -> None:
        """Write the pending counts and the held locks now (one pipeline per engine)."""
        with self._mutex:
            pending, self._counts = self._counts, {}
            orphans = pending.pop(0, None)
            if orphans:
                if self._first in self._engines:
                    mine = pending.setdefault(self._first, {})
                    for name, amount in orphans.items():
                        mine[name] = mine.get(name, 0) + amount
                else:  # no engine counted with yet: kept
                    self._counts[0] = orphans
            work = [(key, engine, pending.get(key, {}), self._held_sources.get(key))
                    for key, engine in self._engines.items()]
        for key, engine, counts, source in work:
            self._flush_one(key, engine, counts, source, quiet)
        with self._mutex:  # nothing left to write through it: forgotten
            for key, _engine, _counts, _source in work:
                # a source registered since the snapshot counts (held_from)
                if (key not in self._held_sources and key not in self._counts
                        and key not in self._held_written and key != self._first):
                    self._engines.pop(key, None)

    def _flush_one(self, key: int, engine: Any, counts: dict[str, float],
                   source: Optional[Callable[[], Iterable[Any]]], quiet: bool) -> None:
        prefix = engine.config.key_prefix
        field = f"{NODE.hostname}{_SEP}{os.getpid()}"
        locks = _held_snapshot(source() if source is not None else ())
        written = key in self._held_written
        if not counts and not locks and not written:
            return
        try:
            if counts:
                engine.update_hash(stats_key(prefix), add=counts, ttl_s=STATS_TTL)
            if locks:
                engine.update_hash(held_key(prefix), put={field: json.dumps(
                    {"ts": time.time(), "pid": os.getpid(), "locks": locks})},
                    ttl_s=int(HELD_MAX_AGE * 4))
            elif written:
                engine.update_hash(held_key(prefix), drop=[field])
        except redis.RedisError as exc:
            with self._mutex:  # kept for the next round
                kept = self._counts.setdefault(key, {})
                for name, amount in counts.items():
                    kept[name] = kept.get(name, 0) + amount
            if not self._warned and not quiet:
                self._warned = True
                logger.warning("Could not publish singleton lock stats: %s", describe(exc))
            return
        if locks:
            self._held_written.add(key)
        else:
            self._held_written.discard(key)


PUBLISHER = Publisher()
at_fork_in_child(PUBLISHER.reset)


@atexit.register
def _flush_at_exit() -> None:
    # a caller's refusals counted in its last interval (pool children exit
    # without atexit: the worker step flushes them at worker_process_shutdown)
    try:
        PUBLISHER.flush(quiet=True)
    except Exception as exc:
        logger.debug("Could not publish singleton lock stats at exit: %r", exc)


def _field(counter: str, task_name: str, reason: str = "") -> str:
    return _SEP.join((counter, task_name, NODE.hostname, reason))


#: (histogram, task name, hostname) -> its fields: each bucket's and the sum's
_histogram_fields: dict[tuple[str, str, str], tuple[list[str], str]] = {}


def count(engine: Optional[Any], counter: str, task_name: str, reason: str = "") -> None:
    """Add one to ``counter`` of ``task_name`` (written within a publish interval)."""
    PUBLISHER.add(engine, _field(counter, task_name, reason))


def observe_hold(engine: Any, task_name: str, seconds: float) -> None:
    """A lock of ``task_name`` was held ``seconds``: the hold time histogram."""
    _observe(engine, "hold", HOLD_BUCKETS, task_name, seconds)


def observe_acquire(engine: Any, task_name: str, seconds: float) -> None:
    """An execution of ``task_name`` waited ``seconds`` for its lock's answer
    (granted or refused): the acquire latency histogram."""
    _observe(engine, "acquire", ACQUIRE_BUCKETS, task_name, seconds)


def _observe(engine: Any, histogram: str, bounds: tuple[float, ...], task_name: str,
             seconds: float) -> None:
    fields = _histogram_fields.get((histogram, task_name, NODE.hostname))
    if fields is None:
        fields = _histogram_fields[(histogram, task_name, NODE.hostname)] = (
            [_field(f"{histogram}_bucket", task_name, _bound(b)) for b in bounds],
            _field(f"{histogram}_sum", task_name))
    buckets, total = fields
    index = bisect.bisect_left(bounds, seconds)  # the first bound >= seconds
    PUBLISHER.add(engine, buckets[index], 1, total, seconds)


def _bound(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


def _held_snapshot(locks: Iterable[Any]) -> list[dict[str, Any]]:
    return [{"task": lock.task_name, "id": lock.task_id, "key": lock.key,
             "token": lock.token, "since": lock.acquired_at, "lost": lock.lost,
             "slot": lock.slot}
            for lock in locks if lock.held and not lock.handed_off]


# -- reading ---------------------------------------------------------------------

def read_held(engine: Any, prefix: str,
              hostname: Optional[str] = None) -> list[dict[str, Any]]:
    """The locks held now (by one worker, or by all), as ``engine`` (an
    :class:`~..engine.base.Engine`) reads them: task, id, key, token, age
    (seconds), hostname, pid. Entries of processes that stopped publishing
    are left out (and removed)."""
    now = time.time()
    rows: list[dict[str, Any]] = []
    stale: list[str] = []
    for field, value in engine.read_hash(held_key(prefix)).items():
        host = field.rsplit(_SEP, 1)[0]
        try:
            entry = json.loads(value)
        except ValueError:
            stale.append(field)
            continue
        if now - float(entry.get("ts", 0)) > HELD_MAX_AGE:
            stale.append(field)
            continue
        if hostname is not None and host != hostname:
            continue
        for lock in entry.get("locks", ()):
            rows.append({"task": lock["task"], "id": lock["id"], "key": lock["key"],
                         "token": lock["token"], "age": round(max(now - lock["since"], 0.0), 3),
                         "lost": lock.get("lost", False), "hostname": host,
                         "pid": entry.get("pid"), "slot": lock.get("slot", 1)})
    if stale:
        with contextlib.suppress(redis.RedisError):
            engine.update_hash(held_key(prefix), drop=stale)
    rows.sort(key=lambda row: (row["hostname"], -row["age"]))
    return rows


#: the field a task holding a lock shows on its Flower page (Flower: "Singleton lock")
FLOWER_FIELD = "singleton_lock"


def flower_format_task(url: str, prefix: str = "singleton:",
                       every: float = PUBLISH_INTERVAL) -> Callable[[Any], Any]:
    """A ``format_task`` for Flower's configuration file: the page of a task
    that holds a lock shows, besides Flower's own fields, one named
    "Singleton lock": its key and slot, fencing token and age::

        # flowerconfig.py  (celery -A proj flower --conf=flowerconfig.py)
        from celery_singleton_lock import flower_format_task
        format_task = flower_format_task("redis://locks:CHANGE-ME@redis:6379/2")

    ``url`` is the lock Redis (``singleton_redis_url``). The locks are read
    from what the workers publish each second (:func:`read_held`), at most
    once per ``every`` seconds, and only for tasks Flower shows as STARTED;
    a lock Redis that does not answer adds nothing. Flower's task page shows
    the fields a task object lists in ``_fields``: the copy Flower hands over
    gets the field added there.
    """
    from ..config import SingletonConfig
    from ..engine.registry import connect

    engine = connect(SingletonConfig.defaults(url, redis_options={
        "socket_timeout": 0.5, "socket_connect_timeout": 0.5}))
    cache: dict[str, Any] = {"at": float("-inf"), "locks": {}}

    def format_task(task: Any) -> Any:
        if getattr(task, "state", None) != "STARTED":
            return task
        now = time.monotonic()
        if now - cache["at"] >= every:
            cache["at"] = now
            try:
                cache["locks"] = {row["id"]: row for row in read_held(engine, prefix)}
            except redis.RedisError:
                cache["locks"] = {}
        lock = cache["locks"].get(getattr(task, "uuid", None))
        if lock is None:
            return task
        task._fields = (*type(task)._fields, FLOWER_FIELD)
        setattr(task, FLOWER_FIELD,
                f"{lock['key']} slot {lock.get('slot', 1)}, token {lock['token']}, "
                f"held {lock['age']:.1f} s"
                + (", LOST" if lock.get("lost") else ""))
        return task

    return format_task


def read_counts(engine: Any, prefix: str) -> list[tuple[str, str, str, str, float]]:
    """Every counter, as ``engine`` reads them: (counter, task, hostname, reason, value)."""
    out = []
    for field, value in engine.read_hash(stats_key(prefix)).items():
        parts = field.split(_SEP)
        if len(parts) != 4:
            continue
        out.append((parts[0], parts[1], parts[2], parts[3], float(value)))
    return out


def worker_totals(engine: Any, prefix: str, hostname: str) -> dict[str, int]:
    """This worker's lost and renewal failure counts."""
    totals = {"lost": 0, "renew_failed": 0}
    for counter, _task, host, _reason, value in read_counts(engine, prefix):
        if host == hostname and counter in totals:
            totals[counter] += int(value)
    return totals
