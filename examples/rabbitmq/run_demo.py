"""RabbitMQ as the broker, Redis only for the locks.

    python examples/rabbitmq/run_demo.py

Needs a RabbitMQ (``AMQP_URL``, default ``amqp://guest:guest@127.0.0.1:5672//``;
the demo uses a queue of its own and deletes it at the end). Starts a
redis-server of its own for the locks and a Celery worker (prefork, 3
processes), sends 6 stock recounts for one SKU at once and prints what ran.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from pathlib import Path

import redis

from celery_singleton_lock.testing import CeleryWorker, RedisServer

HERE = Path(__file__).resolve().parent


def main() -> int:
    amqp = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
    with RedisServer() as server:
        env = {"AMQP_URL": amqp, "LOCK_REDIS_URL": f"redis://127.0.0.1:{server.port}",
               "DEMO_QUEUE": f"inventory-{uuid.uuid4().hex[:8]}",
               "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
        os.environ.update(env)
        sys.path.insert(0, str(HERE))
        import tasks

        from celery_singleton_lock import is_skipped

        try:
            with tasks.app.connection_for_write() as conn:
                conn.ensure_connection(max_retries=1)
        except Exception as exc:
            print(f"No RabbitMQ at {amqp}: {exc}")
            return 2
        worker = CeleryWorker("tasks", env["DEMO_QUEUE"], concurrency=3, env=env,
                              cwd=str(HERE)).start()
        try:
            sent = [tasks.recount_stock.delay("SKU-1234", reason=f"scan {i}") for i in range(6)]
            # the duplicates are answered while the first still counts; then it ends
            deadline = time.monotonic() + 30
            while sum(r.ready() for r in sent) < 5 and time.monotonic() < deadline:
                time.sleep(0.05)
            shelves = redis.Redis.from_url(f"{env['LOCK_REDIS_URL']}/2")
            shelves.rpush(tasks.COUNTED.format(sku="SKU-1234"), *["counted"] * 6)
            results = [r.get(timeout=30) for r in sent]
        finally:
            worker.stop()
            worker.log.unlink(missing_ok=True)
            with tasks.app.connection_for_write() as conn:
                conn.default_channel.queue_delete(env["DEMO_QUEUE"])
    ran = [r for r in results if not is_skipped(r)]
    skipped = [r for r in results if is_skipped(r)]
    print(f"6 recounts of SKU-1234 sent through RabbitMQ: {len(ran)} ran, "
          f"{len(skipped)} skipped while it ran")
    holders = {r["holder"] for r in skipped}
    print(f"every skip names the running one: {holders <= {r['counted_by'] for r in ran}}")
    ok = len(ran) >= 1 and len(skipped) >= 1 and holders <= {r["counted_by"] for r in ran}
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
