"""RedBeat without its leader: any number of RedBeat beats, each tick sent once.

``celery -A app beat -S celery_singleton_lock.beat.redbeat:SingletonRedBeatScheduler``

celery-redbeat keeps the schedule in Redis (a hash per entry, ``definition``
and ``meta``; a sorted set of the entries by their next due time) and lets
one beat at a time send, the holder of its lock ``<prefix>:lock``: the other
beats wait to take it, so a leader killed with ``kill -9`` stops every tick
until its lock times out (``redbeat_lock_timeout``, 25 minutes by default).

Here no beat takes that lock. Every beat reads RedBeat's entries from Redis at
each of its loops, as RedBeat's leader does (so an entry added, changed,
disabled or deleted through RedBeat's API is followed by every beat), and
each due tick goes through :class:`.scheduler.SingletonSchedulerMixin`: named
by its nominal time, claimed in one ``SET NX``, sent by the beat that won the
claim, under the entry's overlap mode. The winner alone writes the entry's
``meta`` as RedBeat does (``last_run_at``, ``total_run_count``) and its score
in the sorted set, with ``last_run_at`` the nominal tick, so every beat finds
the next tick due at its nominal time.

RedBeat replaces Celery's ``Scheduler.tick`` with its own loop over the entries
due now; this module takes its per-entry step (``maybe_due``) and its listing
of every entry for the overlap modes' waiting ticks.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from typing import Any, Iterable, Optional

from redbeat.schedulers import RedBeatScheduler, get_redis

from ..worker.ticks import aware
from .scheduler import SingletonSchedulerMixin

logger = logging.getLogger("celery_singleton_lock")

#: how long the list of every entry (read for the overlap modes' waiting
#: ticks, one ZRANGE and a pipelined read of each entry) is kept
ENTRIES_FOR = 1.0


class SingletonRedBeatScheduler(SingletonSchedulerMixin, RedBeatScheduler):  # type: ignore[misc]
    """RedBeat's scheduler, its entries and their storage as they are, with
    per-tick claims instead of its leader lock: every beat stays active."""

    def __init__(self, app: Any, lock_key: Optional[str] = None, lock_timeout: Any = None,
                 **kwargs: Any) -> None:
        self._entries: tuple[float, list[Any]] = (0.0, [])
        super().__init__(app, lock_key=lock_key, lock_timeout=lock_timeout, **kwargs)
        # No leader: RedBeat's beat_init handler takes the lock only when the
        # scheduler has a lock key, and its tick extends it only then.
        self.lock_key = None

    @property
    def info(self) -> str:
        return "\n".join([*str(super().info).splitlines(),
                          "       . no leader lock: each tick is claimed by one beat"])

    def singleton_entries(self) -> Iterable[Any]:
        """Every entry in RedBeat's schedule, read again at most every
        :data:`ENTRIES_FOR` seconds (RedBeat's ``schedule`` holds only the
        entries due now and the next one)."""
        read_at, entries = self._entries
        if time.monotonic() - read_at < ENTRIES_FOR:
            return entries
        client = get_redis(self.app)
        keys = client.zrange(self.app.redbeat_conf.schedule_key, 0, -1)
        with client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hget(key, "definition")
            definitions = pipe.execute()
        entries = []
        for definition in definitions:
            if not definition:
                continue  # deleted since: RedBeat's own loop drops it from the set
            try:
                entries.append(self.Entry(app=self.app, **self.Entry.decode_definition(
                    definition)))
            except Exception as exc:  # RedBeat's loop logs and drops what it cannot read
                logger.debug("RedBeat entry not read (%r)", exc)
        self._entries = (time.monotonic(), entries)
        return entries

    def maybe_due(self, entry: Any, producer: Any = None, **kwargs: Any) -> float:
        """RedBeat's step for one entry of its loop: the tick, its claim, its
        overlap mode, then the send (:meth:`SingletonSchedulerMixin.apply_entry`).
        Returns the seconds until the entry is looked at again."""
        due, delay = self.is_due(entry)
        if due:
            self.apply_entry(entry, producer=producer)
        return float(delay)

    def _count_run(self, entry: Any, tick: dt.datetime) -> None:
        """RedBeat's own ``meta`` write and score (its entry's ``next``), with
        ``last_run_at`` the nominal tick, never moved back (a buffered tick
        sent after a newer one), so the entry is due again at its next tick
        in every beat; ``total_run_count`` counted by the sending beat only."""
        try:
            stored: Any = self.Entry.from_key(entry.key, app=self.app)
        except KeyError:
            return  # deleted meanwhile: nothing to count on
        last = stored.last_run_at
        if last is not None and aware(last) > tick:
            tick = aware(last)
        try:
            stored._next_instance(last_run_at=tick)
        except Exception as exc:
            logger.warning("Beat entry %r: its run could not be counted (%r)", entry.name, exc)
