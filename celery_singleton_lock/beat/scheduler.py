"""Beat without a leader: any number of ``celery beat`` processes, each tick sent once.

Every beat stays active. A tick is named by its entry and its *nominal* fire
time in UTC (never the moment a process woke up), and the first beat to claim
that name in Redis sends it; the others see the claim and move on. A beat that
dies costs nothing: the next tick is claimed by whichever beat gets there first,
with no lease to wait out (docs/beat.md).

``celery -A app beat -S celery_singleton_lock.beat:SingletonScheduler`` keeps
stock Celery's file persistence; :class:`SingletonSchedulerMixin` goes in front
of any other scheduler class (django-celery-beat's ``DatabaseScheduler``, ...).

The mixin decides *which* beat sends a tick; whether a tick exists at all
stays the wrapped scheduler's: the entry's own due-check (django-celery-beat's
``one_off``, ``start_time``, ``expires``, enabled state, or whatever a custom
entry class adds) is asked at every check, its schedule's timing answered by
the tick (:meth:`SingletonSchedulerMixin.is_due`). Only the beat that sends a
tick advances the entry's last run and run count.

Tick names, their keys and the worker's check that each tick runs once are in
:mod:`.ticks`.

What a beat does with a tick whose previous run still runs (overlap modes,
buffered ticks) is in :mod:`.overlap`.

Over 500 lines: one idea, the scheduler mixin: the hooks of Celery's scheduler
it takes over and the wrapped scheduler's entries whose rules and counts it
keeps (django-celery-beat's rows among them); tick naming and the overlap modes
are in their own modules.
"""

from __future__ import annotations

import datetime as dt
import heapq
import logging
import os
import socket
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

import redis
from celery.beat import PersistentScheduler, event_t
from celery.schedules import crontab, schedstate
from celery.schedules import schedule as interval_schedule

from ..checks.permissions import beat_denied, beat_refusal
from ..config import BEAT_SETTINGS, get_config
from ..engine.registry import engine_for
from ..observe.masking import mask_url
from ..worker.signals import is_singleton
from ..worker.ticks import (
    BEAT_HEADER,
    BEAT_TASK_HEADER,
    ENTRY_HEADER,
    PERIODIC_TASK_HEADER,
    TICK_HEADER,
    tick_name,
)
from .overlap import OVERLAP_OPTION as OVERLAP_OPTION
from .overlap import Overlap, redis_failure
from .ticks import claim_key, ticks_around

logger = logging.getLogger("celery_singleton_lock")

UTC = dt.timezone.utc

#: wake this much after a nominal fire time: Celery wakes 10 ms early (its drift)
_WAKE_SLACK = 0.015
#: extra life of a claim beyond the catch-up window and the clock-skew bound
_CLAIM_MARGIN = 10.0


# -- settings -------------------------------------------------------------------------


@dataclass(frozen=True)
class BeatConfig:
    """The ``singleton_beat_*`` settings of one app, checked."""

    #: seconds after its nominal time a missed tick may still be sent
    catchup: float
    #: "skip" (default: not sent, error logged) or "send" (sent without a claim)
    on_backend_error: str
    #: default overlap mode of entries whose task is a SingletonTask
    overlap: str
    #: the largest clock difference between beat hosts that keeps one send per tick
    max_clock_skew: float
    #: overlap "buffer_all": how many ticks of one entry may wait (more are dropped)
    buffer_max: int = 10

    @property
    def claim_ttl_ms(self) -> int:
        """A claim outlives every attempt any beat can make on its tick.

        Beat ``i`` with clock offset ``d_i`` attempts tick ``T`` at real times in
        ``[T - d_i, T + catchup - d_i]``; the first attempt writes the claim, so
        it must live ``catchup + (d_max - d_min)`` at least.
        """
        return int((self.catchup + self.max_clock_skew + _CLAIM_MARGIN) * 1000)


def beat_config(app: Any) -> BeatConfig:
    """Read and check the beat settings (raises ConfigurationError naming the setting)."""
    values: dict[str, Any] = {}
    for name, default, check in BEAT_SETTINGS:
        value = app.conf.get(name)
        values[name[len("singleton_beat_"):]] = default if value is None else check(name, value)
    return BeatConfig(**values)


