"""Redlock: the lock on a majority of five independent redis-servers.

Engine level first (grants, a master killed, one paused past the lease, one
restarted empty, too few masters), then real workers with
``singleton_redis_url = redlock://...``. The broker and the test events stay
on the session's standalone server.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from typing import Any, Iterator, Optional

import pytest
import redis

from celery_singleton_lock import SingletonConfig
from celery_singleton_lock.checks.doctor import engine_checks, startup_check
from celery_singleton_lock.engine.redlock.engine import QuorumError, RedlockEngine
from celery_singleton_lock.engine.redlock.quorum import MISSING, _settled_by
from celery_singleton_lock.engine.registry import connect
from celery_singleton_lock.engine.replies import (
    Acquire,
    Acquired,
    Enqueue,
    Release,
    Released,
    Renew,
)
from celery_singleton_lock.engine.request import Lease, Request
from celery_singleton_lock.engine.server import LockEngine
from celery_singleton_lock.engine.watch import MastersWatch
from celery_singleton_lock.keys import LockKeys
from celery_singleton_lock.lock import SingletonLock
from celery_singleton_lock.worker.heartbeat import Heartbeat
from celery_singleton_lock.worker.ticks import entry_base
from tests.beat.test_beat import Beat, tick_events
from tests.support import ROOT, RedisServer, Worker, discard, owner_field, wait_for
from tests.workerapp import make_app


def redlock_url(servers: list[RedisServer], db: int = 2) -> str:
    return "redlock://" + ",".join(f"127.0.0.1:{s.port}" for s in servers) + f"/{db}"


def start_masters(count: int = 5) -> list[RedisServer]:
    servers: list[RedisServer] = []
    try:
        for _ in range(count):
            servers.append(RedisServer().start())
    except BaseException:
        for s in servers:
            s.cleanup()
        raise
    return servers


@pytest.fixture
def masters() -> Iterator[list[RedisServer]]:
    """Five masters of the test's own, free to kill, pause and restart."""
    servers = start_masters()
    yield servers
    for s in servers:
        if s.proc is not None:
            s.resume()  # a paused one must die too
        s.cleanup()


@pytest.fixture
def engine(masters: list[RedisServer]) -> Iterator[RedlockEngine]:
    e = connect(SingletonConfig.defaults(redlock_url(masters)))
    assert isinstance(e, RedlockEngine)
    yield e
    e.close()


def new_keys() -> LockKeys:
    return LockKeys("singleton:", uuid.uuid4().hex)


def take(engine: LockEngine, keys: LockKeys, task_id: str, exec_id: str = "",
         lease_ms: int = 30_000) -> Any:
    return engine.acquire(keys, Request(task_id=task_id, exec_id=exec_id or uuid.uuid4().hex,
                                        lease=Lease.of_ms(lease_ms), hostname="w1@host", retries=0,
                                        task_name="t.x"))


def holder_on(server: RedisServer, keys: LockKeys) -> Optional[str]:
    value = owner_field(server.client(2), keys.lock, "task")
    return None if value is None else str(value)


def answers(server: RedisServer) -> bool:
    try:
        return bool(server.client(2).ping())
    except redis.RedisError:
        return False


def stall_after_the_majority(engine: RedlockEngine, monkeypatch: pytest.MonkeyPatch,
                             seconds: float) -> None:
    """The engine's clock moved on ``seconds`` between the majority's answers
    (once the token is carried) and the decision: a process stalled there."""
    import celery_singleton_lock.engine.redlock.engine as module

    real_carry, stalled = engine._carry, []

    def carry_then_stall(*args: Any) -> int:
        carried = real_carry(*args)
        stalled.append(True)
        return carried

    class Clock:
        def __getattr__(self, name: str) -> Any:
            return getattr(time, name)

        @staticmethod
        def monotonic() -> float:
            return time.monotonic() + (seconds if stalled else 0.0)

    monkeypatch.setattr(engine, "_carry", carry_then_stall)
    monkeypatch.setattr(module, "time", Clock())


def test_a_majority_won_after_the_validity_time_is_given_back_everywhere(
        masters, engine, monkeypatch):
    """docs/deployments.md: a grant won by a majority only once the validity
    time (the lease less the drift allowed) had passed is no grant: by then a
    master's copy may have expired and another holder won. It is given back
    on every master and the caller told why; the next task is granted. The
    engine's clock is moved on a lease between the majority's answers and the
    decision (a process stalled there)."""
    stall_after_the_majority(engine, monkeypatch, 31.0)
    keys = new_keys()
    with pytest.raises(QuorumError, match="too late"):
        take(engine, keys, "stalled")
    monkeypatch.undo()
    wait_for(lambda: all(holder_on(m, keys) is None for m in masters), 10, interval=0.01,
             what="the grant given back on every master")
    assert take(engine, keys, "next").status is Acquire.GRANTED


def test_a_grant_holds_every_master_with_one_token_and_refuses_a_second_task(masters, engine):
    """Granted on all five (the call returns once a majority carries the token;
    the others follow), each master's counter and record at or above the token
    handed out; a second task is refused naming the holder; after the release
    nothing is left and the next grant has a higher token."""
    keys = new_keys()
    first = take(engine, keys, "A", "exec-a")
    assert first.status is Acquire.GRANTED
    for s in masters:
        c = s.client(2)
        wait_for(lambda c=c: owner_field(c, keys.lock, "task") == "A"
                 and int(owner_field(c, keys.lock, "token") or 0) >= first.token, 5,
                 what="the grant and its token on every master")
        assert int(c.get(keys.fence)) >= first.token
    second = take(engine, keys, "B")
    assert second.status is Acquire.HELD and second.holder.task_id == "A"
    assert engine.owner(keys)["task"] == "A"
    assert engine.renew([(keys.lock, "exec-a", 30_000)]) == [Renew.RENEWED]
    assert engine.release(keys, "exec-a", "A") is True
    wait_for(lambda: not any(holder_on(s, keys) for s in masters), 5, what="released on all")
    third = take(engine, keys, "B")
    assert third.status is Acquire.GRANTED and third.token > first.token


def test_with_one_master_killed_a_lock_is_granted_renewed_and_released(masters, engine):
    masters[0].stop()
    keys = new_keys()
    first = take(engine, keys, "A", "exec-a")
    assert first.status is Acquire.GRANTED
    assert sum(holder_on(s, keys) == "A" for s in masters[1:]) == 4
    assert take(engine, keys, "B").status is Acquire.HELD
    assert engine.renew([(keys.lock, "exec-a", 30_000)]) == [Renew.RENEWED]
    assert engine.release(keys, "exec-a", "A") is True
    second = take(engine, keys, "B")
    assert second.status is Acquire.GRANTED and second.token > first.token


