"""A payment provider's callback, made a singleton per order.

Run by ``run_demo.py``; ``REDIS_URL`` names the Redis it uses (broker, results
and locks, in separate databases of one server).
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery

from celery_singleton_lock import SingletonTask

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
_BASE = REDIS_URL.rsplit("/", 1)[0] if REDIS_URL.count("/") > 2 else REDIS_URL.rstrip("/")
DB = int(os.environ.get("DEMO_DB", "10"))  # databases DB..DB+2 belong to the demo
PREFIX = os.environ.get("DEMO_PREFIX", "demo:")
QUEUE = os.environ.get("DEMO_QUEUE", "payment-callbacks")

app = Celery("shop", broker=f"{_BASE}/{DB}", backend=f"{_BASE}/{DB + 1}")
app.conf.update(
    task_default_queue=QUEUE,
    singleton_redis_url=f"{_BASE}/{DB + 2}",
    singleton_key_prefix=f"{PREFIX}lock:",
    singleton_ttl=10,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    result_expires=600,
)

# The "ledger": what a payment service would keep in its database.
ledger = redis.Redis.from_url(f"{_BASE}/{DB + 2}", decode_responses=True)

# Apply a payment only with a fencing token newer than the last one written for
# the order: a holder paused past its lease cannot overwrite a newer one.
_APPLY = ledger.register_script("""
local last = tonumber(redis.call('HGET', KEYS[1], 'fence') or '0')
if tonumber(ARGV[1]) <= last then return 0 end
redis.call('HSET', KEYS[1], 'fence', ARGV[1], 'state', 'paid', 'amount', ARGV[2])
redis.call('HINCRBY', KEYS[1], 'applied', 1)
return 1
""")


# One execution per order at a time, and for an hour after a success any repeat
# of the callback is skipped and points to the run that did the work.
@app.task(base=SingletonTask, bind=True, name="shop.payment_callback",
          singleton_key=("order_id",), singleton_done_ttl=3600)
def payment_callback(self: Any, order_id: int, payload: dict[str, Any]) -> dict[str, Any]:
    time.sleep(0.5)  # talk to the bank, update the order...
    applied = _APPLY(keys=[f"{PREFIX}order:{order_id}"],
                     args=[self.singleton.token, payload["amount"]])
    return {"order_id": order_id, "applied": bool(applied), "token": self.singleton.token}
