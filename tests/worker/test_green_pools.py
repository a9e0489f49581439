"""gevent and eventlet pools: real `celery worker -P gevent|eventlet -c 50` processes.

Run when gevent / eventlet are installed (the ``green`` extra). Each pool:
duplicates skipped while 20 other greenlets run, a task longer than its lease
renewed, a greenlet that blocks the event loop (shorter than the lease: the
lock holds; longer: the key expires and the lock is lost, as the docs say),
revoke with terminate, the worker killed with kill -9 (the key frees within
the lease), the lock Redis restarted mid-run (the lock is written back). And the ``solo``
pool: a task longer than its lease renewed by a thread of the worker.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Iterator

import pytest

from celery_singleton_lock import is_skipped
from tests.greenapp import BLOCK_TTL, make_green_app
from tests.support import RedisServer, Worker, discard, installed, owner_field, wait_for
from tests.workerapp import make_app

POOLS = ["gevent", "eventlet"]

pytestmark = pytest.mark.worker


def green_worker(redis_url: str, pool: str, lock_url: str | None = None) -> Worker:
    installed(pool, "extra 'green'")
    worker = Worker(redis_url, f"{pool}-{uuid.uuid4().hex[:6]}", pool=pool, concurrency=50,
                    lock_url=lock_url)
    worker.cmd[worker.cmd.index("tests.workerapp:app")] = "tests.greenapp:app"
    return worker.start()


@pytest.fixture(scope="module", params=POOLS)
def green(request: Any, redis_server: RedisServer) -> Iterator[tuple[Worker, Any]]:
    """A green worker of the module's server, and the caller's app."""
    worker = green_worker(redis_server.url(), request.param)
    yield worker, make_green_app(redis_server.url(), worker.queue)
    discard(worker)


def test_duplicates_skip_and_a_task_longer_than_its_lease_keeps_it(green, r, events, key):
    """A task on a 1 s lease running past four of them, 20 duplicates of it
    and 20 other calls running at the same time on one process: one run of
    the key at a time, every duplicate skipped, the long task never lost its
    lock. (It runs until the test has seen all that and four leases passed:
    ``finish:<key>``.)"""
    _, app = green
    long = app.tasks["t.hold_short"].delay(key, 120.0, "long")
    started = wait_for(lambda: events.starts("long"), 20, what="the long task to start")[0]
    others = [app.tasks["t.hold"].delay(f"{key}-{i}", 1.0, f"other{i}") for i in range(20)]
    dups = [app.tasks["t.hold_short"].delay(key, 0.0, f"dup{i}") for i in range(20)]
    got = [d.get(timeout=30) for d in dups]
    ran = [g for g in got if not is_skipped(g)]
    assert not ran, (
        f"{len(ran)} of 20 duplicates ran while the long task held the key: {ran}; the "
        f"key's runs: {[e for e in events.starts() if e.get('key') == key]}; its ends: "
        f"{[e for e in events.ends() if e.get('key') == key]}")
    assert all(o.get(timeout=30)["tag"].startswith("other") for o in others)
    wait_for(lambda: time.time() - started["t"] > 4.0, 10, what="four leases to pass")
    assert not long.ready()
    events.client.set(f"finish:{key}", 1)
    result = long.get(timeout=30)
    assert result["lost"] is False
    starts = events.starts()
    assert max(e["concurrent"] for e in starts if e["key"] == key) == 1
    # the others ran side by side, on the one process: green concurrency
    other = sorted((e["t"], 1) for e in starts if e["tag"].startswith("other")) + sorted(
        (e["t"], -1) for e in events.ends("other"))
    at_once, most = 0, 0
    for _, step in sorted(other):
        at_once += step
        most = max(most, at_once)
    assert most > 1
    assert len({e["pid"] for e in starts}) == 1
    assert not r.exists(app.tasks["t.hold_short"].singleton_keys(key).lock)


def test_a_greenlet_blocking_the_event_loop(green, r, events, key):
    """Blocked for 1 s (longer than the 0.5 s renewal interval, shorter than
    the 1.5 s lease): the lock holds. Blocked for 3 s: the renewer cannot run,
    the key expires in Redis while the task still runs (another worker could
    take it), and the task finds its lock lost."""
    _, app = green
    block = app.tasks["t.block_hub"]
    short = block.delay(f"{key}-short", 1.0).get(timeout=30)
    assert short == {"lost_after_block": False, "lost": False}

    lock = block.singleton_keys(f"{key}-long", 0.0).lock
    long = block.delay(f"{key}-long", 3 * BLOCK_TTL)
    wait_for(lambda: r.exists(lock), 20, what="the blocking task's lock")
    wait_for(lambda: not r.exists(lock), 20, interval=0.02,
             what="the key to expire while the loop is blocked")
    assert not long.ready()  # still running: the key is free under it
    assert long.get(timeout=30) == {"lost_after_block": True, "lost": True}


def test_revoke_with_terminate_frees_the_key(green, r, events, key):
    _, app = green
    hold = app.tasks["t.hold"]
    victim = hold.delay(key, 30.0, "victim")
    wait_for(lambda: events.starts("victim"), 20, what="the victim to start")
    assert r.exists(hold.singleton_keys(key).lock)
    victim.revoke(terminate=True)
    wait_for(lambda: not r.exists(hold.singleton_keys(key).lock), 20,
             what="the key freed by the terminated greenlet")
    assert hold.delay(key, 0.0, "after").get(timeout=20)["tag"] == "after"


@pytest.mark.parametrize("pool", POOLS)
def test_a_worker_killed_with_kill_9_frees_the_key_within_the_lease(pool, redis_server, r,
                                                                    events, key):
    worker = green_worker(redis_server.url(), pool)
    try:
        app = make_green_app(redis_server.url(), worker.queue)
        hold = app.tasks["t.hold"]  # lease 2 s
        hold.delay(key, 30.0, "killed")
        wait_for(lambda: events.starts("killed"), 20, what="the task to start")
        worker.kill_all()
        lock = hold.singleton_keys(key).lock
        remaining = r.pttl(lock)
        assert 0 < remaining <= 2000  # never more than the lease
        wait_for(lambda: not r.exists(lock), 10, what="the key to expire")
    finally:
        discard(worker)


@pytest.mark.parametrize("pool", POOLS)
def test_the_lock_redis_restarted_mid_run_gets_the_lock_written_back(pool, redis_server,
                                                                     own_redis, events, key):
    worker = green_worker(redis_server.url(), pool, lock_url=own_redis.url())
    try:
        app = make_green_app(redis_server.url(), worker.queue, lock_url=own_redis.url())
        hold = app.tasks["t.hold"]
        lock = hold.singleton_keys(key).lock
        running = hold.delay(key, 5.0, "through")
        wait_for(lambda: events.starts("through"), 20, what="the task to start")
        own_redis.stop()
        own_redis.start()
        locks = own_redis.client()
        wait_for(lambda: locks.exists(lock), 20, what="the lock written back")
        dup = hold.delay(key, 0.0, "dup")
        assert is_skipped(dup.get(timeout=20))
        assert running.get(timeout=30)["lost"] is False
        assert max(e["concurrent"] for e in events.starts() if e["key"] == key) == 1
    finally:
        discard(worker)


def test_solo_renews_the_lock_of_a_run_longer_than_its_lease(redis_server, r, events, key):
    """docs/pools.md, ``solo``: a run longer than its lease is "renewed by a
    thread of the worker". A real ``-P solo`` worker runs ``t.hold_short``
    (1 s lease) until ``finish:<key>``; the test watches the key's PTTL go back
    up nine times (three leases of renewals), the owner record naming the
    run's token throughout; a duplicate sent then to a second solo worker is
    skipped against it; the run ends still holding its lock, never told it
    was lost."""
    solo = Worker(redis_server.url(), f"solo-{uuid.uuid4().hex[:6]}", pool="solo",
                  concurrency=1).start()
    other = Worker(redis_server.url(), f"solo2-{uuid.uuid4().hex[:6]}", pool="solo",
                   concurrency=1).start()
    try:
        app = make_app(redis_server.url(), solo.queue)
        task = app.tasks["t.hold_short"]
        lock = task.singleton_keys(key).lock
        long = task.delay(key, 600.0, "long")
        [started] = wait_for(lambda: events.starts("long"), 60, what="the long task to start")
        token = str(started["token"])
        seen: dict[str, Any] = {"rises": 0, "last": None}

        def renewed(count: int) -> bool:
            pttl = r.pttl(lock)
            assert pttl > 0, (
                f"the lock key is gone (PTTL {pttl}) while the run still runs, after "
                f"{seen['rises']} renewals seen; worker log:\n{solo.logs()[-3000:]}")
            assert owner_field(r, lock, "token") == token, owner_field(r, lock, "token")
            if seen["last"] is not None and pttl > seen["last"]:
                seen["rises"] += 1  # the PTTL went back up: renewed
            seen["last"] = pttl
            return seen["rises"] >= count

        wait_for(lambda: renewed(9), 60, interval=0.01, what="nine renewals of the lock")
        dup = task.apply_async((key, 0.0, "dup"), queue=other.queue).get(timeout=60)
        assert is_skipped(dup) and dup["holder"] == long.id, dup
        wait_for(lambda: renewed(12), 60, interval=0.01, what="three renewals more")
        assert not long.ready() and not events.ends("long")
        events.client.set(f"finish:{key}", 1)
        result = long.get(timeout=60)
        assert result["lost"] is False and str(result["token"]) == token, result
        assert [e["lost"] for e in events.ends("long")] == [False]
        assert not events.starts("dup")
        wait_for(lambda: not r.exists(lock), 30, what="the key freed at the end")
    finally:
        discard(solo)
        discard(other)
