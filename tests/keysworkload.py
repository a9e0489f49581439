"""The Celery app of ``tests/keys/test_keys_in_redis.py``: its worker and its
beat run it, and the test sends with it.

``tests.beatapp``'s app (the tick tasks, the schedule from
``SLT_BEAT_SCHEDULE``) with the settings of :data:`CONF`, plus one task for
each kind of key a run can leave: :data:`TASKS` gives their options. Each
runs ``seconds`` unless db 3 has ``finish:<key>`` set. Configured from the
environment like ``tests.beatapp``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery import Celery

from celery_singleton_lock import SingletonTask
from tests.beatapp import make_beat_app
from tests.workerapp import recorder

#: app settings, none at its default, so each TTL shows which setting made it
CONF: dict[str, Any] = {
    "singleton_ttl": 6.0,
    "singleton_fence_ttl": 40.0,
    "singleton_finished_ttl": 500.0,
    "singleton_queue_ttl": 70.0,
    "singleton_beat_catchup": 20.0,
    "singleton_beat_max_clock_skew": 3.0,
}
#: task name -> its options
TASKS: dict[str, dict[str, Any]] = {
    "kw.late": {"acks_late": True},
    "kw.done": {"singleton_done_ttl": 200.0},
    "kw.throttle": {"singleton_throttle": 150.0},
    "kw.rate": {"singleton_rate": "5/3m"},
    "kw.limit": {"singleton_limit": 2},
    "kw.replace": {"singleton_scope": "queue", "singleton_on_duplicate": "replace"},
}
#: the window of kw.rate's singleton_rate, seconds
RATE_WINDOW = 180.0


def make_workload_app(redis_url: str, queue: str,
                      schedule: dict[str, Any] | None = None) -> Celery:
    app = make_beat_app(redis_url, queue, conf=CONF, schedule=schedule)
    rec = recorder(redis_url)

    def run(key: str, seconds: float) -> str:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not rec.exists(f"finish:{key}"):
            time.sleep(0.05)
        return key

    for name, options in TASKS.items():
        @app.task(base=SingletonTask, name=name, shared=False, singleton_key=("key",),
                  **options)
        def task(key: str, seconds: float = 0.0) -> str:
            return run(key, seconds)
    return app


def _from_env() -> Celery:
    return make_workload_app(os.environ.get("SLT_REDIS_URL", "redis://127.0.0.1:6379/0"),
                             os.environ.get("SLT_QUEUE", "celery"),
                             json.loads(os.environ.get("SLT_BEAT_SCHEDULE") or "{}"))


def __getattr__(name: str) -> Celery:
    if name == "app":
        app = _from_env()
        globals()["app"] = app
        return app
    raise AttributeError(name)
