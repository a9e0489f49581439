"""WAIT after the grant: a primary and a replica of the test's own; the replica
is stopped with SIGSTOP to make WAIT fall short."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any, Iterator, Optional

import pytest

from celery_singleton_lock import SingletonConfig, is_skipped
from celery_singleton_lock.engine.registry import connect
from celery_singleton_lock.engine.replies import Acquire, Renew
from celery_singleton_lock.engine.request import Lease, Request
from celery_singleton_lock.engine.server import LockEngine
from celery_singleton_lock.exceptions import TooFewReplicasError, UnconfirmedHolderError
from celery_singleton_lock.keys import LockKeys
from tests.conftest import Events
from tests.support import RedisServer, Worker, discard, owner_field, wait_for
from tests.workerapp import make_app


@pytest.fixture
def pair() -> Iterator[tuple[RedisServer, RedisServer]]:
    primary = RedisServer(["--repl-diskless-sync-delay", "0"]).start()
    replica = RedisServer(["--replicaof", "127.0.0.1", str(primary.port)]).start()
    wait_for(lambda: replica.client().info("replication").get("master_link_status") == "up",
             20, what="replica in sync")
    yield primary, replica
    replica.resume()
    replica.cleanup()
    primary.cleanup()


def engine_for(primary: RedisServer, **conf: Any) -> LockEngine:
    return connect(SingletonConfig.defaults(primary.url(2), **conf))


def take(engine: LockEngine, keys: LockKeys) -> Any:
    return engine.acquire(keys, Request(task_id="t1", exec_id=uuid.uuid4().hex,
                                        lease=Lease.of_ms(10_000), hostname="w1@host", retries=0,
                                        task_name="t.x"))


def calls(primary: RedisServer, command: str) -> int:
    stats = primary.client().info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


def test_wait_is_off_by_default_and_sent_after_each_grant_when_on(pair):
    """Off: no WAIT reaches Redis. On: one WAIT per grant, answered by the
    replica in sync, and the lock is granted."""
    primary, _ = pair
    take(engine_for(primary), LockKeys("singleton:", "off"))
    assert calls(primary, "wait") == 0
    engine = engine_for(primary, wait_replicas=1, wait_timeout=2000)
    keys, exec_id = LockKeys("singleton:", "on"), uuid.uuid4().hex
    assert engine.acquire(keys, Request(task_id="t1", exec_id=exec_id, lease=Lease.of_ms(10_000),
                                        hostname="w1@host", retries=0,
                                        task_name="t.x")).status is Acquire.GRANTED
    assert calls(primary, "wait") == 1
    # confirmed: the grant's WAIT mark (a holder not yet running) is deleted,
    # sent without waiting and read with the next call
    engine.settle()
    assert not primary.client(2).exists(keys.waiting(exec_id))
    assert owner_field(primary.client(2), keys.lock, "exec") == exec_id


def test_too_few_replicas_with_policy_release_gives_the_lock_back(pair):
    """The replica is stopped: WAIT answers 0 of 1 after the timeout, the
    grant is given back (key free on the primary) and TooFewReplicasError (a
    Redis error: singleton_on_backend_error applies) names the counts."""
    primary, replica = pair
    engine = engine_for(primary, wait_replicas=1, wait_timeout=150, wait_policy="release")
    replica.pause()
    keys = LockKeys("singleton:", "short")
    with pytest.raises(TooFewReplicasError) as info:
        take(engine, keys)
    assert (info.value.acked, info.value.wanted) == (0, 1)
    assert not primary.client(2).exists(keys.lock)
    replica.resume()
    # the replica catches up on what it missed before it acknowledges again
    wait_for(lambda: primary.client(2).execute_command("WAIT", 1, 1000) >= 1, 20,
             what="the replica to acknowledge again")
    assert take(engine, keys).status is Acquire.GRANTED


def test_too_few_replicas_with_policy_proceed_keeps_the_lock_and_warns(pair, caplog):
    """policy proceed: the grant stands, a warning says a failover could lose it;
    a renewal that WAIT leaves short still renews, and warns."""
    primary, replica = pair
    engine = engine_for(primary, wait_replicas=1, wait_timeout=150, wait_policy="proceed")
    replica.pause()
    keys = LockKeys("singleton:", "proceed")
    exec_id = uuid.uuid4().hex
    with caplog.at_level(logging.WARNING, "celery_singleton_lock"):
        got = engine.acquire(keys, Request(task_id="t1", exec_id=exec_id,
                                           lease=Lease.of_ms(10_000), hostname="h", retries=0,
                                           task_name="t.x"))
        assert got.status is Acquire.GRANTED
        assert engine.renew([(keys.lock, exec_id, 10_000)]) == [Renew.RENEWED]
    assert owner_field(primary.client(2), keys.lock, "exec") == exec_id
    assert "only 0 of 1 replicas acknowledged it" in caplog.text
    assert "Renewed 1 singleton lock(s) but only 0 of 1" in caplog.text


@pytest.mark.worker
def test_a_worker_retries_a_grant_too_few_replicas_saw_and_runs_it_once_they_do(pair, key):
    """A real worker, WAIT 1 with policy release, its primary's replica
    stopped: each grant is given back and the task retried (the default
    backend-error policy), never run; once the replica answers again the task
    runs exactly once and its key is freed."""
    primary, replica = pair
    conf = {"singleton_wait_replicas": 1, "singleton_wait_timeout": 100,
            "singleton_wait_policy": "release"}
    worker = Worker(primary.url(), f"wait-{uuid.uuid4().hex[:8]}", conf=conf).start()
    events = Events(primary)
    try:
        app = make_app(primary.url(), worker.queue, conf=conf)
        hold = app.tasks["t.hold"]
        replica.pause()
        result = hold.delay(key, 0.0, "replicated")
        given_back = "(TooFewReplicasError: "
        wait_for(lambda: worker.log.read_text().count(given_back) >= 2, 30,
                 what="two grants given back for too few replicas")
        assert events.starts("replicated") == []
        assert not primary.client(2).exists(hold.singleton_keys(key).lock)
        replica.resume()
        assert result.get(timeout=30)["tag"] == "replicated"
        starts = events.starts("replicated")
        assert len(starts) == 1
        assert not primary.client(2).exists(hold.singleton_keys(key).lock)
    finally:
        replica.resume()
        discard(worker)


@pytest.mark.worker
def test_a_grant_waiting_on_wait_is_no_running_holder_for_a_duplicate(pair, key):
    """Two workers, WAIT 1 (300 ms) with policy release, the replica stopped:
    every grant waits 300 ms on WAIT and is given back. A holder and five
    duplicates of its key sent meanwhile keep meeting each other's pending
    grants; none is skipped as "duplicate of X (running)" while nothing can
    run (before: most were, against grants that were then given back). Once
    the replica answers, one runs; a call skipped then names a holder that
    started, or one whose grant reached it too late to run (logged as such)."""
    primary, replica = pair
    conf = {"singleton_wait_replicas": 1, "singleton_wait_timeout": 300,
            "singleton_wait_policy": "release"}
    queue = f"wait-{uuid.uuid4().hex[:8]}"
    workers = [Worker(primary.url(), queue, concurrency=2, conf=conf, name=n).start()
               for n in ("a", "b")]
    events = Events(primary)
    events.client.delete("events")
    try:
        app = make_app(primary.url(), queue, conf=conf)
        hold = app.tasks["t.hold"]
        replica.pause()
        calls = [hold.delay(key, 0.5, "holder")]
        for i in range(5):
            time.sleep(0.15)  # spread over the grants' WAIT windows, not racing a lease
            calls.append(hold.delay(key, 0.5, f"dup{i}"))
        given_back = "(TooFewReplicasError: "  # "Lock backend unavailable for t.hold[...] (...)"

        def backs() -> int:
            return sum(w.log.read_text().count(given_back) for w in workers)

        wait_for(lambda: backs() >= 30, 60, what="30 grants given back for too few replicas")
        assert events.starts() == []
        skipped = [c.id for c in calls if c.ready() and is_skipped(c.result)]
        assert skipped == [], f"skipped against grants that never ran: {skipped}"
        replica.resume()
        results = [c.get(timeout=60) for c in calls]
        started = {e["id"] for e in events.starts()}
        assert started
        logs = "".join(w.log.read_text() for w in workers)
        for r in results:
            if is_skipped(r) and r["holder"] not in started:
                # the one other give-back: a grant that reached its task after
                # its lease could have run out (a loaded machine) is no grant
                # either, and a duplicate may have met it in between
                lines = [x for x in logs.splitlines() if f"t.hold[{r['holder']}]" in x]
                assert any("grant arrived after its lease ran out" in x for x in lines), (
                    r, lines)
        assert max(e["concurrent"] for e in events.starts()) == 1
    finally:
        replica.resume()
        for w in workers:
            discard(w)


def test_no_replica_at_all_follows_its_own_setting(pair, caplog):
    """singleton_wait_no_replica: with no replica acknowledging (stopped),
    'proceed' keeps the grant with a warning naming the setting although
    singleton_wait_policy is 'release'; left unset, the policy decides and
    the grant is given back, with a warning that says why and what to set."""
    primary, replica = pair
    replica.pause()
    keys = LockKeys("singleton:", "none")
    runs = engine_for(primary, wait_replicas=1, wait_timeout=100, wait_policy="release",
                      wait_no_replica="proceed")
    with caplog.at_level(logging.WARNING, "celery_singleton_lock"):
        assert take(runs, keys).status is Acquire.GRANTED
        assert "singleton_wait_no_replica: proceed" in caplog.text
        refuses = engine_for(primary, wait_replicas=1, wait_timeout=100, wait_policy="release")
        with pytest.raises(TooFewReplicasError):
            take(refuses, LockKeys("singleton:", "none2"))
    assert "No replica acknowledged the grant" in caplog.text
    assert not primary.client(2).exists(LockKeys("singleton:", "none2").lock)
    # and the other way: 'release' gives the grant back though the policy is 'proceed'
    strict = engine_for(primary, wait_replicas=1, wait_timeout=100, wait_policy="proceed",
                        wait_no_replica="release")
    with pytest.raises(TooFewReplicasError):
        take(strict, LockKeys("singleton:", "none3"))
    assert not primary.client(2).exists(LockKeys("singleton:", "none3").lock)


def _plain(primary: RedisServer, **conf: Any) -> LockEngine:
    """An engine with no socket timeout: its requests carry no deadline, so
    its grants live their whole lease from the start (none to confirm), and
    a grant in its way is never one that expires at its request's deadline."""
    return engine_for(primary, redis_options={"socket_timeout": None}, **conf)


