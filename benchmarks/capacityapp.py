"""The app the capacity run starts a worker and a beat of, to count the
connections each process opens to the lock Redis (``benchmarks/capacity.py``).

``celery -A benchmarks.capacityapp:app worker`` / ``beat``; configured from
the environment: ``CAP_BROKER_URL`` (broker, on a Redis of its own) and
``CAP_LOCK_URL`` (the lock Redis, where nothing else connects).
"""

from __future__ import annotations

import os
import time

from celery import Celery

from celery_singleton_lock import SingletonTask

app = Celery("cap", broker=os.environ.get("CAP_BROKER_URL", "redis://127.0.0.1:6379/0"),
             set_as_current=False)
app.conf.update(
    task_default_queue=os.environ.get("CAP_QUEUE", "cap"),
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
    singleton_redis_url=os.environ.get("CAP_LOCK_URL", "redis://127.0.0.1:6379/2"),
    singleton_native=os.environ.get("CAP_NATIVE", "auto"),
    singleton_ttl=float(os.environ.get("CAP_TTL", "30")),
    beat_schedule={"tick": {"task": "cap.tick", "schedule": 1.0}},
)


@app.task(base=SingletonTask, name="cap.hold", singleton_key=("key",))
def hold(key: str, seconds: float) -> None:
    time.sleep(seconds)


@app.task(base=SingletonTask, name="cap.tick")
def tick() -> None:
    return None
