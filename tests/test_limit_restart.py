"""``singleton_limit = 2`` through a lock Redis killed and restarted empty at
any point of the renewal cycle: both slots are written back by their holders,
neither is declared lost, no third execution starts beside them and no slot
ever has two.

The slots of one key share its fencing counter; the first slot written back
recreates it, which the second slot's holder used to read as "released": it
was told ``lost`` and its slot went to a new execution while it still ran
(three at once, two in one slot). Engine-level checks of the write-back
(``reclaim.lua``) and of the slots kept for their holders meanwhile
(``acquire_slots.lua``) come first.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from celery_singleton_lock import SingletonConfig, is_skipped
from celery_singleton_lock.engines import connect
from celery_singleton_lock.keys import LockKeys
from celery_singleton_lock.replies import Acquire, Reclaim
from tests.support import RedisServer, Worker, discard, owner_record, wait_for
from tests.test_restart_race import OFFSETS, wait_for_renewal
from tests.workerapp import make_app

CONF = {"singleton_ttl": 3.0}


def grant(engine: Any, keys: LockKeys, n: int) -> Any:
    return engine.acquire(keys, task_id=f"task-{n}", exec_id=f"exec-{n}", lease_ms=30_000,
                          hostname="w1@host", retries=0, task_name="t.limit", slots=2)


def reclaim(engine: Any, keys: LockKeys, n: int, token: int) -> Any:
    return engine.reclaim(keys, task_id=f"task-{n}", exec_id=f"exec-{n}", token=token,
                          lease_ms=30_000, hostname="w1@host", retries=0, task_name="t.limit")


def test_every_slot_is_written_back_after_an_empty_restart_and_none_is_given_away(own_redis):
    """Two slots held, the server restarted empty: slot 1's write-back
    recreates the shared counter, and slot 2's holder still gets its slot back
    (before: "released", lost). Between the two write-backs a third execution
    is refused, not given slot 2. Tokens only go up. A slot written back and
    then released by someone else is lost, not taken back a second time."""
    engine = connect(SingletonConfig.defaults(own_redis.url(0)))
    keys = LockKeys("singleton:", uuid.uuid4().hex)
    first, second = grant(engine, keys, 1), grant(engine, keys, 2)
    assert (first.slot, second.slot) == (1, 2)
    own_redis.stop()
    own_redis.start()  # same port, empty
    one = reclaim(engine, keys.slot(1), 1, first.token)
    assert one.status is Reclaim.WRITTEN_BACK and one.token > second.token
    third = grant(engine, keys, 3)
    assert third.status is Acquire.HELD and third.holder is not None
    assert third.holder.task_id == "task-1"
    assert not own_redis.client().exists(keys.slot(2).lock)
    two = reclaim(engine, keys.slot(2), 2, second.token)
    assert two.status is Reclaim.WRITTEN_BACK and two.token > one.token
    assert owner_record(own_redis.client(), keys.slot(2).lock)["exec"] == "exec-2"
    # released by an operator after its write-back: lost, not written back again
    assert engine.release(keys.slot(2), "exec-2", "task-2", finished=False)
    assert reclaim(engine, keys.slot(2), 2, second.token).status is Reclaim.RELEASED
    # a slot written back and then released is free for the next execution
    fourth = grant(engine, keys, 4)
    assert fourth.status is Acquire.GRANTED and fourth.slot == 2
    assert fourth.token > two.token


def test_without_a_restart_a_released_slot_is_still_lost(own_redis):
    """No write-back happened: a slot whose key is gone while the counter is
    there was released, as before."""
    engine = connect(SingletonConfig.defaults(own_redis.url(0)))
    keys = LockKeys("singleton:", uuid.uuid4().hex)
    grant(engine, keys, 1)
    second = grant(engine, keys, 2)
    assert engine.release(keys.slot(2), "exec-2", "task-2", finished=False)
    assert reclaim(engine, keys.slot(2), 2, second.token).status is Reclaim.RELEASED
    assert grant(engine, keys, 3).slot == 2


@pytest.mark.worker
def test_two_slots_survive_restarts_anywhere_in_the_renewal_cycle(redis_server, events):
    """Two workers; two long runs of one key under singleton_limit=2, in two
    processes; the lock Redis killed and restarted empty at five points of the
    1 s renewal cycle. After each restart both slots are written back by their
    own holders and a burst of three duplicates is skipped naming one of them.
    At the end: neither holder was told lost, no duplicate ever started, never
    more than two ran at once and no slot had two runs at once."""
    lock_server = RedisServer().start()
    lock_url = f"redis://127.0.0.1:{lock_server.port}/2"
    queue = f"limit-restart-{uuid.uuid4().hex[:8]}"
    workers = [Worker(redis_server.url(), queue, concurrency=2, conf=CONF, lock_url=lock_url,
                      name=name).start() for name in ("a", "b")]
    try:
        app = make_app(redis_server.url(), queue, lock_url=lock_url, conf=CONF)
        task = app.tasks["t.limit2"]
        key = uuid.uuid4().hex[:8]
        keys = task.singleton_keys(key)
        holders = [task.delay(key, 120.0, f"holder{i}") for i in range(2)]
        wait_for(lambda: len(events.starts("holder")) == 2, 20, what="both slots taken")
        ids = {h.id for h in holders}
        admin = lock_server.client(2)
        for i, offset in enumerate(OFFSETS):
            wait_for_renewal(admin, keys.slot(1).lock)
            time.sleep(offset)  # placing the kill in the cycle, not racing a lease
            lock_server.stop()  # kill -9
            lock_server.start()  # same port, empty
            admin = lock_server.client(2)

            def both_back(admin: Any = admin) -> bool:
                owners = [owner_record(admin, keys.slot(n).lock).get("task") for n in (1, 2)]
                return set(owners) == ids

            wait_for(both_back, 15, what=f"both slots written back after restart {i + 1}")
            dups = [task.delay(key, 0.0, f"dup{i}-{n}") for n in range(3)]
            for dup in dups:
                result = dup.get(timeout=30)
                assert is_skipped(result) and result["holder"] in ids, result
        events.client.set(f"finish:{key}", 1)
        results = [h.get(timeout=60) for h in holders]
        logs = "".join(w.logs() for w in workers)
        assert "Lost singleton lock" not in logs, logs[-3000:]
        assert all(r["lost"] is False for r in results), results
        assert logs.count("Took back singleton lock") == 2 * len(OFFSETS)
        assert not events.starts("dup")
        starts = events.starts()
        assert max(e["concurrent"] for e in starts) <= 2
        assert sorted(e["slot"] for e in starts) == [1, 2]
    finally:
        for w in workers:
            discard(w)
        lock_server.cleanup()
