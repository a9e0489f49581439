"""RabbitMQ carries the messages; Redis holds only the locks.

``AMQP_URL`` (default ``amqp://guest:guest@127.0.0.1:5672//``) and
``LOCK_REDIS_URL`` name them; results go to the locks' Redis, database 1.
"""

from __future__ import annotations

import os

import redis
from celery import Celery

from celery_singleton_lock import SingletonTask

AMQP = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
LOCKS = os.environ.get("LOCK_REDIS_URL", "redis://127.0.0.1:6379").rstrip("/")

app = Celery("inventory", broker=AMQP, backend=f"{LOCKS}/1")
app.conf.update(
    task_default_queue=os.environ.get("DEMO_QUEUE", "inventory"),
    singleton_redis_url=f"{LOCKS}/2",  # required: the broker is not Redis
    task_acks_late=True,               # a message of a dead worker is redelivered...
    task_reject_on_worker_lost=True,   # ...and its lock frees within the TTL
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)


#: the demo's stand-in for counting the shelves: a list it pushes to once it has
#: seen every duplicate answered (so the count lasts until then, however slow the
#: machine; 30 s at most)
COUNTED = "demo:counted:{sku}"
_shelves = redis.Redis.from_url(f"{LOCKS}/2")


@app.task(base=SingletonTask, bind=True, singleton_key=("sku",))
def recount_stock(self, sku: str, reason: str) -> dict[str, object]:  # type: ignore[no-untyped-def]
    _shelves.blpop([COUNTED.format(sku=sku)], timeout=30)  # count the shelves
    return {"sku": sku, "counted_by": self.request.id, "token": self.singleton.token}
