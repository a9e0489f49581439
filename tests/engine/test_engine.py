"""The lock engine and its scripts against a real redis-server."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import time
import uuid
from typing import Any

import pytest
import redis

from celery_singleton_lock import LockLostError, SingletonConfig
from celery_singleton_lock.engine.calls import marker_task
from celery_singleton_lock.engine.registry import connect
from celery_singleton_lock.engine.replies import Acquire, Enqueue, Reclaim, Release, Released
from celery_singleton_lock.engine.request import Lease, Request
from celery_singleton_lock.engine.server import LockEngine
from celery_singleton_lock.keys import LockKeys
from celery_singleton_lock.lock import SingletonLock
from celery_singleton_lock.process import HOST_KEY as PROCESS_HOST_KEY
from celery_singleton_lock.process import PROCESS
from celery_singleton_lock.worker.heartbeat import RENEW_FRACTION, RETRY_FAILED, Heartbeat
from tests.support import (
    ROOT,
    held_on_another_host,
    marker,
    owner_field,
    owner_record,
    wait_for,
    write_owner,
)


@pytest.fixture
def engine(redis_server, r) -> LockEngine:
    config = SingletonConfig.defaults(redis_server.url(2), finished_ttl=60)
    return connect(config)


def new_keys() -> LockKeys:
    return LockKeys("singleton:", uuid.uuid4().hex)


def take(engine: LockEngine, keys: LockKeys, task_id: str = "", exec_id: str = "",
         lease_ms: int = 5000, retries: int = 0, **kw: Any) -> Any:
    return engine.acquire(keys, Request(task_id or uuid.uuid4().hex,
                                        exec_id or uuid.uuid4().hex, Lease.of_ms(lease_ms),
                                        "w1@host", retries, "t.x", **kw))


def evalsha_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


def test_grant_records_the_owner_and_a_second_task_sees_it(engine, r):
    keys = new_keys()
    got = take(engine, keys, "task-a", "exec-a")
    assert got.status is Acquire.GRANTED and got.token > 0
    owner = owner_record(r, keys.lock)
    assert owner["task"] == "task-a" and owner["exec"] == "exec-a"
    assert owner["host"] == "w1@host" and int(owner["pid"]) == os.getpid()
    assert int(owner["token"]) == got.token and int(owner["at"]) > 0
    other = take(engine, keys, "task-b")
    assert other.status is Acquire.HELD
    assert other.holder.task_id == "task-a" and other.holder.exec_id == "exec-a"
    assert other.holder.pid == os.getpid() and other.holder.hostname == "w1@host"
    assert 4000 < r.pttl(keys.lock) <= 5000


@pytest.mark.parametrize("path", [{}, {"throttle_ms": 60_000}, {"slots": 2}],
                         ids=["run", "throttle", "limit"])
def test_a_host_or_task_name_with_a_newline_leaves_the_record_whole(engine, r, path):
    """docs/redis-keys.md: the owner record's fields are joined by newlines, so
    the fields users write (the worker's host name, the task's name) go with
    each newline made a space: the record reads back field by field, the
    task that holds the key is named to another, and the throttle window
    names its opener's task."""
    keys = new_keys()
    got = engine.acquire(keys, Request("task-a", "exec-a", Lease.of_ms(5000), "w1\n@host", 0,
                                       "t.\nx", **path))
    assert got.status is Acquire.GRANTED
    owner = owner_record(r, keys.slot(got.slot).lock)
    assert (owner["host"], owner["name"], owner["task"], owner["exec"]) == (
        "w1 @host", "t. x", "task-a", "exec-a")
    assert int(owner["pid"]) == os.getpid() and owner["lease"] == "5000"
    if not path:
        other = take(engine, keys, "task-b")
        assert other.status is Acquire.HELD
        assert (other.holder.task_id, other.holder.hostname) == ("task-a", "w1 @host")
    if "throttle_ms" in path:
        assert r.get(keys.throttle).split("\n")[::2] == ["t. x", "task-a"]


def test_release_is_owner_checked(engine, r):
    keys = new_keys()
    take(engine, keys, "task-a", "exec-a")
    assert engine.release(keys, "exec-other", "task-a") is False
    assert r.exists(keys.lock)
    assert engine.release(keys, "exec-a", "task-a") is True
    assert not r.exists(keys.lock)
    assert take(engine, keys, "task-b").status is Acquire.GRANTED


def test_same_task_copy_waits_and_is_dropped_once_the_original_finished(engine, r):
    keys = new_keys()
    take(engine, keys, "task-a", "exec-a")
    copy = take(engine, keys, "task-a", "exec-copy")
    assert copy.status is Acquire.SAME_TASK and copy.holder.exec_id == "exec-a"
    assert owner_field(r, keys.lock, "copies") == "1"
    engine.release(keys, "exec-a", "task-a")
    assert r.get(keys.fin) == "task-a"
    assert take(engine, keys, "task-a", "exec-copy").status is Acquire.FINISHED
    # another task id is not affected by the marker
    assert take(engine, keys, "task-b").status is Acquire.GRANTED


def test_under_a_limit_the_same_task_id_finds_its_own_slot(engine, r):
    """acquire_slots.lua, with the task in slot 2 (slot 1 another task's): the
    same execution asking again keeps its slot, token and a fresh lease; a copy
    of it waits (SAME_TASK, naming it, its record marked as copied); an id that
    merely ends like it is another task; its retry takes back the slot its
    hand-off kept; then a done marker names its task, a finished id is dropped."""
    keys = new_keys()
    take(engine, keys, "other", "e-other", slots=2)
    first = take(engine, keys, "task-a", "exec-a", slots=2)
    assert (first.status, first.slot) == (Acquire.GRANTED, 2)
    slot = keys.slot(2)
    again = take(engine, keys, "task-a", "exec-a", lease_ms=9000, slots=2)
    assert (again.status, again.token, again.slot) == (Acquire.GRANTED, first.token, 2)
    assert 8000 < r.pttl(slot.lock) <= 9000
    copy = take(engine, keys, "task-a", "exec-copy", slots=2)
    assert (copy.status, copy.holder.exec_id, copy.slot) == (Acquire.SAME_TASK, "exec-a", 2)
    assert owner_field(r, slot.lock, "copies") == "1"
    assert take(engine, keys, "task-a", "exec-copy-2", slots=2).status is Acquire.SAME_TASK
    assert owner_field(r, slot.lock, "copies") == "1"
    assert owner_field(r, keys.lock, "copies") is None, "slot 1 is another task's"
    suffix = take(engine, keys, "x-task-a", slots=2)
    assert suffix.status is Acquire.HELD and suffix.holder.task_id == "other"
    assert engine.hand_off(slot, "exec-a", 1, 3000) is True
    retried = take(engine, keys, "task-a", "exec-a2", retries=1, slots=2)
    assert (retried.status, retried.slot) == (Acquire.GRANTED, 2)
    assert retried.token > first.token and owner_field(r, slot.lock, "exec") == "exec-a2"
    engine.release(slot, "exec-a2", "task-a")
    engine.release(keys, "e-other", "other")
    r.set(keys.done, "t.x\ntask-d", px=60_000)
    done = take(engine, keys, "task-e", slots=2)
    assert (done.status, done.holder.task_id) == (Acquire.DONE, "task-d")
    assert take(engine, keys, "task-d", slots=2).status is Acquire.FINISHED


def test_under_a_limit_a_copy_of_a_finished_task_is_dropped_by_its_finish_marker(engine, r):
    """acquire_slots.lua reads the finish marker (``fin``), not the done
    marker or the counter, before it grants a free slot: a redelivered copy
    that waited while its task ran is dropped once the task finished, with no
    done window to name it."""
    keys = new_keys()
    assert take(engine, keys, "task-a", "exec-a", slots=2).status is Acquire.GRANTED
    copy = take(engine, keys, "task-a", "exec-copy", slots=2)
    assert copy.status is Acquire.SAME_TASK
    assert engine.release(keys, "exec-a", "task-a") is True
    assert r.get(keys.fin) == "task-a" and not r.exists(keys.done)
    assert take(engine, keys, "task-a", "exec-copy", slots=2).status is Acquire.FINISHED
    assert not r.exists(keys.lock) and not r.exists(keys.slot(2).lock)
    assert take(engine, keys, "task-b", "exec-b", slots=2).status is Acquire.GRANTED


def test_under_a_limit_a_request_past_its_deadline_does_nothing_before_its_grant_bound(
        engine, r):
    """acquire_slots.lua refuses a request that arrives past its deadline
    (its caller gave up waiting), though the bound a grant would live to
    unconfirmed, one wait later, is still ahead: nothing is written. One in
    time is granted a slot that lives, unconfirmed, until that bound (not
    the deadline: a reply that came in time has until then to be confirmed)."""
    from celery_singleton_lock.engine.calls import acquire_slots_call

    keys = new_keys()
    now_ms = server_micros(r) // 1000
    request = Request("task-a", "exec-a", Lease.of_ms(60_000), "w1@host", 0, "t.x", slots=2)
    keys_, args = acquire_slots_call(keys, request, 60_000, keep_ms=300_000,
                                     deadline_ms=now_ms - 1_000, confirm_by_ms=now_ms + 60_000)
    reply = engine.run_script(engine._acquire_slots, keys_, args)
    assert int(reply[0]) == 8 and int(reply[1]) >= now_ms
    assert r.keys("*") == []
    keys_, args = acquire_slots_call(keys, request, 60_000, keep_ms=300_000,
                                     deadline_ms=now_ms + 20_000, confirm_by_ms=now_ms + 40_000)
    reply = engine.run_script(engine._acquire_slots, keys_, args)
    assert int(reply[0]) == 1 and int(reply[2]) == 1
    assert 30_000 < r.pttl(keys.lock) <= 40_000


def test_finish_is_recorded_without_a_copy_only_when_asked(engine, r):
    keys = new_keys()
    take(engine, keys, "task-a", "exec-a")
    engine.release(keys, "exec-a", "task-a")
    assert r.get(keys.fin) is None
    take(engine, keys, "task-b", "exec-b")
    engine.release(keys, "exec-b", "task-b", always_record=True)
    assert r.get(keys.fin) == "task-b"


