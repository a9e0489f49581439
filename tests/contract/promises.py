"""The core promises through real workers, written once and run against each
kind of lock server (a cluster, Valkey): the test modules give the app, the
event log, a fresh key and how to see whether a lock key exists."""

from __future__ import annotations

import datetime as dt
import os
import signal
import uuid
from collections import Counter
from typing import Any, Callable, Optional

import pytest
from celery.beat import Scheduler

from celery_singleton_lock import is_deduplicated, is_skipped
from celery_singleton_lock.beat import SingletonSchedulerMixin
from tests.beatapp import make_beat_app
from tests.support import wait_for

LockExists = Callable[[str, str], bool]  # (task name, call key) -> the lock key exists


def duplicate_storm_runs_one_at_a_time(app: Any, events: Any, key: str) -> None:
    """Twelve sends of one key while the first runs: one execution at any
    moment, every other send skipped naming the holder. (The first runs until
    every duplicate was answered: ``finish:<key>``, however slow the machine.)"""
    hold = app.tasks["t.hold"]
    first = hold.delay(key, 120.0, "first")
    wait_for(lambda: events.starts("first"), 15, what="first start")
    dups = [hold.delay(key, 0.0, f"dup{i}") for i in range(12)]
    try:
        for d in dups:
            result = d.get(timeout=15)
            assert is_skipped(result) and result["holder"] == first.id, (result, events.all())
    finally:
        events.client.set(f"finish:{key}", 1)
    assert first.get(timeout=15)["tag"] == "first"
    assert [e["tag"] for e in events.starts()] == ["first"]
    assert all(e["concurrent"] == 1 for e in events.starts())


def killed_child_is_freed_by_the_main_process(app: Any, events: Any, key: str,
                                              lock_exists: LockExists) -> None:
    """kill -9 of the pool process holding a lock: the worker's main process
    frees its key long before the 30 s lease."""
    res = app.tasks["t.hold"].delay(key, 20.0, "kill9")
    pid = wait_for(lambda: events.starts("kill9"), 15, what="start")[0]["pid"]
    assert lock_exists("t.hold", key)
    os.kill(pid, signal.SIGKILL)
    # within 10 s, where the lease alone would take 30
    wait_for(lambda: not lock_exists("t.hold", key), 10, what="key freed")
    with pytest.raises(Exception, match=r"WorkerLost|exited prematurely"):
        res.get(timeout=10)


def redelivery_runs_once_more_with_a_higher_token(app: Any, events: Any, key: str,
                                                  lock_exists: LockExists) -> None:
    """acks_late task whose child is killed: the requeued copy (same id) finds
    the dead holder's lock, runs at once, with a higher token."""
    res = app.tasks["t.hold_late"].delay(key, 2.0, "lost")
    first = wait_for(lambda: events.starts("lost"), 15, what="first start")[0]
    os.kill(first["pid"], signal.SIGKILL)
    # at once as a rule; a dead holder's pid taken by a new process (the pid
    # space wrapped) looks alive, and the copy then runs after the lease (30 s)
    assert res.get(timeout=75)["tag"] == "lost"
    starts = [e for e in events.starts("lost") if e["id"] == res.id]
    assert len(starts) == 2 and starts[1]["token"] > first["token"]
    assert not lock_exists("t.hold_late", key)


def queue_scopes_refuse_while_queued_and_while_running(app: Any, events: Any, key: str) -> None:
    """queue: a send while one is queued is refused as that task; queue_and_run:
    refused while queued and while running; free again once it finished."""
    q = app.tasks["t.queue"]
    first = q.apply_async((key, 0.2, "q-first"), countdown=1.0)
    dup = q.delay(key, 0.0, "q-dup")
    assert is_deduplicated(dup) and dup.id == first.id
    assert first.get(timeout=15)["tag"] == "q-first"
    t = app.tasks["t.queue_and_run"]
    other = key + "-qar"
    running = t.apply_async((other, 1.5, "r-first"), countdown=0.3)
    assert is_deduplicated(t.delay(other, 0.0, "r-dup-queued"))
    wait_for(lambda: events.starts("r-first"), 15, what="queue_and_run start")
    assert t.delay(other, 0.0, "r-dup-running").id == running.id
    assert running.get(timeout=15)["tag"] == "r-first"
    after = t.delay(other, 0.0, "r-after")
    assert not is_deduplicated(after) and after.get(timeout=15)["tag"] == "r-after"
    assert [e["tag"] for e in events.starts()] == ["q-first", "r-first", "r-after"]


