"""examples/webhooks: a Flask endpoint called over HTTP, Celery worker subprocesses,
a real database. Without the lock a repeated webhook charges an order several
times; with it, once; and a holder paused past its lease has its late write
refused by PostgreSQL through the fencing token."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
import uuid
from typing import Any

import pytest
from celery import Celery

from celery_singleton_lock.testing import CeleryWorker, RedisServer, wait_for
from tests.pg import own_database
from tests.support import ROOT, discard, owner_record

pytestmark = pytest.mark.worker

HERE = ROOT / "examples" / "webhooks"


def web_endpoint(env: dict[str, str]) -> contextlib.AbstractContextManager[str]:
    """web.py started the demo's way: on a port it picks, or an error with its output."""
    spec = importlib.util.spec_from_file_location("_webhooks_demo", HERE / "run_demo.py")
    assert spec and spec.loader
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    return demo.web_endpoint(env)  # type: ignore[no-any-return]


def run_demo(*args: str) -> str:
    out = subprocess.run([sys.executable, str(HERE / "run_demo.py"), *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def check_table(output: str) -> None:
    rows = {int(m[0]): (m[1], int(m[2]), int(m[3]), int(m[4]), int(m[5])) for m in re.findall(
        r"^\s+(\d+)\s+(guarded|unguarded)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)", output, re.M)}
    assert set(rows) == {1, 2, 3, 11, 12, 13}, output
    for order, (kind, deliveries, ran, skipped, charges) in rows.items():
        assert deliveries == 5
        if kind == "guarded":
            assert (ran, skipped, charges) == (1, 4, 1), (order, output)
    assert any(r[4] > 1 for r in rows.values() if r[0] == "unguarded"), \
        "the demo should show the double charge the lock prevents:\n" + output
    assert "With the lock: every order charged exactly once." in output


def test_webhook_demo_on_postgresql_double_charges_without_the_lock_and_once_with_it():
    with own_database():  # skips, saying why, when no PostgreSQL answers
        pass
    output = run_demo()
    assert "Created PostgreSQL database" in output
    check_table(output)


def test_webhook_demo_on_sqlite_double_charges_without_the_lock_and_once_with_it():
    check_table(run_demo("--sqlite"))


def post(url: str, body: dict[str, Any]) -> str:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 202
        return str(json.load(resp)["task_id"])


def test_a_holder_paused_past_its_lease_has_its_charge_refused_by_postgresql():
    """Holder A claims order 21 and is SIGSTOPped while it talks to the bank; its
    2 s lease lapses; a repeated webhook runs B with a higher token, which charges
    the order; A is SIGCONTed and its write is refused (StaleTokenError): one
    charge, by B, and the row keeps B's token."""
    with own_database() as dsn, RedisServer() as redis_server:
        import psycopg

        redis_url = f"redis://127.0.0.1:{redis_server.port}"
        env = {"WEBHOOKS_REDIS_URL": redis_url, "WEBHOOKS_DATABASE": dsn,
               "WEBHOOKS_QUEUE": f"webhooks-{uuid.uuid4().hex[:8]}",
               "WEBHOOKS_LOCK_TTL": "2", "WEBHOOKS_AUTHORIZE_SECONDS": "4",
               "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
        subprocess.run([sys.executable, "-c", "import ledger; ledger.create({21: 5000})"],
                       cwd=HERE, env={**os.environ, **env}, check=True, timeout=30)
        worker = CeleryWorker("payments", env["WEBHOOKS_QUEUE"], concurrency=2, env=env,
                              cwd=str(HERE)).start()
        locks = redis_server.client(2)
        results = Celery(backend=f"{redis_url}/1")
        paused = 0
        try:
            with web_endpoint(env) as base:
                url = f"{base}/webhooks/payment"
                body = {"order_id": 21, "amount_cents": 5000}
                first = post(url, body)

                def fence() -> int:
                    with psycopg.connect(dsn) as conn:
                        row = conn.execute("SELECT fence FROM orders WHERE id = 21").fetchone()
                        return int(row[0]) if row else 0

                token_a = wait_for(fence, 20, what="A's claim of the order")
                lock_key = next(iter(locks.scan_iter("*:lock")))
                record = owner_record(locks, lock_key)
                assert record["task"] == first and int(record["token"]) == token_a
                paused = int(record["pid"])
                os.kill(paused, signal.SIGSTOP)
                wait_for(lambda: not locks.exists(lock_key), 10, what="A's lease to run out")

                second = post(url, body)
                b = results.AsyncResult(second).get(timeout=30)
                assert b["outcome"] == "charged" and b["token"] > token_a, b

                os.kill(paused, signal.SIGCONT)
                paused = 0
                a = results.AsyncResult(first).get(timeout=30)
                assert a == {"order_id": 21, "outcome": "stale write refused", "token": token_a,
                             "stored": b["token"]}, a
                with psycopg.connect(dsn) as conn:
                    charges = conn.execute("SELECT amount_cents, token, task_id FROM charges "
                                           "WHERE order_id = 21").fetchall()
                    order = conn.execute("SELECT state, fence FROM orders WHERE id = 21").fetchone()
                assert charges == [(5000, b["token"], second)], "one charge, by the newer holder"
                assert order == ("paid", b["token"])
                assert "stale write to orders {'id': 21} refused" in worker.logs()
        finally:
            if paused:
                os.kill(paused, signal.SIGCONT)
            discard(worker)

