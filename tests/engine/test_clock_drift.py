"""The estimate of the lock Redis's clock ages: two clocks run apart by up to
0.1 % (``DRIFT_PPM``), so a bound drawn from a reply an hour old may be
seconds off. The moment a grant's holder counts on it until comes sooner by
that rate with its reply's age, and a call made when the last reply is older
than 30 s carries a ``TIME`` of its own in its write (no round trip more), so
that moment stays within 30 ms of one drawn from a fresh reply.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Iterator

import pytest

from celery_singleton_lock import SingletonConfig
from celery_singleton_lock.engine.clock import REFRESH_US, ServerClock, now_us
from celery_singleton_lock.engine.registry import connect
from celery_singleton_lock.engine.replies import Acquire, Acquired
from celery_singleton_lock.engine.request import Lease, Request
from celery_singleton_lock.engine.server import LockEngine
from celery_singleton_lock.keys import LockKeys
from tests.support import RedisServer

HOUR_US = 3_600_000_000


def _heard(clock: ServerClock, offset_us: int, age_us: int, trip_us: int = 100) -> None:
    """A reply heard ``age_us`` ago whose clock was ``offset_us`` ahead of ours."""
    sent = now_us() - age_us
    clock.heard(sent, divmod(sent + offset_us, 1_000_000), sent + trip_us)


@pytest.mark.unit  # no server
def test_bounds_drawn_from_an_old_reply_widen_by_the_drift_allowed() -> None:
    """A reply an hour old bounds the server's clock 3.6 s looser than a
    fresh one with the same offset: the moment before which the server
    surely has not reached a time (until which a grant's holder counts on
    it) comes 3.6 s sooner."""
    offset = 5_000_000_000
    fresh, old = ServerClock(), ServerClock()
    _heard(fresh, offset, 0)
    _heard(old, offset, HOUR_US)
    target_ms = (now_us() + offset) // 1000 + 4_000
    # the server's clock gains at most 0.1 % on ours in an hour: it may
    # reach the target 3.6 s of its own sooner, 3.6 s / 1.001 of ours
    assert fresh.local_time_of(target_ms) - old.local_time_of(target_ms) == pytest.approx(
        3.6 / 1.001, abs=0.002)
    # a fresh reply beside the old one gives back the fresh bound
    _heard(old, offset, 0)
    assert old.local_time_of(target_ms) == pytest.approx(fresh.local_time_of(target_ms),
                                                         abs=0.001)


@pytest.mark.unit  # no server
def test_a_clock_is_stale_only_once_its_last_reply_is_older_than_the_refresh() -> None:
    clock = ServerClock()
    assert not clock.stale()  # nothing heard: nothing to refresh
    _heard(clock, 0, REFRESH_US - 1_000_000)
    assert not clock.stale()
    _heard(clock, 0, REFRESH_US + 1_000_000)  # the last reply heard counts
    assert clock.stale()


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    s = RedisServer().start()
    yield s
    s.cleanup()


@pytest.fixture
def engine(server: RedisServer) -> Iterator[LockEngine]:
    e = connect(dataclasses.replace(SingletonConfig.defaults(server.url(0)), native="off"))
    assert isinstance(e, LockEngine)
    yield e
    e.close()


def _times_run(server: RedisServer) -> int:
    """``TIME`` commands the server ran, its scripts' own included."""
    stats = server.client().info("commandstats")
    return int(stats.get("cmdstat_time", {}).get("calls", 0))


def _take(engine: LockEngine, task_id: str) -> Acquired:
    keys = LockKeys("singleton:", uuid.uuid4().hex)
    return engine.acquire(keys, Request(task_id, f"e-{task_id}", Lease(60.0), "w@h",
                                        task_name="t.x", done=False))


def test_a_call_after_an_hour_without_a_reply_reads_the_clock_in_its_own_write(
        server: RedisServer, engine: LockEngine) -> None:
    """Every reply this process heard from the server is an hour old (its
    estimate aged as a worker idle for an hour): the next call carries a
    ``TIME`` in its write, the estimate is fresh again, and its grant's
    confirmation window is counted from it: not seconds short (the old
    reply, widened by an hour's drift, would give less than the wait a grant
    is confirmed within). The call after reads no clock."""
    assert _take(engine, "warm").status is Acquire.GRANTED
    before = _times_run(server)
    assert _take(engine, "fresh").status is Acquire.GRANTED
    scripts = _times_run(server) - before  # what a grant's script reads itself
    clock = engine.wire.clock  # type: ignore[union-attr]
    aged = [(offset, trip, sent - HOUR_US) for offset, trip, sent in clock.heard_from]
    clock.heard_from.clear()
    clock.heard_from.extend(aged)
    assert clock.stale()
    before = _times_run(server)
    started = time.monotonic()
    answer = _take(engine, "after-an-hour")
    assert answer.status is Acquire.GRANTED, answer
    assert _times_run(server) == before + scripts + 1
    assert not clock.stale() and clock.heard_from[-1][2] >= int(started * 1e6)
    confirmation = answer.confirmation
    # confirmed by the request's deadline and one more wait: two waits in all
    assert confirmation.until - started > engine.wire.budget * 1.5  # type: ignore[union-attr]
    assert _take(engine, "next").status is Acquire.GRANTED
    assert _times_run(server) == before + 2 * scripts + 1