def test_tokens_increase_with_every_grant_even_when_the_counter_is_gone(engine, r):
    keys = new_keys()
    tokens = []
    for i in range(30):
        got = take(engine, keys, f"t{i}", f"e{i}")
        tokens.append(got.token)
        engine.release(keys, f"e{i}", f"t{i}")
        if i == 15:
            r.delete(keys.fence)
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)


def server_micros(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1_000_000 + int(micros)


@pytest.mark.parametrize("slots", [1, 2], ids=["lock", "limit"])
def test_a_token_is_the_server_clock_while_the_counter_is_behind_it(engine, r, slots):
    """docs/fencing.md#retention: a token is the lock Redis's clock in
    microseconds; the counter (the last grant's token, behind the clock by
    now) raises it only when at or above the clock. The same under
    ``singleton_limit`` (acquire_slots.lua)."""
    keys = new_keys()
    for i in range(3):
        before = server_micros(r)
        got = take(engine, keys, f"t{i}", f"e{i}", slots=slots)
        assert before <= got.token <= server_micros(r)
        assert int(r.get(keys.fence)) == got.token
        engine.release(keys.slot(got.slot), f"e{i}", f"t{i}")


@pytest.mark.parametrize("slots", [1, 2], ids=["lock", "limit"])
def test_a_counter_ahead_of_the_clock_is_counted_on(engine, r, slots):
    """The grant writes the clock and reads the counter back in one call; a
    counter at or above the clock (a clock set back, a failover to a server
    whose clock is behind) gives the counter + 1, written in place of the clock.
    The same under ``singleton_limit`` (acquire_slots.lua), slot after slot."""
    keys = new_keys()
    ahead = int(r.time()[0]) * 1_000_000 + 3_600_000_000  # an hour ahead, in µs
    r.set(keys.fence, str(ahead), px=60_000)
    got = take(engine, keys, "task-a", "exec-a", slots=slots)
    assert got.token == ahead + 1 and int(r.get(keys.fence)) == ahead + 1
    assert int(owner_field(r, keys.slot(got.slot).lock, "token")) == ahead + 1
    if slots > 1:  # the next slot, while the first is held
        other = take(engine, keys, "task-c", "exec-c", slots=slots)
        assert other.slot != got.slot and other.token == ahead + 2
        ahead += 1
    engine.release(keys.slot(got.slot), "exec-a", "task-a")
    assert take(engine, keys, "task-b", "exec-b", slots=slots).token == ahead + 2
    # the counter's own TTL again: the lease and singleton_fence_ttl
    assert 300_000 < r.pttl(keys.fence) <= 5_000 + 300_000


def test_a_counter_outlives_a_long_lease_by_a_tenth_of_it_at_least(redis_server, r):
    """docs/fencing.md#retention: a key's fencing counter outlives its lock by
    ``singleton_fence_ttl``, but by a tenth of the lease at least: 1 s of
    retention under a 60 s lease keeps it 66 s, from the grant and from each
    renewal (renew.lua counts the same), on a lock and under a limit.
    (Without a socket timeout no confirmation renews a grant at once: the
    TTL read first is the grant's own.)"""
    engine = connect(SingletonConfig.defaults(redis_server.url(2), fence_ttl=1.0,
                                              redis_options={"socket_timeout": None}))
    try:
        for slots in (1, 2):
            keys = new_keys()
            got = take(engine, keys, "task-a", "exec-a", lease_ms=60_000, slots=slots)
            assert got.status is Acquire.GRANTED
            assert 60_000 < r.pttl(keys.fence) <= 66_000
            r.pexpire(keys.fence, 1_000)
            assert engine.renew([(keys.slot(got.slot).lock, "exec-a", 60_000)]) == [1]
            assert 60_000 < r.pttl(keys.fence) <= 66_000
    finally:
        engine.close()


def test_a_renewal_keeps_the_keys_counter_whatever_the_prefix(engine, r):
    """renew.lua extends each lock's fencing counter with its lease; the
    counter's key is the lock's up to its last ``:lock`` (calls.fence_of),
    so a prefix that holds ``:lock`` itself and a slot of a
    ``singleton_limit`` (``...:lock:2``) find the key's one counter."""
    keys = LockKeys("jobs:lock:", uuid.uuid4().hex)
    assert take(engine, keys, "other", "e-other", lease_ms=30_000, slots=2).slot == 1
    assert take(engine, keys, "task-a", "exec-a", lease_ms=30_000, slots=2).slot == 2
    for lock, exec_id in ((keys.lock, "e-other"), (keys.slot(2).lock, "exec-a")):
        r.pexpire(keys.fence, 1_000)
        assert engine.renew([(lock, exec_id, 30_000)]) == [1]
        assert 30_000 < r.pttl(keys.fence) <= 30_000 + 300_000


def test_a_raised_fence_carries_a_higher_token_only_for_its_holder(engine, r):
    """fence.lua (Redlock puts the token it hands out on each master with it):
    the counter and the owner record's token go up to the token, never down,
    and only for the execution holding the lock here."""
    keys = new_keys()
    got = take(engine, keys, "task-a", "exec-a", lease_ms=30_000)
    higher = got.token + 1_000
    assert engine.raise_fence(keys, "exec-a", higher) is True
    assert int(r.get(keys.fence)) == higher
    record = owner_record(r, keys.lock)
    assert int(record["token"]) == higher
    assert (record["exec"], record["task"], record["host"]) == ("exec-a", "task-a", "w1@host")
    assert 300_000 < r.pttl(keys.fence) <= 30_000 + 300_000  # the lock's, and the retention
    assert engine.raise_fence(keys, "exec-a", got.token) is True  # lower: nothing goes down
    assert engine.raise_fence(keys, "exec-a", 999) is True  # fewer digits: lower too
    assert int(r.get(keys.fence)) == higher
    assert int(owner_field(r, keys.lock, "token")) == higher
    assert engine.raise_fence(keys, "exec-b", higher + 1) is False  # not its holder
    assert int(r.get(keys.fence)) == higher
    r.delete(keys.lock)
    assert engine.raise_fence(keys, "exec-a", higher + 1) is False  # the lease ran out
    assert int(r.get(keys.fence)) == higher


def test_a_throttle_window_lets_no_other_task_start_before_it_ends(engine, r):
    """``singleton_throttle``: a start opens a window of exactly the throttle,
    by the server clock; other task ids asking all along are refused, each told
    when it reopens, and the first one granted starts at its end or later
    (both instants are the server's own, from the owner records)."""
    keys = new_keys()
    window_ms = 1500
    assert take(engine, keys, "opener", "e-opener", throttle_ms=window_ms).token > 0
    opened_at = int(owner_field(r, keys.lock, "at"))  # the grant's server time, ms
    engine.release(keys, "e-opener", "opener")
    name, ends, by = r.get(keys.throttle).split("\n")
    assert (name, by, int(ends)) == ("t.x", "opener", opened_at + window_ms)
    refusals: list[int] = []

    def started() -> bool:
        got = take(engine, keys, f"later-{len(refusals)}", throttle_ms=window_ms)
        if got.status is Acquire.THROTTLED:
            assert got.holder.task_id == "opener" and 0 < got.reopens_ms <= window_ms
            refusals.append(got.reopens_ms)
            return False
        assert got.status is Acquire.GRANTED, got
        return True

    wait_for(started, 15, interval=0.02, what="a start once the window ends")
    assert refusals, "asked only after the window had ended"
    assert int(owner_field(r, keys.lock, "at")) >= int(ends), "started inside the window"


@pytest.mark.parametrize("slots", [1, 2], ids=["lock", "limit"])
def test_a_full_rate_window_refuses_new_task_ids_but_not_a_retry(engine, r, slots):
    """``singleton_rate``: two starts a minute. A third task id is refused,
    told when the oldest start leaves the window; a retry of a task id that
    started within it is the start it already made. The same under
    ``singleton_limit`` (acquire_slots.lua), slot after slot."""
    keys = new_keys()
    rate = (2, 60_000)
    for name in ("a", "b"):
        got = take(engine, keys, name, f"e-{name}", slots=slots, rate=rate)
        assert got.status is Acquire.GRANTED
        engine.release(keys.slot(got.slot), f"e-{name}", name, finished=False)
    third = take(engine, keys, "c", "e-c", slots=slots, rate=rate)
    assert third.status is Acquire.RATE_LIMITED and third.holder.task_id == "a"
    assert 50_000 < third.reopens_ms <= 60_000
    assert take(engine, keys, "a", "e-a2", slots=slots, rate=rate, retries=1).status \
        is Acquire.GRANTED


@pytest.mark.parametrize("slots", [1, 2], ids=["lock", "limit"])
def test_a_rate_of_one_start_a_window_refuses_the_next_task_id(engine, r, slots):
    """``singleton_rate="1/m"``: one start is a rate too (config.parse_rate);
    once a task id started, the next is refused until the window admits it,
    on a lock and under ``singleton_limit``."""
    keys = new_keys()
    rate = (1, 60_000)
    got = take(engine, keys, "a", "e-a", slots=slots, rate=rate)
    assert got.status is Acquire.GRANTED
    engine.release(keys.slot(got.slot), "e-a", "a", finished=False)
    second = take(engine, keys, "b", "e-b", slots=slots, rate=rate)
    assert second.status is Acquire.RATE_LIMITED and second.holder.task_id == "a"
    assert 50_000 < second.reopens_ms <= 60_000


def test_under_a_rate_a_send_replaced_while_queued_does_not_run(engine, r):
    """``replace`` with ``singleton_rate``: acquire.lua is then given every
    key, the superseded ids' hash among them; a task a later send replaced
    while it was queued is told so when it starts, and the later one runs."""
    keys = new_keys()
    rate = (5, 60_000)
    assert engine.enqueue(keys, "x", "queue", 5000, "t.x", replace=(0, 0)).status \
        == Enqueue.TAKEN
    assert engine.enqueue(keys, "y", "queue", 5000, "t.x", replace=(0, 0)).status \
        == Enqueue.REPLACED
    late = take(engine, keys, "x", "e-x", scope="queue", replace=True, rate=rate)
    assert late.status is Acquire.REPLACED and late.holder.task_id == "y"
    assert take(engine, keys, "y", "e-y", scope="queue", replace=True, rate=rate).status \
        is Acquire.GRANTED


def test_a_starts_throttle_and_rate_windows_live_the_window(engine, r):
    """acquire.lua's TTLs: a start leaves the throttle key its window and the
    rate set its window (docs/redis-keys.md), no longer; under
    ``singleton_limit`` too (acquire_slots.lua)."""
    keys = new_keys()
    got = take(engine, keys, "task-a", "exec-a", throttle_ms=20_000, rate=(5, 40_000))
    assert got.status is Acquire.GRANTED
    assert 10_000 < r.pttl(keys.throttle) <= 20_000
    assert 30_000 < r.pttl(keys.rate) <= 40_000
    keys = new_keys()
    assert take(engine, keys, "task-b", "exec-b", slots=2,
                rate=(5, 40_000)).status is Acquire.GRANTED
    assert 30_000 < r.pttl(keys.rate) <= 40_000


def test_without_a_socket_timeout_a_repeated_grant_renews_the_lease_it_asks_for(
        redis_server, r):
    """``socket_timeout`` None: no grant is confirmed by a renewal after it,
    so the TTL the script gives is the lease: the same execution asking again
    (a repeat after a lost reply) keeps its token with the lease it asks for,
    no longer, on its lock and on its slot of a ``singleton_limit``."""
    config = dataclasses.replace(SingletonConfig.defaults(redis_server.url(2)), native="off",
                                 redis_options={"socket_timeout": None})
    engine = connect(config)
    try:
        for slots in (1, 2):
            keys = new_keys()
            first = take(engine, keys, "task-a", "exec-a", lease_ms=30_000, slots=slots)
            assert first.status is Acquire.GRANTED and 20_000 < r.pttl(keys.lock) <= 30_000
            again = take(engine, keys, "task-a", "exec-a", lease_ms=9_000, slots=slots)
            assert (again.status, again.token) == (Acquire.GRANTED, first.token)
            assert 8_000 < r.pttl(keys.lock) <= 9_000
    finally:
        engine.close()


@pytest.mark.parametrize("path", [{}, {"scope": "queue"}, {"scope": "queue_and_run"},
                                  {"throttle_ms": 60_000}, {"scope": "queue", "replace": True},
                                  {"slots": 2}],
                         ids=["run", "queue", "queue_and_run", "throttle", "replace", "limit"])
def test_a_done_marker_is_looked_for_only_with_a_done_window(engine, r, path):
    """A task without ``singleton_done_ttl`` writes no done marker, so its
    acquire does not read one (nothing else writes one for its keys): a marker
    left from before its window was turned off does not skip it, on every path."""
    keys = new_keys()
    r.set(keys.done, "t.x\nb", px=60_000)
    assert take(engine, keys, "c", done=True, **path).status is Acquire.DONE
    assert take(engine, keys, "c", "ec", done=False, **path).status is Acquire.GRANTED
    assert r.exists(keys.done)  # looked past, not touched


def test_a_send_looks_for_a_done_marker_only_with_a_done_window(engine, r):
    """The send-time take of the queue scopes likewise."""
    keys = new_keys()
    r.set(keys.done, "t.x\nb", px=60_000)
    assert engine.enqueue(keys, "c", "queue", 60_000, "t.x").status is Enqueue.DONE
    assert engine.enqueue(keys, "c", "queue", 60_000, "t.x",
                          done=False).status is Enqueue.TAKEN
    assert r.get(keys.queued) == "t.x\nc"


def test_an_expired_lease_lets_another_task_in(engine, r):
    keys = new_keys()
    take(engine, keys, "task-a", "exec-a", lease_ms=1000)
    assert take(engine, keys, "task-b").status is Acquire.HELD
    wait_for(lambda: not r.exists(keys.lock), 5, what="the lease to run out")
    assert take(engine, keys, "task-b", "exec-b").status is Acquire.GRANTED
    # the old owner cannot release the new one
    assert engine.release(keys, "exec-a", "task-a") is False
    assert owner_field(r, keys.lock, "exec") == "exec-b"


def test_hand_off_keeps_the_key_for_the_retry_only(engine, r):
    keys = new_keys()
    first = take(engine, keys, "task-a", "exec-a", retries=0, lease_ms=10_000)
    assert engine.hand_off(keys, "exec-a", 1, 60_000) is True
    # the hand-off's own lease, not the attempt's (nor a longer one)
    assert 10_000 < r.pttl(keys.lock) <= 60_000
    assert engine.hand_off(keys, "exec-nope", 1, 3000) is False
    assert engine.renew([(keys.lock, "exec-a", 5000)]) == [2]
    assert take(engine, keys, "task-b").status is Acquire.HELD
    retried = take(engine, keys, "task-a", "exec-a2", retries=1)
    assert retried.status is Acquire.GRANTED and retried.token > first.token
    assert owner_field(r, keys.lock, "exec") == "exec-a2"


@pytest.mark.parametrize("n", [1, 100, 2000])
def test_renewal_of_n_locks_is_one_round_trip_of_short_calls(engine, r, n):
    """One write per round; at most RENEW_CHUNK locks per script call."""
    from celery_singleton_lock.engine.link import Link
    from celery_singleton_lock.engine.server import RENEW_CHUNK

    writes = []
    real_send = Link.send

    def counting(link, *args, **kwargs):
        writes.append(1)
        return real_send(link, *args, **kwargs)

    held = []
    for i in range(n):
        keys = new_keys()
        # leases that outlive taking them all on a loaded machine
        take(engine, keys, f"t{i}", f"e{i}", lease_ms=30_000)
        held.append((keys.lock, f"e{i}", 60_000))
    stranger = new_keys()
    take(engine, stranger, "other", "e-other", lease_ms=1000)
    before = evalsha_calls(r)
    Link.send = counting
    try:
        results = engine.renew([*held, (stranger.lock, "e-not-mine", 60_000)])
    finally:
        Link.send = real_send
    assert len(writes) == 1
    assert evalsha_calls(r) - before == -(-(n + 1) // RENEW_CHUNK)
    assert results == [1] * n + [0]
    assert min(r.pttl(k) for k, _, _ in held[:50]) > 50_000
    assert r.pttl(stranger.lock) <= 1000


def test_heartbeat_keeps_a_short_lease_alive_for_many_leases(engine, r):
    keys = new_keys()
    got = take(engine, keys, "task-a", "exec-a", lease_ms=1000)
    lock = SingletonLock(keys, task_id="task-a", exec_id="exec-a", token=got.token,
                         lease=1.0, started=time.monotonic(), held=True)
    hb = Heartbeat(engine)
    added = time.monotonic()
    hb.add(lock)
    try:
        wait_for(lambda: hb.rounds >= 6, 15, what="six renewal rounds (two leases)")
        rounds, elapsed = hb.rounds, time.monotonic() - added
        # a round a third of the lease after the one before, never sooner
        # (a load can only make them later): not a loop renewing back to back
        assert rounds <= elapsed / (1.0 / RENEW_FRACTION) + 1, (rounds, elapsed)
        assert owner_field(r, keys.lock, "exec") == "exec-a"
        assert not lock.lost
    finally:
        hb.discard(lock)


def test_a_lock_lost_to_its_deadline_is_renewed_nowhere(engine, r):
    """A lock whose local lease ran out (no renewal got through in time) is
    lost: its task was told so. A later round leaves its key to expire as it
    was set, not kept alive for a holder that no longer counts on it."""
    keys = new_keys()
    got = take(engine, keys, "task-a", "exec-a", lease_ms=20_000)
    lock = SingletonLock(keys, task_id="task-a", exec_id="exec-a", token=got.token,
                         lease=30.0, started=time.monotonic() - 31, held=True)
    assert lock.lost
    hb = Heartbeat(engine)  # not started: the round is driven by hand
    hb._held[id(lock)] = lock
    assert hb.renew_now() is True
    assert r.pttl(keys.lock) <= 20_000
    assert hb.rounds == 0


def test_while_redis_is_down_a_failed_round_is_tried_again_every_half_second(own_redis):
    """With the lock Redis gone, the renewer asks again every RETRY_FAILED
    (0.5 s), while the leases still run: not a third of a lease later, and not
    back to back (a loop against a dead server)."""
    engine = connect(SingletonConfig.defaults(own_redis.url(0)))
    keys = new_keys()
    lock = held_lock(engine, keys, lease=6.0)
    hb = Heartbeat(engine)
    hb.add(lock)
    try:
        wait_for(lambda: hb.watch.run_id, 5, what="the watch to connect")
        own_redis.stop()
        stopped = time.monotonic()
        wait_for(lambda: hb.failed_rounds >= 3, 30, interval=0.01,
                 what="three failed rounds in a row")
        failed, elapsed = hb.failed_rounds, time.monotonic() - stopped
        assert failed <= elapsed / RETRY_FAILED + 2, (failed, elapsed)
    finally:
        hb.discard(lock)
        hb.watch.close()


def test_a_short_lease_added_while_the_renewer_sleeps_on_a_long_one_is_kept(engine, r):
    """The worker process's renewer sleeps a third of the longest-lived need
    (here a 30 s lock: 10 s); a task with a 1.5 s lease taken meanwhile wakes
    it, and is renewed through several of its leases, never lost."""
    assert engine.config.ttl == 30.0
    long_keys, short_keys = new_keys(), new_keys()
    got = take(engine, long_keys, "long", "e-long", lease_ms=30_000)
    long_lock = SingletonLock(long_keys, task_id="long", exec_id="e-long", token=got.token,
                              lease=30.0, started=time.monotonic(), held=True)
    hb = Heartbeat(engine)
    hb.add(long_lock)
    short: Any = None
    try:
        wait_for(lambda: hb._sleeping == 10.0, 10, what="the renewer asleep for 10 s")
        got = take(engine, short_keys, "short", "e-short", lease_ms=1500)
        short = SingletonLock(short_keys, task_id="short", exec_id="e-short", token=got.token,
                              lease=1.5, started=time.monotonic(), held=True)
        rounds = hb.rounds
        hb.add(short)
        # six rounds of a 0.5 s interval: three of the short lease's lifetimes
        wait_for(lambda: hb.rounds >= rounds + 6, 30, what="six rounds after the short lock")
        assert not short.lost
        assert owner_field(r, short_keys.lock, "exec") == "e-short"
        assert owner_field(r, long_keys.lock, "exec") == "e-long"
    finally:
        hb.discard(long_lock)
        if short is not None:
            hb.discard(short)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_renewer_that_ended_is_started_again_by_the_next_lock(engine, r):
    """Taking a lock checks no thread's liveness (it runs for every task): a
    renewer ended by a BaseException says so, and the next add starts another."""
    hb = Heartbeat(engine)
    ended = []

    def fatal_round(next_round: float) -> float:
        ended.append(True)
        raise SystemExit("a round raised what 'except Exception' does not catch")

    hb._step = fatal_round  # type: ignore[method-assign]
    first = SingletonLock(new_keys(), task_id="t0", exec_id="e0", token=1, lease=3.0,
                          started=time.monotonic(), held=True)
    hb.add(first)
    wait_for(lambda: ended and hb._thread is None, 10, what="the renewer to end")
    del hb._step  # rounds as usual from now on
    hb.discard(first)
    keys = new_keys()
    got = take(engine, keys, "task-a", "exec-a", lease_ms=1000)
    lock = SingletonLock(keys, task_id="task-a", exec_id="exec-a", token=got.token,
                         lease=1.0, started=time.monotonic(), held=True)
    hb.add(lock)
    try:
        assert hb._thread is not None
        wait_for(lambda: hb.rounds >= 3, 15, what="three rounds of the new renewer")
        assert owner_field(r, keys.lock, "exec") == "exec-a" and not lock.lost
    finally:
        hb.discard(lock)


def test_heartbeat_marks_a_taken_over_lock_lost(engine, r):
    keys = new_keys()
    got = take(engine, keys, "task-a", "exec-a", lease_ms=3000)
    lock = SingletonLock(keys, task_id="task-a", exec_id="exec-a", token=got.token,
                         lease=3.0, started=time.monotonic(), held=True)
    hb = Heartbeat(engine)
    hb.add(lock)
    try:
        write_owner(r, keys.lock, exec="someone-else")
        wait_for(lambda: lock.lost, 5, what="the lock to be seen lost")
        with pytest.raises(LockLostError) as info:
            lock.check()
        assert info.value.token == got.token and "another execution" in str(info.value)
    finally:
        hb.discard(lock)


def test_a_passed_deadline_is_lost_without_asking_redis(engine, r):
    keys = new_keys()
    take(engine, keys, "task-a", "exec-a")
    lock = SingletonLock(keys, task_id="task-a", exec_id="exec-a", token=1, lease=0.5,
                         started=time.monotonic() - 1.0, held=True)
    before = r.info("stats")["total_commands_processed"]
    assert lock.lost
    with pytest.raises(LockLostError):
        lock.check()
    # only our own INFO reached the server
    assert r.info("stats")["total_commands_processed"] - before <= 2


def test_dead_holder_is_cleared_live_one_is_not(engine, r, redis_server):
    keys = new_keys()
    code = (
        "import sys; from celery_singleton_lock import SingletonConfig;"
        "from celery_singleton_lock.keys import LockKeys;"
        "from celery_singleton_lock.engine.registry import connect;"
        "from celery_singleton_lock.engine.request import Lease, Request;"
        f"e = connect(SingletonConfig.defaults({redis_server.url(2)!r}));"
        f"k = LockKeys('singleton:', {keys.base.split('{')[1][:-1]!r});"
        "o = e.acquire(k, Request('dead', 'x', Lease(60.0), 'h', task_name='t'));"
        "sys.exit(0 if o.status == 1 else 3)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=30)
    held = take(engine, keys, "task-b")
    assert held.status is Acquire.HELD and held.holder.task_id == "dead"
    assert engine.clear_dead_holder(keys, held.holder) is True
    assert take(engine, keys, "task-b").status is Acquire.GRANTED
    # our own process is alive: its lock stays
    assert engine.clear_dead_holder(keys, take(engine, keys, "task-c").holder) is False


def test_a_holder_on_another_host_is_never_declared_dead_here(engine, r):
    """A pid in another machine's record means nothing here: no local lookup
    frees that lock (a duplicate's, the reaper's, a slot of singleton_limit's),
    however dead the pid looks on this host; the very record with our host key
    is freed, so the host key alone is what keeps it."""
    from celery_singleton_lock.cli.listing import liveness

    keys = new_keys()
    take(engine, keys, "remote", "e-remote", lease_ms=60_000)
    pid = held_on_another_host(r, keys.lock)
    before = r.get(keys.lock)
    held = take(engine, keys, "dup")
    assert held.status is Acquire.HELD and held.holder.pid == pid
    assert held.holder.hostname == "w1@other-machine"
    assert engine.clear_dead_holder(keys, held.holder) is False
    assert engine.reap(keys, "remote", wait=0.2) is False
    assert liveness(owner_record(r, keys.lock)) == "unknown"
    assert take(engine, keys, "dup-2").status is Acquire.HELD
    assert r.get(keys.lock) == before, "the other host's lock is untouched"

    # singleton_limit: a slot held on another host stays taken too
    slotted = new_keys()
    for n in (1, 2):
        assert take(engine, slotted, f"s{n}", f"e-s{n}", lease_ms=60_000,
                    slots=2).status is Acquire.GRANTED
    held_on_another_host(r, slotted.slot(2).lock)
    assert take(engine, slotted, "s3", slots=2).status is Acquire.HELD
    assert engine.clear_dead_slots(slotted, 2) is False
    assert owner_field(r, slotted.slot(2).lock, "task") == "s2"

    # control: the same dead pid under this host's key is freed at once
    write_owner(r, keys.lock, hostkey=PROCESS_HOST_KEY)
    mine = take(engine, keys, "dup-3").holder
    assert mine.pid == pid and engine.clear_dead_holder(keys, mine) is True
    assert take(engine, keys, "dup-4").status is Acquire.GRANTED


def _pid_given_to_a_new_process() -> tuple[subprocess.Popen[bytes], str, bool]:
    """A process that died, and a new process with its pid: (the new process,
    the dead one's start time, whether the pid was really reused). As root the
    kernel is asked to hand the pid out again (``ns_last_pid``); where that
    cannot be done, the new process has a pid of its own, and the record
    names it with the dead one's start time, as a reused pid would read."""
    from celery_singleton_lock.process import start_ticks

    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    tick = os.sysconf("SC_CLK_TCK")

    def ticks_now() -> int:  # clock ticks since boot, as /proc/<pid>/stat counts them
        with open("/proc/uptime") as fh:
            return int(float(fh.read().split()[0]) * tick)

    for _ in range(50):
        dead = subprocess.Popen(sleep)
        started = start_ticks(dead.pid)
        # a process that takes its pid starts at a later tick (a reuse takes
        # the pid counter's wrap-around, seconds at the very least)
        wait_for(lambda s=started: ticks_now() > int(s or 0) + 1, 5, interval=0.005)
        dead.kill()
        dead.wait()
        try:
            with open("/proc/sys/kernel/ns_last_pid", "w") as fh:
                fh.write(str(dead.pid - 1))
        except OSError:
            break
        new = subprocess.Popen(sleep)
        if new.pid == dead.pid:
            return new, started, True
        new.kill()
        new.wait()
    return subprocess.Popen(sleep), started, False


def test_a_dead_holders_pid_taken_by_a_new_process_reads_as_dead(engine, r):
    """A holder's process died and the kernel gave its pid to a new process:
    its record (pid, host key with the holder's start time) reads as dead, so
    a redelivered copy of its task frees the lock and runs at once instead of
    waiting out the lease behind a process that is not the holder. A record
    naming the live process as it is reads as alive."""
    from celery_singleton_lock.process import HOST_KEY, start_ticks

    new, started, reused = _pid_given_to_a_new_process()
    try:
        keys = new_keys()
        take(engine, keys, "orig", "e-orig", lease_ms=60_000)
        write_owner(r, keys.lock, pid=new.pid, hostkey=f"{HOST_KEY}:{started}")
        copy = take(engine, keys, "orig", "e-copy")
        assert copy.status is Acquire.SAME_TASK and copy.holder.pid == new.pid
        assert engine.clear_dead_holder(keys, copy.holder) is True, (
            f"pid {new.pid} {'reused' if reused else 'named'}, holder started at {started}, "
            f"this process at {start_ticks(new.pid)}")
        assert take(engine, keys, "orig", "e-copy").status is Acquire.GRANTED
        # control: the same pid with its own start time is its live process
        alive = new_keys()
        take(engine, alive, "other", "e-other", lease_ms=60_000)
        write_owner(r, alive.lock, pid=new.pid, hostkey=f"{HOST_KEY}:{start_ticks(new.pid)}")
        again = take(engine, alive, "other", "e-again")
        assert engine.clear_dead_holder(alive, again.holder) is False
    finally:
        new.kill()
        new.wait()


def test_a_holder_seen_alive_is_asked_again_only_after_a_short_interval(engine, r,
                                                                         monkeypatch):
    """A storm of duplicates does not ask the kernel about one holder each time;
    a holder that died is still noticed, at most ALIVE_RECHECK later."""
    from celery_singleton_lock import process as lock_module

    # wide enough that a slow machine stays inside it between two calls
    monkeypatch.setattr(lock_module, "ALIVE_RECHECK", 1.0)
    recheck = lock_module.ALIVE_RECHECK
    holder_proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        keys = new_keys()
        take(engine, keys, "running", "e-running")
        write_owner(r, keys.lock, pid=holder_proc.pid)  # as if that process held it
        held = take(engine, keys, "dup-1")
        assert held.status is Acquire.HELD and held.holder.pid == holder_proc.pid
        assert engine.clear_dead_holder(keys, held.holder) is False  # alive: remembered
        holder_proc.kill()
        holder_proc.wait(10)
        seen_dead_at = time.monotonic()
        # within the interval the remembered answer stands ...
        assert engine.clear_dead_holder(keys, held.holder) is False
        assert time.monotonic() - seen_dead_at < recheck
        # ... and after it the kernel is asked again: the dead holder's lock is freed
        time.sleep(recheck + 0.05)
        assert engine.clear_dead_holder(keys, held.holder) is True
        assert take(engine, keys, "dup-2").status is Acquire.GRANTED
    finally:
        holder_proc.kill()
        holder_proc.wait(10)


def test_the_reaper_frees_a_dead_holder_it_had_seen_alive(engine, r, monkeypatch):
    """The main process confirms the death itself: a remembered "alive" from
    before the kill does not keep the lock."""
    from celery_singleton_lock import process as lock_module

    monkeypatch.setattr(lock_module, "ALIVE_RECHECK", 30.0)
    holder_proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        keys = new_keys()
        take(engine, keys, "doomed", "e-doomed")
        write_owner(r, keys.lock, pid=holder_proc.pid)
        holder = take(engine, keys, "dup").holder
        assert engine.clear_dead_holder(keys, holder) is False  # alive, and remembered
        holder_proc.kill()
        holder_proc.wait(10)
        assert engine.reap(keys, "doomed", wait=2.0) is True
        assert not r.exists(keys.lock)
    finally:
        holder_proc.kill()
        holder_proc.wait(10)


def test_queue_marker_passes_to_its_execution_and_refuses_others(engine, r):
    keys = new_keys()
    assert engine.enqueue(keys, "q1", "queue_and_run", 5000).status == Enqueue.TAKEN
    refused = engine.enqueue(keys, "q2", "queue_and_run", 5000)
    assert refused.status == Enqueue.HELD and refused.holder.task_id == "q1"
    # a message that skipped the send-time check meets the queued one's key
    stray = take(engine, keys, "q2", scope="queue_and_run")
    assert stray.status is Acquire.HELD and stray.holder.task_id == "q1"
    assert not stray.queued_by_it
    assert take(engine, keys, "q1", "e1", scope="queue_and_run").status is Acquire.GRANTED
    assert r.get(keys.queued) is None
    # running now: still refused at send
    assert engine.enqueue(keys, "q3", "queue_and_run", 5000).holder.task_id == "q1"
    # under "queue" the key is free again once the queued one started
    assert engine.enqueue(keys, "q3", "queue", 5000).status == Enqueue.TAKEN
    assert engine.unqueue(keys, "q-other") is False
    assert engine.unqueue(keys, "q3") is True


def test_queued_by_names_the_task_whose_send_took_the_key(engine, r):
    """``queued_by``: the id of the task whose send took the key, from the
    send-time marker (its task's name, a newline, its id: an id may hold any
    character, a newline too); a marker left by 0.1.0 holds the id alone
    (CHANGELOG), read as an id with no name; no marker: ''."""
    keys = new_keys()
    assert engine.queued_by(keys) == ""
    assert engine.enqueue(keys, "order\n42", "queue", 5000, "t.x").status == Enqueue.TAKEN
    assert engine.queued_by(keys) == "order\n42"
    r.set(keys.queued, "sent-by-0.1", px=5000)
    assert engine.queued_by(keys) == "sent-by-0.1"
    assert marker_task("sent-by-0.1") == ("", "sent-by-0.1")


@pytest.mark.parametrize("scope", ["queue", "queue_and_run"])
def test_a_throttled_call_gives_up_the_key_it_took_when_sent(engine, r, scope):
    """docs/throttle.md: under the queue scopes a call refused by the throttle
    window at its start gives up the key it took at send; the next send takes
    it (else every later send is refused for a call that never runs, until
    the marker's TTL)."""
    keys = new_keys()
    assert take(engine, keys, "opener", "e-opener", throttle_ms=60_000,
                scope=scope).status is Acquire.GRANTED
    assert engine.release(keys, "e-opener", "opener") is True
    assert engine.enqueue(keys, "sent", scope, 60_000, "t.x").status == Enqueue.TAKEN
    got = take(engine, keys, "sent", "e-sent", throttle_ms=60_000, scope=scope)
    assert got.status is Acquire.THROTTLED and got.holder.task_id == "opener"
    assert r.get(keys.queued) is None
    assert engine.enqueue(keys, "next", scope, 60_000, "t.x").status == Enqueue.TAKEN


def test_a_retry_of_the_task_that_opened_the_window_does_not_open_it_again(engine, r):
    """docs/throttle.md: the opener's retry is that call starting again: it
    is let in, and the window keeps its end (the key's value and TTL)."""
    keys = new_keys()
    assert take(engine, keys, "opener", "e1", throttle_ms=60_000).status is Acquire.GRANTED
    window, ttl = r.get(keys.throttle), r.pttl(keys.throttle)
    assert engine.release(keys, "e1", "opener") is True
    wait_for(lambda: r.pttl(keys.throttle) < ttl - 50, 5, interval=0.01,
             what="the window's TTL to run down a little")
    got = take(engine, keys, "opener", "e2", retries=1, throttle_ms=60_000)
    assert got.status is Acquire.GRANTED
    assert r.get(keys.throttle) == window
    assert r.pttl(keys.throttle) < ttl - 50
    assert take(engine, keys, "other", "e3", throttle_ms=60_000).status is Acquire.THROTTLED


def test_replace_supersedes_a_queued_task_only_while_it_has_not_started(engine, r):
    """``replace``: a send takes the key from a task still queued, never from
    one that started. A send reusing the running task's id (an idempotency key
    as task id) takes the key under "queue"; the next send finds that task
    running (its owner record) and is told it is queued as it, not replacing it."""
    keys = new_keys()
    first = engine.enqueue(keys, "x", "queue", 5000, "t.x", replace=(0, 0))
    assert first.status == Enqueue.TAKEN and first.countdown_ms is None  # no debounce
    assert engine.enqueue(keys, "y", "queue", 5000, "t.x", replace=(0, 0)).status \
        == Enqueue.REPLACED  # x had not started
    assert take(engine, keys, "y", "e-y", scope="queue", replace=True).status \
        is Acquire.GRANTED
    assert engine.enqueue(keys, "y", "queue", 5000, "t.x", replace=(0, 0)).status \
        == Enqueue.TAKEN  # y again, while y runs
    again = engine.enqueue(keys, "z", "queue", 5000, "t.x", replace=(0, 0))
    assert again.status == Enqueue.HELD and again.holder.task_id == "y"
    assert r.hget(keys.replaced, "y") is None


def test_a_replacing_send_leaves_its_marker_and_the_hash_the_markers_ttl(engine, r):
    """enqueue.lua's TTLs under ``replace``: the send-time marker lives the
    TTL given (countdown and ``singleton_queue_ttl``), and the hash of
    superseded ids as long as the longest marker it has seen, no longer; the
    hash names the superseded task's successor with its task's name."""
    keys = new_keys()
    assert engine.enqueue(keys, "x", "queue", 20_000, "t.x", replace=(0, 0)).status \
        == Enqueue.TAKEN
    assert 10_000 < r.pttl(keys.queued) <= 20_000
    assert engine.enqueue(keys, "y", "queue", 30_000, "t.x", replace=(0, 0)).status \
        == Enqueue.REPLACED
    assert marker(r, keys.queued) == ("t.x", "y") and 20_000 < r.pttl(keys.queued) <= 30_000
    assert r.hget(keys.replaced, "x") == "t.x\ny"
    assert 20_000 < r.pttl(keys.replaced) <= 30_000
    keys = new_keys()
    assert engine.enqueue(keys, "x", "queue", 20_000, "t.x",
                          replace=(1_000, 0)).countdown_ms == 1_000
    assert 10_000 < r.pttl(keys.queued) <= 20_000
    assert 10_000 < r.pttl(keys.replaced) <= 20_000


def test_a_debounced_burst_waits_the_debounce_until_debounce_max_from_its_first_send(
        engine, r):
    """``singleton_debounce`` 1 s: each send of a burst is sent with a countdown
    of the debounce; with ``singleton_debounce_max`` 2 s, no later than 2 s
    after the burst's first send (kept in the hash, by the server clock)."""
    keys = new_keys()
    sends = [engine.enqueue(keys, name, "queue", 5000, "t.x", replace=(1000, 0))
             for name in ("a", "b")]
    assert [s.countdown_ms for s in sends] == [1000, 1000]  # no debounce_max
    keys = new_keys()
    assert engine.enqueue(keys, "a", "queue", 5000, "t.x", replace=(1000, 2000)).countdown_ms \
        == 1000
    started = int(r.hget(keys.replaced, ""))
    r.hset(keys.replaced, "", started - 1500)  # the burst began 1.5 s ago
    later = engine.enqueue(keys, "b", "queue", 5000, "t.x", replace=(1000, 2000))
    assert later.status == Enqueue.REPLACED and 0 < later.countdown_ms <= 500
    r.hset(keys.replaced, "", started - 3000)  # past debounce_max: at once
    assert engine.enqueue(keys, "c", "queue", 5000, "t.x", replace=(1000, 2000)).countdown_ms \
        == 0


def test_a_refused_execution_that_took_the_key_at_send_keeps_its_marker(engine, r):
    """Sent under "queue" while another task runs, its send took the key; its
    execution, refused by the running one, is told so and keeps the marker:
    an accepted send must run, it waits its turn."""
    keys = new_keys()
    assert take(engine, keys, "running", "e-running").status is Acquire.GRANTED
    assert engine.enqueue(keys, "sent", "queue", 5000, "t.x").status == Enqueue.TAKEN
    refused = take(engine, keys, "sent", "e-sent", scope="queue")
    assert refused.status is Acquire.HELD and refused.holder.task_id == "running"
    assert refused.queued_by_it and marker(r, keys.queued) == ("t.x", "sent")
    other = take(engine, keys, "other", "e-other", scope="queue")
    assert other.status is Acquire.HELD and not other.queued_by_it


def test_done_marker_counts_success_only(engine, r):
    keys = new_keys()
    take(engine, keys, "a", "ea")
    engine.release(keys, "ea", "a")  # failed: no done_ttl
    assert r.get(keys.done) is None
    take(engine, keys, "b", "eb")
    engine.release(keys, "eb", "b", done_ms=5000, task_name="t.b")
    assert marker(r, keys.done) == ("t.b", "b") and 4000 < r.pttl(keys.done) <= 5000
    done = take(engine, keys, "c")
    assert done.status is Acquire.DONE and done.holder.task_id == "b"
    assert take(engine, keys, "b").status is Acquire.FINISHED
    assert engine.enqueue(keys, "d", "queue", 5000).status == Enqueue.DONE


def test_scripts_flushed_from_the_server_are_loaded_again(engine, r):
    keys = new_keys()
    take(engine, keys, "a", "ea")
    r.script_flush()
    assert engine.release(keys, "ea", "a") is True
    assert take(engine, keys, "b").status is Acquire.GRANTED


def test_a_restarted_redis_costs_no_failed_call(own_redis):
    """The pooled connection broke when Redis restarted: one fresh try, no error."""
    engine = connect(SingletonConfig.defaults(own_redis.url(0)))
    keys = new_keys()
    assert take(engine, keys, "a", "ea").status is Acquire.GRANTED
    own_redis.stop()
    own_redis.start()  # same port, empty, scripts gone
    assert take(engine, keys, "b", "eb").status is Acquire.GRANTED
    own_redis.stop()
    with pytest.raises(redis.ConnectionError):
        take(engine, keys, "c")


def test_a_lost_reply_is_repeated_safely(redis_server, r):
    """The command ran but its answer was lost with the connection: the engine's
    one repeat finds its own work and says so."""
    from tests.support import ReplyDroppingProxy

    proxy = ReplyDroppingProxy(redis_server.port)
    try:
        engine = connect(SingletonConfig.defaults(proxy.url(2)))
        keys = new_keys()
        # connected, and every script loaded (a lost NOSCRIPT answer proves nothing)
        engine.enqueue(new_keys(), "warm", "queue", 1000)
        take(engine, new_keys())
        proxy.drop_after = b"EVALSHA"
        got = take(engine, keys, "a", "ea")
        assert proxy.dropped == 1
        assert got.status is Acquire.GRANTED
        assert got.token == int(owner_field(r, keys.lock, "token") or 0)
        # A send-time key taken by the lost attempt comes back as held by the
        # sender itself (SingletonTask.apply_async knows its fresh id: it sends).
        proxy.drop_after = b"EVALSHA"
        again = engine.enqueue(keys, "q1", "queue", 5000)
        assert proxy.dropped == 2
        assert again.status is Enqueue.HELD and again.holder.task_id == "q1"
        # A release whose reply is lost: the repeat finds the key free and
        # knows its first attempt freed it.
        proxy.drop_after = b"EVALSHA"
        assert engine.release(keys, "ea", "a") is True
        assert proxy.dropped == 3 and not r.exists(keys.lock)
    finally:
        proxy.close()


def test_a_send_time_key_whose_reply_never_came_is_freed_once_redis_answers(redis_server, r):
    """enqueue: the send-time key was taken at the server, but the reply never
    came back (the path went silent: ``socket_timeout``, and the call raises).
    The sender cannot know whether Redis took the key; its task goes out
    without it, so the key is given back (owner-checked, ``unqueue``) once
    Redis answers again, not left to turn later sends away for its TTL."""
    from tests.support import ReplyDroppingProxy

    class ReplyHoldingProxy(ReplyDroppingProxy):
        """The reply to the marked command, and all after it on that
        connection, never arrive; the connection stays open."""

        def _down(self, upstream: Any, client: Any, state: dict[str, bool]) -> None:
            with contextlib.suppress(OSError):
                while data := upstream.recv(65536):
                    if state["drop"]:
                        self.dropped += 1
                        continue
                    client.sendall(data)

    proxy = ReplyHoldingProxy(redis_server.port)
    try:
        engine = connect(dataclasses.replace(
            SingletonConfig.defaults(proxy.url(2)),
            redis_options={"socket_timeout": 0.5, "socket_connect_timeout": 0.5}))
        engine.enqueue(new_keys(), "warm", "queue", 1000)  # connected, scripts loaded
        keys = new_keys()
        proxy.drop_after = b"EVALSHA"
        with pytest.raises(redis.TimeoutError):
            engine.enqueue(keys, "q1", "queue", 60_000)
        assert proxy.dropped >= 1
        assert marker_task(r.get(keys.queued))[1] == "q1"  # taken at the server
        wait_for(lambda: not r.exists(keys.queued), 10, interval=0.02,
                 what="the send-time key given back")
        # the outage ends once every owed call went out: a moment after the undo ran
        wait_for(lambda: not engine.wire.down, 10, interval=0.01, what="the outage to end")
        assert engine.enqueue(keys, "q2", "queue", 60_000).status is Enqueue.TAKEN
        engine.close()
    finally:
        proxy.close()


def test_a_forked_child_gets_its_own_pid_engine_and_execution_ids(redis_server):
    """Identity is refreshed at fork: no exec id or engine is shared with the parent."""
    from celery import Celery

    from celery_singleton_lock.engine.registry import engine_for

    app = Celery("fork", broker=redis_server.url(0), set_as_current=False)
    parent_engine = engine_for(app)
    parent = (PROCESS.pid, PROCESS.prefix, PROCESS.new_exec_id())
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave at once
        try:
            ok = (PROCESS.pid == os.getpid() and PROCESS.prefix != parent[1]
                  and not PROCESS.new_exec_id().startswith(parent[1])
                  and engine_for(app) is not parent_engine)
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.waitpid(pid, 0)
    assert answer == b"1"
    assert parent[0] == os.getpid() and engine_for(app) is parent_engine
    assert PROCESS.new_exec_id() != parent[2]


# -- a release sent without waiting for its reply ------------------------------------

class Answers:
    def __init__(self) -> None:
        self.got: list[tuple[Any, Any]] = []

    def __call__(self, released: Any, error: Any) -> None:
        self.got.append((released, error))


def test_a_release_sent_without_waiting_frees_the_key_and_is_answered_later(engine, r):
    keys = new_keys()
    take(engine, keys, "a", "ea")
    answers = Answers()
    engine.release_later(keys, "ea", "a", answers, done_ms=60000)
    # nothing read yet: neither the grant's confirmation nor the release
    assert engine.unsettled == 2 and answers.got == []
    wait_for(lambda: not r.exists(keys.lock), timeout=2)
    assert marker(r, keys.done) == ("", "a")  # the success record went with it
    # the next call on the connection reads the owed reply first
    assert take(engine, new_keys(), "b").status is Acquire.GRANTED
    assert answers.got == [(Released(Release.RELEASED), None)]
    assert engine.unsettled == 1  # what is owed now: the new grant's confirmation


def test_a_release_sent_without_waiting_leaves_the_finish_marker_a_finish_leaves(engine, r):
    """release_later is how every task's end frees its lock: a finished task
    whose copy waited leaves the finish marker (the copy is dropped by it);
    with ``always_record`` it leaves one though no copy was seen."""
    keys, other = new_keys(), new_keys()
    take(engine, keys, "task-a", "exec-a")
    assert take(engine, keys, "task-a", "exec-copy").status is Acquire.SAME_TASK
    take(engine, other, "task-b", "exec-b")
    answers = Answers()
    engine.release_later(keys, "exec-a", "task-a", answers)
    engine.release_later(other, "exec-b", "task-b", answers, always_record=True)
    engine.settle()
    assert answers.got == [(Released(Release.RELEASED), None)] * 2
    assert r.get(keys.fin) == "task-a" and r.get(other.fin) == "task-b"
    assert take(engine, keys, "task-a", "exec-copy").status is Acquire.FINISHED


def test_a_release_that_finds_the_lock_gone_is_reported_when_read(engine, r):
    keys = new_keys()
    take(engine, keys, "a", "ea")
    r.delete(keys.lock)
    answers = Answers()
    engine.release_later(keys, "ea", "a", answers)
    engine.settle()
    assert answers.got == [(Released(Release.FREE), None)]


def test_a_release_that_finds_another_owner_says_so_and_leaves_it(engine, r):
    keys = new_keys()
    take(engine, keys, "a", "ea", lease_ms=100)
    time.sleep(0.15)
    take(engine, keys, "b", "eb")
    answers = Answers()
    engine.release_later(keys, "ea", "a", answers)
    engine.settle()
    assert answers.got == [(Released(Release.TAKEN), None)]
    assert owner_field(r, keys.lock, "exec") == "eb"


def test_a_release_whose_script_was_flushed_is_sent_again(engine, r):
    keys = new_keys()
    take(engine, keys, "a", "ea")
    r.script_flush()
    answers = Answers()
    engine.release_later(keys, "ea", "a", answers, done_ms=60000)
    engine.settle()
    assert answers.got == [(Released(Release.RELEASED), None)]  # it had not run: no repeat
    assert not r.exists(keys.lock) and marker(r, keys.done) == ("", "a")


def test_a_release_whose_reply_was_lost_is_repeated(redis_server, r):
    from tests.support import ReplyDroppingProxy

    proxy = ReplyDroppingProxy(redis_server.port)
    try:
        engine = connect(SingletonConfig.defaults(proxy.url(2)))
        take(engine, new_keys())  # connected, scripts loaded
        keys = new_keys()
        take(engine, keys, "a", "ea")
        engine.settle()  # the grant's confirmation answered: the release is next
        answers = Answers()
        proxy.drop_after = b"EVALSHA"
        engine.release_later(keys, "ea", "a", answers, done_ms=60000)
        wait_for(lambda: proxy.dropped == 1, timeout=2)  # it ran; its reply is gone
        engine.settle()
        # the repeat found its own work done (the key free), says it was a
        # repeat, and the success record stands
        assert answers.got == [(Released(Release.FREE, repeated=True), None)]
        assert not r.exists(keys.lock) and marker(r, keys.done) == ("", "a")
    finally:
        proxy.close()


def test_a_release_to_a_stopped_redis_is_owed_until_it_answers_again(own_redis):
    """A refused connection: the release is kept (a replicated deployment
    still has the key, on the replica it promotes), never raised into the
    task, and sent once the server answers; its answer is told then."""
    engine = connect(SingletonConfig.defaults(own_redis.url(0)))
    keys = new_keys()
    take(engine, keys, "a", "ea")
    own_redis.stop()
    answers = Answers()
    engine.release_later(keys, "ea", "a", answers)  # never raises into the task
    engine.settle()
    assert answers.got == [] and engine.wire.outage.owed == 1
    own_redis.start()  # same port, empty: the repeat finds the key free
    wait_for(lambda: answers.got, 10, what="the owed release answered")
    assert answers.got == [(Released(Release.FREE, repeated=True), None)]
    assert not engine.wire.down


def test_the_heartbeat_reads_owed_replies_when_nothing_else_does(redis_server, r):
    engine = connect(SingletonConfig.defaults(redis_server.url(2), ttl=0.6))
    hb = Heartbeat(engine)
    held_keys, keys = new_keys(), new_keys()
    got = take(engine, held_keys, "h", "eh", lease_ms=600)
    lock = SingletonLock(held_keys, task_id="h", exec_id="eh", token=got.token, lease=0.6,
                         started=time.monotonic(), held=True)
    hb.add(lock)  # starts the renewer
    hb.discard(lock)  # ... which now renews nothing: it wakes only to read replies
    take(engine, keys, "a", "ea")
    answers = Answers()
    engine.release_later(keys, "ea", "a", answers)
    wait_for(lambda: answers.got == [(Released(Release.RELEASED), None)], timeout=3)
    assert engine.unsettled == 0


# -- what a task says about its release -------------------------------------------------

@pytest.fixture
def lock_task(redis_server, r):
    """A SingletonTask run in this process as a worker runs it, its engine, and a
    proxy in front of Redis that can lose a reply."""
    from celery import Celery

    from celery_singleton_lock import SingletonTask
    from celery_singleton_lock.engine.registry import engine_for, forget_engine
    from tests.support import ReplyDroppingProxy

    proxy = ReplyDroppingProxy(redis_server.port)
    app = Celery("release-words", broker="memory://", set_as_current=False)
    app.conf.singleton_redis_url = proxy.url(2)
    body: list[Any] = []

    @app.task(base=SingletonTask, bind=True, name="t.words", singleton_key=("k",), shared=False)
    def words(self: Any, k: str) -> str:
        for step in body:
            step(self)
        return k

    def run(k: str) -> None:
        words.push_request(id=uuid.uuid4().hex, hostname="w@h", retries=0, is_eager=False,
                           called_directly=False, args=(k,), kwargs={})
        try:
            words(k)
        finally:
            words.pop_request()

    yield run, body, engine_for(app), proxy
    forget_engine(app)
    proxy.close()


def lost_warnings(caplog) -> list[str]:
    return [rec.getMessage() for rec in caplog.records
            if rec.levelname == "WARNING" and "Lost singleton lock" in rec.getMessage()]


def test_a_release_repeated_after_a_lost_reply_is_not_called_a_lost_lock(lock_task, r, caplog):
    run, body, engine, proxy = lock_task
    caplog.set_level("INFO", logger="celery_singleton_lock")
    run("warm")  # connected, scripts loaded
    engine.settle()
    # the next command after the body is the release (the grant's
    # confirmation, sent before the body, answered first)
    body.append(lambda task: engine.settle())
    body.append(lambda task: setattr(proxy, "drop_after", b"EVALSHA"))
    run(uuid.uuid4().hex)
    assert engine.unsettled == 1
    wait_for(lambda: proxy.dropped == 1, timeout=2)  # the release ran; its reply is gone
    engine.settle()
    # repeated at once, or owed and sent once the wire sees Redis answer again
    # (a reset connection may be an outage): either way its reply is read soon
    wait_for(lambda: any("repeated after a lost reply" in rec.getMessage()
                         for rec in caplog.records), 10, what="the repeated release's reply")
    assert lost_warnings(caplog) == []


def test_a_lease_that_ran_out_under_the_task_is_reported_at_release(lock_task, r, caplog):
    # an in-process Celery worker (tests of the testing module) leaves the
    # root logger at ERROR: ask for the warnings this test reads
    caplog.set_level("WARNING", logger="celery_singleton_lock")
    run, body, engine, _proxy = lock_task
    body.append(lambda task: r.delete(task.singleton.keys.lock))  # as if the lease ran out
    run(uuid.uuid4().hex)
    engine.settle()
    assert len(lost_warnings(caplog)) == 1
    assert "lease had run out" in lost_warnings(caplog)[0]


def test_a_key_taken_over_under_the_task_is_reported_at_release(lock_task, r, caplog):
    # an in-process Celery worker (tests of the testing module) leaves the
    # root logger at ERROR: ask for the warnings this test reads
    caplog.set_level("WARNING", logger="celery_singleton_lock")
    run, body, engine, _proxy = lock_task
    body.append(lambda task: write_owner(r, task.singleton.keys.lock, exec="someone-else"))
    run(uuid.uuid4().hex)
    engine.settle()
    assert len(lost_warnings(caplog)) == 1
    assert "another execution held the key" in lost_warnings(caplog)[0]


def test_the_first_release_on_a_fresh_redis_frees_the_key_at_once(own_redis):
    """Every script is loaded when a connection is made: a release sent without
    waiting never meets NOSCRIPT, whose reply would be read (and the command
    sent again) only on the next call, seconds later."""
    engine = connect(SingletonConfig.defaults(own_redis.url(0)))
    keys = new_keys()
    got = take(engine, keys, "a", "ea")
    assert got.status is Acquire.GRANTED
    engine.release_later(keys, "ea", "a", lambda reply, error: None)
    assert own_redis.client().exists(keys.lock) == 0  # before any reply was read
    assert engine.unsettled == 2  # the grant's confirmation and the release


def held_lock(engine: LockEngine, keys: LockKeys, lease: float) -> SingletonLock:
    started = time.monotonic()
    got = take(engine, keys, "task-a", "exec-a", lease_ms=int(lease * 1000))
    assert got.status is Acquire.GRANTED
    return SingletonLock(keys, task_id="task-a", task_name="t.x", exec_id="exec-a",
                         token=got.token, lease=lease, started=started, held=True,
                         hostname="w1@host")


def test_a_redis_restarted_empty_gets_the_held_lock_back_at_once(own_redis):
    """The renewer's watch connection sees the server go; as soon as it answers
    again, every held lock is written back with a higher token (the next
    regular round is 10 s away: without the watch the key would stay absent,
    free for a duplicate, until then)."""
    engine = connect(SingletonConfig.defaults(own_redis.url(0)))
    keys = new_keys()
    lock = held_lock(engine, keys, lease=30.0)
    hb = Heartbeat(engine)
    hb.add(lock)
    try:
        wait_for(lambda: hb.watch.run_id, 5, what="the watch to connect")
        first_run, original = hb.watch.run_id, lock.token
        own_redis.stop()
        own_redis.start()  # same port, empty
        client = own_redis.client()
        record = wait_for(lambda: owner_record(client, keys.lock), 10, what="the lock back")
        assert record["exec"] == "exec-a" and record["task"] == "task-a"
        assert int(record["token"]) > lock.token  # later grants stay above it
        assert lock.token == original and not lock.lost  # the task keeps its token
        assert hb.watch.run_id != first_run and hb.reasserted == 1
        assert 25_000 < client.pttl(keys.lock) <= 30_000
    finally:
        hb.discard(lock)


def test_a_renewal_that_reaches_a_restarted_redis_first_writes_the_lock_back(own_redis):
    """Whichever comes first after an empty restart, the renewer's watch or a
    renewal round (a retried one, the regular one), finds the same thing: the
    key is gone with its fencing counter, so Redis forgot it; the round writes
    it back instead of declaring the lock lost."""
    engine = connect(SingletonConfig.defaults(own_redis.url(0)))
    keys = new_keys()
    lock = held_lock(engine, keys, lease=30.0)
    hb = Heartbeat(engine)  # not started: no watch, the round is driven by hand
    hb._held[id(lock)] = lock
    own_redis.stop()
    own_redis.start()  # same port, empty
    assert hb.renew_now() is True
    record = owner_record(own_redis.client(), keys.lock)
    assert not lock.lost and hb.reasserted == 1
    assert record["exec"] == "exec-a" and int(record["token"]) > lock.token
    # the counter is written back too: the next grant of the key comes above
    other = connect(SingletonConfig.defaults(own_redis.url(0)))
    engine.release(keys, "exec-a", "task-a", finished=False)
    assert take(other, keys, "task-b", "exec-b").token > int(record["token"])


def test_a_write_back_and_a_renewal_of_the_same_lock_agree(own_redis):
    """Two calls find the key gone (a renewal round and a second one racing it):
    the first writes it back, the second finds it this execution's and renews."""
    engine = connect(SingletonConfig.defaults(own_redis.url(0)))
    keys = new_keys()
    lock = held_lock(engine, keys, lease=30.0)
    own_redis.stop()
    own_redis.start()
    request = Request("task-a", "exec-a", Lease(30.0), "w1@host", task_name="t.x")
    before = server_micros(own_redis.client())
    first = engine.reclaim(keys, request, lock.token)
    second = engine.reclaim(keys, request, lock.token)
    assert first.status is Reclaim.WRITTEN_BACK and first.token > lock.token
    # the clock, now past the holder's token (docs/fencing.md#retention)
    assert before <= first.token <= server_micros(own_redis.client())
    assert second.status is Reclaim.OURS and second.token == first.token


def reclaim_args(task_id: str, exec_id: str, token: int) -> tuple[Request, int]:
    return Request(task_id, exec_id, Lease(30.0), "w1@host", task_name="t.x"), token


def test_a_lock_granted_ahead_of_the_clock_is_written_back_above_its_token(engine, r):
    """A counter ahead of the server clock (written by a server whose clock was
    ahead, before a failover) gives the holder a token ahead of the clock; when
    the server then forgets the lock with its counter, the write-back comes
    above the holder's token, not at it: the clock alone is below it."""
    keys = new_keys()
    ahead = int(r.time()[0]) * 1_000_000 + 3_600_000_000  # an hour ahead, in µs
    r.set(keys.fence, str(ahead), px=60_000)
    held = take(engine, keys, "task-a", "exec-a", lease_ms=30_000).token
    assert held == ahead + 1
    r.delete(keys.lock, keys.fence)  # forgotten, as by a replica that never had them
    back = engine.reclaim(keys, *reclaim_args("task-a", "exec-a", held))
    assert back.status is Reclaim.WRITTEN_BACK and back.token == held + 1
    assert int(r.get(keys.fence)) == held + 1
    assert int(owner_field(r, keys.lock, "token")) == held + 1


def test_a_lock_written_back_keeps_its_finish_ttl(engine, r):
    """reclaim.lua writes the owner record anew with the fields a grant
    writes, the finish marker's TTL among them (release.lua reads it there):
    a copy that waited on a lock written back is dropped by the finish
    marker its release leaves, which lives ``singleton_finished_ttl`` (60 s
    here)."""
    keys = new_keys()
    held = take(engine, keys, "task-a", "exec-a", lease_ms=30_000).token
    r.delete(keys.lock, keys.fence)  # forgotten, as by a server restarted empty
    assert engine.reclaim(keys, *reclaim_args("task-a", "exec-a", held)).status \
        is Reclaim.WRITTEN_BACK
    assert owner_field(r, keys.lock, "fin") == "60000"
    assert take(engine, keys, "task-a", "exec-copy").status is Acquire.SAME_TASK
    assert engine.release(keys, "exec-a", "task-a") is True
    assert r.get(keys.fin) == "task-a" and 30_000 < r.pttl(keys.fin) <= 60_000
    assert take(engine, keys, "task-a", "exec-copy").status is Acquire.FINISHED


def test_slots_written_back_ahead_of_the_clock_each_come_above_the_counter(engine, r):
    """``singleton_limit``: two slots granted ahead of the clock, forgotten with
    their counter. The later-granted slot is written back first and recreates
    the counter above its token; the other, whose own token is lower, comes
    above that counter: no two slots share a token."""
    keys = new_keys()
    ahead = int(r.time()[0]) * 1_000_000 + 3_600_000_000
    r.set(keys.fence, str(ahead), px=60_000)
    first = take(engine, keys, "task-a", "exec-a", lease_ms=30_000, slots=2)
    second = take(engine, keys, "task-b", "exec-b", lease_ms=30_000, slots=2)
    assert (first.token, second.token) == (ahead + 1, ahead + 2)
    r.delete(keys.slot(first.slot).lock, keys.slot(second.slot).lock, keys.fence, keys.back)
    b = engine.reclaim(keys.slot(second.slot), *reclaim_args("task-b", "exec-b", second.token))
    a = engine.reclaim(keys.slot(first.slot), *reclaim_args("task-a", "exec-a", first.token))
    assert b.status is Reclaim.WRITTEN_BACK and b.token == ahead + 3
    assert a.status is Reclaim.WRITTEN_BACK and a.token == ahead + 4
    assert int(r.get(keys.fence)) == ahead + 4


def test_a_lock_whose_lease_ran_out_during_the_outage_is_not_taken_back(own_redis):
    engine = connect(SingletonConfig.defaults(own_redis.url(0)))
    keys = new_keys()
    lock = held_lock(engine, keys, lease=1.0)
    hb = Heartbeat(engine)
    hb.add(lock)
    try:
        wait_for(lambda: hb.watch.run_id, 5, what="the watch to connect")
        own_redis.stop()
        wait_for(lambda: lock.lost, 10, what="the local lease to run out")
        own_redis.start()
        wait_for(lambda: hb.watch.run_id and not hb.watch.down, 10, what="reconnect")
        hb.renew_now(take_back=True)
        assert not own_redis.client().exists(keys.lock)
        assert hb.reasserted == 0
    finally:
        hb.discard(lock)


def test_a_key_taken_by_another_while_absent_means_lost(own_redis):
    engine = connect(SingletonConfig.defaults(own_redis.url(0)))
    keys = new_keys()
    lock = held_lock(engine, keys, lease=30.0)
    hb = Heartbeat(engine)  # not started: the round is driven by hand
    own_redis.stop()
    own_redis.start()
    other = connect(SingletonConfig.defaults(own_redis.url(0)))
    assert take(other, keys, "task-b", "exec-b").status is Acquire.GRANTED
    hb._held[id(lock)] = lock
    hb.renew_now(take_back=True)
    assert lock.lost
    assert owner_field(own_redis.client(), keys.lock, "exec") == "exec-b"


def test_a_key_released_by_someone_else_is_lost_not_taken_back(engine, r):
    """Absent in a regular round (the server did not restart): an operator's
    forced release, not a forgotten key. The holder loses it."""
    keys = new_keys()
    lock = held_lock(engine, keys, lease=30.0)
    hb = Heartbeat(engine)
    hb._held[id(lock)] = lock
    r.delete(keys.lock)
    hb.renew_now()
    assert lock.lost and not r.exists(keys.lock)


def test_renewing_ten_thousand_locks_goes_in_calls_of_a_bounded_size(own_redis):
    """Chunked: no renewal call carries more than ``RENEW_CHUNK`` locks (250:
    about 1.4 ms of Redis's time, where one call for 10,000 locks took 45-90 ms
    and kept every other client waiting; docs/benchmarks-details.md), counted
    call by call in what Redis received (MONITOR), not timed. Lost scripts are
    loaded again."""
    from celery_singleton_lock.engine.server import RENEW_CHUNK

    # a wait no load makes a renewal of 10,000 locks outlast (MONITOR slows Redis):
    # what is counted is what Redis received, not how soon
    engine = connect(SingletonConfig.defaults(own_redis.url(0),
                                              redis_options={"socket_timeout": 30.0}))
    client = own_redis.client()
    held = []
    for i in range(10_000):
        keys = LockKeys("singleton:", f"{i:032x}")
        take(engine, keys, f"t{i}", f"e{i}", lease_ms=60_000)
        held.append((keys.lock, f"e{i}", 60_000))
    client.script_flush()

    def locks_per_call() -> list[int]:
        """Locks in each renewal script call Redis received (each lock comes
        with its counter's key), read from MONITOR up to a marker."""
        marker = uuid.uuid4().hex
        sizes = []
        with client.monitor() as monitor:
            assert engine.renew(held) == [1] * 10_000
            client.echo(marker)
            while True:
                words = monitor.next_command()["command"].split(" ", 3)
                if words[0] == "ECHO" and marker in words[1]:
                    return sizes
                if words[0] in ("EVALSHA", "EVAL") and len(words) > 2:
                    sizes.append(int(words[2]) // 2)

    sizes = locks_per_call()
    assert sum(sizes) >= 10_000 and max(sizes) <= RENEW_CHUNK <= 250, sizes
    engine.renew_chunk = 10_000  # what a single call did
    assert max(locks_per_call()) == 10_000


def test_a_grant_that_arrives_after_its_lease_is_no_grant(redis_server):
    """The acquire's reply is held up longer than the lease (a network stall):
    the body never runs, the key is given back, and the backend-error policy
    decides (here "raise": the task fails with LockBackendError naming why)."""
    import threading

    from celery import Celery
    from celery.app.trace import build_tracer
    from celery.result import AsyncResult

    from celery_singleton_lock import LockBackendError, SingletonTask
    from celery_singleton_lock.engine.registry import engine_for
    from tests.support import PausableProxy

    proxy = PausableProxy(redis_server.port)
    app = Celery("stale", broker=redis_server.url(0), backend=redis_server.url(1),
                 set_as_current=False)
    app.conf.update(singleton_redis_url=proxy.url(2), singleton_ttl=1.0,
                    singleton_on_backend_error="raise")
    ran: list[int] = []

    @app.task(base=SingletonTask, name="stale.t", bind=True, shared=False)
    def t(self: Any, x: int) -> int:
        ran.append(self.singleton.token)
        return x

    tracer = build_tracer(t.name, t, app=app, eager=False)

    def run(x: int) -> AsyncResult:
        task_id = uuid.uuid4().hex
        tracer(task_id, (x,), {}, {"id": task_id, "hostname": "w@h", "delivery_info": {}})
        return AsyncResult(task_id, app=app)

    try:
        assert run(0).get(timeout=10) == 0 and len(ran) == 1  # connected, scripts loaded
        ran.clear()
        proxy.pause()
        threading.Timer(1.5, proxy.resume).start()  # longer than the 1 s lease
        late = run(1)
        assert ran == []
        # given back: the reply took longer than the lease, and than half of
        # the caller's wait (socket_timeout, 2 s), whichever is found first
        with pytest.raises(LockBackendError,
                           match=r"after its lease ran out|over half of its caller's wait"):
            late.get(timeout=10)
        engine_for(app).settle()
        assert not redis_server.client(2).exists(t.singleton_keys(1).lock)
    finally:
        proxy.resume()
        proxy.close()


def test_the_markers_a_release_leaves_live_the_finish_ttl(engine, r):
    """The finish marker lives ``singleton_finished_ttl`` (60 s here), not
    longer: recorded always (``acks_late``), and recorded because a copy was
    seen (the TTL read from the owner record)."""
    keys = new_keys()
    take(engine, keys, "task-a", "exec-a")
    engine.release(keys, "exec-a", "task-a", always_record=True)
    assert r.get(keys.fin) == "task-a" and 30_000 < r.pttl(keys.fin) <= 60_000
    keys = new_keys()
    take(engine, keys, "task-b", "exec-b")
    assert take(engine, keys, "task-b", "exec-copy").status is Acquire.SAME_TASK
    engine.release(keys, "exec-b", "task-b")
    assert r.get(keys.fin) == "task-b" and 30_000 < r.pttl(keys.fin) <= 60_000


def test_a_write_back_leaves_the_lease_the_counters_retention_and_the_back_hash(engine, r):
    """reclaim.lua's TTLs: a lock written back lives its lease; its counter the
    lease and the retention (``singleton_fence_ttl``, 300 s by default); the
    ``back`` hash a lease and a second. A holder's key found still its own has
    its lease renewed to the lease asked for, no longer. (The figures are
    written out: ``back_ms`` and ``fence_ttl_ms`` are what is checked.)"""
    keys = new_keys()
    held = take(engine, keys, "task-a", "exec-a", lease_ms=30_000).token
    r.delete(keys.lock, keys.fence)  # forgotten, as by a server restarted empty
    sent = time.monotonic()
    back = engine.reclaim(keys, *reclaim_args("task-a", "exec-a", held))
    back_left = r.pttl(keys.back)
    since_ms = (time.monotonic() - sent) * 1000
    assert back.status is Reclaim.WRITTEN_BACK
    # a lease and a second, less only the time it took to ask
    assert 31_000 - since_ms - 1 <= back_left <= 31_000
    assert 20_000 < r.pttl(keys.lock) <= 30_000
    assert 30_000 + 300_000 - 10_000 < r.pttl(keys.fence) <= 30_000 + 300_000
    r.pexpire(keys.lock, 5_000)
    again = engine.reclaim(keys, *reclaim_args("task-a", "exec-a", held))
    assert again.status is Reclaim.OURS and 20_000 < r.pttl(keys.lock) <= 30_000
