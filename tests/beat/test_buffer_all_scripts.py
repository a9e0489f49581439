"""``buffer_all``'s two scripts on a real Redis, call by call, as the beats
call them (``beat/overlap.py``): a tick arriving (``beat_arrive.lua``) is sent
at once only when the run before it ended, nothing waits and no beat sent
another since this one looked; else it waits in tick order, up to the cap.
The run's end takes the oldest waiting tick (``beat_take.lua``), unless another
beat sent one since this one looked.
"""

from __future__ import annotations

import uuid
from typing import Any

import redis

from celery_singleton_lock.beat.overlap import _ARRIVE, _TAKE
from celery_singleton_lock.beat.ticks import last_sent_key, queue_key
from celery_singleton_lock.config import SingletonConfig
from celery_singleton_lock.engine.registry import connect
from celery_singleton_lock.engine.shapes import text

QUEUE_TTL = 60_000
LAST_TTL = 30_000


class Entry:
    """One entry's queue and last-sent key, and the two scripts on them."""

    def __init__(self, r: redis.Redis, cap: int = 3) -> None:
        name = f"e-{uuid.uuid4().hex[:8]}"
        self.r, self.cap = r, cap
        kwargs = r.connection_pool.connection_kwargs
        self.engine = connect(SingletonConfig.defaults(
            f"redis://{kwargs['host']}:{kwargs['port']}/{kwargs.get('db', 0)}"))
        self.queue, self.last = queue_key("singleton:", name), last_sent_key("singleton:", name)

    def arrive(self, tick: int, seen: str, ended: bool) -> Any:
        return text(self.engine.run_script(_ARRIVE, [self.queue, self.last],
                                           [str(tick), seen, "1" if ended else "0",
                                            self.cap, QUEUE_TTL, LAST_TTL]))

    def take(self, seen: str) -> int:
        return int(self.engine.run_script(_TAKE, [self.queue, self.last], [seen, LAST_TTL]))

    def waiting(self) -> list[int]:
        return [int(t) for t in self.r.zrange(self.queue, 0, -1)]


def test_the_first_tick_is_sent_at_once_and_the_ones_behind_a_run_wait_in_order(r):
    e = Entry(r)
    assert e.arrive(1000, "", ended=True) == "send"  # nothing sent before: no last key
    assert r.get(e.last) == "1000" and 0 < r.pttl(e.last) <= LAST_TTL
    assert e.arrive(2000, "1000", ended=False) == "buffered"  # its run still runs
    assert e.arrive(2000, "1000", ended=False) == "buffered"  # the same tick, claimed again
    assert e.arrive(3000, "1000", ended=True) == "buffered"  # ended, but 2000 waits
    assert e.waiting() == [2000, 3000] and 0 < r.pttl(e.queue) <= QUEUE_TTL
    assert r.get(e.last) == "1000"


def test_a_tick_after_another_beats_send_waits_though_the_run_ended(r):
    e = Entry(r)
    assert e.arrive(1000, "", ended=True) == "send"
    assert e.arrive(2000, "", ended=True) == "buffered"  # it looked before 1000 was sent
    assert e.waiting() == [2000]


def test_the_queue_holds_at_most_the_cap(r):
    e = Entry(r, cap=2)
    r.set(e.last, "1000")
    assert [e.arrive(t, "1000", ended=False) for t in (2000, 3000, 4000)] == [
        "buffered", "buffered", "full"]
    assert e.waiting() == [2000, 3000]
    # a tick that already waits, claimed again: it waits, it is not dropped
    assert e.arrive(3000, "1000", ended=False) == "buffered"
    assert e.waiting() == [2000, 3000]


def test_the_runs_end_takes_the_oldest_waiting_tick_once(r):
    e = Entry(r)
    # ticks buffered while no tick was sent yet (or the last-sent key expired)
    assert e.arrive(2000, "", ended=False) == "buffered"
    assert e.arrive(1000, "", ended=False) == "buffered"
    assert e.take("") == 1000
    assert r.get(e.last) == "1000" and 0 < r.pttl(e.last) <= LAST_TTL
    assert e.take("") == 0  # another beat's look: 1000 was sent since, its run comes first
    assert e.take("1000") == 2000
    assert e.take("2000") == -1 and e.waiting() == []  # nothing waits
    assert r.get(e.last) == "2000"