def test_a_master_paused_past_the_lease_gives_no_double_grant_and_tokens_go_up(masters, engine):
    """A holds all five and dies; master 4 is SIGSTOPped with A's record. A's
    lease runs out on the others: B gets the four that answer. Master 4 comes
    back with A's record expired (B's late acquire may run there then): C is
    refused (B holds a majority), B keeps renewing, and once B releases C gets
    a token above B's."""
    keys = new_keys()
    a = take(engine, keys, "A", "exec-a", lease_ms=1000)
    assert a.status is Acquire.GRANTED
    paused = masters[4]
    paused.pause()
    # A never renews: its lease runs out on every master that runs
    wait_for(lambda: not any(holder_on(s, keys) for s in masters[:4]), 10,
             what="A's lease to run out")
    b = take(engine, keys, "B", "exec-b")
    assert b.status is Acquire.GRANTED and b.token > a.token
    assert [holder_on(s, keys) for s in masters[:4]] == ["B"] * 4
    paused.resume()
    # B's acquire, sent while it was paused, may run there now that it is back
    wait_for(lambda: answers(paused) and holder_on(paused, keys) in (None, "B"), 10,
             what="master 4 back, A's record expired there")
    c = take(engine, keys, "C", "exec-c")
    assert c.status is Acquire.HELD and c.holder.task_id == "B"
    assert engine.renew([(keys.lock, "exec-b", 30_000)]) == [Renew.RENEWED]
    # C's grant on master 4 alone was given back
    wait_for(lambda: holder_on(paused, keys) != "C", 5, what="C's lone grant given back")
    assert engine.release(keys, "exec-b", "B") is True
    # a call that timed out on master 4 while it was paused (on a busy machine,
    # C's first one) left it out until its outage's probe sees it answer
    wait_for(lambda: not engine.masters[4].engine.down, 10,
             what="the engine to count master 4 in again")
    c = take(engine, keys, "C", "exec-c")
    assert c.status is Acquire.GRANTED and c.token > b.token
    # the grant is decided by the first three answers: master 4's may come after
    wait_for(lambda: holder_on(paused, keys) == "C", 10, what="C's grant on master 4 too")


def _holder_of(engine: RedlockEngine, keys: LockKeys, answer: Acquired, exec_id: str,
               started: float) -> SingletonLock:
    """The lock a task holds on ``answer``, as task.py makes it on Redlock."""
    assert answer.status is Acquire.GRANTED, answer
    return SingletonLock(keys, task_id="t", task_name="t.x", exec_id=exec_id,
                         token=answer.token, lease=30.0, started=started, held=True,
                         hostname="w1@host", margin=engine.lease_margin(30.0),
                         confirmation=answer.confirmation)


def test_a_grant_confirmed_on_a_majority_counts_its_whole_lease(masters, engine):
    """Each master's grant lives a short window until confirmed (sent without
    waiting); once a majority of the confirmations are answered the holder
    counts on its whole lease, past that window."""
    keys = new_keys()
    answer = take(engine, keys, "t", "exec-ok")
    lock = _holder_of(engine, keys, answer, "exec-ok", time.monotonic())
    # (each master's thread may have read its confirmation's reply already)
    assert answer.confirmation is not None
    engine.settle()
    wait_for(lambda: not lock.confirming, 10, what="a majority of the confirmations read")
    window = answer.confirmation.until
    wait_for(lambda: time.monotonic() > window, 10, what="an unconfirmed grant's window to pass")
    assert not lock.lost
    assert engine.release(keys, "exec-ok", "t") is True


def test_a_grant_whose_confirmations_a_majority_never_ran_in_time_is_in_doubt(
        masters, engine):
    """The confirmations of the masters' grants are held on the way (a path
    that holds them, masters that stall, alike): the grants expire
    unconfirmed at the end of their window, and the lock then holds on no
    majority. By the time Redis has freed them the holder no longer counts
    on it (in doubt); before, it counted on its whole lease. Let through late,
    the confirmations find the key gone, and a renewal round makes the lock
    lost for good."""
    keys = new_keys()
    held_up: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []
    restore = []
    for master in engine.masters:
        wire = master.engine.wire
        send_later = wire.call_later

        def hold(*args: Any, _send: Any = send_later, **kw: Any) -> None:
            held_up.append((_send, args, kw))

        wire.call_later = hold  # type: ignore[method-assign]
        restore.append((wire, send_later))
    try:
        answer = take(engine, keys, "t", "exec-f")
        # a majority decides the grant; the others' grants (and confirmations) may follow
        wait_for(lambda: len(held_up) == len(masters), 10, what="every grant's confirmation")
    finally:
        for wire, send_later in restore:
            wire.call_later = send_later  # type: ignore[method-assign]
    lock = _holder_of(engine, keys, answer, "exec-f", time.monotonic())
    assert lock.confirming
    wait_for(lambda: not any(m.client(2).exists(keys.lock) for m in masters), 10,
             interval=0.01, what="the unconfirmed grants freed by their masters")
    # the holder stopped counting on it by the time a majority had freed it
    assert lock.lost and lock.in_doubt and not lock.gone, lock
    for send, args, kw in held_up:
        send(*args, **kw)
    engine.settle()
    hb = Heartbeat(engine)
    hb.add(lock)
    try:
        wait_for(lambda: hb.renew_now() and lock.gone, 20, interval=0.2,
                 what="a renewal round that finds the lock gone from a majority")
    finally:
        hb.discard(lock)
        hb.watch.close()


def test_a_master_restarted_empty_gives_a_second_execution_no_majority(masters, engine):
    """A holds all five; two masters restart empty (one after the other).
    B can take only those: refused, its lone grants given back; A still
    renews on a majority; after A releases, B's token is above A's."""
    keys = new_keys()
    a = take(engine, keys, "A", "exec-a")
    assert a.status is Acquire.GRANTED
    for restarted in masters[1:3]:
        restarted.stop()
        restarted.start()  # same port, nothing persisted
        assert holder_on(restarted, keys) is None
        b = take(engine, keys, "B", "exec-b")
        assert b.status is Acquire.HELD and b.holder.task_id == "A"
        wait_for(lambda r=restarted: holder_on(r, keys) is None, 5, what="B's grant given back")
        assert engine.renew([(keys.lock, "exec-a", 30_000)]) == [Renew.RENEWED]
    assert engine.release(keys, "exec-a", "A") is True
    b = take(engine, keys, "B", "exec-b")
    assert b.status is Acquire.GRANTED and b.token > a.token


def test_a_held_lock_is_written_back_on_every_master_restarted_empty(masters, engine):
    """A's renewer watches every master. Three of the five restart empty, one
    after the other, under A's lock: each gets the lock back at once (the next
    round is 10 s away), with a fencing counter at least A's token, so A keeps
    its majority throughout. Without the write-back the three would be empty
    and B would be granted on them."""
    keys = new_keys()
    started = time.monotonic()
    got = take(engine, keys, "A", "exec-a")
    lock = SingletonLock(keys, task_id="A", task_name="t.x", exec_id="exec-a", token=got.token,
                         lease=30.0, started=started, held=True, hostname="w1@host")
    hb = Heartbeat(engine)
    hb.add(lock)
    try:
        assert isinstance(hb.watch, MastersWatch)
        wait_for(lambda: all(w.run_id for w in hb.watch.watches.values()), 5,
                 what="a watch on every master")
        for n, restarted in enumerate(masters[1:4], start=1):
            restarted.stop()
            restarted.start()  # same port, nothing persisted
            wait_for(lambda r=restarted: holder_on(r, keys) == "A", 10,
                     what=f"the lock back on restarted master {n}")
            assert int(restarted.client(2).get(keys.fence)) >= lock.token
            assert owner_field(restarted.client(2), keys.lock, "exec") == "exec-a"
            wait_for(lambda n=n: engine.refilled == n, 5, what="the write-back counted")
        b = take(engine, keys, "B", "exec-b")
        assert b.status is Acquire.HELD and b.holder.task_id == "A"
        assert not lock.lost and lock.token == got.token
    finally:
        hb.discard(lock)
        hb.watch.close()


