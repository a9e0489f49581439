"""The app of ``python -m benchmarks.userstyle``: a no-op task per library that
counts itself with one ``INCR``, as a user comparing libraries writes it, and
the floor of a lock taken in the worker.

``celery -A benchmarks.userapp:app worker``; configured from the environment:
``USER_BROKER_URL``, ``USER_LOCK_URL`` (the same Redis, or one of its own),
``USER_COUNTER_URL`` and ``USER_PREFETCH``.
"""

from __future__ import annotations

import os
from typing import Any

import redis
from celery import Celery

from celery_singleton_lock.engine.request import Lease, Request

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


# Bounds of a lock whose steps run in Redis scripts, taken in the worker as the
# floor is (``python -m benchmarks.userstyle --bounds``; the scripts are
# benchmarks.lockworkloads'): the barest pair that keeps a fencing token, and a
# grant script whose owner record is a hash field named by the execution, freed
# by a plain HDEL that can free nothing else.
def _bounds() -> None:
    import uuid

    from celery_singleton_lock.engine.calls import record_rest

    from .lockworkloads import BARE_FREE, FENCED_TAKE, HASH_TAKE

    fenced_take, bare_free = _floor.register_script(FENCED_TAKE), _floor.register_script(BARE_FREE)
    hash_take = _floor.register_script(HASH_TAKE)

    @app.task(name="user.fenced")
    def fenced(n: int) -> None:
        base, owner = f"user-fenced:{{{n}}}:", uuid.uuid4().hex
        if fenced_take(keys=[base + "lock", base + "fence"], args=[owner, 60_000]) == 0:
            return
        try:
            _count()
        finally:
            bare_free(keys=[base + "lock"], args=[owner])

    @app.task(name="user.hashfield", bind=True)
    def hashfield(self: Any, n: int) -> None:
        base, owner = f"user-hash:{{{n}}}:", uuid.uuid4().hex
        task_id = self.request.id or owner
        token = hash_take(keys=[base + "lock", base + "fence"],
                          args=[task_id, owner, 60_000, record_rest(
                              Request(task_id, owner, Lease(60.0), "celery@user",
                                      task_name="user.hashfield"), 86_400_000)])
        if not (isinstance(token, bytes) and token.isdigit()):
            return
        try:
            _count()
        finally:
            _floor.hdel(base + "lock", owner)


if os.environ.get("USER_BOUNDS"):
    _bounds()


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
