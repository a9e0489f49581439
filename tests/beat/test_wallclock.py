"""Crontab ticks across daylight-saving changes (no servers, no clock).

Every fire time of a day is walked with :func:`ticks.tick_after`, the
function the beats use, and compared with the instants the rules of
:mod:`celery_singleton_lock.beat.wallclock` name. Away from a change, the ticks are
Celery's own (checked against ``crontab.remaining_delta`` in UTC).
"""

from __future__ import annotations

import datetime as dt
import random

import pytest
from celery import Celery
from celery.schedules import crontab

from celery_singleton_lock.beat.ticks import tick_after, ticks_around

pytestmark = pytest.mark.unit  # no server, no worker: the fast run (-m unit)

UTC = dt.timezone.utc


def utc(*args: int) -> dt.datetime:
    return dt.datetime(*args, tzinfo=UTC)  # type: ignore[misc]


def app_in(zone: str) -> Celery:
    app = Celery(set_as_current=False)
    app.conf.timezone = zone
    return app


def walk(sched: crontab, start: dt.datetime, end: dt.datetime) -> list[dt.datetime]:
    """Every tick in (start, end], as the beats step from one to the next."""
    ticks = []
    tick = tick_after(sched, start)
    while tick is not None and tick <= end:
        ticks.append(tick)
        tick = tick_after(sched, tick)
    return ticks


def every(start: dt.datetime, end: dt.datetime, minutes: int) -> list[dt.datetime]:
    out, t = [], start
    while t <= end:
        out.append(t)
        t += dt.timedelta(minutes=minutes)
    return out


def test_fall_back_interval_entries_run_once_per_real_period_through_the_repeated_hour():
    """New York, 2026-11-01: 01:00-01:59 happens twice (05:00-05:59 and
    06:00-06:59 UTC). */15 fires every 15 real minutes; Celery's own beat
    loses 06:00-06:45 UTC."""
    app = app_in("America/New_York")
    quarter = walk(crontab(minute="*/15", app=app), utc(2026, 11, 1, 3, 59), utc(2026, 11, 1, 8))
    assert quarter == every(utc(2026, 11, 1, 4), utc(2026, 11, 1, 8), 15)
    hourly = walk(crontab(minute=30, app=app), utc(2026, 11, 1, 3), utc(2026, 11, 1, 9))
    assert hourly == every(utc(2026, 11, 1, 3, 30), utc(2026, 11, 1, 8, 30), 60)


def test_fall_back_a_chosen_hour_runs_once_at_its_first_occurrence():
    app = app_in("America/New_York")
    at_0130 = walk(crontab(minute=30, hour=1, app=app), utc(2026, 10, 31), utc(2026, 11, 3))
    # 01:30 EDT on the 31st and the 1st (05:30 UTC), then 01:30 EST (06:30 UTC)
    assert at_0130 == [utc(2026, 10, 31, 5, 30), utc(2026, 11, 1, 5, 30),
                       utc(2026, 11, 2, 6, 30)]
    berlin = app_in("Europe/Berlin")  # 2026-10-25: 02:00-02:59 twice (00:00-01:59 UTC)
    at_0215 = walk(crontab(minute=15, hour=2, app=berlin), utc(2026, 10, 24), utc(2026, 10, 27))
    assert at_0215 == [utc(2026, 10, 24, 0, 15), utc(2026, 10, 25, 0, 15),
                       utc(2026, 10, 26, 1, 15)]


def test_spring_forward_a_time_in_the_gap_runs_once_an_hour_later():
    """New York, 2026-03-08: 02:00-02:59 does not exist. 02:30 runs at 03:30
    EDT (07:30 UTC), as Celery's beat does; hourly entries lose nothing."""
    app = app_in("America/New_York")
    at_0230 = walk(crontab(minute=30, hour=2, app=app), utc(2026, 3, 7), utc(2026, 3, 10))
    assert at_0230 == [utc(2026, 3, 7, 7, 30), utc(2026, 3, 8, 7, 30), utc(2026, 3, 9, 6, 30)]
    # the tick the beats look for from the moment it is due (the library skipped it before)
    assert ticks_around(crontab(minute=30, hour=2, app=app), utc(2026, 3, 8, 7, 30, 1),
                        60)[0] == utc(2026, 3, 8, 7, 30)
    # 02:30 and 03:30 both land on 07:30 UTC: once
    both = walk(crontab(minute=30, hour="2,3", app=app), utc(2026, 3, 8), utc(2026, 3, 8, 23))
    assert both == [utc(2026, 3, 8, 7, 30)]
    quarter = walk(crontab(minute="*/15", app=app), utc(2026, 3, 8, 5, 59), utc(2026, 3, 8, 9))
    assert quarter == every(utc(2026, 3, 8, 6), utc(2026, 3, 8, 9), 15)
    gap_hour = walk(crontab(minute="*/20", hour=2, app=app), utc(2026, 3, 8), utc(2026, 3, 9))
    assert gap_hour == [utc(2026, 3, 8, 7), utc(2026, 3, 8, 7, 20), utc(2026, 3, 8, 7, 40)]


def test_the_ticks_are_the_same_whatever_the_zone_the_instant_is_given_in():
    app = app_in("America/New_York")
    sched = crontab(minute="*/15", app=app)
    tokyo = dt.timezone(dt.timedelta(hours=9))
    ref = utc(2026, 11, 1, 5, 50)
    assert tick_after(sched, ref) == tick_after(sched, ref.astimezone(tokyo)) == utc(
        2026, 11, 1, 6)


@pytest.mark.parametrize("seed", range(3))
def test_away_from_a_change_the_ticks_are_celerys(seed: int):
    """In UTC (no change) Celery's remaining_delta is right: the same ticks."""
    rnd = random.Random(seed)
    app = app_in("UTC")
    for _ in range(60):
        spec = {
            "minute": rnd.choice(["*", "*/7", "0", "15,45", "59"]),
            "hour": rnd.choice(["*", "3", "0-5", "*/6", "23"]),
            "day_of_week": rnd.choice(["*", "1", "sat,sun"]),
            "day_of_month": rnd.choice(["*", "1", "15-20", "31"]),
        }
        sched = crontab(app=app, **spec)
        ref = utc(2025, 1, 1) + dt.timedelta(minutes=rnd.randrange(0, 2 * 365 * 24 * 60),
                                             seconds=rnd.randrange(60))
        sched.nowfun = lambda ref=ref: ref
        start, delta, _ = sched.remaining_delta(ref)
        celerys = (start + delta).astimezone(UTC)
        assert tick_after(sched, ref) == celerys, (spec, ref)