def test_a_lock_lost_for_want_of_a_majority_is_no_longer_renewed_anywhere(masters, engine):
    """Three of the five masters stop under a held lock: no round reaches a
    majority, the lease runs out, and the lock is lost. From then on nothing
    renews it on the two masters still up, so it expires there within its
    lease (before: the renewer kept it alive on them until the task ended,
    blocking a majority for the key once the others came back)."""
    keys = new_keys()
    started = time.monotonic()
    got = take(engine, keys, "A", "exec-a", lease_ms=1500)
    lock = SingletonLock(keys, task_id="A", task_name="t.x", exec_id="exec-a", token=got.token,
                         lease=1.5, started=started, held=True, hostname="w1@host",
                         margin=engine.lease_margin(1.5))
    hb = Heartbeat(engine)
    hb.add(lock)
    try:
        for s in masters[:3]:
            s.stop()
        wait_for(lambda: lock.lost, 10, what="the lock lost for want of a majority")
        up = masters[3:]
        wait_for(lambda: all(not s.client(2).exists(keys.lock) for s in up), 10,
                 interval=0.05, what="the lock expired on the masters still up")
    finally:
        hb.discard(lock)
        hb.watch.close()
        for s in masters[:3]:
            s.start()


def test_a_lock_no_longer_held_here_is_not_written_back(masters, engine):
    """The write-back asks, in the master's own queue, whether the lock is
    still held: a lock released meanwhile stays released."""
    keys = new_keys()
    got = take(engine, keys, "A", "exec-a")
    assert got.status is Acquire.GRANTED
    masters[0].client(2).delete(keys.lock)
    renewed, gaps = engine.renew_round([(keys.lock, "exec-a", 30_000)], every=True)
    assert renewed == [Renew.RENEWED] and gaps == [[0]]
    request = Request("A", "exec-a", Lease(30.0), "w1@host", task_name="t.x")
    engine.refill(keys, request, got.token, only=gaps[0], still_held=lambda: False)
    # a call on the same master's queue runs after the write-back: waited for
    assert engine.majority.each(lambda e: True, only=[0], timeout=30)[0] is True
    assert holder_on(masters[0], keys) is None and engine.refilled == 0
    engine.refill(keys, request, got.token, only=gaps[0], still_held=lambda: True)
    # the write-back is counted after its acquire returns: a call queued behind it
    # on master 0 runs once the count is made
    assert engine.majority.each(lambda e: True, only=[0], timeout=30)[0] is True
    assert holder_on(masters[0], keys) == "A" and engine.refilled == 1


def test_claims_racing_on_the_masters_give_each_key_to_exactly_one(masters, engine):
    """Two processes' engines claim the same keys at the same moment (as beats
    at one tick): each key goes to exactly one, on a majority, and the other
    is told who has it; the same with the first master killed."""
    rival = connect(SingletonConfig.defaults(redlock_url(masters)))
    assert isinstance(rival, RedlockEngine)
    try:
        for round_ in range(2):
            if round_ == 1:
                masters[0].stop()
            for n in range(20):
                key = f"singleton:{{race-{uuid.uuid4().hex}}}:claim"
                start = threading.Barrier(2)
                got: dict[str, tuple[bool, str]] = {}

                def claim(e: RedlockEngine, name: str, key: str = key,
                          start: threading.Barrier = start,
                          got: dict[str, tuple[bool, str]] = got) -> None:
                    start.wait()
                    got[name] = e.claim(key, name, 60_000)

                threads = [threading.Thread(target=claim, args=(e, name))
                           for e, name in ((engine, "a"), (rival, "b"))]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(30)
                winners = [name for name, (won, _) in got.items() if won]
                assert len(winners) == 1, (round_, n, got)
                loser = "b" if winners == ["a"] else "a"
                assert got[loser] == (False, winners[0])
                on = sum(1 for s in masters if s.running and s.client(2).get(key) == winners[0])
                assert on >= 3
                assert not any(s.running and s.client(2).get(key) == loser for s in masters)
    finally:
        rival.close()


def test_too_few_masters_is_a_backend_error_naming_them(masters, engine):
    """Two of five down: still granted (three are a majority). Three down: the
    acquire raises a Redis error naming each master that did not answer; an
    acquire already held by a live majority stays refused, not an error."""
    keys = new_keys()
    masters[0].stop()
    masters[1].stop()
    assert take(engine, keys, "A", "exec-a").status is Acquire.GRANTED
    masters[2].stop()
    with pytest.raises(QuorumError) as info:
        take(engine, new_keys(), "B")
    assert isinstance(info.value, redis.RedisError)
    for s in masters[:3]:
        assert f"127.0.0.1:{s.port}" in str(info.value)
    for s in masters[3:]:
        assert f"127.0.0.1:{s.port}" not in str(info.value)
    # each named with the error it raised: a refused connection, or the
    # outage the first refusal opened on that master (calls fail at once)
    assert sorted(info.value.failed) == sorted(f"127.0.0.1:{s.port}" for s in masters[:3])
    for why in info.value.failed.values():
        assert why.partition(": ")[0] in ("ConnectionError", "RedisUnanswered"), why
    # the holder's renewal: too few answers leave the lock alone (its deadline decides)
    assert engine.renew([(keys.lock, "exec-a", 30_000)]) == [Renew.UNANSWERED]


@pytest.mark.parametrize("held, stopped, refused", [
    (3, 1, True),   # one grant, three refusals, one master down: refused
    (2, 2, False),  # one grant, two refusals, two down: the two could have granted
])
def test_an_acquire_with_masters_down_is_refused_only_when_the_rest_could_not_grant(
        masters, engine, held, stopped, refused):
    """docs/deployments.md: an acquire is refused when the masters that
    answered leave no majority to grant it, however the masters that did not
    answer would have; while they could still make one, it is an error naming
    them (the task retries), not a refusal (the task would be skipped). Either
    way the lone grant on the last master is given back."""
    keys = new_keys()
    for m in engine.masters[:held]:
        assert take(m.engine, keys, "T", "exec-t").status is Acquire.GRANTED
    down = masters[held:held + stopped]
    for s in down:
        s.stop()
    if refused:
        answer = take(engine, keys, "U", "exec-u")
        assert answer.status is Acquire.HELD, answer
        assert (answer.holder.task_id, answer.holder.exec_id) == ("T", "exec-t"), answer.holder
    else:
        with pytest.raises(QuorumError, match=r"not decided \(1 master\(s\) granted it, "
                                              r"2 refused") as info:
            take(engine, keys, "U", "exec-u")
        assert sorted(info.value.failed) == sorted(f"127.0.0.1:{s.port}" for s in down)
        assert (info.value.answered, info.value.needed) == (3, 3), str(info.value)
    wait_for(lambda: holder_on(masters[-1], keys) is None, 5,
             what="the lone grant on the last master given back")
    assert [holder_on(s, keys) for s in masters[:held]] == ["T"] * held


