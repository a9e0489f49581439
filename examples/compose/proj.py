"""The app the docker-compose stack runs: payment callbacks and a periodic report.

``REDIS_URL`` names the Redis (broker db 0, results db 1, locks db 2).
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery

from celery_singleton_lock import SingletonTask

REDIS_URL = os.environ.get("REDIS_URL", "redis://redis:6379")

app = Celery("proj", broker=f"{REDIS_URL}/0", backend=f"{REDIS_URL}/1")
app.conf.update(
    singleton_redis_url=f"{REDIS_URL}/2",
    worker_send_task_events=True,
    task_send_sent_event=True,
    broker_connection_retry_on_startup=True,
    beat_schedule={
        "sales-report-every-10s": {"task": "proj.report", "schedule": 10.0, "args": ("sales",)},
    },
)


@app.task(base=SingletonTask, bind=True, name="proj.payment_callback",
          singleton_key=("order_id",), singleton_done_ttl=3600)
def payment_callback(self: Any, order_id: int, amount: int) -> dict[str, Any]:
    time.sleep(1.0)  # the bank, the order table...
    return {"order_id": order_id, "amount": amount, "token": self.singleton.token}


@app.task(base=SingletonTask, name="proj.report", singleton_scope="queue_and_run")
def report(name: str) -> str:
    time.sleep(2.0)
    return f"{name} report done"
