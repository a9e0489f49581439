"""A release says whether this call freed the lock: True when it deleted its
own record, or when it is the repeat of an attempt whose reply was lost and
finds the key free (that attempt freed it); False when the key was already
free or is another execution's. On both paths (the native commands and the
scripts), on Redis and on Valkey.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any, Iterator

import pytest

from celery_singleton_lock import SingletonConfig
from celery_singleton_lock.engine.registry import connect
from celery_singleton_lock.engine.replies import Acquire
from celery_singleton_lock.engine.request import Lease, Request
from celery_singleton_lock.engine.server import LockEngine
from celery_singleton_lock.keys import LockKeys
from tests.support import RedisServer, ReplyDroppingProxy, owner_field, wait_for

Setup = tuple[RedisServer, ReplyDroppingProxy, LockEngine]

#: test id -> (server, ``singleton_native``)
KINDS = {"redis-scripts": ("redis", "off"), "valkey-native": ("valkey", "auto"),
         "valkey-scripts": ("valkey", "off")}


@pytest.fixture(params=list(KINDS))
def setup(request: pytest.FixtureRequest, redis_server: RedisServer, valkey: RedisServer
          ) -> Iterator[Setup]:
    which, native = KINDS[request.param]
    server = redis_server if which == "redis" else valkey
    proxy = ReplyDroppingProxy(server.port)
    engine = connect(dataclasses.replace(SingletonConfig.defaults(proxy.url(0)), native=native))
    assert isinstance(engine, LockEngine)
    assert (engine.path.native is not None) == (native == "auto")
    yield server, proxy, engine
    engine.close()
    proxy.close()


def _take(engine: LockEngine, keys: LockKeys, exec_id: str) -> None:
    got = engine.acquire(keys, Request(f"t-{exec_id}", exec_id, Lease(60.0), "w@h",
                                       task_name="t.x", done=False))
    assert got.status is Acquire.GRANTED, got
    engine.settle()  # the grant's confirmation answered: the release goes next


def test_a_release_is_true_only_for_the_call_that_freed_the_key(setup: Setup) -> None:
    """The holder's release frees the key: True. The same release again finds
    the key free, and no reply was lost: False. Another execution's release
    of a held key: False, and the key stays its holder's."""
    server, _, engine = setup
    keys = LockKeys("singleton:", uuid.uuid4().hex)
    _take(engine, keys, "e-first")
    assert engine.release(keys, "e-first", "t-e-first") is True
    assert server.client().get(keys.lock) is None
    assert engine.release(keys, "e-first", "t-e-first") is False
    _take(engine, keys, "e-second")
    assert engine.release(keys, "e-other", "t-e-other") is False
    assert owner_field(server.client(), keys.lock, "exec") == "e-second"
    assert engine.release(keys, "e-second", "t-e-second") is True


def test_a_release_repeated_after_its_reply_was_lost_is_true(setup: Setup) -> None:
    """The release ran and freed the key, but its reply was lost with the
    connection: the engine sends it once more, that repeat finds the key
    free, and the call says it freed the key (its first attempt did)."""
    server, proxy, engine = setup
    keys = LockKeys("singleton:", uuid.uuid4().hex)
    _take(engine, keys, "e-lost-reply")
    proxy.drop_after = b"e-lost-reply"
    assert engine.release(keys, "e-lost-reply", "t-e-lost-reply") is True
    assert proxy.dropped == 1
    assert server.client().get(keys.lock) is None


def test_a_release_after_the_lease_ran_out_is_false(setup: Setup) -> None:
    """The holder's lease ran out under it (Redis expired the key) and no
    reply was lost: its release finds the key free and says it did not free
    it (the task is told its lock was lost), on the path that granted it."""
    server, _, engine = setup
    keys = LockKeys("singleton:", uuid.uuid4().hex)
    got = engine.acquire(keys, Request("t-short", "e-short", Lease.of_ms(300), "w@h",
                                       task_name="t.x", done=False))
    assert got.status is Acquire.GRANTED, got
    engine.settle()
    wait_for(lambda: server.client().get(keys.lock) is None, 10, interval=0.01,
             what="the lease to run out")
    assert engine.release(keys, "e-short", "t-short") is False


@pytest.mark.parametrize("later", [False, True], ids=["release", "release_later"])
def test_a_release_recorded_always_leaves_a_finish_marker_though_no_copy_was_seen(
        setup: Setup, later: bool) -> None:
    """``always_record`` (a task acked late, whose redelivered copy may come
    after its end): the finished task's release leaves the finish marker
    though no copy of it was seen, on the path that granted it; without it
    the release leaves none (no copy waited). ``done_ms``: the key stays done,
    its marker naming the task and its id."""
    server, _, engine = setup
    got: list[tuple[object, object]] = []

    def release(keys: LockKeys, exec_id: str, **kw: Any) -> None:
        if later:
            engine.release_later(keys, exec_id, f"t-{exec_id}",
                                 lambda *answer: got.append(answer), **kw)
            engine.settle()
        else:
            assert engine.release(keys, exec_id, f"t-{exec_id}", **kw) is True

    plain, acked_late, done = (LockKeys("singleton:", uuid.uuid4().hex) for _ in range(3))
    _take(engine, plain, "e-plain")
    release(plain, "e-plain")
    _take(engine, acked_late, "e-acked-late")
    release(acked_late, "e-acked-late", always_record=True)
    _take(engine, done, "e-done")
    release(done, "e-done", done_ms=60_000, task_name="t.x")
    client = server.client()
    assert [client.get(k.lock) for k in (plain, acked_late, done)] == [None] * 3
    assert client.get(plain.fin) is None
    assert client.get(acked_late.fin) == "t-e-acked-late"
    assert client.get(done.done) == "t.x\nt-e-done"
    assert client.get(plain.done) is None and client.get(acked_late.done) is None
    if later:
        assert [error for _, error in got] == [None] * 3
