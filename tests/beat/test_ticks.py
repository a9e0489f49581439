"""Beat ticks: names, keys and fire times every beat computes alike from its
clock alone, and the worker's run marker (on a real redis-server; beats and
workers are in tests/beat/test_beat.py)."""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import replace as dataclasses_replace
from types import SimpleNamespace
from typing import Any

import pytest
from celery.schedules import crontab, schedule

from celery_singleton_lock.beat.ticks import (
    buffer_key,
    claim_key,
    interval_ticks,
    last_sent_key,
    late_key,
    next_fire_after,
    queue_key,
    tick_after,
    ticks_around,
)
from celery_singleton_lock.keys import LockKeys
from celery_singleton_lock.worker import ticks as worker_ticks
from celery_singleton_lock.worker.ticks import (
    ENTRY_HEADER,
    TICK_HEADER,
    cancel_key,
    cancel_requested,
    claim_tick_run,
    decide_lost_tick_run,
    entry_base,
    from_ms,
    run_key,
    tick_name,
    to_ms,
)

pytestmark = pytest.mark.unit  # no server, no worker: the fast run (-m unit)

UTC = dt.timezone.utc
T = dt.datetime(2026, 3, 4, 10, 15, 30, 250000, tzinfo=UTC)


@pytest.fixture(autouse=True)
def _local_time_is_not_utc(monkeypatch):
    """Beats on hosts in other time zones name the same ticks: run every test
    in a local zone far from UTC, so a conversion to local time shows."""
    import time

    monkeypatch.setenv("TZ", "Asia/Kathmandu")  # UTC+05:45
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_milliseconds_since_the_epoch_both_ways():
    assert to_ms(dt.datetime(1970, 1, 1, tzinfo=UTC)) == 0
    assert to_ms(dt.datetime(1970, 1, 1, 0, 0, 1, 999, tzinfo=UTC)) == 1000
    assert to_ms(T) == 1772619330250
    assert from_ms(1772619330250) == T and from_ms(0).tzinfo is UTC
    plus_two = dt.timezone(dt.timedelta(hours=2))
    assert to_ms(T.astimezone(plus_two)) == to_ms(T)


def test_a_tick_travels_as_iso_8601_utc_to_the_millisecond():
    assert tick_name(T) == "2026-03-04T10:15:30.250+00:00"
    assert tick_name(T.astimezone(dt.timezone(dt.timedelta(hours=-5)))) == tick_name(T)


def test_interval_ticks_floor_to_the_period_from_the_epoch():
    minute = dt.timedelta(minutes=1)
    assert interval_ticks(minute, T) == (T.replace(second=0, microsecond=0),
                                         T.replace(minute=16, second=0, microsecond=0))
    on_the_tick = T.replace(second=0, microsecond=0)
    assert interval_ticks(minute, on_the_tick) == (on_the_tick, on_the_tick + minute)
    # below a millisecond the period is one millisecond
    latest, following = interval_ticks(dt.timedelta(microseconds=10), T)
    assert (latest, following) == (T, T + dt.timedelta(milliseconds=1))
    # a period is counted in whole milliseconds
    assert interval_ticks(dt.timedelta(seconds=10, microseconds=500), T) == (
        T.replace(microsecond=0), T.replace(second=40, microsecond=0))


def test_the_tick_after_a_tick_is_the_schedules_next_fire_whenever_it_is_asked():
    minute = dt.timedelta(minutes=1)
    on_the_tick = T.replace(second=0, microsecond=0)
    assert tick_after(schedule(minute), on_the_tick) == on_the_tick + minute
    assert tick_after(schedule(minute), T.replace(tzinfo=None)) == on_the_tick + minute
    assert tick_after(crontab(minute="*/5"), on_the_tick) == on_the_tick.replace(minute=20)
    assert tick_after(SimpleNamespace(clocked_time=T), T - minute) == T
    assert tick_after(SimpleNamespace(clocked_time=T), T) is None


def test_the_next_crontab_fire_is_strictly_after_the_reference_in_utc():
    every_five = crontab(minute="*/5")
    assert next_fire_after(every_five, T) == T.replace(minute=20, second=0, microsecond=0)
    on_it = T.replace(minute=20, second=0, microsecond=0)
    assert next_fire_after(every_five, on_it) == on_it.replace(minute=25)
    naive = T.replace(tzinfo=None)  # taken as UTC
    assert next_fire_after(every_five, naive) == T.replace(minute=20, second=0, microsecond=0)
    # within a fire minute, past its start: the next one, not this one
    inside = T.replace(minute=20, second=30, microsecond=5)
    assert next_fire_after(every_five, inside) == T.replace(minute=25, second=0, microsecond=0)
    every_minute = next_fire_after(crontab(), inside)
    assert every_minute == T.replace(minute=21, second=0, microsecond=0)
    assert every_minute.tzinfo is not None and every_minute.utcoffset() == dt.timedelta(0)