def grant_waiting_on_wait(pair: Any, keys: Optional[LockKeys] = None, slots: int = 1
                          ) -> tuple[LockKeys, threading.Thread, list[BaseException]]:
    """Task t1's execution e1 is granted a key (under a limit of ``slots``:
    slot ``slots``, the others held already) and waits on WAIT for a replica
    that is paused (1 s, policy release: it is given back then), in a
    thread: (the keys, the thread, what its acquire raised once it ends)."""
    primary, replica = pair
    replica.pause()
    keys = keys or LockKeys("singleton:", uuid.uuid4().hex)
    first = engine_for(primary, wait_replicas=1, wait_timeout=1000, wait_policy="release")
    given_back: list[BaseException] = []

    def hold() -> None:
        try:
            first.acquire(keys, Request("t1", "e1", Lease.of_ms(60_000), "w1@host",
                                        task_name="t.x", slots=slots))
        except BaseException as exc:
            given_back.append(exc)

    holder = threading.Thread(target=hold)
    holder.start()
    admin = primary.client(2)
    wait_for(lambda: admin.exists(keys.waiting("e1")) and admin.exists(keys.slot(slots).lock),
             10, interval=0.005, what="the grant marked while it waits on WAIT")
    return keys, holder, given_back


def test_under_a_limit_a_refusal_meeting_a_grant_given_back_takes_the_freed_slot(pair):
    """Under a limit of two, slot 1 runs a task and slot 2's grant waits on
    WAIT; another execution asks meanwhile and is refused, then waits out
    its own WAIT, during which slot 2's grant is given back (too few
    replicas). It takes the freed slot. (Before, the refusal was read again
    after its WAIT, found slot 2 empty and no marked holder, and stood: the
    task was skipped as a duplicate with a slot free.)"""
    primary, _ = pair
    keys = LockKeys("singleton:", uuid.uuid4().hex)
    running = _plain(primary).acquire(keys, Request("t0", "e0", Lease.of_ms(60_000),
                                                    "w1@host", task_name="t.x", slots=2))
    assert (running.status, running.slot) == (Acquire.GRANTED, 1)
    keys, holder, given_back = grant_waiting_on_wait(pair, keys, slots=2)
    second = _plain(primary, wait_replicas=1, wait_timeout=1900, wait_policy="release",
                    wait_no_replica="proceed")
    got = second.acquire(keys, Request("t2", "e2", Lease.of_ms(60_000), "w1@host",
                                       task_name="t.x", slots=2))
    holder.join(10)
    assert [type(e) for e in given_back] == [TooFewReplicasError]
    assert (got.status, got.slot) == (Acquire.GRANTED, 2), got
    assert owner_field(primary.client(2), keys.slot(2).lock, "exec") == "e2"