def test_a_call_is_decided_by_the_first_majority_of_one_kind_and_not_before():
    """Five masters: three that granted decide an acquire, three that refused
    decide it, three that failed decide it; two of each, or a split, wait for
    the rest (a master still to answer could change the outcome)."""
    granted = Acquired(Acquire.GRANTED, token=1)
    held = Acquired(Acquire.HELD)
    down = redis.ConnectionError("down")
    decided = _settled_by(3, Acquired, lambda r: isinstance(r, Acquired)
                          and r.status is Acquire.GRANTED)
    assert decided([granted, granted, granted, MISSING, MISSING])
    assert decided([held, MISSING, held, held, MISSING])
    assert decided([down, down, MISSING, down, MISSING])
    assert not decided([granted, granted, MISSING, MISSING, MISSING])
    assert not decided([held, held, MISSING, MISSING, MISSING])
    assert not decided([down, down, MISSING, MISSING, MISSING])
    assert not decided([granted, granted, held, held, MISSING])
    assert not decided([granted, held, down, MISSING, MISSING])


def test_a_masters_calls_run_one_at_a_time_in_the_order_they_were_made(masters, engine):
    """quorum.py: each master has one thread with a queue, so a release sent
    without waiting reaches a master before the acquire made after it. Calls
    queued on one master, each slower than the one after it, end in the order
    they were made, one at a time, every time."""
    master = engine.masters[0]
    done: list[int] = []
    running: list[int] = []
    overlap: list[int] = []
    finished = threading.Event()

    def call(i: int) -> Any:
        def run() -> None:
            running.append(i)
            if len(running) > 1:
                overlap.append(i)
            time.sleep((20 - i) / 1000)
            running.remove(i)
            done.append(i)
            if i == 19:
                finished.set()
        return run

    for i in range(20):
        master.submit(call(i))
    assert finished.wait(30)
    assert done == list(range(20)) and overlap == [], (done, overlap)


def test_masters_silent_past_the_validity_time_are_named_and_what_they_grant_later_freed(
        masters):
    """Two of five masters are frozen (their socket timeout 30 s), two hold the
    key for another execution, one grants: no majority of any kind within the
    lease's validity time (3 s lease), so the acquire stops waiting then and
    raises, naming the two silent masters ("no answer in time") and no other.
    Once they run again, the acquire they got late grants there, and the grant
    given back after it frees the key: nothing is left held for nobody."""
    engine = connect(SingletonConfig.defaults(redlock_url(masters), redis_options={
        "socket_timeout": 30.0, "socket_connect_timeout": 30.0}))
    assert isinstance(engine, RedlockEngine)
    keys = new_keys()
    try:
        for m in engine.masters[:2]:
            assert take(m.engine, keys, "other", "exec-other").status is Acquire.GRANTED
        for s in masters[3:]:
            s.pause()
        try:
            with pytest.raises(QuorumError) as info:
                take(engine, keys, "B", "exec-b", lease_ms=3000)
        finally:
            for s in masters[3:]:
                s.resume()
        error = info.value
        assert error.failed == {f"127.0.0.1:{s.port}": "no answer in time"
                                for s in masters[3:]}, str(error)
        assert error.answered == 3 and error.needed == 3, str(error)
        wait_for(lambda: all(holder_on(s, keys) in (None, "other") for s in masters), 15,
                 what="B's grants, the late ones too, given back")
        engine.settle()
        assert [holder_on(s, keys) for s in masters] == ["other", "other", None, None, None]
    finally:
        for s in masters:
            s.resume()
        engine.close()


def test_a_lock_gone_from_a_majority_is_lost_and_from_a_minority_is_kept(masters, engine):
    keys = new_keys()
    take(engine, keys, "A", "exec-a")
    for s in masters[:2]:
        s.client(2).delete(keys.lock)
    assert engine.renew([(keys.lock, "exec-a", 30_000)]) == [Renew.RENEWED]
    masters[2].client(2).delete(keys.lock)
    assert engine.renew([(keys.lock, "exec-a", 30_000)]) == [Renew.ABSENT]


def test_a_release_sent_without_waiting_is_answered_once(masters, engine):
    keys = new_keys()
    take(engine, keys, "A", "exec-a")
    told: list[tuple[Optional[Released], Optional[Exception]]] = []
    engine.release_later(keys, "exec-a", "A", lambda reply, error: told.append((reply, error)))
    # the next acquire on the same key is sent after the release on every master
    assert take(engine, keys, "B").status is Acquire.GRANTED
    engine.settle()
    wait_for(lambda: told, 5, what="the release's answer")
    assert told == [(Released(Release.RELEASED), None)]


def test_a_release_sent_without_waiting_is_answered_as_most_masters_found_the_key(
        masters, engine, monkeypatch):
    """docs/concepts.md: the reply of a release sent without waiting, read
    later, tells the task its lock was lost when the lease had run out or
    another execution had the key. On Redlock the answer is what most masters
    found, told once: gone from three of five (two freed it) is FREE, another
    execution's on three is TAKEN; with two masters failing and the key gone
    from the three that answer, FREE (three answers are a majority); with
    three failing, a QuorumError. A master's failure is its engine's answer
    to the release (a connection error), as its outage gives up."""
    def release_later(keys: LockKeys) -> tuple[Optional[Released], Optional[Exception]]:
        told: list[tuple[Optional[Released], Optional[Exception]]] = []
        got = threading.Event()

        def answered(reply: Optional[Released], error: Optional[Exception]) -> None:
            told.append((reply, error))
            got.set()

        engine.release_later(keys, "exec-a", "A", answered)
        engine.settle()  # each master's thread reads the reply it owes
        assert got.wait(30), "no answer"
        # every master's reply read (a call queued behind each settle)
        engine.settle()
        assert engine.majority.each(lambda e: True, timeout=30) == [True] * len(masters)
        assert len(told) == 1, told
        return told[0]

    def taken_everywhere(keys: LockKeys) -> None:
        assert take(engine, keys, "A", "exec-a").status is Acquire.GRANTED
        wait_for(lambda: all(holder_on(s, keys) == "A" for s in masters), 5,
                 what="the grant on every master")

    gone, other, fewer, failing = new_keys(), new_keys(), new_keys(), new_keys()
    for keys in (gone, other, fewer, failing):
        taken_everywhere(keys)
    for s in masters[:3]:
        s.client(2).delete(gone.lock, other.lock, fewer.lock)
    for m in engine.masters[:3]:
        assert take(m.engine, other, "B", "exec-b").status is Acquire.GRANTED
    assert release_later(gone) == (Released(Release.FREE), None)
    assert release_later(other) == (Released(Release.TAKEN), None)

    def fails(keys: LockKeys, exec_id: str, task_id: str, answered: Any, **_: Any) -> None:
        answered(None, redis.ConnectionError("down"))

    def raises(*args: Any, **kw: Any) -> None:
        raise redis.ConnectionError("refused")

    for m in engine.masters[3:]:
        monkeypatch.setattr(m.engine, "release_later", fails)
    assert release_later(fewer) == (Released(Release.FREE), None)
    monkeypatch.setattr(engine.masters[2].engine, "release_later", raises)
    reply, error = release_later(failing)
    assert reply is None and isinstance(error, QuorumError), (reply, error)
    assert sorted(error.failed) == sorted(f"127.0.0.1:{s.port}" for s in masters[2:]), error
    assert "refused" in error.failed[f"127.0.0.1:{masters[2].port}"], error.failed
    assert (error.answered, error.needed) == (2, 3), str(error)


