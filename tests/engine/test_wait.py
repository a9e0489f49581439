"""WAIT after the grant: a primary and a replica of the test's own; the replica
is stopped with SIGSTOP to make WAIT fall short."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Iterator

import pytest

from celery_singleton_lock import SingletonConfig, is_skipped
from celery_singleton_lock.engine.registry import connect
from celery_singleton_lock.engine.replies import Acquire, Renew
from celery_singleton_lock.engine.request import Lease, Request
from celery_singleton_lock.engine.server import LockEngine
from celery_singleton_lock.exceptions import TooFewReplicasError
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
