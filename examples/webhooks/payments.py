"""The payment webhook's work: charge an order once, however often the provider
calls.

``charge`` is the guarded task: a singleton per order, with a done window, and
its writes fenced by the lock's token. ``charge_unguarded`` is the same work as
a plain task: what runs without the lock, and double-charges.

Environment: ``WEBHOOKS_REDIS_URL`` (broker db 0, results db 1, locks db 2),
``WEBHOOKS_DATABASE`` (see ledger.py), ``WEBHOOKS_LOCK_TTL`` (the lease, s),
``WEBHOOKS_AUTHORIZE_SECONDS`` (how long the bank takes), ``WEBHOOKS_QUEUE``.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import ledger
from celery import Celery

from celery_singleton_lock import SingletonTask, StaleTokenError
from celery_singleton_lock.fencing import dbapi_update

REDIS = os.environ.get("WEBHOOKS_REDIS_URL", "redis://127.0.0.1:6379").rstrip("/")
AUTHORIZE_SECONDS = float(os.environ.get("WEBHOOKS_AUTHORIZE_SECONDS", "0.5"))

app = Celery("payments", broker=f"{REDIS}/0", backend=f"{REDIS}/1")
app.conf.update(
    task_default_queue=os.environ.get("WEBHOOKS_QUEUE", "payments"),
    singleton_redis_url=f"{REDIS}/2",
    singleton_ttl=float(os.environ.get("WEBHOOKS_LOCK_TTL", "30")),
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)
logger = logging.getLogger(__name__)


def authorize(order_id: int, cents: int) -> None:
    """Talk to the bank: slow, and where a process pause hurts."""
    time.sleep(AUTHORIZE_SECONDS)


@app.task(base=SingletonTask, bind=True, name="payments.charge",
          singleton_key=("order_id",),   # one charge per order at a time...
          singleton_done_ttl=24 * 3600)  # ...and none for a day after a success
def charge(self: Any, order_id: int, cents: int) -> dict[str, Any]:
    token = self.singleton.token
    try:
        # Claim the order with our token: from here on, every older holder's
        # write to this row is refused, whatever it believes about its lease.
        with ledger.transaction() as cur:
            dbapi_update(cur, "orders", {"id": order_id}, {}, self.singleton)
            if ledger.state(cur, order_id) == "paid":
                return {"order_id": order_id, "outcome": "already paid"}
        authorize(order_id, cents)
        # (self.singleton.check() here would catch most late wakers; the fenced
        # write below catches every one, however late it wakes.)
        with ledger.transaction() as cur:
            dbapi_update(cur, "orders", {"id": order_id}, {"state": "paid"}, self.singleton)
            ledger.record_charge(cur, order_id, cents, token, self.request.id)
    except StaleTokenError as exc:
        logger.warning("Charge of order %s not recorded: %s", order_id, exc)
        return {"order_id": order_id, "outcome": "stale write refused", "token": exc.token,
                "stored": exc.stored}
    return {"order_id": order_id, "outcome": "charged", "token": token}


@app.task(name="payments.charge_unguarded", bind=True)
def charge_unguarded(self: Any, order_id: int, cents: int) -> dict[str, Any]:
    """The same work without the lock: check, then act; every concurrent copy
    sees the order unpaid and charges it."""
    with ledger.transaction() as cur:
        if ledger.state(cur, order_id) == "paid":
            return {"order_id": order_id, "outcome": "already paid"}
    authorize(order_id, cents)
    with ledger.transaction() as cur:
        cur.execute(ledger.q("UPDATE orders SET state = 'paid' WHERE id = %s"), (order_id,))
        ledger.record_charge(cur, order_id, cents, 0, self.request.id)
    return {"order_id": order_id, "outcome": "charged"}