def test_a_one_off_clocked_schedule_fires_once_then_never():
    clocked = SimpleNamespace(clocked_time=T)
    assert next_fire_after(clocked, T - dt.timedelta(seconds=1)) == T
    assert next_fire_after(clocked, T) is None
    naive = SimpleNamespace(clocked_time=T.replace(tzinfo=None))
    assert next_fire_after(naive, T - dt.timedelta(seconds=1)) == T
    in_kathmandu = T.astimezone(dt.timezone(dt.timedelta(hours=5, minutes=45)))
    fire = next_fire_after(SimpleNamespace(clocked_time=in_kathmandu), T - dt.timedelta(seconds=1))
    assert fire == T and fire.utcoffset() == dt.timedelta(0), "in UTC"


class _Solar:
    """A schedule known only by its estimate relative to its own now()."""

    def __init__(self, now: dt.datetime, remaining: dt.timedelta) -> None:
        self._now, self._remaining = now, remaining

    def now(self) -> dt.datetime:
        return self._now

    def remaining_estimate(self, ref: dt.datetime) -> dt.timedelta:
        return self._remaining


class _AfterLastRun:
    """A schedule that fires ``period`` after its last run, as Celery's
    ``remaining_estimate(last_run_at)`` is asked."""

    def __init__(self, now: dt.datetime, period: dt.timedelta) -> None:
        self._now, self._period = now, period

    def now(self) -> dt.datetime:
        return self._now

    def remaining_estimate(self, last_run_at: dt.datetime) -> dt.timedelta:
        return last_run_at + self._period - self._now


def test_other_schedules_are_asked_for_their_estimate_from_the_reference():
    local = dt.timezone(dt.timedelta(hours=5, minutes=45))
    every_ten = _AfterLastRun(T.astimezone(local), dt.timedelta(minutes=10))
    fire = next_fire_after(every_ten, T - dt.timedelta(minutes=3))
    assert fire == T + dt.timedelta(minutes=7) and fire.utcoffset() == dt.timedelta(0)


def test_other_schedules_fire_at_their_own_now_plus_their_estimate():
    """A fire time the schedule gives alike from wherever it is asked (a
    sunrise) is named to the second (T is 10:15:30.25)."""
    whole = T.replace(microsecond=0)
    ahead = _Solar(T, dt.timedelta(minutes=3))
    assert next_fire_after(ahead, T) == whole + dt.timedelta(minutes=3)
    assert next_fire_after(_Solar(T, dt.timedelta(0)), T) is None
    assert next_fire_after(_Solar(T.replace(tzinfo=None), dt.timedelta(seconds=1)),
                           T) == whole + dt.timedelta(seconds=1)
    half = _Solar(T + dt.timedelta(milliseconds=250), dt.timedelta(minutes=3))
    assert next_fire_after(half, T) == whole + dt.timedelta(minutes=3, seconds=1)


def test_ticks_around_an_interval_name_the_latest_only_within_the_window():
    every_minute = schedule(dt.timedelta(minutes=1))
    latest = T.replace(second=0, microsecond=0)
    assert ticks_around(every_minute, T, 60) == (latest, latest + dt.timedelta(minutes=1))
    assert ticks_around(every_minute, T, 30.25) == (latest, latest + dt.timedelta(minutes=1))
    assert ticks_around(every_minute, T, 30.2) == (None, latest + dt.timedelta(minutes=1))
    assert ticks_around(every_minute, T.replace(tzinfo=None), 60)[0] == latest


def test_ticks_around_a_crontab_walk_to_the_latest_fire_in_the_window():
    every_minute = crontab()
    now = T.replace(second=0, microsecond=0) + dt.timedelta(seconds=5)
    fired = now.replace(second=0)
    assert ticks_around(every_minute, now, 600) == (fired, fired + dt.timedelta(minutes=1))
    assert ticks_around(every_minute, now, 3) == (None, fired + dt.timedelta(minutes=1))
    on_the_minute = fired
    assert ticks_around(every_minute, on_the_minute, 1) == (
        on_the_minute, on_the_minute + dt.timedelta(minutes=1))
    clocked = SimpleNamespace(clocked_time=T)
    assert ticks_around(clocked, T + dt.timedelta(seconds=1), 10) == (T, None)


