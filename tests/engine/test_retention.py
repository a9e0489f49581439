"""How long a key's fencing counter outlives its lock (``singleton_fence_ttl``),
against a real redis-server: what a finished key leaves behind, that a renewal
keeps the counter as long as the lock, and that tokens still never go down
across a restart.

The clock stepped back under the server is in ``test_clock_step.py``, a
failover in ``test_sentinel.py``.
"""

from __future__ import annotations

import re
import subprocess
import time
import uuid
from typing import Any

import pytest

from celery_singleton_lock import SingletonConfig
from celery_singleton_lock.engine.registry import connect
from celery_singleton_lock.engine.replies import Acquire, Reclaim, Renew
from celery_singleton_lock.engine.request import Lease, Request
from celery_singleton_lock.keys import LockKeys
from celery_singleton_lock.testing.processes import redis_server_binary
from tests.support import RedisServer, wait_for


def new_keys() -> LockKeys:
    return LockKeys("singleton:", uuid.uuid4().hex)


def take(engine: Any, keys: LockKeys, task_id: str, exec_id: str, lease_ms: int = 5000) -> Any:
    return engine.acquire(keys, Request(task_id=task_id, exec_id=exec_id,
                                        lease=Lease.of_ms(lease_ms), hostname="w1@host", retries=0,
                                        task_name="t.x", done=False))


def test_a_finished_key_leaves_nothing_past_the_lease_and_the_retention(redis_server, r):
    """With the default settings, every key a granted and released task leaves
    expires within the lease and ``singleton_fence_ttl`` (5 minutes): no
    counter kept for a day. Tasks as the worker runs them, each on a key of
    its own, two with a copy seen meanwhile (their finish marker lives
    ``singleton_finished_ttl``, an hour, and only there)."""
    engine = connect(SingletonConfig.defaults(redis_server.url(2)))
    lease_ms = 30_000
    for i in range(200):
        keys = new_keys()
        assert take(engine, keys, f"t{i}", f"e{i}", lease_ms).status is Acquire.GRANTED
        if i < 2:  # a redelivered copy of it asks meanwhile
            assert take(engine, keys, f"t{i}", f"copy{i}").status is Acquire.SAME_TASK
        assert engine.release(keys, f"e{i}", f"t{i}") is True
    left = {key: r.pttl(key) for key in r.scan_iter(count=1000)}
    assert left, "nothing left at all: the counters are kept"
    counters = {k: ttl for k, ttl in left.items() if k.endswith(":fence")}
    fins = {k: ttl for k, ttl in left.items() if k.endswith(":fin")}
    assert len(counters) == 200 and len(fins) == 2 and len(left) == 202, left
    bound = lease_ms + 300_000  # the lease and singleton_fence_ttl's default
    assert all(0 < ttl <= bound for ttl in counters.values()), max(counters.values())
    assert all(0 < ttl <= 3_600_000 for ttl in fins.values())  # singleton_finished_ttl


def test_a_renewal_keeps_the_counter_as_long_as_the_lock(redis_server, r):
    """A lock held past its counter's own retention keeps the counter: each
    renewal carries it the lease and ``singleton_fence_ttl`` further. So a
    lock released by hand (``celery singleton release``) while its task still
    runs is found released, not forgotten by the server, and is not written
    back; nor is one whose lease ran out."""
    engine = connect(SingletonConfig.defaults(redis_server.url(2), fence_ttl=0.3))
    keys = new_keys()
    lease_ms = 600
    assert take(engine, keys, "t", "e", lease_ms).status is Acquire.GRANTED
    token = int(r.get(keys.fence))
    deadline = time.monotonic() + 2.0  # more than twice the counter's own retention
    while time.monotonic() < deadline:
        assert engine.renew([(keys.lock, "e", lease_ms)]) == [Renew.RENEWED]
        time.sleep(0.15)
    assert r.exists(keys.lock) and int(r.get(keys.fence)) == token
    assert lease_ms < r.pttl(keys.fence) <= lease_ms + 300
    r.delete(keys.lock)  # released by hand while the task runs
    assert engine.renew([(keys.lock, "e", lease_ms)]) == [Renew.ABSENT]
    back = engine.reclaim(keys, Request(task_id="t", exec_id="e", lease=Lease.of_ms(lease_ms),
                                        hostname="w1@host", retries=0,
                                        task_name="t.x"), token)
    assert back.status is Reclaim.RELEASED and not r.exists(keys.lock)
    # the counter outlives the lock by singleton_fence_ttl, then goes
    wait_for(lambda: not r.exists(keys.fence), 5, what="the counter to expire")


def _server_with_debug() -> RedisServer:
    """A server whose ``DEBUG`` answers a local client (off by default from 7.0)."""
    binary = redis_server_binary()
    assert binary, "redis-server"
    printed = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    version = tuple(int(x) for x in re.search(r"v=(\d+)\.(\d+)", printed).groups())  # type: ignore[union-attr]
    return RedisServer(["--enable-debug-command", "local"] if version >= (7, 0) else [])


def test_memory_comes_back_once_the_retention_has_passed():
    """20,000 distinct keys granted and released: right after, their counters
    are all there; once the retention (here 3 s) has passed they go and the
    lock Redis's ``used_memory`` is back within 5% of its start. The server's
    expiry is held off while the keys are written, so a slow machine that
    takes longer than the retention to write them changes nothing."""
    server = _server_with_debug().start()
    try:
        engine = connect(SingletonConfig.defaults(server.url(0), fence_ttl=3.0))
        client = server.client()
        take(engine, new_keys(), "warm", "warm", 500)  # the connection and scripts
        engine.release(new_keys(), "warm", "warm")
        client.flushall()
        start = int(client.info("memory")["used_memory"])
        client.execute_command("DEBUG", "SET-ACTIVE-EXPIRE", "0")
        for i in range(20_000):
            keys = new_keys()
            take(engine, keys, f"t{i}", f"e{i}", 500)
            engine.release(keys, f"e{i}", f"t{i}")
        right_after = int(client.info("memory")["used_memory"])
        assert client.dbsize() == 20_000 and right_after > start * 1.5, (start, right_after)
        client.execute_command("DEBUG", "SET-ACTIVE-EXPIRE", "1")
        wait_for(lambda: client.dbsize() == 0, 60, what="the counters to expire")
        after = int(client.info("memory")["used_memory"])
        assert after <= start * 1.05, (start, right_after, after)
    finally:
        server.cleanup()