def overlap_modes(app: Any, entries: Iterable[tuple[str, Optional[Mapping[str, Any]]]]
                  ) -> list[str]:
    """The overlap modes of the entries, as (task name, options), whose task is a
    SingletonTask of ``app``: they decide what a beat sends besides its claims."""
    default = beat_config(app).overlap
    return sorted({str((options or {}).get(OVERLAP_OPTION) or default)
                   for name, options in entries if is_singleton(app.tasks.get(name))})


def schedule_modes(app: Any) -> Optional[list[str]]:
    """:func:`overlap_modes` of the app's ``beat_schedule``; None without one."""
    schedule = app.conf.beat_schedule or {}
    if not schedule:
        return None
    return overlap_modes(app, ((str(e.get("task")), e.get("options"))
                               for e in schedule.values()))


# -- the scheduler --------------------------------------------------------------------


class SingletonSchedulerMixin:
    """Put in front of a Celery scheduler class: each tick is claimed before it is sent.

    Overrides ``is_due`` (ticks by nominal time, interval entries aligned to the
    epoch), ``populate_heap`` (so the first wake-up uses the same rule),
    ``apply_entry`` (claim, overlap check) and ``apply_async`` (tick headers).
    Everything else, persistence included, is the scheduler's own.

    ``singleton_stats`` counts what happened to the ticks this process decided.
    """

    app: Any
    schedule: Any
    producer: Any
    max_interval: float
    singleton_beat: BeatConfig
    _heap: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        app = kwargs.get("app", args[0] if args else None)
        self.singleton_beat = beat_config(app)
        self.singleton_stats: Counter[str] = Counter()
        self.beat_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._done: dict[str, dt.datetime] = {}  # last tick decided here, per entry
        self._due: dict[str, dt.datetime] = {}  # tick is_due found, for apply_entry
        self._sending: dict[str, dt.datetime] = {}  # tick being sent, for apply_async
        self._went: set[str] = set()  # entries whose tick being sent went out
        self.overlap = Overlap(self)
        super().__init__(*args, **kwargs)

    def setup_schedule(self) -> None:
        """The scheduler's, then a check of what the lock Redis user may run
        (not on the banner's lazy scheduler, which has no schedule)."""
        super().setup_schedule()  # type: ignore[misc]
        self._check_permissions()
        # with several beats, each one's log would otherwise show only the
        # ticks it won: a 10 s entry would look like a 20 s one
        logger.info("celery-singleton-lock: beat %s shares its ticks with every other beat "
                    "of this app through %s: each tick is sent by the beat that claims it "
                    "first; a tick another beat claimed is logged as such",
                    self.beat_id, mask_url(get_config(self.app).redis_url))

    def _check_permissions(self) -> None:
        """Stop the start when the lock Redis user may not run a command this
        beat needs: every tick would fail the same way, late and quietly. Redis
        merely down is logged and the start goes on (the ticks then follow
        ``singleton_beat_on_backend_error``)."""
        modes = overlap_modes(self.app, ((e.task, e.options) for e in self.singleton_entries()))
        for _, client in engine_for(self.app).servers():  # every master of Redlock
            try:
                denied = beat_denied(client, get_config(self.app).key_prefix, modes)
            except redis.RedisError as exc:
                logger.warning("celery-singleton-lock: could not check what the lock Redis "
                               "user may run (%r); the beat starts", exc)
                return
            if denied:
                message = "; ".join(beat_refusal(client, denied, modes))
                logger.critical("celery-singleton-lock: %s", message)
                raise SystemExit(f"celery-singleton-lock configuration error: {message}")

    def singleton_entries(self) -> Iterable[Any]:
        """Every entry of the schedule, due or not: the overlap modes look
        for waiting ticks of each. The scheduler's ``schedule`` here; a
        scheduler whose ``schedule`` holds only the entries due now
        (RedBeat's) lists them all its own way."""
        return list(self.schedule.values())

    # -- the clock ----------------------------------------------------------------

    def last_decided(self, name: str) -> Optional[dt.datetime]:
        return self._done.get(name)

    def send_tick(self, entry: Any, tick: dt.datetime, producer: Any) -> None:
        self._send(entry, tick, producer)

    def singleton_now(self) -> dt.datetime:
        """Now, aware, in UTC. Override to shift the clock (tests of clock skew)."""
        return dt.datetime.now(UTC)

    # -- when an entry is due -------------------------------------------------------

    def singleton_window(self, entry: Any) -> float:
        """Seconds after its nominal time a tick of ``entry`` may still be sent."""
        window = self.singleton_beat.catchup
        deadline = self.app.conf.get("beat_cron_starting_deadline")
        if deadline is not None and isinstance(entry.schedule, crontab):
            window = min(window, float(deadline))
        return window

    def is_due(self, entry: Any) -> Any:
        """Due when the latest nominal tick within the window was not decided
        here yet and the entry's own rules let it run (:meth:`_entry_rules`)."""
        now = self.singleton_now()
        self._bind_app(entry)
        latest, nxt = ticks_around(entry.schedule, now, self.singleton_window(entry))
        delay = (nxt - now).total_seconds() + _WAKE_SLACK if nxt is not None else (
            self.max_interval)
        done = self._done.get(entry.name)
        fresh = latest is not None and (done is None or latest > done)
        due, delay = self._entry_rules(entry, schedstate(fresh, delay))
        if fresh and due:
            assert latest is not None
            self._due[entry.name] = latest
            return schedstate(True, delay)
        return schedstate(False, delay)

    def _bind_app(self, entry: Any) -> None:
        """A schedule read back from the schedule file has lost its app
        (Celery pickles a crontab without it) and reads ``timezone`` from the
        current app, which is not this beat's when its app was made with
        ``set_as_current=False``: its fields are matched in this beat's app's
        zone, as Celery meant when it gave the entry the app."""
        sched = entry.schedule
        # Celery's own crontab only: a subclass may set its zone itself
        # (django-celery-beat's TzAwareCrontab, the row's timezone)
        if type(sched) is crontab and getattr(sched, "_app", self.app) is None:
            sched.app = self.app
            for cached in ("tz", "utc_enabled"):  # cached_property values of the other app
                sched.__dict__.pop(cached, None)

    def _entry_rules(self, entry: Any, timing: Any) -> tuple[bool, float]:
        """The wrapped scheduler's own due-check of ``entry`` (Celery's
        ``Scheduler.is_due``: ``entry.is_due()``), with the entry's schedule
        answering ``timing`` when asked: (due, seconds until the next look).

        Every rule of the entry stays its own. django-celery-beat's
        ``ModelEntry`` says "not due" without asking its schedule while its row
        is disabled, before its ``start_time``, after its ``expires`` (and
        disables the row) and once a ``one_off`` row ran (and disables it);
        only its timing, counted from its own ``last_run_at``, gives way to
        the tick's, which every beat computes alike."""
        schedule = entry.schedule
        try:
            entry.schedule = _Timed(schedule, timing)
        except AttributeError:  # an entry whose schedule cannot be swapped: the tick decides
            return bool(timing.is_due), float(timing.next)
        try:
            due, delay = super().is_due(entry)  # type: ignore[misc]
        finally:
            entry.schedule = schedule
        if isinstance(delay, bool) or not isinstance(delay, (int, float)):
            delay = timing.next
        return bool(due), float(delay)

    def populate_heap(self, event_t: Any = event_t, heapify: Any = heapq.heapify) -> None:
        """Celery's, asking :meth:`is_due` (the entry's own timing counts from last_run_at)."""
        self._heap = []
        for entry in self.schedule.values():
            try:
                is_due, delay = self.is_due(entry)
            except Exception:
                is_due, delay = self._is_due_failed(entry)  # type: ignore[attr-defined]
            self._heap.append(event_t(self._when(entry, 0 if is_due else delay) or 0,  # type: ignore[attr-defined]
                                      5, entry))
        heapify(self._heap)

    def reserve(self, entry: Any) -> Any:
        """Celery's tick reserves every due entry just before ``apply_entry``
        (its last run time, its run count): with several beats, every beat
        would count every tick. Here the beat that sends a tick counts it
        (:meth:`apply_async`), and the entry goes back on the heap as it is."""
        return entry

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """Celery's tick; first, waiting ticks whose run ended are sent, and
        every beat with entries whose ticks may wait looks for waiting ticks it
        does not hold (their beat may have died): :mod:`.overlap`."""
        waiting = self.overlap.before_tick()
        delay: float = super().tick(*args, **kwargs)  # type: ignore[misc]
        return self.overlap.delay(delay, waiting)

    # -- sending ------------------------------------------------------------------

    def apply_entry(self, entry: Any, producer: Any = None) -> None:
        """Claim the tick; only the winner sends it (if no previous run is in the way)."""
        tick = self._due.pop(entry.name, None)
        if tick is None:
            tick, _ = ticks_around(entry.schedule, self.singleton_now(),
                                   self.singleton_window(entry))
            if tick is None:
                return
        self._count_missed(entry, tick)
        self._done[entry.name] = tick
        if not self._claim(entry, tick) or not self._still_due(entry, tick):
            return
        overlap = self.overlap.mode_of(entry)
        if overlap != "allow" and self.overlap.previous_still_runs(entry, tick, overlap):
            return
        self._send(entry, tick, producer)

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True,
                    **kwargs: Any) -> Any:
        """The scheduler's send, with the tick headers merged into the entry's
        own; then the entry's run is counted (:meth:`_count_run`), by this beat
        alone."""
        tick = self._sending.get(entry.name)
        if tick is None:
            # Called directly, not from apply_entry: claim the current tick here.
            tick, _ = ticks_around(entry.schedule, self.singleton_now(),
                                   self.singleton_window(entry))
            if tick is None or not self._claim(entry, tick):
                return None
        original = entry.options
        headers = dict(original.get("headers") or {})
        headers.setdefault(PERIODIC_TASK_HEADER, entry.name)
        headers.setdefault(BEAT_TASK_HEADER, True)
        headers.update({ENTRY_HEADER: entry.name, TICK_HEADER: tick_name(tick),
                        BEAT_HEADER: self.beat_id})
        # Swapped only for the send: a changed entry would look like a new schedule.
        entry.options = {**original, "headers": headers}
        try:
            # advance=False: Celery's would reserve the entry; _count_run does
            result = super().apply_async(entry, producer, False, **kwargs)  # type: ignore[misc]
        finally:
            entry.options = original
            self._count_run(entry, tick)
        if getattr(result, "deduplicated", False) is True:
            # a queue-scoped SingletonTask refused it at send time: its key is taken
            self.singleton_stats["refused_at_send"] += 1
            logger.info("Beat entry %r tick %s not sent: its task's key is taken (%s)",
                        entry.name, tick_name(tick), getattr(result, "reason", ""))
        else:
            self.singleton_stats["sent"] += 1
            self._went.add(entry.name)
        return result

    def _send(self, entry: Any, tick: dt.datetime, producer: Any) -> None:
        # noted before the send: a beat deciding the next tick meanwhile sees it
        noted = self.overlap.note_if_late(entry, tick)
        self._sending[entry.name] = tick
        self._went.discard(entry.name)
        try:
            super().apply_entry(entry, producer=producer)  # type: ignore[misc]
        finally:
            self._sending.pop(entry.name, None)
            if noted and entry.name not in self._went:
                self.overlap.unnote(entry, tick)  # not sent after all: nothing to wait for

    def _still_due(self, entry: Any, tick: dt.datetime) -> bool:
        """The entry's own rules once more, after the claim, on its stored state
        as it is now: another beat may have sent the tick before it, disabled or
        deleted it since this beat last read it (a ``one_off`` row that ran from
        another beat). Only for entries with a row to reload (django-celery-beat);
        for others the check in :meth:`is_due` stands."""
        state = _reload(entry)
        if state == "kept":
            return True
        if state == "reloaded" and self._entry_rules(entry, schedstate(True, 0.0))[0]:
            return True
        self.singleton_stats["not_due"] += 1
        logger.info("Beat entry %r tick %s not sent: %s", entry.name, tick_name(tick),
                    "its row is gone" if state == "gone"
                    else "as stored now, its own rules say it is not due")
        return False

    def _count_run(self, entry: Any, tick: dt.datetime) -> None:
        """Advance the entry's last run and run count, as the wrapped scheduler
        keeps them, for ``tick``, which this beat sent. A django-celery-beat row is
        counted in the database in one ``UPDATE ... SET total_run_count =
        total_run_count + 1``, so the counts of every beat add up (its own
        ``reserve`` and ``sync`` would write this process's count over the
        others'); any other entry goes through the scheduler's ``reserve``."""
        try:
            row = _stored_row(entry)
            if row is not None:
                _count_row(entry, row)
            else:
                super().reserve(self.schedule.get(entry.name, entry))  # type: ignore[misc]
        except Exception as exc:
            logger.warning("Beat entry %r: its run could not be counted (%r)", entry.name, exc)

    def _claim(self, entry: Any, tick: dt.datetime) -> bool:
        """One round trip: SET NX PX (on a majority with Redlock). True when
        this beat sends the tick."""
        key = claim_key(get_config(self.app).key_prefix, entry.name, tick)
        try:
            won, holder = engine_for(self.app).claim(key, self.beat_id,
                                                     self.singleton_beat.claim_ttl_ms)
        except redis.RedisError as exc:
            if self.singleton_beat.on_backend_error == "send":
                self.singleton_stats["sent_unclaimed"] += 1
                logger.warning("Beat entry %r tick %s sent WITHOUT a claim: %s (%r); another "
                               "beat may send it too", entry.name, tick_name(tick),
                               redis_failure(exc), exc)
                return True
            self.singleton_stats["backend_error"] += 1
            logger.error("Beat entry %r tick %s not sent: %s, the tick could not be claimed "
                         "(%r)", entry.name, tick_name(tick), redis_failure(exc), exc)
            return False
        if not won:
            self.singleton_stats["claimed_elsewhere"] += 1
            logger.info("Beat entry %r tick %s claimed by another beat (%s), which sends it",
                        entry.name, tick_name(tick), holder)
            return False
        return True

    def _count_missed(self, entry: Any, tick: dt.datetime) -> None:
        """Interval ticks this process slept through (only the latest of them is sent)."""
        done = self._done.get(entry.name)
        if done is None or not isinstance(entry.schedule, interval_schedule) or isinstance(
                entry.schedule, crontab):
            return
        period = entry.schedule.run_every.total_seconds()
        missed = round((tick - done).total_seconds() / period) - 1 if period > 0 else 0
        if missed > 0:
            self.singleton_stats["missed"] += missed
            logger.warning("Beat entry %r: %d tick(s) before %s missed; only the latest is sent",
                           entry.name, missed, tick_name(tick))



