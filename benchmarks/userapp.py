"""The app of ``python -m benchmarks.userstyle``: a no-op task per library that
counts itself with one ``INCR``, as a user comparing libraries writes it, and
the floor of a lock taken in the worker.

``celery -A benchmarks.userapp:app worker``; configured from the environment:
``USER_BROKER_URL``, ``USER_LOCK_URL`` (the same Redis, or one of its own),
``USER_COUNTER_URL`` and ``USER_PREFETCH``.
"""

from __future__ import annotations

import os

import redis
from celery import Celery

BROKER = os.environ.get("USER_BROKER_URL", "redis://127.0.0.1:6379/0")
LOCK = os.environ.get("USER_LOCK_URL", BROKER)

app = Celery("user", broker=BROKER, set_as_current=False)
app.conf.update(
    task_default_queue=os.environ.get("USER_QUEUE", "user"),
    task_ignore_result=True,
    worker_prefetch_multiplier=int(os.environ.get("USER_PREFETCH", "4")),
    broker_connection_retry_on_startup=True,
    singleton_redis_url=LOCK,
    singleton_backend_url=LOCK,  # celery-singleton's
    ONCE={"backend": "celery_once.backends.Redis",
          "settings": {"url": LOCK, "default_timeout": 3600}},
)

counter = redis.Redis.from_url(os.environ.get("USER_COUNTER_URL", BROKER))


def _count() -> None:
    counter.incr("done")


@app.task(name="user.plain")
def plain(n: int) -> None:
    _count()


# The floor of a lock taken when the task runs, whatever the library: one bare
# round trip each way (redis-py's SET NX PX before the body, DEL after; no
# script, no token, no renewal). The peers take theirs when the task is sent.
_floor = redis.Redis.from_url(LOCK)


@app.task(name="user.floor")
def floor(n: int) -> None:
    key = f"user-floor:{n}"
    if not _floor.set(key, "1", nx=True, px=60_000):
        return
    try:
        _count()
    finally:
        _floor.delete(key)


def _register() -> None:
    from celery_singleton_lock import SingletonTask

    @app.task(name="user.ours", base=SingletonTask)
    def ours(n: int) -> None:
        _count()

    try:
        from celery_singleton import Singleton

        @app.task(name="user.celery_singleton", base=Singleton)
        def peer_singleton(n: int) -> None:
            _count()
    except ImportError:  # the bench extra is not installed
        pass
    try:
        from celery_once import QueueOnce

        @app.task(name="user.celery_once", base=QueueOnce)
        def peer_once(n: int) -> None:
            _count()
    except ImportError:
        pass


_register()
