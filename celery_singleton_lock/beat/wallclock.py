"""Crontab fire times as instants, across clock changes (daylight saving).

A crontab names wall-clock times in its zone (``crontab.tz``: the app's
``timezone``). Twice a year a zone with daylight saving has wall times that
occur twice (autumn: 01:00-01:59 in America/New_York) or never (spring:
02:00-02:59). Celery's own ``remaining_delta`` adds a wall-clock delta to the
last run and maps any repeated wall time to its first occurrence, so beat
loses the second pass through the repeated hour; the tick found from one
minute before a spring-gap time is the next day's.

Here the fire times are walked as wall times and each is read as instants,
by these rules:

* **Repeated wall time** (autumn): an entry whose hour field is every hour
  (``*/15``, ``minute=0``, ``minute=30``: interval-like) fires at both
  instants, so it runs once per real period through the repeated hour. An
  entry with chosen hours (``hour=1``, ``hour="0-5"``) fires once, at the
  first occurrence (the earlier instant, still on summer time).
* **Wall time that does not exist** (spring): read with the offset in force
  before the change (Python's ``fold=0``, what Celery's beat does too), so
  02:30 fires at 03:30 summer time, once. An interval-like entry's gap times
  land on times it fires at anyway (02:15 is 03:15), and fire once there.

The result is an instant (UTC), and a tick is named by its instant
(:mod:`.ticks`), so beats whose process zones differ name the same ticks.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Optional

UTC = dt.timezone.utc

#: how far ahead a fire time is looked for (a 29 February entry fires every 4 years)
_MAX_DAYS = 366 * 5
_OFFSET_SAMPLES = tuple(dt.timedelta(hours=12 * k) for k in range(-2, 3))


def _zone(sched: Any) -> dt.tzinfo:
    tz = sched.tz
    name = getattr(tz, "zone", None)  # a pytz zone: the same rules from zoneinfo
    if isinstance(name, str) and hasattr(tz, "localize"):
        from zoneinfo import ZoneInfo

        return ZoneInfo(name)
    return tz  # type: ignore[no-any-return]


def _offsets(tz: dt.tzinfo, around: dt.datetime) -> list[dt.timedelta]:
    """The zone's UTC offsets within a day of the instant ``around``."""
    return [(around + k).astimezone(tz).utcoffset() or dt.timedelta(0)
            for k in _OFFSET_SAMPLES]


def instants(wall: dt.datetime, tz: dt.tzinfo, every_hour: bool) -> list[dt.datetime]:
    """The instants (UTC) a crontab fires at for the naive wall time ``wall``
    in ``tz`` (the rules in the module's docstring)."""
    first = wall.replace(tzinfo=tz, fold=0).astimezone(UTC)
    second = wall.replace(tzinfo=tz, fold=1).astimezone(UTC)
    if first == second:
        return [first]
    if first.astimezone(tz).replace(tzinfo=None) != wall:
        return [first]  # in the spring gap: the offset before the change
    return [first, second] if every_hour else [first]


def _day_matches(sched: Any, day: dt.date) -> bool:
    # Celery's rule: month, day of month and day of week must all match (0 is Sunday)
    return (day.month in sched.month_of_year and day.day in sched.day_of_month
            and day.isoweekday() % 7 in sched.day_of_week)


def crontab_fire_after(sched: Any, ref: dt.datetime) -> Optional[dt.datetime]:
    """The first fire time of crontab ``sched`` strictly after the aware
    ``ref``, in UTC; None when none comes within five years."""
    tz = _zone(sched)
    ref = ref.astimezone(UTC)
    hours = sorted(sched.hour)
    minutes = sorted(sched.minute)
    every_hour = len(hours) >= 24
    # a wall time w fires at w - offset(w): none before ref + the smallest offset is after ref
    start = (ref + min(_offsets(tz, ref))).replace(tzinfo=None)
    best: Optional[dt.datetime] = None
    stop: Optional[dt.datetime] = None
    first_day = start.date()
    for n in range(_MAX_DAYS):
        day = first_day + dt.timedelta(days=n)
        if stop is not None and dt.datetime.combine(day, dt.time()) > stop:
            break
        if not _day_matches(sched, day):
            continue
        for hour in hours:
            if n == 0 and hour < start.hour:
                continue  # the first day's hours before the start: none is after ref
            for minute in minutes:
                wall = dt.datetime.combine(day, dt.time(hour, minute))
                if wall < start:
                    continue
                if stop is not None and wall > stop:
                    return best
                for when in instants(wall, tz, every_hour):
                    if when > ref and (best is None or when < best):
                        best = when
                        # a later wall time fires earlier only across an offset change
                        offsets = _offsets(tz, when)
                        stop = wall + (max(offsets) - min(offsets))
    return best
