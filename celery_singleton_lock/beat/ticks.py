"""Beat ticks: when an entry fires, and the keys a beat claims and queues them by.

Every beat computes the same ticks from its clock alone (:func:`ticks_around`,
:func:`interval_ticks`), named as the worker names them
(:mod:`..worker.ticks`); the scheduler (:mod:`.scheduler`) claims each tick
(:func:`claim_key`) before sending it, and the overlap modes keep the ticks
waiting for a run (:mod:`.overlap`).
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any, Optional

from celery.schedules import crontab
from celery.schedules import schedule as interval_schedule

from ..worker.ticks import UTC, aware, entry_base, from_ms, to_ms
from .wallclock import crontab_fire_after

logger = logging.getLogger("celery_singleton_lock")


# -- when an entry fires ---------------------------------------------------------------


def interval_ticks(period: dt.timedelta, now: dt.datetime) -> tuple[dt.datetime, dt.datetime]:
    """(latest tick not after ``now``, next tick) of an interval aligned to the epoch.

    ``floor(now / period) * period``: every beat computes the same ticks from
    its clock alone, whenever it started. Stock Celery counts from each
    process's own last run, so two processes would name different ticks.
    """
    period_ms = max(period // dt.timedelta(milliseconds=1), 1)
    latest = to_ms(now) // period_ms * period_ms
    return from_ms(latest), from_ms(latest + period_ms)


def next_fire_after(sched: Any, ref: dt.datetime) -> Optional[dt.datetime]:
    """The first nominal fire time strictly after ``ref``, in UTC (None: never again)."""
    ref = aware(ref)
    if isinstance(sched, crontab):
        # walked as wall times in the crontab's zone, each read as instants:
        # repeated and missing wall times (daylight saving) by :mod:`.wallclock`'s rules
        return crontab_fire_after(sched, ref)
    clocked = getattr(sched, "clocked_time", None)
    if isinstance(clocked, dt.datetime):  # django-celery-beat's one-off schedule
        fire = aware(clocked).astimezone(UTC)
        return fire if fire > ref else None
    # solar and other schedules: computed, so named by a value every beat gets
    nxt = _estimated_after(sched, ref)
    if nxt is None:
        return None
    named = _named(sched, nxt)
    if named > ref:
        return named
    # the event after ref rounds down onto ref itself: the one after it
    later = _estimated_after(sched, nxt + dt.timedelta(seconds=1))
    return None if later is None else _named(sched, later)


def _estimated_after(sched: Any, ref: dt.datetime) -> Optional[dt.datetime]:
    """The schedule's own estimate of its first fire time after ``ref`` (it
    counts from its own now())."""
    remaining: dt.timedelta = sched.remaining_estimate(ref)
    nxt = aware(sched.now()).astimezone(UTC) + remaining
    return nxt if nxt > ref else None


#: a computed fire time is asked again from this long before it, to the hour
_SETTLE_FROM = dt.timedelta(hours=12)


def _named(sched: Any, fire: dt.datetime) -> dt.datetime:
    """One name for a computed fire time (a sunrise), whichever beat computes it.

    A solar event is found by a numerical search that starts where it is
    asked from: the same sunrise asked from two moments came out 0.6 ms
    apart, which would name two ticks and send it twice. So it is asked again
    from a moment every beat derives alike (12 hours before it, to the hour:
    a solar event of one kind comes once a day), and named to the second. A
    schedule that gives another time from there (one counted from where it
    is asked, a last run) is named as it said.
    """
    start = (fire - _SETTLE_FROM).replace(minute=0, second=0, microsecond=0)
    settled = _estimated_after(sched, start)
    if settled is None or abs(settled - fire) >= dt.timedelta(seconds=1):
        return fire
    whole = settled.replace(microsecond=0)
    return whole + dt.timedelta(seconds=1) if settled.microsecond >= 500_000 else whole


def tick_after(sched: Any, tick: dt.datetime) -> Optional[dt.datetime]:
    """The nominal fire time after ``tick`` (None: never again)."""
    if isinstance(sched, interval_schedule) and not isinstance(sched, crontab):
        return interval_ticks(sched.run_every, aware(tick))[1]
    return next_fire_after(sched, tick)


def ticks_around(sched: Any, now: dt.datetime, window: float
                 ) -> tuple[Optional[dt.datetime], Optional[dt.datetime]]:
    """(latest fire time in ``(now - window, now]`` or None, first fire time after ``now``).

    Only the latest fire time counts: after a downtime the ticks before it are
    never sent (no replay storm), and one older than the window is not either.
    """
    now = aware(now).astimezone(UTC)
    if isinstance(sched, interval_schedule) and not isinstance(sched, crontab):
        latest, following = interval_ticks(sched.run_every, now)
        if (now - latest).total_seconds() > window:
            return None, following
        return latest, following
    candidate: Optional[dt.datetime] = None
    nxt = next_fire_after(sched, now - dt.timedelta(seconds=window))
    # a crontab fires at most once a minute: a bounded walk through the window
    while nxt is not None and nxt <= now:
        candidate = nxt
        nxt = next_fire_after(sched, nxt)
    return candidate, nxt


# -- the keys a beat claims and queues ticks by ---------------------------------------------


def claim_key(prefix: str, entry_name: str, tick: dt.datetime) -> str:
    """String key: which beat sends this tick (value: the beat id)."""
    return f"{entry_base(prefix, entry_name)}:{to_ms(tick)}"


def buffer_key(prefix: str, entry_name: str) -> str:
    """String key: the tick waiting for the running one (overlaps "buffer_one",
    "cancel_other", "terminate_other")."""
    return f"{entry_base(prefix, entry_name)}:buffer"


def queue_key(prefix: str, entry_name: str) -> str:
    """Sorted set: the ticks waiting in order (overlap "buffer_all"; score and member: tick ms)."""
    return f"{entry_base(prefix, entry_name)}:queue"


def last_sent_key(prefix: str, entry_name: str) -> str:
    """String key: the last tick sent of a "buffer_all" entry (tick ms): the next waits for it."""
    return f"{entry_base(prefix, entry_name)}:last"


def late_key(prefix: str, entry_name: str) -> str:
    """String key: the tick after one sent late, until when it waits for that
    one's run, and the late tick (overlap "skip"; ``<next tick ms> <deadline
    ms> <late tick ms>``)."""
    return f"{entry_base(prefix, entry_name)}:late"
