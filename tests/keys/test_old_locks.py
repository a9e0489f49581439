"""The old library's lock during a rollout (``singleton_also_lock``), taken,
renewed and deleted by our scripts (``old_take.lua``, ``old_keep.lua``) on a
real Redis, call by call: whose value is this execution's and whose is not;
then two sentences of docs/migration.md's rollout section end to end: a send
our own key refuses gives the old key back, and a retry keeps it through its
countdown (a real worker).
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis

from celery_singleton_lock.rollout import OtherLibrary, OtherLock
from tests.conftest import Events
from tests.support import RedisServer, Worker, wait_for
from tests.workerapp import make_app


def old_lock(r: redis.Redis, library: str, task_id: str) -> OtherLock:
    other = OtherLibrary(library=library, task_name="t.x", client=r, key_prefix="",
                         expiry_ms=None, names=None, signature=None)
    return other.lock(f"old-{uuid.uuid4().hex}", task_id, adopt=library == "celery_once")


def test_an_absent_old_key_is_taken_for_the_lease(r):
    lock = old_lock(r, "celery_singleton", "task-a")
    assert lock.take(5_000) is None
    assert r.get(lock.key) == "task-a" and 4_000 < r.pttl(lock.key) <= 5_000
    assert lock.take(8_000) is None  # this call's own value: taken again, renewed
    assert 7_000 < r.pttl(lock.key) <= 8_000


def test_a_celery_singleton_value_of_32_hex_digits_is_another_calls(r):
    """celery-singleton writes the task id, which a caller may give as 32 hex
    digits: only celery-once's key holds a token this message may adopt."""
    lock = old_lock(r, "celery_singleton", "task-a")
    other = uuid.uuid4().hex
    r.set(lock.key, other)
    assert lock.take(5_000) == other
    assert r.get(lock.key) == other and r.pttl(lock.key) == -1


def test_a_celery_once_token_is_adopted_and_a_task_id_is_not(r):
    lock = old_lock(r, "celery_once", "task-a")
    token = uuid.uuid4().hex
    r.set(lock.key, token, px=60_000)
    assert lock.take(5_000) is None and lock.value == token
    assert 4_000 < r.pttl(lock.key) <= 5_000
    held = old_lock(r, "celery_once", "task-a")
    r.set(held.key, str(uuid.uuid4()))  # another call's task id, dashes and all
    assert held.take(5_000) == r.get(held.key)


def test_the_old_key_is_renewed_and_deleted_only_while_it_holds_this_calls_value(r):
    lock = old_lock(r, "celery_singleton", "task-a")
    assert lock.take(5_000) is None
    lock.keep(20_000)
    assert 19_000 < r.pttl(lock.key) <= 20_000
    lock.release()
    assert not r.exists(lock.key)
    r.set(lock.key, "task-b", px=3_000)  # another call's since
    lock.keep(20_000)
    lock.release()
    assert r.get(lock.key) == "task-b" and r.pttl(lock.key) <= 3_000


# -- docs/migration.md, "A rollout with no double-run window": a send, a retry --------

def also_lock(server: RedisServer) -> dict[str, Any]:
    """The rollout setting of the guide: celery-singleton's locks in db 4."""
    return {"singleton_also_lock": {"library": "celery_singleton",
                                    "url": f"{server.url().rsplit('/', 1)[0]}/4"}}


def test_a_send_this_library_refuses_gives_the_old_key_back(redis_server):
    """docs/migration.md:237-238: "A send of ours that this library refuses too
    gives the old key back." The call's old key is free, but our key is held by
    a running execution (one started before the rollout setting was on): the
    send takes the old key, is refused by ours (a DeduplicatedResult naming the
    running holder), and the old key is gone again, so an old caller's send
    of that call is not refused by a key nobody holds."""
    from celery_singleton_lock import SingletonConfig, is_deduplicated
    from celery_singleton_lock.engine.registry import connect
    from celery_singleton_lock.engine.request import Lease, Request

    app = make_app(redis_server.url(), f"q-{uuid.uuid4().hex[:8]}",
                   conf=also_lock(redis_server))
    task = app.tasks["t.queue_and_run"]
    key = f"given-back-{uuid.uuid4().hex}"
    other = task.singleton_settings().other
    assert other is not None
    old_key, old_locks = other.key((key,), {}), redis_server.client(4)
    assert old_key is not None and not old_locks.exists(old_key)
    holder = f"running-{uuid.uuid4().hex[:8]}"
    engine = connect(SingletonConfig.defaults(redis_server.url(2)))
    try:
        engine.acquire(task.singleton_keys(key), Request(
            task_id=holder, exec_id=f"{holder}-exec", lease=Lease.of_ms(120_000),
            hostname="w1@host", retries=0, task_name=task.name))
        refused = task.delay(key)
        assert is_deduplicated(refused) and refused.holder == holder, refused
        assert not old_locks.exists(old_key), "the refused send kept the old key"
        assert engine.release(task.singleton_keys(key), f"{holder}-exec", holder,
                              finished=False)
    finally:
        engine.close()


@pytest.mark.worker
def test_a_retry_keeps_the_old_key_through_its_countdown(own_redis):
    """docs/migration.md:245: while a fleet moves over, "a `self.retry()` keeps
    it [the old library's key] through the countdown". A run that retries with
    a countdown of two leases: the old key is never deleted nor expired
    between the send and the retried run's end, which deletes it once (Redis's
    keyspace events of the key, a server of this test's own)."""
    own_redis.client(0).config_set("notify-keyspace-events", "Kgx")
    conf = also_lock(own_redis)
    queue = f"q-{uuid.uuid4().hex[:8]}"
    app = make_app(own_redis.url(), queue, conf=conf)
    task = app.tasks["t.retrier"]
    key = f"retried-{uuid.uuid4().hex}"
    other = task.singleton_settings().other
    assert other is not None
    old_key = other.key((key,), {})
    ttl = float(app.conf.singleton_ttl)
    watch = own_redis.client(4).pubsub(ignore_subscribe_messages=True)
    watch.subscribe(f"__keyspace@4__:{old_key}")
    worker = Worker(own_redis.url(), queue, conf=conf, concurrency=1).start()
    try:
        result = task.apply_async((key,), {"attempts": 1, "countdown": 2 * ttl, "tag": "r"})
        assert result.get(timeout=60)["tag"] == "r#1"
        old_locks = own_redis.client(4)
        wait_for(lambda: not old_locks.exists(old_key), 20,
                 what="the old key deleted at the retried run's end")
        # a mark in the key's events: every event of the worker's before it came first
        old_locks.set(f"{old_key}:mark", 1)
        old_locks.rename(f"{old_key}:mark", old_key)
        seen: list[str] = []

        def marked() -> bool:
            message = watch.get_message(timeout=0.1)
            if message is not None and message["type"] == "message":
                seen.append(message["data"])
            return "rename_to" in seen

        wait_for(marked, 20, what="the mark's keyspace event")
        old_locks.delete(old_key)
        gone = [event for event in seen if event in ("del", "expired", "evicted")]
        assert gone == ["del"] and seen[-2:] == ["del", "rename_to"], seen
        assert [e["tag"] for e in Events(own_redis).starts("r#")] == ["r#0", "r#1"]
    finally:
        watch.close()
        worker.stop(timeout=0)
