"""A beat tick's run, as the worker sees it: each tick runs once.

A tick is named by its entry and its *nominal* fire time in UTC (never the
moment a process woke up), so every beat and every worker computes the same
names from the message alone. A singleton beat (:mod:`..beat`) puts them on
each tick's message; here the worker reads them: :func:`claim_tick_run` makes a
``SingletonTask`` sent by beat run at most once per (entry, tick) even when
two beats both sent it because a claim was lost (a Redis failover that dropped
the key), and :func:`cancel_requested` tells a running one that a beat asked
it to stop. The beat reads the run markers written here (:mod:`..beat.overlap`);
the worker imports nothing of the beat.
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any, Mapping, Optional

import redis

from ..engine.base import Engine
from ..engine.registry import engine_for
from ..keys import LockKeys, digest

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

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=UTC)


# -- tick naming (pure: no Redis, no clock of its own) ---------------------------------


def to_ms(when: dt.datetime) -> int:
    """Milliseconds since the epoch of an aware datetime."""
    return (when - _EPOCH) // dt.timedelta(milliseconds=1)


def from_ms(ms: int) -> dt.datetime:
    return _EPOCH + dt.timedelta(milliseconds=ms)


def tick_name(tick: dt.datetime) -> str:
    """The tick as it travels in the header: ISO 8601, UTC, milliseconds."""
    return tick.astimezone(UTC).isoformat(timespec="milliseconds")


def aware(when: dt.datetime) -> dt.datetime:
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


# -- Redis keys -----------------------------------------------------------------------


def entry_base(prefix: str, entry_name: str) -> str:
    """``<prefix>beat:{<digest of the entry name>}``: one hash tag for all of an entry's keys."""
    return f"{prefix}beat:{{{digest(['beat', entry_name])}}}"


def run_key(prefix: str, entry_name: str, tick: dt.datetime) -> str:
    """String key: which task id ran this tick on a worker (value: the task id)."""
    return f"{entry_base(prefix, entry_name)}:run:{to_ms(tick)}"


def cancel_key(keys: LockKeys) -> str:
    """String key: the task id a beat asked to stop (overlap "cancel_other"), by the task's lock."""
    return f"{keys.base}:cancel"


# -- the run of a tick ----------------------------------------------------------------


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
    key = run_key(prefix, str(entry), aware(dt.datetime.fromisoformat(str(tick))))
    return key, task_id, str(entry), str(tick)


def claim_tick_run(engine: Engine, prefix: str, request: Any, *,
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
            holder = engine.read(key) or ""
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


def decide_lost_tick_run(engine: Engine, prefix: str, request: Any) -> None:
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


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def cancel_requested(task: Any) -> bool:
    """True when a beat entry with overlap ``cancel_other`` asked this run to stop.

    Call it from a running ``SingletonTask`` (``cancel_requested(self)``) as
    often as stopping early matters; one Redis ``GET``. Celery's own revoke
    without ``terminate`` does nothing to a running task, so this is how the
    body learns of the request: return (or raise) when it is True.
    """
    lock = task.singleton
    try:
        value = engine_for(task.app).read(cancel_key(lock.keys))
    except redis.RedisError:
        return False
    return value is not None and bool(lock.task_id) and _text(value) == lock.task_id
