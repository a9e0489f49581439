"""A monthly report (one from request to finish) and a cache rebuild (one pending
at a time). ``REDIS_URL`` names the Redis (broker db 0, results db 1, locks db 2)."""

from __future__ import annotations

import os
import time

from celery import Celery

from celery_singleton_lock import SingletonTask

REDIS = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379").rstrip("/")

app = Celery("backoffice", broker=f"{REDIS}/0", backend=f"{REDIS}/1")
app.conf.update(
    task_default_queue=os.environ.get("DEMO_QUEUE", "backoffice"),
    singleton_redis_url=f"{REDIS}/2",
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)


# queue_and_run: the key is taken when the report is requested and freed when it
# is written; every request meanwhile sends nothing and gets this report.
@app.task(base=SingletonTask, singleton_scope="queue_and_run")
def monthly_report(month: str) -> str:
    time.sleep(1.5)  # query, render, upload
    return f"reports/{month}.pdf"


# queue: one pending rebuild is enough; once it has started, a change needs a
# new one (it waits for the running rebuild, then runs).
@app.task(base=SingletonTask, bind=True, singleton_scope="queue")
def rebuild_cache(self, section: str) -> str:  # type: ignore[no-untyped-def]
    # Running: the key passed from the pending send to this run. (Celery's
    # STARTED, with task_track_started, is stored just before the lock is taken.)
    self.update_state(state="REBUILDING")
    started = time.time()
    time.sleep(1.0)  # read the source of truth, write the cache
    return f"{section} rebuilt by {self.request.id[:8]} at +{started % 100:.1f}"
