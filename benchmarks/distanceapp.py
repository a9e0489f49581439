"""The Celery app of the distance run (``benchmarks/distance.py``): one no-op
task per kind of lock, and a gate that holds the worker's one child while a
batch is queued behind it.

``celery -A benchmarks.distanceapp:app worker``; configured from the
environment: ``DIST_BROKER_URL`` (the broker, direct), ``DIST_LOCK_URL`` (the
lock Redis, behind a delay relay), ``DIST_QUEUE`` and ``DIST_COUNTERS_URL``
(where each task that finishes writes its time, direct). The driver makes the
same app with :func:`make_app` for each deployment it sends to.
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional

import redis
from celery import Celery, signals

#: the tasks of each kind, by name; the peers and the floor only where the
#: lock URL is one plain server (their own clients speak nothing else)
GATE = "dist.gate"
PLAIN = "dist.plain"
OURS = "dist.ours"
OURS_LIMIT = "dist.ours_limit2"
OURS_QUEUE_AND_RUN = "dist.ours_queue_and_run"
FLOOR = "dist.floor"
CELERY_SINGLETON = "dist.celery_singleton"
CELERY_ONCE = "dist.celery_once"

#: where each finished task of queue Q writes its time (a list on the counters Redis)
DONE = "dist:done:{queue}"
#: what the gate task waits on (a list the driver pushes to)
OPEN = "dist:gate:{queue}"

_counters: Optional[redis.Redis] = None
_queue = ""


def make_app(broker: str, lock: str, queue: str) -> Celery:
    """The app, its lock Redis at ``lock`` and its tasks sent to ``queue``."""
    app = Celery(f"dist-{queue}", broker=broker, set_as_current=False)
    app.conf.update(
        task_default_queue=queue,
        task_ignore_result=True,
        worker_prefetch_multiplier=8,
        broker_connection_retry_on_startup=True,
        singleton_redis_url=lock,
    )
    _register(app, broker, lock, queue)
    return app


def _trivial(n: int) -> int:
    return n + 1


def _register(app: Celery, broker: str, lock: str, queue: str) -> None:
    from celery_singleton_lock import SingletonTask

    gate_key = OPEN.format(queue=queue)
    gate_client = redis.Redis.from_url(broker.rsplit("/", 1)[0] + "/3")

    @app.task(shared=False, name=GATE)
    def gate() -> None:
        gate_client.blpop([gate_key], timeout=300)

    @app.task(shared=False, name=PLAIN)
    def plain(n: int) -> int:
        return _trivial(n)

    @app.task(shared=False, name=OURS, base=SingletonTask)
    def ours(n: int) -> int:
        return _trivial(n)

    @app.task(shared=False, name=OURS_QUEUE_AND_RUN, base=SingletonTask,
              singleton_scope="queue_and_run")
    def ours_queue_and_run(n: int) -> int:
        return _trivial(n)

    if not lock.startswith("redlock://"):  # a limit needs one lock Redis
        @app.task(shared=False, name=OURS_LIMIT, base=SingletonTask, singleton_limit=2)
        def ours_limit(n: int) -> int:
            return _trivial(n)

    if not lock.startswith("redis://"):
        return
    # the peers' settings: celery-singleton reads singleton_backend_url,
    # celery-once its ONCE dict
    app.conf.update(singleton_backend_url=lock,
                    ONCE={"backend": "celery_once.backends.Redis",
                          "settings": {"url": lock, "default_timeout": 3600}})
    # the floor: the least a lock taken as the task runs costs, one bare round
    # trip each way (redis-py, no script, no owner record, no library)
    floor_client = redis.Redis.from_url(lock)

    @app.task(shared=False, name=FLOOR)
    def floor(n: int) -> int:
        key = f"dist-floor:{n}"
        floor_client.set(key, "1", nx=True, px=60_000)
        try:
            return _trivial(n)
        finally:
            floor_client.delete(key)

    try:
        from celery_singleton import Singleton
    except ImportError:  # the bench extra is not installed
        Singleton = None
    try:
        from celery_once import QueueOnce
    except ImportError:
        QueueOnce = None
    if Singleton is not None:
        @app.task(shared=False, name=CELERY_SINGLETON, base=Singleton)
        def peer_singleton(n: int) -> int:
            return _trivial(n)
    if QueueOnce is not None:
        @app.task(shared=False, name=CELERY_ONCE, base=QueueOnce)
        def peer_once(n: int) -> int:
            return _trivial(n)


@signals.task_postrun.connect(weak=False)
def _finished(task: Any = None, **_: Any) -> None:
    # every task of a batch, after the library's own postrun work: its time,
    # on the host's clock (the driver reads it on the same host)
    if _counters is not None and task is not None and task.name != GATE:
        _counters.rpush(DONE.format(queue=_queue), repr(time.time()))


def _from_environment() -> Celery:
    global _counters, _queue
    broker = os.environ.get("DIST_BROKER_URL", "redis://127.0.0.1:6379/0")
    _queue = os.environ.get("DIST_QUEUE", "dist")
    _counters = redis.Redis.from_url(os.environ.get("DIST_COUNTERS_URL",
                                                    broker.rsplit("/", 1)[0] + "/3"))
    return make_app(broker, os.environ.get("DIST_LOCK_URL", broker), _queue)


app = _from_environment()
