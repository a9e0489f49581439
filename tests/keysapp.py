"""Apps for the key tests: pydantic arguments, and a fleet moving over from
celery-singleton or celery-once (`celery -A tests.keysapp:app worker`).

``KEYS_LIB`` picks the app a worker runs: ``new`` (SingletonTask, with
``singleton_also_lock`` from ``KEYS_ALSO``), ``celery_singleton`` or
``celery_once`` (the old library's own task class); ``KEYS_SCOPE`` the new
app's ``singleton_scope`` (the migration guide maps both libraries to
``queue_and_run``). Every app has the task
``r.work(account_id, seconds, tag)``; each run records its start and end, and
how many runs of its account ran at once, in db 3 of the test's Redis.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Optional

import redis
from celery import Celery
from pydantic import BaseModel

from celery_singleton_lock import SingletonTask


class Order(BaseModel):
    id: int
    note: Optional[str] = None


def recorder(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(f"{redis_url.rsplit('/', 1)[0]}/3", decode_responses=True)


def run_recorded(rec: redis.Redis, lib: str, task_id: str, key: str, seconds: float,
                 tag: str) -> dict[str, Any]:
    """The body every app's task runs: how many runs of ``key`` ran at once."""
    n = rec.incr(f"active:{key}")
    rec.rpush("events", json.dumps({"ev": "start", "lib": lib, "id": task_id, "key": key,
                                    "tag": tag, "concurrent": n, "t": time.time()}))
    try:
        time.sleep(seconds)
    finally:
        rec.decr(f"active:{key}")
        rec.rpush("events", json.dumps({"ev": "end", "lib": lib, "id": task_id, "key": key,
                                        "tag": tag, "t": time.time()}))
    return {"lib": lib, "key": key, "tag": tag}


def make_app(redis_url: str, queue: str, lib: str = "new",
             also: Optional[Any] = None, migrated: bool = False, scope: str = "run") -> Celery:
    """``redis_url``'s db 0 is the broker, db 1 results, db 2 our locks, db 4
    the old library's locks."""
    base = redis_url.rsplit("/", 1)[0]
    app = Celery(f"keys-{lib}", broker=f"{base}/0", backend=f"{base}/1", set_as_current=False)
    app.conf.update(
        task_default_queue=queue,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        result_expires=600,
    )
    rec = recorder(redis_url)

    if lib == "celery_singleton":
        from celery_singleton import Singleton

        app.conf.singleton_backend_url = f"{base}/4"

        @app.task(base=Singleton, bind=True, name="r.work", shared=False,
                  unique_on=["account_id"])
        def work(self: Any, account_id: int, seconds: float = 0.0, tag: str = "") -> Any:
            return run_recorded(rec, lib, self.request.id, str(account_id), seconds, tag)

        return app
    if lib == "celery_once":
        from celery_once import QueueOnce

        app.conf.ONCE = {"backend": "celery_once.backends.Redis",
                         "settings": {"url": f"{base}/4", "default_timeout": 60}}

        @app.task(base=QueueOnce, bind=True, name="r.work", shared=False,
                  once={"keys": ["account_id"], "graceful": True})
        def work_once(self: Any, account_id: int, seconds: float = 0.0, tag: str = "") -> Any:
            return run_recorded(rec, lib, self.request.id, str(account_id), seconds, tag)

        return app

    app.conf.update(singleton_redis_url=f"{base}/2", singleton_ttl=2.0,
                    singleton_retry_delay=0.2, singleton_retry_max_delay=1.0,
                    singleton_scope=scope)
    if also is not None:
        app.conf.singleton_also_lock = also

    @app.task(base=SingletonTask, bind=True, name="r.work", shared=False,
              singleton_key=("account_id",))
    def work_new(self: Any, account_id: int, seconds: float = 0.0, tag: str = "") -> Any:
        return run_recorded(rec, lib, self.request.id, str(account_id), seconds, tag)

    if migrated:  # moved from celery-singleton by changing the base class only
        @app.task(base=SingletonTask, bind=True, name="m.migrated", shared=False,
                  unique_on=["account_id"])
        def migrated_task(self: Any, account_id: int, full: bool = False) -> Any:
            return run_recorded(rec, "new", self.request.id, str(account_id), 0.0, "")

    # -- pydantic arguments: every form of one order is one key ----------------
    @app.task(base=SingletonTask, bind=True, name="k.charge", shared=False, pydantic=True)
    def charge(self: Any, order: Order) -> Any:
        assert isinstance(order, Order)  # Celery validated it before the body
        return run_recorded(rec, "new", self.request.id, f"order-{order.id}", 0.6, "")

    @app.task(base=SingletonTask, bind=True, name="k.charge_queued", shared=False,
              pydantic=True, singleton_scope="queue_and_run")
    def charge_queued(self: Any, order: Order) -> Any:
        return run_recorded(rec, "new", self.request.id, f"order-{order.id}", 0.6, "")

    return app


def _from_env() -> Celery:
    also = os.environ.get("KEYS_ALSO") or None
    return make_app(os.environ.get("KEYS_REDIS_URL", "redis://127.0.0.1:6379/0"),
                    os.environ.get("KEYS_QUEUE", "celery"), os.environ.get("KEYS_LIB", "new"),
                    json.loads(also) if also else None,
                    migrated=os.environ.get("KEYS_MIGRATED") == "1",
                    scope=os.environ.get("KEYS_SCOPE", "run"))


app = _from_env()