def test_a_release_sent_without_waiting_leaves_on_every_master_what_the_task_asked(
        masters, engine):
    """The end of a task on Redlock (task.py sends its release without
    waiting) leaves on every master what it leaves on one server: the done
    window (``singleton_done_ttl``: the task's name and id) and, for an
    ``acks_late`` task, the finish record that drops a redelivered copy;
    a release that is not a finish leaves neither."""
    def release(keys: LockKeys, **kw: Any) -> None:
        told: list[Any] = []
        engine.release_later(keys, "exec-a", "A", lambda *a: told.append(a), **kw)
        engine.settle()
        wait_for(lambda: told, 10, what="the release's answer")
        engine.settle()
        assert engine.majority.each(lambda e: True, timeout=30) == [True] * len(masters)
        assert told == [(Released(Release.RELEASED), None)], told

    done, unfinished = new_keys(), new_keys()
    for keys in (done, unfinished):
        assert take(engine, keys, "A", "exec-a").status is Acquire.GRANTED
        wait_for(lambda keys=keys: all(holder_on(s, keys) == "A" for s in masters), 5,
                 what="the grant on every master")
    release(done, always_record=True, done_ms=60_000, task_name="t.x", finished=True)
    release(unfinished, always_record=True, done_ms=0, task_name="t.x", finished=False)
    for s in masters:
        c = s.client(2)
        assert c.get(done.done) == "t.x\nA" and 0 < c.pttl(done.done) <= 60_000
        assert c.get(done.fin) == "A"
        assert not c.exists(done.lock, unfinished.lock, unfinished.fin, unfinished.done)


def test_a_token_is_handed_out_only_once_a_majority_carries_it(masters, engine, monkeypatch):
    """docs/deployments.md: the token a grant hands out is the largest of its
    majority's, written as the counter of every granting master that gave
    less, and handed out only once a majority carries it. Each master's
    counter is set apart so that their grants differ; every write of the
    token but the first one (then the first two) is held until the acquire
    has answered: with the master that gave it and one more, two of five
    carry it, and the acquire raises once its time is up, the grant given
    back; with two more, three carry it and it is granted at once, each of
    the three holding the token."""
    held_up = threading.Event()
    let_through = [0]
    mutex = threading.Lock()
    for m in engine.masters:
        real = m.engine.raise_fence

        def raise_fence(keys: LockKeys, exec_id: str, token: int, _real: Any = real) -> bool:
            with mutex:
                go = let_through[0] > 0
                let_through[0] -= 1
            if not go:
                assert held_up.wait(60)
            return bool(_real(keys, exec_id, token))

        monkeypatch.setattr(m.engine, "raise_fence", raise_fence)

    def counters_apart(keys: LockKeys) -> None:
        for n, s in enumerate(masters):
            s.client(2).set(keys.fence, 4 * 10**15 + 1000 * n, px=600_000)

    short = new_keys()
    counters_apart(short)
    let_through[0] = 1
    try:
        with pytest.raises(QuorumError, match="could not be put on a majority"):
            take(engine, short, "A", "exec-a")
    finally:
        held_up.set()
    wait_for(lambda: all(holder_on(s, short) is None for s in masters), 10,
             what="the grant given back on every master")

    held_up.clear()
    keys = new_keys()
    counters_apart(keys)
    let_through[0] = 2
    try:
        got = take(engine, keys, "B", "exec-b")
        assert got.status is Acquire.GRANTED
        carrying = [n for n, s in enumerate(masters)
                    if int(s.client(2).get(keys.fence)) >= got.token]
        assert len(carrying) >= 3, (got.token, carrying)
    finally:
        held_up.set()
    assert engine.release(keys, "exec-b", "B") is True


def test_a_refusal_names_the_execution_most_masters_hold_the_key_for(
        masters, engine, monkeypatch):
    """docs/deployments.md: a refused acquire's answer is the refusal a
    majority gave, its holder named. Two executions of one task id (a
    redelivered copy) hold the key: the first on master 0, the second on
    masters 2 to 4; master 1 is free. However the refusals come, the second
    is named; master 0 answers first (the others wait for it), so naming the
    first answer would name the first execution."""
    keys = new_keys()
    assert take(engine.masters[0].engine, keys, "T", "exec-x").status is Acquire.GRANTED
    for m in engine.masters[2:]:
        assert take(m.engine, keys, "T", "exec-y").status is Acquire.GRANTED
    first_answered = threading.Event()
    real = engine.masters[0].engine.acquire

    def first(*args: Any, **kw: Any) -> Any:
        try:
            return real(*args, **kw)
        finally:
            first_answered.set()

    monkeypatch.setattr(engine.masters[0].engine, "acquire", first)
    for m in engine.masters[2:]:
        def after_first(*args: Any, _real: Any = m.engine.acquire, **kw: Any) -> Any:
            assert first_answered.wait(30)
            return _real(*args, **kw)

        monkeypatch.setattr(m.engine, "acquire", after_first)
    answer = take(engine, keys, "U", "exec-u")
    assert answer.status is Acquire.HELD, answer
    assert (answer.holder.task_id, answer.holder.exec_id) == ("T", "exec-y"), answer.holder
    monkeypatch.undo()
    wait_for(lambda: holder_on(masters[1], keys) is None, 5,
             what="the lone grant on master 1 given back")


def test_the_owner_is_read_from_a_bare_majority_and_fewer_is_an_error_naming_the_rest(
        masters, engine):
    """docs/deployments.md: ``celery singleton release`` asks every master who
    holds the key. With two of five stopped the three left are a majority and
    name the holder; with three stopped, a QuorumError names the three, two
    having answered of the three needed."""
    keys = new_keys()
    assert take(engine, keys, "A", "exec-a").status is Acquire.GRANTED
    for s in masters[:2]:
        s.stop()
    record = engine.owner(keys)
    assert (record["task"], record["exec"]) == ("A", "exec-a"), record
    masters[2].stop()
    with pytest.raises(QuorumError, match="reading the owner of") as info:
        engine.owner(keys)
    assert sorted(info.value.failed) == sorted(f"127.0.0.1:{s.port}" for s in masters[:3])
    assert (info.value.answered, info.value.needed) == (2, 3), str(info.value)


