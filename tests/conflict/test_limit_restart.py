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

import contextlib
import os
import signal
import time
import uuid
from typing import Any

import pytest

from celery_singleton_lock import SingletonConfig, is_skipped
from celery_singleton_lock.engine.registry import connect
from celery_singleton_lock.engine.replies import Acquire, Reclaim, Renew
from celery_singleton_lock.engine.request import Lease, Request
from celery_singleton_lock.keys import LockKeys
from tests.engine.test_restart_race import OFFSETS, wait_for_renewal
from tests.support import RedisServer, Worker, discard, owner_record, wait_for
from tests.workerapp import make_app

CONF = {"singleton_ttl": 3.0}
#: the soak's lease: long enough that a pool process starved of CPU for a few
#: seconds on a loaded machine keeps renewing (a lease that runs out under a
#: holder is the lost-lock case, tested with frozen processes elsewhere); the
#: write-back after an empty restart and the slots held back meanwhile scale
#: with it and are exercised the same way
SOAK_CONF = {"singleton_ttl": 10.0}


def grant(engine: Any, keys: LockKeys, n: int) -> Any:
    return engine.acquire(keys, Request(task_id=f"task-{n}", exec_id=f"exec-{n}",
                                        lease=Lease.of_ms(30_000), hostname="w1@host", retries=0,
                                        task_name="t.limit", slots=2))


def reclaim(engine: Any, keys: LockKeys, n: int, token: int) -> Any:
    return engine.reclaim(keys, Request(task_id=f"task-{n}", exec_id=f"exec-{n}",
                                        lease=Lease.of_ms(30_000), hostname="w1@host", retries=0,
                                        task_name="t.limit"), token)


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


def test_a_slot_whose_renewer_runs_late_after_an_empty_restart_is_kept_for_it(own_redis):
    """Two slots held under a 6 s lease, the server restarted empty: slot 1 is
    written back at once, slot 2's holder writes its slot back only after a
    third of the lease and a second have passed (a starved process's renewer),
    its lease still valid. Meanwhile a third execution is refused, not given
    slot 2, and the late holder gets its slot back (before: the key's note of
    the write-backs lived a third of the lease and a second, slot 2 went to the
    third execution, and the late holder was told its slot was released while
    it still ran: three executions of a key under singleton_limit=2)."""
    engine = connect(SingletonConfig.defaults(own_redis.url(0)))
    keys = LockKeys("singleton:", uuid.uuid4().hex)
    lease = 6_000

    def take(n: int) -> Any:
        return engine.acquire(keys, Request(task_id=f"task-{n}", exec_id=f"exec-{n}",
                                            lease=Lease.of_ms(lease), hostname="w1@host",
                                            retries=0, task_name="t.limit",
                                            slots=2))

    def back(n: int, token: int) -> Any:
        return engine.reclaim(keys.slot(n), Request(task_id=f"task-{n}", exec_id=f"exec-{n}",
                                                    lease=Lease.of_ms(lease), hostname="w1@host",
                                                    retries=0,
                                                    task_name="t.limit"), token)

    first, second = take(1), take(2)
    granted = time.monotonic()
    own_redis.stop()
    own_redis.start()  # same port, empty
    assert back(1, first.token).status is Reclaim.WRITTEN_BACK
    written = time.monotonic()
    # past the old note's life (a third of the lease and a second), within the lease
    wait_for(lambda: time.monotonic() - written > lease / 3000 + 1.5, 10, interval=0.05)
    assert time.monotonic() - granted < lease / 1000 - 1.0, "the machine took too long"
    # slot 1's holder renews on time (its lock would look doubtful otherwise)
    assert engine.renew([(keys.slot(1).lock, "exec-1", lease)]) == [Renew.RENEWED]
    third = take(3)
    assert third.status is Acquire.HELD, third
    late = back(2, second.token)
    assert late.status is Reclaim.WRITTEN_BACK, late
    assert owner_record(own_redis.client(), keys.slot(2).lock)["exec"] == "exec-2"


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
        written: list[float] = []
        admin = lock_server.client(2)
        for i, offset in enumerate(OFFSETS):
            wait_for_renewal(admin, keys.slot(1).lock)
            time.sleep(offset)  # placing the kill in the cycle, not racing a lease
            lock_server.stop()  # kill -9
            lock_server.start()  # same port, empty
            answered = time.monotonic()
            admin = lock_server.client(2)

            def both_back(admin: Any = admin) -> bool:
                owners = [owner_record(admin, keys.slot(n).lock).get("task") for n in (1, 2)]
                return set(owners) == ids

            wait_for(both_back, 15, interval=0.005,
                     what=f"both slots written back after restart {i + 1}")
            written.append(time.monotonic() - answered)
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
        ms = sorted(w * 1000 for w in written)
        print(f"\nboth slots written back {ms[0]:.0f} / {ms[len(ms) // 2]:.0f} / {ms[-1]:.0f} ms "
              "(min / median / max) after the restarted server answered")
    finally:
        for w in workers:
            discard(w)
        lock_server.cleanup()


SOAK_SECONDS = float(os.environ.get("SLT_SOAK_SECONDS", "12"))
KILL_EVERY = float(os.environ.get("SLT_SOAK_KILL_EVERY", "3"))
#: empty restarts of the lock Redis, spread evenly over the soak (each met
#: both slots of some key held in about half the runs before the fix)
RESTARTS = int(os.environ.get("SLT_SOAK_RESTARTS", "3"))


