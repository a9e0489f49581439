"""Report generation with ``queue_and_run`` and a cache rebuild with ``queue``.

    python examples/reports_and_cache/run_demo.py

Starts a redis-server of its own and a Celery worker (prefork, 2 processes),
then: requests one month's report 5 times (one is written, every request gets
it); asks for a cache rebuild 5 times while one is pending (one runs), and once
more after it started (a second rebuild runs after the first).
"""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

from celery_singleton_lock.testing import CeleryWorker, RedisServer, wait_for

HERE = Path(__file__).resolve().parent


def main() -> int:
    with RedisServer() as server:
        env = {"REDIS_URL": f"redis://127.0.0.1:{server.port}",
               "DEMO_QUEUE": f"backoffice-{uuid.uuid4().hex[:8]}",
               "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
        os.environ.update(env)
        sys.path.insert(0, str(HERE))
        import tasks

        from celery_singleton_lock import is_deduplicated

        worker = CeleryWorker("tasks", env["DEMO_QUEUE"], concurrency=2, env=env,
                              cwd=str(HERE)).start()
        try:
            print("Report for 2026-10, requested 5 times:")
            requests = [tasks.monthly_report.delay("2026-10") for _ in range(5)]
            refused = sum(is_deduplicated(r) for r in requests)
            files = {r.get(timeout=30) for r in requests}
            print(f"  sent 1, not sent {refused}; every request got {sorted(files)}")
            ok = refused == 4 and files == {"reports/2026-10.pdf"}

            print("Cache rebuild of 'prices', asked 5 times while one is pending:")
            # due in 2 s: the first stays pending while the other four are asked,
            # however quickly a worker would have started it
            asks = [tasks.rebuild_cache.apply_async(("prices",), countdown=2) for _ in range(5)]
            refused = sum(is_deduplicated(r) for r in asks)
            print(f"  sent 1, not sent {refused}")
            first = asks[0]
            wait_for(lambda: first.state == "REBUILDING", 10, what="the rebuild to start")
            later = tasks.rebuild_cache.delay("prices")
            print(f"  asked again once it had started: sent={not is_deduplicated(later)}")
            done = [first.get(timeout=30), later.get(timeout=30)]
            print(f"  rebuilds that ran: {len(set(done))}")
            ok = ok and refused == 4 and not is_deduplicated(later) and len(set(done)) == 2
        finally:
            worker.stop()
            worker.log.unlink(missing_ok=True)
    print("\nOne report written for five requests; one rebuild per pending change."
          if ok else "\nUNEXPECTED: see above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