def test_a_grants_confirmation_is_its_majoritys():
    """A grant on Redlock is confirmed once a majority of its masters'
    confirmations found it (its lease from the earliest of them), in doubt
    once too few can, and told each once; until then the holder counts on it
    until the last moment a majority of the masters' grants surely live (the
    third latest of five windows, the third latest of four). A master's grant
    without a deadline (no confirmation) counts as confirmed, living its lease
    from the grant; a majority of them needs no confirmation at all."""
    from celery_singleton_lock.engine.redlock.engine import _of_majority
    from celery_singleton_lock.engine.replies import Confirmation

    def heard(out: Any) -> list[Renew]:
        told: list[Renew] = []
        out.listen(lambda answer, _sent_at: told.append(answer))
        return told

    each = [Confirmation(10.0 + n, 1.0 + n) for n in range(5)]
    out = _of_majority(each, 3, 100.0)
    assert (out.until, out.sent_at) == (12.0, 1.0)
    told = heard(out)
    for n, answer, after in [(0, Renew.RENEWED, []), (1, Renew.RENEWED, []),
                             (2, Renew.ABSENT, []), (3, Renew.RENEWED, [Renew.RENEWED]),
                             (4, Renew.ABSENT, [Renew.RENEWED])]:
        each[n].answered(answer)
        assert told == after, (n, told)

    each = [Confirmation(10.0 + n, 1.0 + n) for n in range(5)]
    told = heard(_of_majority(each, 3, 100.0))
    for n, answer, after in [(0, Renew.ABSENT, []), (1, Renew.RENEWED, []),
                             (2, Renew.ABSENT, []), (3, Renew.ABSENT, [Renew.ABSENT]),
                             (4, Renew.RENEWED, [Renew.ABSENT])]:
        each[n].answered(answer)
        assert told == after, (n, told)

    assert _of_majority([Confirmation(10.0 + n, 1.0) for n in range(4)], 3, 100.0).until == 11.0

    each = [None] + [Confirmation(10.0 + n, 2.0 + n) for n in range(4)]
    out = _of_majority(each, 3, 100.0)
    assert (out.until, out.sent_at) == (12.0, 2.0)
    told = heard(out)
    each[1].answered(Renew.RENEWED)
    assert told == []
    each[2].answered(Renew.RENEWED)
    assert told == [Renew.RENEWED]
    assert _of_majority([None, None, None, Confirmation(10.0, 1.0), Confirmation(11.0, 1.0)],
                        3, 100.0) is None
    assert _of_majority([None, None, Confirmation(10.0, 1.0), Confirmation(11.0, 1.0),
                         Confirmation(12.0, 1.0)], 3, 100.0) is not None


@pytest.mark.parametrize("stall,granted", [(3562.2, True), (3582.0, False)])
def test_a_grant_is_given_only_within_the_validity_time(masters, engine, monkeypatch,
                                                        stall, granted):
    """docs/deployments.md: an acquire is granted when a majority granted and
    the time since the request left is below the lease less the drift allowed
    (1 % of it plus 2 ms: 36.002 s of a lease of an hour). The engine's clock
    is moved on between the majority's answers and the decision: 1.8 s short
    of the validity time the grant stands; 18 s past it, though still within
    the lease, it is given back."""
    assert engine.lease_margin(3600.0) == pytest.approx(36.002, abs=1e-9)
    assert engine.lease_margin(30.0) == pytest.approx(0.302, abs=1e-9)
    stall_after_the_majority(engine, monkeypatch, stall)
    keys = new_keys()
    if granted:
        assert take(engine, keys, "A", "exec-a", lease_ms=3_600_000).status is Acquire.GRANTED
        monkeypatch.undo()
        assert engine.release(keys, "exec-a", "A") is True
    else:
        with pytest.raises(QuorumError, match="too late"):
            take(engine, keys, "A", "exec-a", lease_ms=3_600_000)
        monkeypatch.undo()
        wait_for(lambda: all(holder_on(m, keys) is None for m in masters), 10, interval=0.01,
                 what="the grant given back on every master")


def test_a_master_that_grants_after_the_decision_gets_the_token_too(masters, engine,
                                                                     monkeypatch):
    """docs/deployments.md: a master that had not answered when a majority
    decided the grant gets the token as its counter too, not waited for. Four
    masters' counters are set far above master 4's; master 4's acquire is held
    until the grant is handed out, then grants below the token: its counter is
    raised to it after."""
    keys = new_keys()
    for s in masters[:4]:
        s.client(2).set(keys.fence, 4 * 10**15, px=600_000)
    go = threading.Event()
    real = engine.masters[4].engine.acquire

    def late(*args: Any, **kw: Any) -> Any:
        assert go.wait(60)
        return real(*args, **kw)

    monkeypatch.setattr(engine.masters[4].engine, "acquire", late)
    try:
        got = take(engine, keys, "A", "exec-a")
    finally:
        go.set()
    assert got.status is Acquire.GRANTED and got.token > 4 * 10**15
    late_master = masters[4].client(2)
    wait_for(lambda: holder_on(masters[4], keys) == "A"
             and int(late_master.get(keys.fence) or 0) >= got.token, 10,
             what="the late grant's counter raised to the token")
    assert int(owner_field(late_master, keys.lock, "token") or 0) >= got.token
    assert engine.release(keys, "exec-a", "A") is True


@pytest.mark.parametrize("request_", [{"slots": 2}, {"replace": True}])
def test_slots_and_replace_are_refused_by_the_redlock_engine_itself(engine, request_):
    """A limit of two slots or a replacing send cannot hold on a majority (each
    master would grant its own slot): the engine refuses them too, naming the
    setting, whatever let them through."""
    from celery_singleton_lock.exceptions import ConfigurationError

    request = Request(task_id="A", exec_id="exec-a", lease=Lease.of_ms(30_000), **request_)
    with pytest.raises(ConfigurationError) as info:
        engine.acquire(new_keys(), request)
    assert info.value.setting == ("singleton_limit" if "slots" in request_
                                  else "singleton_on_duplicate"), info.value


def test_counts_live_on_the_first_master_and_a_call_waits_two_timeouts_and_connects(
        masters, engine):
    """docs/deployments.md: counts, held-lock lists and beat's buffered ticks
    are kept on the first master of the URL; each master's client times out
    after 0.5 s (and connects within 0.5 s), so a call waits at most 2 s (a
    broken connection is tried once more); with 30 s of each, 120 s."""
    kwargs = engine.client.connection_pool.connection_kwargs
    assert kwargs["port"] == masters[0].port, kwargs
    assert engine.call_timeout == pytest.approx(2.0)
    slow = connect(SingletonConfig.defaults(redlock_url(masters), redis_options={
        "socket_timeout": 30.0, "socket_connect_timeout": 30.0}))
    try:
        assert slow.call_timeout == pytest.approx(120.0)
    finally:
        slow.close()


def test_send_time_keys_are_taken_on_a_majority(masters, engine):
    keys = new_keys()
    assert engine.enqueue(keys, "Q1", "queue", 10_000).status is Enqueue.TAKEN
    held = engine.enqueue(keys, "Q2", "queue", 10_000)
    assert held.status is Enqueue.HELD and held.holder.task_id == "Q1"
    assert engine.queued_by(keys) == "Q1"
    assert engine.unqueue(keys, "Q1") is True
    assert engine.queued_by(keys) == ""