Span = tuple[str, int, float, float, str]


def spans_of(evs: list[dict[str, Any]], killed_at: dict[int, float]) -> list[Span]:
    """(key, slot, start, end, task id) of every execution; one killed ends
    when its process was first killed."""
    ends = {e["id"] + str(e["pid"]): e["t"] for e in evs if e["ev"] == "end"}
    return [(e["key"], e["slot"], e["t"],
             ends.get(e["id"] + str(e["pid"]), killed_at.get(e["pid"], float("inf"))), e["id"])
            for e in evs if e["ev"] == "start"]


def most_at_once(spans: list[Span]) -> int:
    """The most executions of one key that ran at the same moment."""
    most = 0
    for key, _, start, _, _ in spans:
        most = max(most, sum(1 for k, _, s, e, _ in spans if k == key and s <= start < e))
    return most


def two_in_a_slot(spans: list[Span]) -> list[tuple[str, str]]:
    """Pairs of executions that ran at once in one slot of one key."""
    return [(a[4], b[4]) for a in spans for b in spans
            if a[4] < b[4] and a[:2] == b[:2] and a[2] < b[3] and b[2] < a[3]]


@pytest.mark.long
@pytest.mark.worker
@pytest.mark.timeout(SOAK_SECONDS + 240)
def test_limit_soak_killed_children_and_an_empty_restart(redis_server, events):
    """Two workers, calls of three keys under singleton_limit=2 sent all the
    time (0.5-3 s each), a pool child killed every few seconds and the lock
    Redis killed and restarted empty three times: never more than two
    executions of a key at once, never two in one slot, every call final.
    ``SLT_SOAK_SECONDS=120 SLT_SOAK_KILL_EVERY=6 SLT_SOAK_RESTARTS=1`` is a
    long form (an operator's: one restart)."""
    import random

    lock_server = RedisServer().start()
    lock_url = f"redis://127.0.0.1:{lock_server.port}/2"
    queue = f"limit-soak-{uuid.uuid4().hex[:6]}"
    workers = [Worker(redis_server.url(), queue, concurrency=3, conf=SOAK_CONF, lock_url=lock_url,
                      name=name).start() for name in ("a", "b")]
    rng = random.Random(45)
    killed_at: dict[int, float] = {}
    sent: list[Any] = []
    try:
        app = make_app(redis_server.url(), queue, lock_url=lock_url, conf=SOAK_CONF)
        task = app.tasks["t.limit2"]
        keys = [f"ls-{uuid.uuid4().hex[:6]}-{i}" for i in range(3)]
        started = last_kill = time.monotonic()
        restarts = 0
        while time.monotonic() - started < SOAK_SECONDS:
            sent.append(task.delay(rng.choice(keys), rng.uniform(0.5, 3.0), "soak"))
            if time.monotonic() - last_kill > KILL_EVERY:
                last_kill = time.monotonic()
                children = [p for w in workers for p in w.children()]
                if children:
                    victim = rng.choice(children)
                    killed_at.setdefault(victim, time.time())
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(victim, signal.SIGKILL)
            if time.monotonic() - started > SOAK_SECONDS * (restarts + 1) / (RESTARTS + 1):
                restarts += 1
                lock_server.stop()  # kill -9
                lock_server.start()  # same port, empty
            time.sleep(0.1)
        for res in sent:
            with contextlib.suppress(Exception):  # a killed child's task fails: final too
                res.get(timeout=120, propagate=False)
            assert res.state in ("SUCCESS", "FAILURE"), (res.id, res.state)
        spans = spans_of(events.all(), killed_at)
        most, doubled = most_at_once(spans), two_in_a_slot(spans)
        print(f"\nlimit soak: {len(sent)} calls, {len(spans)} executions, "
              f"{len(killed_at)} children killed, {restarts} empty restart(s); "
              f"most at once {most}, two in a slot {len(doubled)}")
        # An execution told that its lock was lost ran on knowingly: its key had
        # been granted to another in the milliseconds between the restarted
        # server answering and its write-back (a single lock has the same
        # window: docs/limit.md). Among the executions that held their slot,
        # never more than two at once and never two in one slot; and a loss is
        # that rare race, not the rule (before slots were written back one by
        # one, every restart cost the second slot's holder).
        lost = {e["id"] for e in events.all() if e["ev"] == "end" and e.get("lost")}
        held = [s for s in spans if s[4] not in lost]
        pairs = two_in_a_slot(held)
        if most_at_once(held) > 2 or pairs:
            named = {i for pair in pairs for i in pair}
            history = [e for e in events.all() if e.get("id") in named]
            logs = "\n".join(w.logs()[-6000:] for w in workers)
            raise AssertionError(
                f"most at once {most_at_once(held)}, two in a slot {pairs}; lost {sorted(lost)}; "
                f"killed {killed_at}; restarts {restarts}\nevents of those executions:\n"
                + "\n".join(map(str, history)) + f"\nworker logs:\n{logs}")
        assert len(lost) <= restarts, sorted(lost)
    finally:
        for w in workers:
            discard(w)
        lock_server.cleanup()
