"""``async def`` SingletonTask bodies: the lock is taken before the coroutine
starts, held (renewed) while it awaits, freed when it returns, raises or is
cancelled; many executions of one process, on one thread, each hold their own.

Real workers run celery-aio-pool (its AsyncIOPool, one coroutine at a time per
worker process: docs/pools.md); executions sharing one loop and one thread
run in this process on a real Redis, with the worker's renewer.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import uuid
from collections import defaultdict
from typing import Any, Iterator

import pytest

from celery_singleton_lock import SingletonTask
from celery_singleton_lock.conflict.results import is_skipped
from celery_singleton_lock.engine.registry import engine_for
from celery_singleton_lock.testing import CeleryWorker
from tests.support import ROOT, RedisServer, discard, missing, wait_for

AIO_POOL = "celery_aio_pool.pool:AsyncIOPool"


@pytest.fixture(autouse=True)
def _needs_celery_aio_pool() -> None:
    try:
        import celery_aio_pool  # noqa: F401
    except ImportError:
        missing("celery-aio-pool is not installed (pip install 'celery-singleton-lock[asyncio]')")


def aio_worker(redis_url: str, queue: str, conf: dict[str, Any] | None = None) -> CeleryWorker:
    return CeleryWorker("tests.aioapp:app", queue, pool="custom", concurrency=1, env={
        "CELERY_CUSTOM_WORKER_POOL": AIO_POOL, "SLT_REDIS_URL": redis_url, "SLT_QUEUE": queue,
        "SLT_CONF": json.dumps(conf or {}),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
        cwd=str(ROOT))


@pytest.fixture
def aio_workers(redis_server: RedisServer) -> Iterator[tuple[str, list[CeleryWorker]]]:
    """Two celery-aio-pool workers on a queue of their own."""
    queue = f"aio-{uuid.uuid4().hex[:8]}"
    workers = [aio_worker(redis_server.url(), queue).start() for _ in range(2)]
    yield queue, workers
    for worker in workers:
        discard(worker)


@pytest.mark.worker
def test_twenty_duplicated_coroutine_calls_over_five_keys_run_each_key_once_at_a_time(
        redis_server, aio_workers, events, r):
    """Two celery-aio-pool workers, 20 calls of an ``async def`` body (0.3 s of
    ``await``), four per key, sent key by key so the two workers start on the
    same key: each key runs once at a time (its lock held while the body
    awaits), the duplicates wait (``retry``) and every call runs."""
    from tests.aioapp import make_aio_app

    queue, _workers = aio_workers
    app = make_aio_app(redis_server.url(), queue)
    keys = [f"k{n}-{uuid.uuid4().hex[:6]}" for n in range(5)]
    calls = [app.tasks["a.hold"].delay(key, f"{key}/{i}") for key in keys for i in range(4)]
    assert sorted(c.get(timeout=60) for c in calls) == sorted(
        f"{key}/{i}" for key in keys for i in range(4))
    starts = [e for e in events.all() if e["ev"] == "start"]
    assert len(starts) == 20
    assert all(e["concurrent"] == 1 for e in starts), [e for e in starts if e["concurrent"] > 1]
    # its key's lock, seen from inside the body; on failure every event of the key
    unheld = {e["key"] for e in starts if not e["held"]}
    assert not unheld, "a body ran without its key's lock; every event of the key:\n" + (
        "\n".join(json.dumps(e) for e in events.all() if e.get("key") in unheld))
    assert not any(e["lost"] for e in events.all() if e["ev"] == "end")
    assert len({e["pid"] for e in starts}) == 2  # both workers ran some
    runs: dict[str, list[tuple[float, float]]] = defaultdict(list)
    ends = {e["id"]: e["t"] for e in events.all() if e["ev"] == "end"}
    for e in starts:
        runs[e["key"]].append((e["t"], ends[e["id"]]))
    for key, spans in runs.items():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), (key, spans)
    assert not list(r.scan_iter("singleton:*:lock"))  # every key freed


@pytest.mark.worker
def test_a_cancelled_coroutine_frees_its_key_at_once(redis_server, events, r):
    """A coroutine cancelled while it awaits (lease 30 s) frees its key at
    once: the key is gone and the next call of that key runs, long before the
    lease could have run out."""
    queue = f"aio-{uuid.uuid4().hex[:8]}"
    worker = aio_worker(redis_server.url(), queue).start()
    try:
        from tests.aioapp import make_aio_app

        app = make_aio_app(redis_server.url(), queue)
        key = uuid.uuid4().hex[:8]
        app.tasks["a.cancellable"].delay(key, "victim")
        started = wait_for(lambda: [e for e in events.all() if e["ev"] == "start"], 30,
                           what="the coroutine to start")
        lock_key = started[0]["lockkey"]
        assert started[0]["held"] and r.pttl(lock_key) > 20_000
        events.client.set(f"cancel:{key}", 1)
        wait_for(lambda: not r.exists(lock_key), 10, what="the cancelled coroutine's key freed")
        assert [e["tag"] for e in events.all() if e["ev"] == "end"] == ["victim"]
        assert app.tasks["a.hold"].delay(key, "next", 0.0).get(timeout=30) == "next"
        assert "CancelledError" in worker.logs()
    finally:
        discard(worker)


def test_many_coroutines_on_one_thread_each_hold_their_own_key_renewed_while_they_await(
        redis_server, r):
    """Twenty executions of an ``async def`` body over five keys, their
    coroutines on one event loop in one thread: the five that got a key hold it
    side by side, renewed by the worker's renewer while they await past their
    1 s lease, each seeing its own lock as ``self.singleton``; the fifteen
    duplicates are skipped before any coroutine exists. Then one returns, one
    raises, one is cancelled, and two are cancelled by an enclosing timeout:
    each frees its key at once."""
    from tests.aioapp import make_aio_app

    app = make_aio_app(redis_server.url(), "unused", {"singleton_ttl": 1.0})
    seen: dict[str, Any] = {}

    @app.task(base=SingletonTask, bind=True, name="a.inproc", shared=False,
              singleton_key=("key",), singleton_on_duplicate="skip")
    async def inproc(self: Any, key: str, how: str) -> str:
        seen[key] = (self.singleton, threading.get_ident())
        await asyncio.sleep(2.5 if how != "return" else 2.0)
        assert not self.singleton.lost and self.singleton is seen[key][0]
        if how == "raise":
            raise ValueError(key)
        return key

    hows = ["return", "raise", "cancel", "timeout", "timeout"]
    keys = [f"c{n}-{uuid.uuid4().hex[:6]}" for n in range(5)]
    bodies, skipped = [], 0
    for i in range(4):
        for key, how in zip(keys, hows):
            inproc.push_request(id=f"{key}-{i}", called_directly=False, is_eager=False,
                                hostname="w@h", retries=0, args=(key, how), kwargs={})
            try:
                out = inproc(key, how)
            finally:
                inproc.pop_request()
            if asyncio.iscoroutine(out):
                bodies.append((key, how, out))
            else:
                skipped += is_skipped(out)
    assert skipped == 15 and len(bodies) == 5
    lock_keys = {key: f"{inproc.singleton_keys(key, 'x').base}:lock" for key in keys}
    assert all(r.exists(k) for k in lock_keys.values())  # taken before the coroutines start

    async def run_all() -> dict[str, Any]:
        tasks = {}
        for key, how, coro in bodies:
            body = asyncio.wait_for(coro, 1.5) if how == "timeout" else coro
            tasks[key] = asyncio.ensure_future(body)
        await asyncio.sleep(1.6)  # past the 1 s lease: renewed; the timeouts hit
        held_now = {k: bool(r.exists(lk)) for k, lk in lock_keys.items()}
        tasks[keys[2]].cancel()
        await asyncio.sleep(0)
        await asyncio.sleep(0.05)
        held_after_cancel = bool(r.exists(lock_keys[keys[2]]))
        outcomes = await asyncio.gather(*tasks.values(), return_exceptions=True)
        return {"held": held_now, "cancelled_held": held_after_cancel,
                "outcomes": dict(zip(tasks, outcomes))}

    result = asyncio.run(run_all())
    assert result["held"] == {k: how != "timeout" for k, how in zip(keys, hows)}, result
    assert result["cancelled_held"] is False
    out = result["outcomes"]
    assert out[keys[0]] == keys[0] and isinstance(out[keys[1]], ValueError)
    assert isinstance(out[keys[2]], asyncio.CancelledError)
    assert all(isinstance(out[k], asyncio.TimeoutError) for k in keys[3:])
    assert not any(r.exists(k) for k in lock_keys.values())
    assert len({thread for _, thread in seen.values()}) == 1  # one thread ran every body
    assert len({id(lock) for lock, _ in seen.values()}) == 5
    assert engine_for(app).client.ping()


@pytest.mark.worker
def test_a_duplicate_sent_back_to_the_same_process_waits_again_for_the_lock(redis_server, events):
    """``retry`` under celery-aio-pool: a duplicate is sent again with its own
    task id, and with one worker process it comes back to the process that
    decided it. There it is decided again (waits while the key is held), and
    runs under the lock once the key is free: the request celery-aio-pool keeps
    for the task between calls carries nothing of the call before."""
    from celery_singleton_lock.testing import hold_key
    from tests.aioapp import make_aio_app

    queue = f"aio1-{uuid.uuid4().hex[:8]}"
    worker = aio_worker(redis_server.url(), queue).start()
    try:
        app = make_aio_app(redis_server.url(), queue)
        key = f"again-{uuid.uuid4().hex[:6]}"
        task = app.tasks["a.hold"]
        with hold_key(task, key, "dup"):
            dup = task.delay(key, "dup")
            rounds = f"a.hold[{dup.id}] waits:"
            try:
                wait_for(lambda: worker.logs().count(rounds) >= 3, 30,
                         what="three rounds of the duplicate waiting for the held key")
            except AssertionError:
                print(worker.logs()[-5000:], events.all())
                raise
            assert not events.starts("dup"), (
                "the duplicate ran while the key was held:\n" + "\n".join(
                    json.dumps(e) for e in events.all()))
        assert dup.get(timeout=30) == "dup"
        [start] = events.starts("dup")
        assert start["held"] is True, start
    finally:
        discard(worker)


@pytest.mark.worker
def test_a_coroutine_retry_keeps_its_key_through_the_countdown(redis_server, events, r):
    """docs/pools.md: an ``async def`` body that asks for a retry keeps the
    key for it, "as for a plain body" (docs/concepts.md: ``self.retry(countdown=
    ...)`` keeps the key through the countdown, a duplicate arriving meanwhile
    is a duplicate). One celery-aio-pool worker (one coroutine at a time): the
    duplicate, sent while the first run awaits, is decided after that run has
    asked for its retry and before the retried run starts, and is skipped
    against it; the retried run then runs under the lock."""
    from tests.aioapp import make_aio_app

    queue = f"aio-retry-{uuid.uuid4().hex[:8]}"
    worker = aio_worker(redis_server.url(), queue).start()
    try:
        app = make_aio_app(redis_server.url(), queue)
        task = app.tasks["a.retrier"]
        key = f"retry-{uuid.uuid4().hex[:6]}"
        # the duplicate is decided in milliseconds; a countdown of 15 s leaves a
        # loaded machine room for it (decided after it, the ordering check fails)
        first = task.delay(key, "first", 15.0)
        [start] = wait_for(lambda: events.starts("first#0"), 60, what="the first run to start")
        assert start["held"], start
        dup = task.delay(key, "dup", 15.0)  # waits for the first run's coroutine to end
        events.client.set(f"finish:{key}", 1)  # the first run asks for its retry
        wait_for(lambda: dup.ready() or events.starts("dup"), 60,
                 what="the duplicate decided")
        assert not events.starts("dup"), (
            "the duplicate ran while the retry waited its countdown:\n" + "\n".join(
                json.dumps(e) for e in events.all()) + "\n" + worker.logs()[-3000:])
        skipped = dup.get(timeout=30)
        assert is_skipped(skipped) and skipped["holder"] == first.id, skipped
        [retried] = wait_for(lambda: events.starts("first#1"), 60,
                             what="the retried run to start")
        [ended] = events.ends("first#0")
        decided = dup.date_done.timestamp()
        assert ended["t"] <= decided <= retried["t"], (ended, decided, retried)
        assert retried["held"] and retried["lockkey"] == start["lockkey"], retried
        result = first.get(timeout=60)
        assert result["lost"] is False and result["token"] == retried["token"] > 0, result
        assert not events.starts("dup")
        wait_for(lambda: not r.exists(start["lockkey"]), 30, what="the key freed at the end")
    finally:
        discard(worker)
