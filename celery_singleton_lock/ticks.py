"""Beat ticks: their names, their keys in Redis, and the worker's check that a tick runs once.

A tick is named by its entry and its *nominal* fire time in UTC (never the
moment a process woke up), so every beat computes the same names from its
clock alone. The scheduler (:mod:`.beat`) claims each tick before sending it;
the worker side, :func:`claim_tick_run`, makes a ``SingletonTask`` sent by beat
run at most once per (entry, tick) even when two beats both sent it because a
claim was lost (a Redis failover that dropped the key).
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any, Mapping, Optional

import redis
from celery.schedules import crontab
from celery.schedules import schedule as interval_schedule

from .engine import LockEngine
from .keys import LockKeys, digest
from .wallclock import crontab_fire_after

logger = logging.getLogger("celery_singleton_lock")

UTC = dt.timezone.utc

#: headers on every message a singleton beat sends
ENTRY_HEADER = "singleton_beat_entry"
TICK_HEADER = "singleton_beat_tick"
BEAT_HEADER = "singleton_beat_id"
#: django-celery-beat's header naming the periodic task; kept, or set to the entry name
PERIODIC_TASK_HEADER = "periodic_task_name"
#: Celery's own mark of a beat message (set by Celery 5.4 and later; set here on 5.3 too)
BEAT_TASK_HEADER = "celery_beat_task"

#: the request fields that name a beat tick's run marker
BEAT_HEADERS_READ = (ENTRY_HEADER, TICK_HEADER, "id")

#: how long the worker remembers that a tick ran (a second copy of it arriving
#: later than this is no longer recognised)
RUN_MARKER_TTL_MS = 3600 * 1000


# -- tick naming (pure: no Redis, no clock of its own) ---------------------------------


def to_ms(when: dt.datetime) -> int:
    """Milliseconds since the epoch of an aware datetime."""
    return (when - _EPOCH) // dt.timedelta(milliseconds=1)


def from_ms(ms: int) -> dt.datetime:
    return _EPOCH + dt.timedelta(milliseconds=ms)


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=UTC)


def tick_name(tick: dt.datetime) -> str:
    """The tick as it travels in the header: ISO 8601, UTC, milliseconds."""
    return tick.astimezone(UTC).isoformat(timespec="milliseconds")


def _aware(when: dt.datetime) -> dt.datetime:
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


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
    ref = _aware(ref)
    if isinstance(sched, crontab):
        # walked as wall times in the crontab's zone, each read as instants:
        # repeated and missing wall times (daylight saving) by :mod:`.wallclock`'s rules
        return crontab_fire_after(sched, ref)
    clocked = getattr(sched, "clocked_time", None)
    if isinstance(clocked, dt.datetime):  # django-celery-beat's one-off schedule
        fire = _aware(clocked).astimezone(UTC)
        return fire if fire > ref else None
    # solar and other schedules: their estimate is relative to their own now()
    remaining: dt.timedelta = sched.remaining_estimate(ref)
    nxt = _aware(sched.now()).astimezone(UTC) + remaining
    return nxt if nxt > ref else None


def tick_after(sched: Any, tick: dt.datetime) -> Optional[dt.datetime]:
    """The nominal fire time after ``tick`` (None: never again)."""
    if isinstance(sched, interval_schedule) and not isinstance(sched, crontab):
        return interval_ticks(sched.run_every, _aware(tick))[1]
    return next_fire_after(sched, tick)


def ticks_around(sched: Any, now: dt.datetime, window: float
                 ) -> tuple[Optional[dt.datetime], Optional[dt.datetime]]:
    """(latest fire time in ``(now - window, now]`` or None, first fire time after ``now``).

    Only the latest fire time counts: after a downtime the ticks before it are
    never sent (no replay storm), and one older than the window is not either.
    """
    now = _aware(now).astimezone(UTC)
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


# -- Redis keys -----------------------------------------------------------------------


def entry_base(prefix: str, entry_name: str) -> str:
    """``<prefix>beat:{<digest of the entry name>}``: one hash tag for all of an entry's keys."""
    return f"{prefix}beat:{{{digest(['beat', entry_name])}}}"


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
    """String key: the tick after one sent late, and until when it waits for
    that one's run (overlap "skip"; ``<next tick ms> <deadline ms>``)."""
    return f"{entry_base(prefix, entry_name)}:late"