def test_every_key_of_an_entry_shares_one_hash_tag_and_names_its_tick():
    base = entry_base("app:", "nightly report")
    assert base == "app:beat:{0ee50a0f37b6a1eec4bf1564f8b27802}"  # as every release names it
    assert base != entry_base("app:", "nightly report ") != entry_base("other:", "nightly report")
    ms = to_ms(T)
    assert claim_key("app:", "nightly report", T) == f"{base}:{ms}"
    assert run_key("app:", "nightly report", T) == f"{base}:run:{ms}"
    assert buffer_key("app:", "nightly report") == f"{base}:buffer"
    assert queue_key("app:", "nightly report") == f"{base}:queue"
    assert last_sent_key("app:", "nightly report") == f"{base}:last"
    assert late_key("app:", "nightly report") == f"{base}:late"
    keys = LockKeys("app:", "ab" * 16)
    assert cancel_key(keys) == f"{keys.base}:cancel"


@pytest.mark.parametrize("request_", [
    {},
    {ENTRY_HEADER: "nightly"},
    {TICK_HEADER: tick_name(T)},
    SimpleNamespace(headers={ENTRY_HEADER: "", TICK_HEADER: tick_name(T)}),
    SimpleNamespace(headers=None),
], ids=["plain", "no-tick", "no-entry", "empty-entry", "no-headers"])
def test_a_message_not_from_a_singleton_beat_runs_without_asking_redis(request_: Any):
    assert claim_tick_run(None, "app:", request_) is True  # type: ignore[arg-type]


def test_a_tick_header_that_is_not_a_time_is_let_through_with_a_warning(caplog):
    request = SimpleNamespace(id="t1", headers={ENTRY_HEADER: "nightly", TICK_HEADER: "soon"})
    with caplog.at_level("WARNING", logger="celery_singleton_lock"):
        assert claim_tick_run(None, "app:", request) is True  # type: ignore[arg-type]
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "Beat tick header 'soon' of entry 'nightly' is not a time: not checked")]


def test_a_lost_copy_of_a_message_not_from_a_singleton_beat_marks_nothing(caplog):
    with caplog.at_level("DEBUG", logger="celery_singleton_lock"):
        decide_lost_tick_run(None, "app:", {"id": "t1"})  # type: ignore[arg-type]
    assert caplog.records == []


def test_a_lost_copy_whose_tick_is_no_time_is_named_in_a_warning(caplog):
    request = SimpleNamespace(id="t1", headers={ENTRY_HEADER: "nightly", TICK_HEADER: "soon"})
    with caplog.at_level("DEBUG", logger="celery_singleton_lock"):
        decide_lost_tick_run(None, "app:", request)  # type: ignore[arg-type]
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "Could not mark the lost copy t1 of a beat tick as decided "
                    "(ValueError(\"Invalid isoformat string: 'soon'\"))")]


def dead_engine() -> Any:
    from celery_singleton_lock import SingletonConfig
    from celery_singleton_lock.engine.registry import connect
    from tests.support import dead_port

    config = SingletonConfig.defaults(f"redis://127.0.0.1:{dead_port()}/0")
    return connect(dataclasses_replace(config, redis_options={
        "socket_connect_timeout": 0.5, "retry_on_timeout": False}))


def test_redis_down_leaves_a_lost_copys_tick_undecided_and_says_so(caplog):
    request = SimpleNamespace(id="t1", headers={ENTRY_HEADER: "nightly",
                                                TICK_HEADER: tick_name(T)})
    with caplog.at_level("DEBUG", logger="celery_singleton_lock"):
        decide_lost_tick_run(dead_engine(), "app:", request)
    [said] = [r for r in caplog.records if "lost copy" in r.getMessage()]
    assert said.levelname == "WARNING"
    assert re.fullmatch(r"Could not mark the lost copy t1 of a beat tick as decided "
                        r"\(.*ConnectionError.*\)", said.getMessage()), said.getMessage()


def test_with_redis_down_no_cancel_is_requested():
    from celery import Celery

    from tests.support import dead_port

    app = Celery("ticks", set_as_current=False, broker=f"redis://127.0.0.1:{dead_port()}/0")
    app.conf.singleton_redis_options = {"socket_connect_timeout": 0.5,
                                        "retry_on_timeout": False}
    task = SimpleNamespace(app=app, singleton=SimpleNamespace(
        keys=LockKeys("app:", "ab" * 16), task_id="t1"))
    assert cancel_requested(task) is False


@pytest.mark.parametrize("look_only,level", [(False, "WARNING"), (True, "DEBUG")])
def test_redis_down_lets_the_tick_run_and_says_so_once_it_claims(caplog, look_only, level):
    """The task's own lock and its backend-error policy decide then; the look
    before the lock is a shortcut, so it only says so at DEBUG."""
    from celery_singleton_lock import SingletonConfig
    from celery_singleton_lock.engine.registry import connect
    from tests.support import dead_port

    config = SingletonConfig.defaults(f"redis://127.0.0.1:{dead_port()}/0")
    engine = connect(dataclasses_replace(config, redis_options={
        "socket_connect_timeout": 0.5, "retry_on_timeout": False}))
    request = SimpleNamespace(id="t1", headers={ENTRY_HEADER: "nightly",
                                                TICK_HEADER: tick_name(T)})
    with caplog.at_level("DEBUG", logger="celery_singleton_lock"):
        assert claim_tick_run(engine, "app:", request, look_only=look_only) is True
    [said] = [r for r in caplog.records if "beat tick" in r.getMessage()]
    assert said.levelname == level
    assert re.fullmatch(r"Could not check whether beat tick 2026-03-04T10:15:30\.250\+00:00 "
                        r"of 'nightly' already ran \(.*ConnectionError.*\)",
                        said.getMessage()), said.getMessage()