class VirtualScheduler(SingletonSchedulerMixin, Scheduler):  # type: ignore[misc]
    """The mixin over Celery's in-memory scheduler, on a virtual clock, recording sends."""

    clock: dt.datetime
    offset = dt.timedelta(0)
    sent: list[tuple[str, dt.datetime, str]]

    def singleton_now(self) -> dt.datetime:
        return self.clock + self.offset

    def _send(self, entry: Any, tick: dt.datetime, producer: Any) -> None:
        self.sent.append((entry.name, tick, self.beat_id))


def one_start_per_throttle_window(app: Any, events: Any, key: str,
                                  window_exists: LockExists) -> None:
    """``singleton_throttle``: a failed start still opens the window; the calls
    in it, sent after it ended, are skipped as "throttled" naming it."""
    t = app.tasks["t.throttle"]
    first = t.delay(key, 0.0, "first", True)
    with pytest.raises(ValueError):
        first.get(timeout=15)
    assert window_exists("t.throttle", key)
    calls = [t.delay(key, 0.0, f"dup{i}") for i in range(4)]
    results = [c.get(timeout=15) for c in calls]
    assert all(is_skipped(x) and x["reason"] == "throttled" and x["holder"] == first.id
               and 0 < x["reopens_in"] <= 3.0 for x in results), results
    assert [e["tag"] for e in events.starts()] == ["first"]


def the_newest_queued_call_wins(app: Any, events: Any, key: str) -> None:
    """``replace``: two sends while the first is queued; the last one's
    arguments run, alone, and each superseded call names the one after it."""
    t = app.tasks["t.queue_replace"]
    sent = [t.apply_async((key, 0.0, tag), countdown=1.5) for tag in ("first", "second", "third")]
    for old, new in zip(sent, sent[1:]):
        result = old.get(timeout=5)
        assert is_skipped(result) and (result["reason"], result["holder"]) == (
            "replaced", new.id), result
    assert sent[-1].get(timeout=15)["tag"] == "third"
    assert [e["tag"] for e in events.starts()] == ["third"]


def two_beats_with_skewed_clocks_send_each_tick_once(
        redis_url: str, lock_url: Optional[str] = None,
        conf: Optional[dict[str, Any]] = None) -> None:
    """Two beats whose clocks are 5 s apart (below singleton_beat_max_clock_skew),
    on a virtual clock for 30 s: one send per tick, none missing. ``lock_url``:
    the lock servers the beats claim ticks on (db 2 of ``redis_url`` if None)."""
    app = make_beat_app(redis_url, "unused", lock_url=lock_url, conf=conf, schedule={
        f"skewed-{uuid.uuid4().hex[:8]}": {"task": "t.tick", "every": 1}})
    beats = []
    for offset in (0.0, 5.0):
        beat = VirtualScheduler(app=app)
        beat.offset = dt.timedelta(seconds=offset)
        beat.sent = []
        beats.append(beat)
    start = dt.datetime(2030, 1, 1, 0, 0, 0, 500000, tzinfo=dt.timezone.utc)
    for step in range(0, 30_000, 50):  # 30 virtual seconds, every beat looks every 50 ms
        for beat in beats:
            beat.clock = start + dt.timedelta(milliseconds=step)
            for entry in list(beat.schedule.values()):
                if beat.is_due(entry)[0]:
                    beat.apply_entry(entry)
    sends = Counter(tick for beat in beats for (_, tick, _) in beat.sent)
    assert set(sends.values()) == {1}, sends
    ticks = sorted(sends)
    assert [(b - a).total_seconds() for a, b in zip(ticks, ticks[1:])] == [1.0] * (len(ticks) - 1)
    assert len(ticks) >= 30
    # the beat whose clock is ahead reaches each tick first and sends it
    assert len(beats[1].sent) >= 29
    assert beats[0].singleton_stats["claimed_elsewhere"] >= 24  # 5 s behind
