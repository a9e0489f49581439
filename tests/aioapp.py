"""The coroutine tasks' app: ``async def`` SingletonTask bodies, for an asyncio pool
(`celery -A tests.aioapp:app worker -P custom`, CELERY_CUSTOM_WORKER_POOL=
celery_aio_pool.pool:AsyncIOPool).

Configured from the environment as ``tests.workerapp`` (SLT_REDIS_URL,
SLT_QUEUE, SLT_CONF). Each body records ``start`` and ``end`` in db 3 list
``events`` with the number of runs of its key at that moment, its pid and
thread, and whether its lock key is held while it awaits.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from typing import Any

import redis
from celery import Celery

from celery_singleton_lock import SingletonTask
from tests.workerapp import make_app, recorder


def make_aio_app(redis_url: str, queue: str, conf: dict[str, Any] | None = None) -> Celery:
    app = make_app(redis_url, queue, None, conf)
    rec = recorder(redis_url)
    locks = redis.Redis.from_url(app.conf.singleton_redis_url, decode_responses=True)

    def record(task: Any, ev: str, key: str, tag: str, **extra: Any) -> None:
        rec.rpush("events", json.dumps({
            "ev": ev, "key": key, "tag": tag, "id": task.request.id, "pid": os.getpid(),
            "thread": threading.get_ident(), "t": time.time(), **extra}))

    async def held(task: Any, key: str, tag: str, seconds: float, until: str = "") -> None:
        """Awaits ``seconds``, or (``until``) until that key is set in db 3."""
        n = rec.incr(f"active:{key}")
        lock_key = f"{task.singleton.key}:lock"
        record(task, "start", key, tag, concurrent=n, lockkey=lock_key,
               held=bool(locks.exists(lock_key)), token=task.singleton.token)
        try:
            if until:
                while not rec.exists(until):
                    await asyncio.sleep(0.02)
            else:
                await asyncio.sleep(seconds)
        finally:
            rec.decr(f"active:{key}")
            record(task, "end", key, tag, lost=task.singleton.lost)

    @app.task(base=SingletonTask, bind=True, name="a.hold", shared=False,
              singleton_key=("key",), singleton_on_duplicate="retry")
    async def hold(self: Any, key: str, tag: str = "", seconds: float = 0.3) -> str:
        await held(self, key, tag, seconds)
        return tag

    @app.task(base=SingletonTask, bind=True, name="a.cancellable", shared=False,
              singleton_key=("key",), singleton_ttl=30)
    async def cancellable(self: Any, key: str, tag: str = "") -> str:
        """Awaits until ``cancel:<key>`` is set in db 3: then another asyncio
        task of the loop cancels this one (as a pool's terminate, or an
        enclosing timeout, would)."""
        me = asyncio.current_task()
        assert me is not None

        async def watch() -> None:
            while not rec.exists(f"cancel:{key}"):
                await asyncio.sleep(0.02)
            me.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await held(self, key, tag, 60)
        finally:
            watcher.cancel()
        return tag

    @app.task(base=SingletonTask, bind=True, name="a.retrier", shared=False,
              singleton_key=("key",), max_retries=3)
    async def retrier(self: Any, key: str, tag: str = "", countdown: float = 1.0) -> Any:
        """Awaits until ``finish:<key>`` is set in db 3 (events tagged
        ``<tag>#<retries>``); the first run then asks for a retry,
        ``self.retry(countdown=countdown)``; the retried run returns."""
        await held(self, key, f"{tag}#{self.request.retries}", 0.0, until=f"finish:{key}")
        if self.request.retries < 1:
            raise self.retry(countdown=countdown)
        return {"tag": tag, "token": self.singleton.token, "lost": self.singleton.lost}

    return app


def _from_env() -> Celery:
    return make_aio_app(os.environ.get("SLT_REDIS_URL", "redis://127.0.0.1:6379/0"),
                        os.environ.get("SLT_QUEUE", "celery"),
                        json.loads(os.environ.get("SLT_CONF") or "{}"))


def __getattr__(name: str) -> Celery:
    if name == "app":
        app = _from_env()
        globals()["app"] = app
        return app
    raise AttributeError(name)
