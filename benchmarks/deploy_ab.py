"""Hot-path CPU of acquire + release on one standalone Redis, in-process.

Run once per code version (``PYTHONPATH`` picks the package) against the same
redis-server; prints CPU microseconds per acquire+release pair.

    python benchmarks/deploy_ab.py PORT [PAIRS]
"""

from __future__ import annotations

import sys
import time
import uuid

from celery_singleton_lock import SingletonConfig
from celery_singleton_lock.engine import LockEngine
from celery_singleton_lock.keys import LockKeys


def main() -> None:
    port = int(sys.argv[1])
    pairs = int(sys.argv[2]) if len(sys.argv) > 2 else 20000
    engine = LockEngine.from_config(SingletonConfig.defaults(f"redis://127.0.0.1:{port}/5"))
    keys = [LockKeys("singleton:", uuid.uuid4().hex) for _ in range(64)]
    for k in keys:  # warm: connection made, scripts loaded
        engine.acquire(k, task_id="w", exec_id="w", lease_ms=5000, hostname="h", retries=0,
                       task_name="t")
        engine.release(k, "w", "w")
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for i in range(pairs):
        k = keys[i % 64]
        engine.acquire(k, task_id="t", exec_id="e", lease_ms=5000, hostname="h", retries=0,
                       task_name="t")
        engine.release(k, "e", "t")
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    print(f"{cpu / pairs * 1e6:.2f} {wall / pairs * 1e6:.2f}")


if __name__ == "__main__":
    main()