def test_tokens_only_go_up_while_masters_fail_and_restart_empty(masters, engine):
    """Grants in turn while one master at a time is killed or restarted empty:
    every token is above the one before. ``SLT_CHAOS_ROUNDS`` runs more."""
    keys = new_keys()
    last = 0
    rounds = int(os.environ.get("SLT_CHAOS_ROUNDS", "0")) or 5
    for i in range(rounds):
        n = i % len(masters)
        victim = masters[n]
        victim.stop()
        got = take(engine, keys, f"T{i}", f"exec-{i}")
        assert got.status is Acquire.GRANTED and got.token > last
        last = got.token
        assert engine.release(keys, f"exec-{i}", f"T{i}") is True
        victim.start()  # back empty: its counter is gone
        # the engine counts it in again once its probe got an answer: until
        # then the next round would find two masters of five out, and a loaded
        # machine's probe comes late
        wait_for(lambda n=n: not engine.masters[n].engine.down, 10,
                 what=f"master {n} counted in again after its restart")


def test_the_start_up_check_says_which_masters_answer(masters, engine, caplog):
    masters[3].stop()
    findings = engine_checks(engine)
    summary = findings[0]
    assert summary.code == "redlock" and summary.level == "warning"
    assert f"127.0.0.1:{masters[3].port}" in summary.message.split("no answer from")[1]
    assert "4 answer" in summary.message
    with caplog.at_level(logging.INFO, logger="celery_singleton_lock"):
        startup_check(engine)  # one master down: logged, the start goes on
    assert any("no answer from" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records)


def test_a_master_refusing_the_password_stops_the_start(masters):
    from celery_singleton_lock.exceptions import ConfigurationError

    masters[1].client().config_set("requirepass", "other")
    engine = connect(SingletonConfig.defaults(redlock_url(masters)))
    try:
        with pytest.raises(ConfigurationError) as info:
            startup_check(engine)
        assert f"master 127.0.0.1:{masters[1].port}" in str(info.value)
    finally:
        assert isinstance(engine, RedlockEngine)
        engine.close()


# -- through real workers ---------------------------------------------------------------

CONF = {"singleton_ttl": 30.0}


@pytest.fixture(scope="module")
def worker_masters() -> Iterator[list[RedisServer]]:
    servers = start_masters()
    yield servers
    for s in servers:
        s.cleanup()


@pytest.fixture(scope="module")
def worker(worker_masters: list[RedisServer], redis_server: RedisServer) -> Iterator[Worker]:
    w = Worker(redis_server.url(), f"rl-{uuid.uuid4().hex[:8]}", concurrency=3,
               lock_url=redlock_url(worker_masters), conf=CONF).start()
    yield w
    discard(w)


@pytest.fixture(scope="module")
def app(worker_masters: list[RedisServer], redis_server: RedisServer, worker: Worker) -> Any:
    return make_app(redis_server.url(), worker.queue, lock_url=redlock_url(worker_masters),
                    conf=CONF)


@pytest.mark.worker
def test_a_redlock_worker_names_its_masters_at_start(worker):
    """The worker's start line says it locks by Redlock, and over how many
    masters (the core promises on Redlock are the contract suite's,
    ``tests/contract/test_contract.py``)."""
    assert "Redlock over 5 masters" in worker.logs()


@pytest.mark.worker
@pytest.mark.parametrize("options,setting", [
    ({"singleton_limit": 2}, "singleton_limit"),
    ({"singleton_scope": "queue", "singleton_on_duplicate": "replace"},
     "singleton_on_duplicate"),
])
def test_limit_and_replace_stop_a_redlock_worker_at_start(worker_masters, redis_server,
                                                          options, setting):
    """Each master would grant its own slot or keep its own queued call: no
    majority agrees, so a task asking for either stops the worker at start,
    named, instead of failing at its first call."""
    w = Worker(redis_server.url(), f"rl-{uuid.uuid4().hex[:8]}", pool="solo",
               lock_url=redlock_url(worker_masters))
    w.env["SLT_TASK_OPTIONS"] = json.dumps(options)
    w.start(wait=False)
    assert w.proc is not None
    try:
        assert w.proc.wait(30) != 0
        output = w.output()
    finally:
        w.stop()
    assert (f"celery-singleton-lock configuration error: {setting}: task 't.options': "
            in output), output
    assert "not redlock://" in output


def run_cli(worker: Worker, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "celery", "-A", "tests.workerapp:app",
                           "singleton", *args], env=worker.env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.worker