def test_a_tick_runs_once_its_own_id_again_and_another_copy_never(redis_server, r, caplog):
    """The run marker, a lost copy's and the cancel request, on a real
    redis-server (the one test here with a server)."""
    from celery import Celery

    from celery_singleton_lock import SingletonConfig
    from celery_singleton_lock.engine.registry import connect

    engine = connect(SingletonConfig.defaults(redis_server.url(2)))
    headers = {ENTRY_HEADER: "nightly", TICK_HEADER: tick_name(T)}
    first = SimpleNamespace(id="t1", headers=headers)
    copy = SimpleNamespace(id="t2", headers=headers)
    assert claim_tick_run(engine, "app:", copy, look_only=True) is True  # nothing yet
    assert r.get(run_key("app:", "nightly", T)) is None, "a look writes nothing"
    assert claim_tick_run(engine, "app:", first) is True
    marker = run_key("app:", "nightly", T)
    assert r.get(marker) == "t1"
    assert 3_500_000 < r.pttl(marker) <= worker_ticks.RUN_MARKER_TTL_MS == 3600 * 1000
    assert claim_tick_run(engine, "app:", first) is True  # its retry, a redelivery
    assert claim_tick_run(engine, "app:", first, look_only=True) is True
    with caplog.at_level("INFO", logger="celery_singleton_lock"):
        assert claim_tick_run(engine, "app:", copy) is False
    assert [r.getMessage() for r in caplog.records] == [
        "Dropped t2 of beat entry 'nightly' tick 2026-03-04T10:15:30.250+00:00: that tick was "
        "already taken by t1 (it started, or was refused for good)"]
    assert claim_tick_run(engine, "app:", copy, look_only=True) is False
    mapping = {"id": "t3", ENTRY_HEADER: "nightly", TICK_HEADER: tick_name(T)}
    assert claim_tick_run(engine, "app:", mapping) is False
    later = {ENTRY_HEADER: "nightly", TICK_HEADER: tick_name(T + dt.timedelta(minutes=1))}
    assert claim_tick_run(engine, "app:", SimpleNamespace(id="t4", headers=later)) is True
    assert r.get(marker) == "t1"
    # a message without an id claims with an empty one
    anonymous = {ENTRY_HEADER: "hourly", TICK_HEADER: tick_name(T)}
    assert claim_tick_run(engine, "app:", SimpleNamespace(headers=anonymous)) is True
    assert r.get(run_key("app:", "hourly", T)) == ""
    # a lost copy (its process died before its lock): its tick is decided for it,
    # unless a copy decided it already
    lost = {ENTRY_HEADER: "nightly", TICK_HEADER: tick_name(T + dt.timedelta(hours=1))}
    with caplog.at_level("INFO", logger="celery_singleton_lock"):
        caplog.clear()
        decide_lost_tick_run(engine, "app:", SimpleNamespace(id="t5", headers=lost))
        decide_lost_tick_run(engine, "app:", SimpleNamespace(id="t6", headers=lost))
        decide_lost_tick_run(engine, "app:", {"id": "t7", **headers})
    lost_marker = run_key("app:", "nightly", T + dt.timedelta(hours=1))
    assert r.get(lost_marker) == "t5" and r.pttl(lost_marker) > 3_500_000
    assert r.get(marker) == "t1"
    assert [r.getMessage() for r in caplog.records] == [
        "Beat entry 'nightly' tick 2026-03-04T11:15:30.250+00:00: its copy t5 was lost before "
        "it took its lock; the tick is decided"]
    # overlap "cancel_other": the beat names the run to stop by its task id
    app = Celery("ticks", set_as_current=False, broker=redis_server.url(2))
    keys = LockKeys("app:", "cd" * 16)
    task = SimpleNamespace(app=app, singleton=SimpleNamespace(keys=keys, task_id="t1"))
    assert cancel_requested(task) is False
    r.set(cancel_key(keys), "t0")
    assert cancel_requested(task) is False, "another run was asked"
    r.set(cancel_key(keys), "t1")
    assert cancel_requested(task) is True
    unnamed = SimpleNamespace(app=app, singleton=SimpleNamespace(keys=keys, task_id=""))
    r.set(cancel_key(keys), "")
    assert cancel_requested(unnamed) is False, "a run without a task id is never the one"
