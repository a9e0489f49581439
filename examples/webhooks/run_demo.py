"""A payment provider repeats its webhook; without the lock the order is charged
several times, with it exactly once.

    python examples/webhooks/run_demo.py [--sqlite]

Starts everything it needs and stops it at the end: a redis-server of its own
(broker, results and locks), a database (a fresh PostgreSQL database on
127.0.0.1:5432 when one answers, dropped at the end; else SQLite in a temporary
folder), a Celery worker (prefork, 4 processes) and the Flask endpoint
(``web.py``). Then it POSTs each order's webhook 5 times at once over HTTP, to
the unguarded endpoint for orders 1-3 and to the guarded one for orders 11-13,
and prints what was charged.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import subprocess
import sys
import tempfile
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

from celery_singleton_lock.testing import CeleryWorker, RedisServer

HERE = Path(__file__).resolve().parent
UNGUARDED = {1: 4200, 2: 1999, 3: 12500}
GUARDED = {11: 4200, 12: 1999, 13: 12500}
DELIVERIES = 5
PG_ADMIN = os.environ.get("WEBHOOKS_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/postgres")


@contextlib.contextmanager
def database(sqlite: bool) -> Iterator[str]:
    """A database URL for the demo alone, removed at the end."""
    if not sqlite:
        try:
            import psycopg

            admin = psycopg.connect(PG_ADMIN, autocommit=True, connect_timeout=3)
        except Exception as exc:  # no driver, no server: SQLite will do
            print(f"No PostgreSQL ({type(exc).__name__}); using SQLite")
        else:
            name = f"slt_webhooks_{uuid.uuid4().hex[:8]}"
            admin.execute(f'CREATE DATABASE "{name}"')
            print(f"Created PostgreSQL database {name}")
            try:
                yield PG_ADMIN.rsplit("/", 1)[0] + "/" + name
            finally:
                admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
                admin.close()
            return
    with tempfile.TemporaryDirectory(prefix="webhooks-") as folder:
        print("Using SQLite")
        yield f"sqlite:///{folder}/shop.db"


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 202, resp.status
        return dict(json.load(resp))


def deliver(base: str, path: str, order: int, cents: int) -> list[str]:
    """The order's webhook, DELIVERIES times at once; the task ids."""
    body = {"order_id": order, "amount_cents": cents}
    with ThreadPoolExecutor(DELIVERIES) as pool:
        return [r["task_id"] for r in pool.map(lambda _: post(base + path, body),
                                                range(DELIVERIES))]


@contextlib.contextmanager
def web_endpoint(env: dict[str, str]) -> Iterator[str]:
    """``web.py`` on a port of its own choosing; its base URL, stopped at the end.

    Waits for the line the server prints once it listens; if it exits first, the
    error names what it printed.
    """
    with tempfile.TemporaryFile("w+") as errors:
        web = subprocess.Popen([sys.executable, "web.py", "--port", "0"], cwd=HERE,
                               env={**os.environ, **env}, stdout=subprocess.PIPE,
                               stderr=errors, text=True)
        try:
            assert web.stdout is not None
            ready, _, _ = select.select([web.stdout], [], [], 60)
            line = web.stdout.readline() if ready else ""
            if not line.startswith("Listening on "):
                web.kill()
                web.wait()
                errors.seek(0)
                raise RuntimeError("the web endpoint did not start "
                                   f"(exit {web.returncode}):\n{line}{errors.read()}")
            yield line.split()[-1]
        finally:
            web.terminate()
            web.wait(10)


def run(redis_url: str, db_url: str) -> int:
    env = {"WEBHOOKS_REDIS_URL": redis_url, "WEBHOOKS_DATABASE": db_url,
           "WEBHOOKS_QUEUE": f"webhooks-{uuid.uuid4().hex[:8]}",
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    os.environ.update(env)
    sys.path.insert(0, str(HERE))
    import ledger
    import payments

    from celery_singleton_lock import is_skipped

    ledger.create({**UNGUARDED, **GUARDED})
    worker = CeleryWorker("payments", env["WEBHOOKS_QUEUE"], concurrency=4, env=env,
                          cwd=str(HERE))
    try:
        worker.start()
        with web_endpoint(env) as base:
            print(f"Worker ready; endpoint on {base}. Each webhook is delivered "
                  f"{DELIVERIES} times at once.\n")
            results: list[tuple[int, Any]] = []
            for orders, path in ((UNGUARDED, "/webhooks/payment-unguarded"),
                                 (GUARDED, "/webhooks/payment")):
                for order, cents in orders.items():
                    ids = deliver(base, path, order, cents)
                    results += [(order, payments.app.AsyncResult(t).get(timeout=60))
                                for t in ids]
    finally:
        worker.stop()
        worker.log.unlink(missing_ok=True)

    print(f"{'order':>5}  {'endpoint':<10} {'deliveries':>10} {'ran':>4} {'skipped':>7} "
          f"{'charges':>7}  charged")
    ok, doubled = True, 0
    for order, cents in {**UNGUARDED, **GUARDED}.items():
        mine = [r for o, r in results if o == order]
        skipped = sum(1 for r in mine if is_skipped(r))
        taken = ledger.charges(order)
        guarded = order in GUARDED
        print(f"{order:>5}  {'guarded' if guarded else 'unguarded':<10} {len(mine):>10} "
              f"{len(mine) - skipped:>4} {skipped:>7} {len(taken):>7}  "
              f"{sum(c for c, _, _ in taken) / 100:.2f} of {cents / 100:.2f}")
        if guarded:
            ok = ok and len(taken) == 1 and ledger.order(order)[0] == "paid"
        elif len(taken) > 1:
            doubled += 1
    print()
    print(f"Without the lock: {doubled} of {len(UNGUARDED)} orders charged more than once.")
    print("With the lock: every order charged exactly once." if ok
          else "With the lock: SOME ORDER WAS NOT CHARGED EXACTLY ONCE")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sqlite", action="store_true", help="use SQLite even if "
                        "PostgreSQL answers")
    args = parser.parse_args()
    with RedisServer() as server, database(args.sqlite) as db_url:
        return run(f"redis://127.0.0.1:{server.port}", db_url)


if __name__ == "__main__":
    sys.exit(main())
