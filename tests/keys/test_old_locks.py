"""The old library's lock during a rollout (``singleton_also_lock``), taken,
renewed and deleted by our scripts (``old_take.lua``, ``old_keep.lua``) on a
real Redis, call by call: whose value is this execution's and whose is not.
"""

from __future__ import annotations

import uuid

import redis

from celery_singleton_lock.rollout import OtherLibrary, OtherLock


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