@pytest.mark.parametrize("persisted", [True, False], ids=["append-only", "empty"])
def test_tokens_never_go_down_across_a_restart(persisted):
    """kill -9 of the lock Redis and a start on the same port: with an
    append-only file the counter comes back with its TTL (a counter set ahead
    of the clock, as after a clock stepped back, is counted on); without, the
    server clock, later than every grant, is the floor."""
    args = ["--appendonly", "yes", "--appendfsync", "always"] if persisted else []
    server = RedisServer(args).start()
    try:
        engine = connect(SingletonConfig.defaults(server.url(0)))
        client = server.client()
        keys = new_keys()
        tokens = []
        for i in range(3):
            tokens.append(take(engine, keys, f"t{i}", f"e{i}").token)
            engine.release(keys, f"e{i}", f"t{i}")
        if persisted:  # a counter ahead of the clock by a minute
            ahead = tokens[-1] + 60_000_000
            client.set(keys.fence, str(ahead), px=310_000)
            tokens.append(ahead)
        server.stop()
        server.start()
        assert client.exists(keys.fence) == (1 if persisted else 0)
        after = wait_for(lambda: _granted(engine, keys), 10, what="a grant after the restart")
        assert after > tokens[-1], (tokens, after)
        if persisted:
            assert after == tokens[-1] + 1
    finally:
        server.cleanup()


def _granted(engine: Any, keys: LockKeys) -> Any:
    try:
        got = take(engine, keys, "after", "e-after")
    except Exception:  # the outage's first calls fail at once until it answers
        return None
    return got.token if got.status is Acquire.GRANTED else None


def test_the_counter_outlives_a_long_lease_by_at_least_a_tenth_of_it(redis_server, r):
    """``singleton_fence_ttl`` shorter than the clock allowance the start-up
    checks use (a tenth of the lease): the counter still outlives the lock by
    that allowance, at the grant and at each renewal."""
    engine = connect(SingletonConfig.defaults(redis_server.url(2), fence_ttl=1.0))
    keys = new_keys()
    assert take(engine, keys, "t", "e", lease_ms=60_000).status is Acquire.GRANTED
    assert 65_000 < r.pttl(keys.fence) <= 66_000
    r.pexpire(keys.fence, 1_000)
    assert engine.renew([(keys.lock, "e", 60_000)]) == [Renew.RENEWED]
    assert 65_000 < r.pttl(keys.fence) <= 66_000


#: the deployments a renewal is checked on: (server fixture, ``singleton_native``, slots)
RENEWALS = {
    "scripts": ("redis_server", "off", 1),
    "slots": ("redis_server", "off", 3),
    "native": ("valkey", "auto", 1),
}


@pytest.mark.parametrize("where", list(RENEWALS))
def test_a_renewal_gives_the_lock_its_lease_and_the_counter_the_lease_and_the_retention(
        where, request):
    """After a renewal the lock key lives the lease the renewal asked for (not
    the grant's, not a fixed five minutes), and its fencing counter the lease
    and ``singleton_fence_ttl`` (300 s by default; docs/redis-keys.md), though
    it had less left: on the scripts path, on the native path (Valkey 9), and
    for a slot under ``singleton_limit`` (every slot shares the key's counter)."""
    fixture, native, slots = RENEWALS[where]
    server = request.getfixturevalue(fixture)
    client = server.client(2)
    engine = connect(SingletonConfig.defaults(server.url(2), native=native))
    assert (engine.path.native is not None) == (native == "auto"), where
    keys = new_keys()
    if slots > 1:  # two slots taken first: the renewed lock is the third
        for i in range(slots - 1):
            assert engine.acquire(keys, Request(task_id=f"o{i}", exec_id=f"eo{i}",
                                                lease=Lease.of_ms(20_000), hostname="w1@host",
                                                retries=0, task_name="t.x",
                                                slots=slots)).status is Acquire.GRANTED
    got = engine.acquire(keys, Request(task_id="t", exec_id="e", lease=Lease.of_ms(20_000),
                                       hostname="w1@host", retries=0, task_name="t.x",
                                       done=False, slots=slots))
    assert got.status is Acquire.GRANTED and got.slot == slots, (where, got)
    lock = keys.slot(got.slot).lock
    assert 0 < client.pttl(lock) <= 20_000
    client.pexpire(keys.fence, 1_000)  # less left than any renewal gives it
    lease_ms = 45_000
    assert engine.renew([(lock, "e", lease_ms)]) == [Renew.RENEWED]
    lock_ttl, fence_ttl = client.pttl(lock), client.pttl(keys.fence)
    # the lease asked for, counted from the renewal (the grant gave 20 s); the
    # bounds' 20 s slack is for a loaded machine, not a measure of speed
    assert lease_ms - 20_000 < lock_ttl <= lease_ms, (where, lock_ttl)
    retention = lease_ms + 300_000  # the lease and singleton_fence_ttl's default
    assert retention - 20_000 < fence_ttl <= retention, (where, fence_ttl)
    assert engine.release(keys.slot(got.slot), "e", "t") is True
