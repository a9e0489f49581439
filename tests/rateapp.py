"""The Celery app of the rate-limit tests: ``tests.workerapp``'s, plus tasks with
``singleton_rate``. Configured from the environment like ``tests.workerapp``.

Each start is recorded in db 3 list ``rate-events`` with the score its grant
wrote in the key's ``rate`` sorted set (the lock Redis's clock, ms): the
window is checked on the very times the limit was decided on.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery

from celery_singleton_lock import SingletonTask
from tests.workerapp import make_app, recorder

#: the limit of every task here: 5 starts of a key in any 2 s
RATE = "5/2s"


def make_rate_app(redis_url: str, queue: str, conf: dict[str, Any] | None = None) -> Celery:
    app = make_app(redis_url, queue, None, conf)
    rec = recorder(redis_url)
    locks = redis.Redis.from_url(str(app.conf.singleton_redis_url), decode_responses=True)

    def record(task: Any, key: str) -> None:
        score = locks.zscore(f"{task.singleton.key}:rate", task.request.id)
        rec.rpush("rate-events", json.dumps({
            "name": task.name, "id": task.request.id, "key": key, "score": score,
            "waits": int(getattr(task.request, "singleton_waits", None) or 0),
            "slot": task.singleton.slot, "pid": os.getpid(), "t": time.time()}))

    @app.task(base=SingletonTask, bind=True, name="t.rated", shared=False,
              singleton_key=("key",), singleton_rate=RATE, singleton_limit=2)
    def rated(self: Any, key: str, seconds: float = 0.0) -> None:
        """Over the limit: skipped. Two may run at once (singleton_limit=2)."""
        record(self, key)
        time.sleep(seconds)

    @app.task(base=SingletonTask, bind=True, name="t.rated_wait", shared=False,
              singleton_key=("key",), singleton_rate=RATE, singleton_on_duplicate="retry")
    def rated_wait(self: Any, key: str, seconds: float = 0.0) -> None:
        """Over the limit: sent again for when the window reopens."""
        record(self, key)
        time.sleep(seconds)

    @app.task(base=SingletonTask, bind=True, name="t.rate_brief", shared=False,
              singleton_key=("key",), singleton_rate="1/0.8s", singleton_on_duplicate="retry")
    def rate_brief(self: Any, key: str, seconds: float = 0.0, tag: str = "") -> Any:
        """One start per 0.8 s: a full window always reopens in under a second.
        Records its start and end as ``tests.workerapp``'s tasks do."""
        record(self, key)
        rec.rpush("events", json.dumps({"ev": "start", "tag": tag, "id": self.request.id,
                                        "key": key, "pid": os.getpid(), "t": time.time()}))
        time.sleep(seconds)
        return {"tag": tag}

    return app


def _from_env() -> Celery:
    return make_rate_app(os.environ.get("SLT_REDIS_URL", "redis://127.0.0.1:6379/0"),
                         os.environ.get("SLT_QUEUE", "celery"),
                         json.loads(os.environ.get("SLT_CONF") or "{}"))


def __getattr__(name: str) -> Celery:
    if name == "app":
        app = _from_env()
        globals()["app"] = app
        return app
    raise AttributeError(name)