def cancel_key(keys: LockKeys) -> str:
    """String key: the task id a beat asked to stop (overlap "cancel_other"), by the task's lock."""
    return f"{keys.base}:cancel"


def run_key(prefix: str, entry_name: str, tick: dt.datetime) -> str:
    """String key: which task id ran this tick on a worker (value: the task id)."""
    return f"{entry_base(prefix, entry_name)}:run:{to_ms(tick)}"


# -- worker side ----------------------------------------------------------------------


def _header(request: Any, name: str) -> Any:
    if isinstance(request, Mapping):
        return request.get(name)
    value = getattr(request, name, None)
    if value is None:
        headers = getattr(request, "headers", None)
        if isinstance(headers, Mapping):
            value = headers.get(name)
    return value


def _tick_run_key(prefix: str, request: Any) -> Optional[tuple[str, str, str, str]]:
    """(run marker key, task id, entry, tick) of a message sent by a singleton
    beat; None for any other message (raises ValueError for a tick that is no time)."""
    entry = _header(request, ENTRY_HEADER)
    tick = _header(request, TICK_HEADER)
    if not entry or not tick:
        return None
    task_id = str(_header(request, "id") or "")
    key = run_key(prefix, str(entry), _aware(dt.datetime.fromisoformat(str(tick))))
    return key, task_id, str(entry), str(tick)


def claim_tick_run(engine: LockEngine, prefix: str, request: Any, *,
                   look_only: bool = False) -> bool:
    """True when this execution is the first of its (entry, tick): let it run.

    ``request`` is the task's request (or a mapping of its headers). A message
    not sent by a singleton beat is always True, without a round trip. The
    same task id is True again (its own retry, a redelivery after a crash);
    another id for a tick that already ran is False: drop it. If Redis cannot
    answer, True: the task's own lock and its backend-error policy decide.
    ``engine``: the app's lock engine (with Redlock, the marker goes on a
    majority of the masters).

    The task writes the marker once its lock is granted (or its run was
    decided against), so a marker beside a free lock means that tick's run
    ended: beat's ``buffer_all`` sends the next tick on it. ``look_only``: a
    ``GET`` before the lock, so a copy of a tick that already ran neither
    takes the key nor waits for it.
    """
    try:
        found = _tick_run_key(prefix, request)
    except ValueError:
        logger.warning("Beat tick header %r of entry %r is not a time: not checked",
                       _header(request, TICK_HEADER), _header(request, ENTRY_HEADER))
        return True
    if found is None:
        return True
    key, task_id, entry, tick = found
    try:
        if look_only:
            raw = engine.client.get(key)
            holder = "" if raw is None else str(raw)
            first = not holder
        else:
            first, holder = engine.claim(key, task_id, RUN_MARKER_TTL_MS)
    except redis.RedisError as exc:
        # the look is a shortcut (with Redlock, on the first master only): the
        # claim after the grant decides, and warns if it cannot
        (logger.debug if look_only else logger.warning)(
            "Could not check whether beat tick %s of %r already ran (%r)", tick, entry, exc)
        return True
    if first or holder == task_id:
        return True
    # the marker is written once a copy's lock is granted or its run decided
    # against: that copy may still be running, or was skipped for good
    logger.info("Dropped %s of beat entry %r tick %s: that tick was already taken by %s "
                "(it started, or was refused for good)", task_id, entry, tick, holder)
    return False


def decide_lost_tick_run(engine: LockEngine, prefix: str, request: Any) -> None:
    """A copy of a beat tick that will not run again (its pool process died, a
    hard time limit, a terminate) may never have reached its lock, so it never
    wrote the tick's run marker: write it now (``SET NX``: a marker already
    there stays). The tick is decided, and beat's ``buffer_all`` sends the next
    one once the lock is free, instead of waiting for this copy until
    ``...:last`` expires. Called by the worker's main process before it frees
    the dead copy's lock."""
    try:
        found = _tick_run_key(prefix, request)
        if found is None:
            return
        key, task_id, entry, tick = found
        first, _ = engine.claim(key, task_id, RUN_MARKER_TTL_MS)
    except (ValueError, redis.RedisError) as exc:
        logger.warning("Could not mark the lost copy %s of a beat tick as decided (%r)",
                       _header(request, "id"), exc)
        return
    if first:
        logger.info("Beat entry %r tick %s: its copy %s was lost before it took its lock; "
                    "the tick is decided", entry, tick, task_id)