def test_an_execution_refused_by_a_grant_waiting_on_wait_takes_the_key_once_it_is_given_back(
        pair):
    """acquire: the holder in the way is granted but WAIT has not confirmed
    it (its marker, ``LockKeys.waiting``); the refused execution is not
    turned away by a holder that may never run: it looks again every
    PENDING_POLL s, and when that grant is given back (WAIT fell short,
    policy release) it takes the key itself (here ``singleton_wait_no_replica
    = proceed`` keeps its own grant)."""
    primary, _ = pair
    keys, holder, given_back = grant_waiting_on_wait(pair)
    admin = primary.client(2)
    # it looks again for its own wait_timeout and PENDING_MARGIN_MS (3.9 s) at
    # most: well past the 1 s the grant in its way waits on WAIT
    second = _plain(primary, wait_replicas=1, wait_timeout=1900, wait_policy="release",
                    wait_no_replica="proceed")
    got = second.acquire(keys, Request("t2", "e2", Lease.of_ms(60_000), "w1@host",
                                       task_name="t.x"))
    holder.join(10)
    assert [type(e) for e in given_back] == [TooFewReplicasError]
    assert isinstance(given_back[0], TooFewReplicasError)
    assert (given_back[0].key, given_back[0].acked, given_back[0].wanted) == (keys.base, 0, 1)
    assert got.status is Acquire.GRANTED, got
    assert owner_field(admin, keys.lock, "exec") == "e2"


