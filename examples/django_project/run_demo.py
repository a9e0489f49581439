"""A Django project configuring the library through Django's settings.

    python examples/django_project/run_demo.py

Starts a redis-server of its own, creates the SQLite database
(``manage.py migrate --run-syncdb``) in a temporary folder, starts
``celery -A shop worker`` (prefork, 3 processes), asks 5 times at once to ship
order 1, and prints what ran and which settings the worker read.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import redis

from celery_singleton_lock.testing import CeleryWorker, RedisServer

HERE = Path(__file__).resolve().parent


def main() -> int:
    with RedisServer() as server, tempfile.TemporaryDirectory(prefix="shop-") as folder:
        env = {"SHOP_REDIS_URL": f"redis://127.0.0.1:{server.port}",
               "SHOP_DB": f"{folder}/shop.sqlite3",
               "SHOP_QUEUE": f"shop-{uuid.uuid4().hex[:8]}",
               "DJANGO_SETTINGS_MODULE": "shop.settings",
               "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
        os.environ.update(env)
        subprocess.run([sys.executable, "manage.py", "migrate", "--run-syncdb", "-v", "0"],
                       cwd=HERE, check=True, timeout=60)
        sys.path.insert(0, str(HERE))
        import django

        django.setup()
        from orders.models import Order
        from orders.tasks import COURIER, ship_order
        from shop.celery import app

        from celery_singleton_lock import get_config, is_skipped

        config = get_config(app)
        print("Read from Django settings: "
              f"singleton_ttl={config.ttl:g} (CELERY_SINGLETON_TTL), "
              f"singleton_key_prefix={config.key_prefix!r} (CELERY_SINGLETON_KEY_PREFIX), "
              f"singleton_redis_url=...{config.redis_url[-2:]} (CELERY_SINGLETON_REDIS_URL)")
        Order.objects.create(pk=1)
        worker = CeleryWorker("shop", env["SHOP_QUEUE"], concurrency=3, env=env,
                              cwd=str(HERE)).start()
        try:
            sent = [ship_order.delay(1) for _ in range(5)]
            # the four duplicates are answered while the first books the courier
            deadline = time.monotonic() + 30
            while sum(r.ready() for r in sent) < 4 and time.monotonic() < deadline:
                time.sleep(0.05)
            couriers = redis.Redis.from_url(f"{env['SHOP_REDIS_URL']}/3")
            couriers.rpush(COURIER.format(order_id=1), "booked")
            results = [r.get(timeout=30) for r in sent]
        finally:
            worker.stop()
            worker.log.unlink(missing_ok=True)
        ran = [r for r in results if not is_skipped(r)]
        order = Order.objects.get(pk=1)
        print(f"Ship order 1, asked 5 times: {len(ran)} ran, {len(results) - len(ran)} skipped")
        print(f"The lock key used the prefix from settings: "
              f"{all(r['key'].startswith('shop-locks:') for r in results)}")
        print(f"Order 1 is {order.state}, written with the lock's token: "
              f"{[order.fence] == [r['token'] for r in ran]}")
        ok = (len(ran) == 1 and order.state == "shipped" and order.fence == ran[0]["token"]
              and config.ttl == 20 and config.key_prefix == "shop-locks:")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
