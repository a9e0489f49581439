"""The demo's Celery app: one periodic task every second, sent by two beats.

``celery -A tasks beat -S celery_singleton_lock.beat:SingletonScheduler`` is all
a deployment changes; run as many beats as you like.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from typing import Any

import redis
from celery import Celery

REDIS_URL = os.environ.get("DEMO_REDIS_URL", "redis://127.0.0.1:6379")

app = Celery("beat_demo", broker=f"{REDIS_URL}/0")
app.conf.update(
    singleton_redis_url=f"{REDIS_URL}/2",
    task_default_queue="beat-demo",
    broker_connection_retry_on_startup=True,
    beat_schedule={
        "heartbeat-report": {"task": "demo.report", "schedule": dt.timedelta(seconds=1)},
    },
)
_log = redis.Redis.from_url(f"{REDIS_URL}/3", decode_responses=True)


@app.task(bind=True, name="demo.report")
def report(self: Any) -> None:
    """Record the tick this message carries and the beat that sent it."""
    _log.rpush("ticks", json.dumps({"tick": self.request.singleton_beat_tick,
                                    "beat": self.request.singleton_beat_id}))
