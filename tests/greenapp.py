"""The Celery app of the green-pool tests: ``tests.workerapp``'s tasks, plus one
that blocks the event loop (the hub) without yielding. Configured from the
environment like ``tests.workerapp``."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery import Celery

from celery_singleton_lock import SingletonTask
from tests.workerapp import make_app, recorder

#: the lease of t.block_hub: renewed every 0.5 s
BLOCK_TTL = 1.5


def make_green_app(redis_url: str, queue: str, lock_url: str | None = None,
                   conf: dict[str, Any] | None = None) -> Celery:
    app = make_app(redis_url, queue, lock_url, conf)
    rec = recorder(redis_url)

    @app.task(base=SingletonTask, bind=True, name="t.block_hub", shared=False,
              singleton_key=("key",), singleton_ttl=BLOCK_TTL)
    def block_hub(self: Any, key: str, seconds: float) -> dict[str, Any]:
        """Spins for ``seconds`` without yielding: no other greenlet of the
        process runs meanwhile, the lock's renewer included."""
        rec.rpush("events", json.dumps({"ev": "block", "key": key, "id": self.request.id,
                                        "t": time.time()}))
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            pass
        lost_after_block = self.singleton.lost
        time.sleep(BLOCK_TTL)  # yields: the renewer has its turn
        return {"lost_after_block": lost_after_block, "lost": self.singleton.lost}

    return app


def __getattr__(name: str) -> Celery:
    if name == "app":
        app = make_green_app(os.environ.get("SLT_REDIS_URL", "redis://127.0.0.1:6379/0"),
                             os.environ.get("SLT_QUEUE", "celery"),
                             os.environ.get("SLT_LOCK_URL") or None,
                             json.loads(os.environ.get("SLT_CONF") or "{}"))
        globals()["app"] = app
        return app
    raise AttributeError(name)