@pytest.mark.parametrize("slots", [1, 2], ids=["lock", "limit"])
def test_a_grant_left_waiting_on_wait_is_waited_for_no_longer_than_wait_and_its_margin(
        pair, slots):
    """A holder whose grant still waits on WAIT when another execution meets
    it (here its marker stays: a holder that died waiting) is looked at again
    for WAIT's timeout and PENDING_MARGIN_MS, no longer: then
    :class:`.UnconfirmedHolderError` names the key, that holder and the time
    waited. Under a limit, the marked holder is found in whichever slot it
    holds (slot 2 here, slot 1 a running holder's). Once its marker is gone
    (its grant confirmed) the holder is a running one: refused at once."""
    primary, _ = pair
    keys = LockKeys("singleton:", uuid.uuid4().hex)
    plain = _plain(primary)
    marked = "e1" if slots == 1 else "e2"
    for n in range(1, slots + 1):
        got = plain.acquire(keys, Request(f"t{n}", f"e{n}", Lease.of_ms(60_000), "w1@host",
                                          task_name="t.x", slots=slots))
        assert (got.status, got.slot) == (Acquire.GRANTED, n)
    admin = primary.client(2)
    admin.set(keys.waiting(marked), marked, px=8_000)
    waiting = _plain(primary, wait_replicas=1, wait_timeout=100)
    request = Request("t9", "e9", Lease.of_ms(60_000), "w1@host", task_name="t.x", slots=slots)
    started = time.monotonic()
    with pytest.raises(UnconfirmedHolderError) as info:
        waiting.acquire(keys, request)
    waited = time.monotonic() - started
    assert (info.value.key, info.value.holder) == (keys.base, marked)
    assert 2.1 <= info.value.waited <= waited, (info.value.waited, waited)
    admin.delete(keys.waiting(marked))
    refused = waiting.acquire(keys, request)
    assert refused.status is Acquire.HELD and refused.holder is not None
    assert refused.holder.exec_id in {"e1", "e2"}