def test_the_cli_reads_and_frees_every_master(worker_masters, worker, app, events, key):
    """With Redlock, `list` and `key` read every master and show each held
    thing once, with on how many masters it is; a record left on one master
    only shows as 1/5 and is not "held". `release --force` frees the key on
    every master (the task then sees its lock lost); `purge --yes` frees a
    done window on every master."""
    keys = app.tasks["t.hold"].singleton_keys(key)
    res = app.tasks["t.hold"].delay(key, 120.0, "cli")  # ended below, once freed
    wait_for(lambda: events.starts("cli"), 15, what="start")
    listed = run_cli(worker, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = [r for r in json.loads(listed.stdout)["locks"] if r["key"] == keys.base]
    assert [(r["state"], r["holder"], r["task"], r["masters"]) for r in rows] == [
        ("run", res.id, "t.hold", [5, 5])]
    table = run_cli(worker, "list", "--task", "t.hold")
    assert "MASTERS" in table.stdout and "5/5" in table.stdout, table.stdout
    shown = run_cli(worker, "key", "t.hold", "--args", json.dumps([key]), "--json")
    assert json.loads(shown.stdout)["held"] is True

    out = run_cli(worker, "release", keys.lock, "--force", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["action"] == "released"
    assert not any(s.client(2).exists(keys.lock) for s in worker_masters)
    events.client.set(f"finish:{key}", 1)  # its 120 s were for the commands above
    res.get(timeout=15)

    # a record on one master only (a grant not given back): shown, not held
    stray = LockKeys(keys.base[:-(len(keys.base) - keys.base.index("{"))], uuid.uuid4().hex)
    one = worker_masters[0].client(2)
    one.set(stray.lock, "\n".join(["exec-x", "", "", "7", "0", "30000", "0", "0", "1",
                                    "elsewhere", "w9@far", "t.hold", "task-x"]), px=30_000)
    for s in worker_masters:  # the done window a success with singleton_done_ttl leaves
        s.client(2).set(keys.done, f"t.hold\n{res.id}", px=30_000)
    shown = json.loads(run_cli(worker, "list", "--json").stdout)["locks"]
    assert {(r["key"], r["state"], tuple(r["masters"])) for r in shown} >= {
        (stray.base, "run", (1, 5)), (keys.base, "done", (5, 5))}
    stray_json = run_cli(worker, "key", "t.hold", "--args", json.dumps([key]), "--json")
    assert json.loads(stray_json.stdout)["held"] is False
    purged = run_cli(worker, "purge", "--task", "t.hold", "--yes", "--json")
    assert purged.returncode == 0, purged.stderr
    assert not any(s.client(2).exists(keys.done) or s.client(2).exists(stray.lock)
                   for s in worker_masters)


@pytest.mark.worker
def test_a_running_task_keeps_its_lock_through_one_master_down_and_loses_it_without_a_majority(
        worker_masters, worker, app, events, key):
    """A task with a 1 s lease runs; the first master is killed: renewals go on
    on the other four. Two more are killed: no renewal reaches a majority, and
    the task sees its lock lost (its run, long enough for all of it, is ended
    once the worker has logged the loss)."""
    lock = app.tasks["t.hold_short"].singleton_keys(key).lock
    res = app.tasks["t.hold_short"].delay(key, 60.0, "minority")
    wait_for(lambda: events.starts("minority"), 15, what="start")
    down = worker_masters[:3]
    try:
        down[0].stop()
        witness = worker_masters[4].client(2)
        # a renewal is a PTTL that went up since the sample before it (a first
        # sample taken just after a renewal may stay the highest one seen)
        samples = [witness.pttl(lock)]

        def renewed() -> bool:
            samples.append(witness.pttl(lock))
            return samples[-1] > samples[-2] > 0

        try:
            wait_for(renewed, 5, what="a renewal with one master down")
        except AssertionError:
            raise AssertionError(f"PTTLs seen: {samples[:20]}...{samples[-5:]}; the "
                                 f"worker's log:\n{worker.logs()[-4000:]}") from None
        assert owner_field(witness, lock, "task") == res.id
        down[1].stop()
        down[2].stop()
        wait_for(lambda: f"of t.hold_short[{res.id}]" in worker.logs(), 30,
                 what="the worker to log the lock lost")
        events.client.set(f"finish:{key}", 1)
        assert res.get(timeout=30)["lost"] is True
    finally:
        for s in down:
            if not s.running:
                s.start()  # back empty, for the tests after this one


@pytest.mark.worker
def test_a_running_task_keeps_its_majority_while_masters_restart_empty(worker_masters, app,
                                                                       events, key):
    """A task holds its key; three of the five masters restart empty, one
    after another. The worker's renewer writes the lock back on each as it
    returns, so the key never stands on fewer than four masters: a duplicate
    sent after the third restart is skipped, not run beside the first (without
    the write-back the three empty masters would be a majority for it)."""
    lock = app.tasks["t.hold"].singleton_keys(key).lock
    res = app.tasks["t.hold"].delay(key, 8.0, "restarts")
    wait_for(lambda: events.starts("restarts"), 15, what="start")
    for s in worker_masters[1:4]:
        s.stop()
        s.start()  # same port, nothing persisted
        wait_for(lambda s=s: owner_field(s.client(2), lock, "task") == res.id, 10,
                 what=f"the lock back on the restarted master {s.port}")
    dup = app.tasks["t.hold"].delay(key, 0.0, "restarts-dup")
    assert dup.get(timeout=15)["skipped"] is True
    assert res.get(timeout=20)["lost"] is False
    assert not events.starts("restarts-dup")


@pytest.mark.worker
def test_beats_on_redlock_send_every_tick_once_through_the_first_masters_death(
        worker_masters, redis_server, events):
    """Three beats claim each tick on a majority of the masters, and the worker
    checks each tick's run of a SingletonTask on a majority too. The first
    master of the URL is killed halfway: every tick still runs exactly once,
    none missing (a claim on the first master alone would stop the ticks)."""
    url = redlock_url(worker_masters)
    worker = Worker(redis_server.url(), f"rlb-{uuid.uuid4().hex[:8]}", concurrency=2,
                    lock_url=url, conf=CONF)
    worker.cmd[worker.cmd.index("tests.workerapp:app")] = "tests.beatapp:app"
    worker.start()
    entry = f"rl-second-{uuid.uuid4().hex[:6]}"
    sched = {entry: {"task": "t.tick_hold", "every": 1,
                     "kwargs": {"key": f"k-{entry}", "seconds": 0.0}}}
    beats = [Beat(redis_server.url(), worker.queue, sched, name=f"rl{name}", offset=offset,
                  lock_url=url).start() for name, offset in (("a", 0.0), ("b", 0.3), ("c", -0.3))]
    first = worker_masters[0]
    try:
        def ticks() -> list[str]:
            return sorted({e["singleton_beat_tick"] for e in tick_events(events, entry, "start")})

        wait_for(lambda: len(ticks()) >= 4, 40, what="4 ticks on Redlock")
        claims = list(worker_masters[1].client(2).scan_iter(f"{entry_base('singleton:', entry)}:*"))
        assert claims and all(sum(1 for s in worker_masters if s.client(2).exists(k)) >= 3
                              for k in claims)
        first.stop()
        killed_at = ticks()[-1]
        wait_for(lambda: len([t for t in ticks() if t > killed_at]) >= 6, 40,
                 what="6 ticks after the first master died")
        for beat in beats:
            beat.stop()
        runs = Counter(e["singleton_beat_tick"] for e in tick_events(events, entry, "start"))
        assert set(runs.values()) == {1}, [t for t, n in runs.items() if n > 1]
        # none missing from the last tick before the death on (a tick missed
        # while the three beats were still starting is not what this tests)
        stamps = sorted(dt.datetime.fromisoformat(t) for t in runs if t >= killed_at)
        gaps = [(b - a).total_seconds() for a, b in zip(stamps, stamps[1:])]
        assert len(gaps) >= 6 and gaps == [1.0] * len(gaps), gaps
        # the worker's look at a tick's marker before the lock reads the first
        # master only; with it dead the claim after the grant decides, quietly
        assert "Could not check whether beat tick" not in worker.logs()
    finally:
        for beat in beats:
            beat.stop()
        discard(worker)
        if not first.running:
            first.start()  # back empty, for the tests after this one


def test_redlocks_speaks_tls_to_every_master(tmp_path):
    """Three servers that speak TLS only, a CA of the test's own: a
    ``redlocks://`` URL verifies each and locks on them."""
    from tests.deployments import TlsServer, make_certificates

    certs = make_certificates(tmp_path)
    servers = [TlsServer(certs) for _ in range(3)]
    try:
        for s in servers:
            s.start()
        url = ("redlocks://" + ",".join(f"127.0.0.1:{s.port}" for s in servers)
               + f"/2?ssl_cert_reqs=required&ssl_ca_certs={certs['ca.crt']}")
        engine = connect(SingletonConfig.defaults(url))
        assert isinstance(engine, RedlockEngine)
        keys = new_keys()
        assert take(engine, keys, "A", "exec-a").status is Acquire.GRANTED
        wait_for(lambda: all(owner_field(s.client(2), keys.lock, "task") == "A"
                             for s in servers), 5, what="the grant on every master")
        assert engine.release(keys, "exec-a", "A") is True
        engine.close()
    finally:
        for s in servers:
            s.cleanup()


def test_the_doctor_runs_every_script_on_every_master(masters, engine):
    """``celery singleton doctor`` on Redlock checks each master as one server:
    its scripts run there (before: the rate flag landed in the scripts
    argument, and every master was said to run no script, its script and
    permission checks skipped)."""
    from celery_singleton_lock.checks.doctor import engine_checks

    before = sum(int(s.client().info("commandstats").get("cmdstat_evalsha", {})
                     .get("calls", 0)) for s in masters)
    findings = engine_checks(engine)
    assert not [f for f in findings if "runs no script" in f.message], findings
    after = sum(int(s.client().info("commandstats").get("cmdstat_evalsha", {})
                    .get("calls", 0)) for s in masters)
    assert after - before >= len(masters) * 5  # each master ran the probe scripts