class SingletonScheduler(SingletonSchedulerMixin, PersistentScheduler):  # type: ignore[misc]
    """Celery's default scheduler (file persistence, ``-s``) with per-tick claims."""


# -- the wrapped scheduler's entries ---------------------------------------------------


class _Timed:
    """Stands in for an entry's schedule while the entry's own ``is_due`` runs:
    asked whether it is due, it answers the tick's timing; anything else is
    the schedule's."""

    def __init__(self, schedule: Any, timing: Any) -> None:
        self._schedule = schedule
        self._timing = timing

    def is_due(self, last_run_at: Any) -> Any:
        return self._timing

    def __getattr__(self, name: str) -> Any:
        return getattr(self._schedule, name)


def _stored_row(entry: Any) -> Any:
    """The database row behind a django-celery-beat entry (``ModelEntry.model``),
    or None for an entry kept otherwise."""
    row = getattr(entry, "model", None)
    if hasattr(row, "refresh_from_db") and hasattr(row, "total_run_count"):
        return row
    return None


def _reload(entry: Any) -> str:
    """Read the entry's row again: "reloaded", "gone" (deleted), or "kept"
    (no row, or the database did not answer: the row as last read decides)."""
    row = _stored_row(entry)
    if row is None:
        return "kept"
    try:
        row.refresh_from_db()
    except Exception as exc:
        if isinstance(exc, getattr(type(row), "DoesNotExist", ())):
            return "gone"
        logger.warning("Beat entry %r: could not read its row again (%r); its row as last "
                       "read decides", getattr(entry, "name", "?"), exc)
        return "kept"
    return "reloaded"


def _count_row(entry: Any, row: Any) -> None:
    """One run more, in the database and on the row in memory."""
    from django.db.models import F

    # the time ModelEntry itself would store (aware or naive, per its setting)
    now = entry._default_now() if hasattr(entry, "_default_now") else entry.default_now()
    type(row)._default_manager.filter(pk=row.pk).update(
        total_run_count=F("total_run_count") + 1, last_run_at=now)
    row.total_run_count += 1
    row.last_run_at = now
    entry.total_run_count = row.total_run_count
    entry.last_run_at = now