def test_a_grant_given_back_after_wait_fell_short_leaves_no_finish_for_a_copy(pair):
    """A redelivered copy of the task meets the grant while it waits on WAIT
    (SAME_TASK: it waits for the original). The grant is given back (too few
    replicas) as a task that did not run, not one that finished: no finish
    marker drops the copy, which takes the key when it asks again."""
    primary, _ = pair
    keys, holder, given_back = grant_waiting_on_wait(pair)
    admin = primary.client(2)
    copies = _plain(primary)
    copy = Request("t1", "e-copy", Lease.of_ms(60_000), "w1@host", task_name="t.x")
    assert copies.acquire(keys, copy).status is Acquire.SAME_TASK
    assert owner_field(admin, keys.lock, "copies") == "1"
    holder.join(10)
    assert [type(e) for e in given_back] == [TooFewReplicasError]
    assert not admin.exists(keys.lock) and not admin.exists(keys.fin)
    assert copies.acquire(keys, copy).status is Acquire.GRANTED


def test_a_wait_the_server_refuses_acknowledges_nothing(pair):
    """WAIT answered with an error (here the lock user may not run it) is no
    replica's acknowledgment, though the replica is in sync and would have
    acknowledged: with policy release each grant is given back
    and TooFewReplicasError says 0 of 1, as often as it happens (a second
    grant on the same engine, within the no-replica warning's 30 s, too)."""
    primary, _ = pair
    primary.client().acl_setuser("locks", enabled=True, passwords=["+s3cret"], keys=["*"],
                                 channels=["*"], commands=["+@all", "-wait"])
    engine = connect(SingletonConfig.defaults(
        f"redis://locks:s3cret@127.0.0.1:{primary.port}/2", wait_replicas=1,
        wait_timeout=100, wait_policy="release"))
    for n in range(2):
        keys = LockKeys("singleton:", uuid.uuid4().hex)
        with pytest.raises(TooFewReplicasError) as info:
            take(engine, keys)
        assert (info.value.key, info.value.acked, info.value.wanted) == (keys.base, 0, 1), n
        assert not primary.client(2).exists(keys.lock)


def test_a_grant_wait_confirmed_is_confirmed_for_its_whole_lease(pair):
    """A grant WAIT confirmed is also confirmed by its holder (its lease
    renewed from now, sent without waiting): once that reply is read its
    lock lives its whole lease, not only the window an unconfirmed grant has
    (its request's deadline and one more wait, 4 s here)."""
    primary, _ = pair
    engine = engine_for(primary, wait_replicas=1, wait_timeout=2000)
    keys, exec_id = LockKeys("singleton:", uuid.uuid4().hex), uuid.uuid4().hex
    got = engine.acquire(keys, Request("t1", exec_id, Lease.of_ms(60_000), "w1@host",
                                       task_name="t.x"))
    assert got.status is Acquire.GRANTED and got.confirmation is not None
    engine.settle()
    assert primary.client(2).pttl(keys.lock) > 50_000
    assert owner_field(primary.client(2), keys.lock, "exec") == exec_id


def test_a_doubtful_holder_left_waiting_on_wait_is_the_tasks_to_wait_for_once_waited_for(pair):
    """A marked holder (its marker stays, as in the test above) whose lock was
    not renewed in time either (it lives less than two thirds of its lease:
    doubtful, a holder that may not be running) is looked at again for WAIT's
    timeout and its margin; then the refusal is returned as it is, for the
    task to wait for as for any doubtful holder (its policies), not
    :class:`.UnconfirmedHolderError`."""
    primary, _ = pair
    keys = LockKeys("singleton:", uuid.uuid4().hex)
    got = _plain(primary).acquire(keys, Request("t1", "e1", Lease.of_ms(60_000), "w1@host",
                                                task_name="t.x"))
    assert got.status is Acquire.GRANTED
    admin = primary.client(2)
    admin.pexpire(keys.lock, 30_000)  # not renewed when a third of its lease had passed
    admin.set(keys.waiting("e1"), "e1", px=30_000)
    waiting = _plain(primary, wait_replicas=1, wait_timeout=100)
    refused = waiting.acquire(keys, Request("t9", "e9", Lease.of_ms(60_000), "w1@host",
                                            task_name="t.x"))
    assert refused.status is Acquire.HELD and refused.doubtful, refused
    assert refused.holder is not None and refused.holder.exec_id == "e1"
    assert admin.exists(keys.waiting("e1"))  # still marked: waited for, then left to the task
    assert owner_field(admin, keys.lock, "exec") == "e1"
