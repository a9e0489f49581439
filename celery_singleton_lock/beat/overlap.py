"""Overlap: what a beat does with a tick whose entry's previous run still runs.

The modes (entry option ``singleton_overlap``, setting ``singleton_beat_overlap``;
docs/beat.md):

``skip``             the tick is not sent (unless the run in the way is that of
                     the tick before, sent late: then the tick waits for it, at
                     most as long as that run started late;
                     :meth:`Overlap._wait_for_late_run`)
``buffer_one``       the tick waits in Redis; a newer one replaces it
``buffer_all``       every tick waits in Redis, in tick order, up to
                     ``singleton_beat_buffer_max``; each is sent once the run
                     before it started and ended
``cancel_other``     the running task is asked to stop (it stops if it checks
                     :func:`cancel_requested`); the tick waits as in ``buffer_one``
``terminate_other``  the running task is revoked with ``terminate=True``
                     (SIGTERM to its pool process); the tick waits as in ``buffer_one``
``allow``            always sent

Only the beat that won a tick's claim decides it. Waiting ticks are in Redis,
so any beat sends them: every beat looks for the ones it does not hold.

Over 500 lines: one idea, the overlap modes of an entry, each a few methods
of one object that the scheduler owns and asks at every tick; ``skip``'s
waits for a late run (its notes, run markers and looks) are the largest.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections import Counter
from typing import Any, Iterable, Mapping, Optional, Protocol

import redis
from redis.exceptions import NoPermissionError

from ..config import OVERLAP_MODES, choice, get_config
from ..engine.registry import engine_for
from ..engine.scripts import Script
from ..worker.signals import is_singleton
from ..worker.ticks import RUN_MARKER_TTL_MS, cancel_key, from_ms, run_key, tick_name, to_ms
from .ticks import buffer_key, last_sent_key, late_key, queue_key, tick_after

logger = logging.getLogger("celery_singleton_lock")

#: the entry option (``options={"singleton_overlap": ...}``) choosing an entry's mode
OVERLAP_OPTION = "singleton_overlap"

#: how often a beat holding a buffered tick looks whether the running one ended
BUFFER_POLL = 0.25
#: how often every beat looks for ticks buffered by a beat that may have died
#: since (one EXISTS per waiting-mode entry of a SingletonTask)
BUFFER_ADOPT = 1.0
#: modes whose ticks may wait in Redis for the running one to end
WAITING_MODES = ("buffer_one", "buffer_all", "cancel_other", "terminate_other")
#: a tick sent more than this many seconds after its nominal time (the first
#: tick after a start or a restart, a beat that stalled) leaves a note for the
#: tick after it: under ``skip`` that one waits for the late run (a beat on time
#: sends 10-20 ms after the nominal time)
LATE_SEND = 0.1
#: how long a late note outlives the moment it stops counting
_LATE_NOTE_MARGIN_MS = 10_000

# buffer_all's two scripts (lua/beat_*.lua), called by SHA through the engine
# (loaded when a server does not have them): EVALSHA and SCRIPT LOAD are in
# the lock user's rule already (docs/redis-acl.md)
_ARRIVE = Script.load("beat_arrive")
_TAKE = Script.load("beat_take")


def redis_failure(exc: Exception) -> str:
    """How a beat's log names a failed Redis call: a refusal is no outage."""
    if isinstance(exc, (redis.AuthenticationError, NoPermissionError)):
        return "Redis refused it (see docs/redis-acl.md)"
    return "Redis unreachable"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _evaluate(values: Any) -> Any:
    """Entry args/kwargs with BeatLazyFunc values called, as Celery sends them."""
    from celery.beat import _evaluate_entry_args, _evaluate_entry_kwargs

    if isinstance(values, Mapping):
        return _evaluate_entry_kwargs(values)
    return _evaluate_entry_args(values)


class Beat(Protocol):
    """What the overlap modes use of the scheduler that owns them
    (:class:`.scheduler.SingletonSchedulerMixin`), and nothing else."""

    #: the Celery app: its tasks (an entry's lock keys) and its control (a revoke)
    app: Any
    #: the producer the scheduler sends with
    producer: Any
    #: the beat's settings (:class:`.scheduler.BeatConfig`)
    singleton_beat: Any
    #: the beat's counters, as its shutdown line and Flower show them
    singleton_stats: Counter[str]

    def singleton_entries(self) -> Iterable[Any]:
        """The schedule's entries."""

    def singleton_now(self) -> dt.datetime:
        """The beat's clock."""

    def last_decided(self, name: str) -> Optional[dt.datetime]:
        """The last tick of entry ``name`` this beat decided (sent, buffered, skipped)."""

    def send_tick(self, entry: Any, tick: dt.datetime, producer: Any) -> None:
        """Send ``entry``'s ``tick`` now."""


class _LateWait:
    """``skip``: a tick waiting for the run of the late tick before it
    (:meth:`Overlap._wait_for_late_run`). Times in ms; the deadline on the
    beat's clock."""

    def __init__(self, entry: Any, tick: dt.datetime, deadline: int, cap: int,
                 late_tick: int) -> None:
        self.entry = entry
        self.tick = tick
        #: skipped if the late run still runs (or has not started) then
        self.deadline = min(deadline, cap)
        #: the tick after this one: waiting past it cannot send this one
        #: (that tick is decided then, and stands for this one)
        self.cap = cap
        #: the late tick's nominal time
        self.late_tick = late_tick
        #: the late run was seen holding the key
        self.started = False

    def running(self, record: Mapping[str, str]) -> None:
        """The late run holds the key (``record``): the tick waits as long as
        that run started late, by its grant's time (a worker slow to pick the
        late tick up counts too), up to the cap."""
        at = str(record.get("at", ""))
        if at.isdigit():
            late = to_ms(self.tick) + int(at) - self.late_tick
            self.deadline = min(max(self.deadline, late), self.cap)
        self.started = True


class Overlap:
    """The overlap modes of one scheduler's entries: what its beat does with a
    tick whose entry's previous run still runs (``skip``, ``buffer_one``,
    ``buffer_all``, ``cancel_other``, ``terminate_other``; ``allow`` never
    asks). The scheduler owns one, asks :meth:`previous_still_runs` at each
    tick of a SingletonTask entry and :meth:`before_tick` before each of its
    rounds; what it uses of the scheduler is :class:`Beat`. Its Redis keys
    (buffers, queues, late notes, cancel requests) go through the engine."""

    def __init__(self, scheduler: Beat) -> None:
        self.scheduler = scheduler
        self._buffered: dict[str, Any] = {}  # entries this beat polls a buffered tick of
        self._queued: dict[str, Any] = {}  # buffer_all entries this beat polls the queue of
        self._stopped: dict[str, str] = {}  # task id this beat last cancelled/terminated
        # skip: a tick waiting for the late run before it, by entry
        self._late_waits: dict[str, _LateWait] = {}
        self._adopt_at = 0.0  # monotonic time of the next look for others' buffers
        self._adopt_failing = False  # the last look failed (said once, not every second)

    def _send(self, entry: Any, tick: dt.datetime, producer: Any) -> None:
        self.scheduler.send_tick(entry, tick, producer)

    def singleton_now(self) -> dt.datetime:
        return self.scheduler.singleton_now()

    # -- the mode -------------------------------------------------------------------

    def mode_of(self, entry: Any) -> str:
        """The entry's overlap mode: its ``mode_of`` option, else the setting."""
        mode = (entry.options or {}).get(OVERLAP_OPTION)
        if mode is None:
            return str(self.scheduler.singleton_beat.overlap)
        return str(choice(OVERLAP_MODES, "overlap mode")(
            f"{OVERLAP_OPTION} of beat entry {entry.name!r}", mode))

    def _task_keys(self, entry: Any) -> Any:
        """The lock keys the entry's next run takes, or None when it is no SingletonTask."""
        task = self.scheduler.app.tasks.get(entry.task)
        if not is_singleton(task):
            return None
        return task.singleton_keys(*_evaluate(entry.args), **_evaluate(entry.kwargs))

    # -- every tick of the scheduler -----------------------------------------------

    def before_tick(self) -> bool:
        """Look for others' waiting ticks (once a second) and send the ones
        whose run ended. True when this beat has waiting-mode entries."""
        waiting = [e for e in self.scheduler.singleton_entries()
                   if self.mode_of(e) in WAITING_MODES
                   and self._task_keys(e) is not None]
        if waiting and time.monotonic() >= self._adopt_at:
            self._adopt_buffers(waiting)
            self._adopt_at = time.monotonic() + BUFFER_ADOPT
        if self._buffered:
            self._send_buffered()
        if self._queued:
            self._send_queued()
        if self._late_waits:
            self._send_after_late_runs()
        return bool(waiting)

    def delay(self, delay: float, waiting: bool) -> float:
        if self._buffered or self._queued:
            delay = min(delay, BUFFER_POLL)
        if self._late_waits:
            # polled like a buffer, and looked at once more at the earliest deadline
            until = min(w.deadline for w in self._late_waits.values()) - to_ms(self.singleton_now())
            delay = min(delay, BUFFER_POLL, max(until / 1000, 0.0))
        if waiting:
            delay = min(delay, max(self._adopt_at - time.monotonic(), 0.0))
        return delay

    def _adopt_buffers(self, entries: list[Any]) -> None:
        """Take on the waiting ticks this beat does not hold: the beat that
        buffered one may be dead, and nobody would send it. Every beat that
        holds a buffer polls it; ``GETDEL`` / ``ZPOPMIN`` lets one of them send it."""
        engine = engine_for(self.scheduler.app)
        prefix = get_config(self.scheduler.app).key_prefix
        for entry in entries:
            queued = self.mode_of(entry) == "buffer_all"
            held = self._queued if queued else self._buffered
            if entry.name in held:
                continue
            key = (queue_key if queued else buffer_key)(prefix, entry.name)
            try:
                waiting = engine.present(key)
            except redis.RedisError as exc:
                if not self._adopt_failing:
                    logger.warning("Beat could not look for the waiting ticks of other beats "
                                   "(%s): one a dead beat buffered is sent once a look "
                                   "works again (%r)", redis_failure(exc), exc)
                self._adopt_failing = True
                return  # the next look, or the next tick, tries again
            if waiting:
                held[entry.name] = entry
        if self._adopt_failing:
            logger.info("Beat looks for the waiting ticks of other beats again")
        self._adopt_failing = False

    # -- a claimed tick -------------------------------------------------------------

    def previous_still_runs(self, entry: Any, tick: dt.datetime, overlap: str) -> bool:
        """True when the tick must not be sent now (skipped, buffered or waiting)."""
        keys = self._task_keys(entry)
        if keys is None:
            return False  # only a SingletonTask's run is visible in Redis
        try:
            if overlap == "buffer_all":
                return not self._arrive_queued(entry, tick, keys)
            record = engine_for(self.scheduler.app).owner(keys)
        except redis.RedisError as exc:
            logger.warning("Beat entry %r tick %s: could not see whether its previous run "
                           "still runs (%r); sent, the task's own lock decides",
                           entry.name, tick_name(tick), exc)
            return False
        if not record:
            # skip: the tick before, sent late, may not have started yet
            return overlap == "skip" and self._wait_for_late_run(entry, tick, record)
        if overlap == "buffer_one":
            self._buffer(entry, tick, "the previous run still runs")
            return True
        if overlap in ("cancel_other", "terminate_other"):
            self._stop_holder(entry, tick, keys, record, overlap == "terminate_other")
            self._buffer(entry, tick, "it is sent when the previous run ended")
            return True
        if self._wait_for_late_run(entry, tick, record):
            return True
        self.scheduler.singleton_stats["overlap_skipped"] += 1
        logger.info("Beat entry %r tick %s skipped: the previous run still runs (%s)",
                    entry.name, tick_name(tick), keys.base)
        return True

    def _stop_holder(self, entry: Any, tick: dt.datetime, keys: Any,
                     record: Mapping[str, str], terminate: bool) -> None:
        """cancel_other: ask the running task to stop (a marker it may check,
        and a revoke, which stops a copy of it not started yet: a retry, a
        redelivery). terminate_other: revoke it with terminate=True."""
        task_id = str(record.get("task") or "")
        if not task_id or self._stopped.get(entry.name) == task_id:
            return  # unknown, or already asked by this beat
        try:
            if not terminate:
                engine_for(self.scheduler.app).write(cancel_key(keys), task_id,
                                                    RUN_MARKER_TTL_MS)
            self.scheduler.app.control.revoke(task_id, terminate=terminate)
        except Exception as exc:
            logger.warning("Beat entry %r tick %s: could not %s the running task %s (%r)",
                           entry.name, tick_name(tick),
                           "terminate" if terminate else "cancel", task_id, exc)
            return
        self._stopped[entry.name] = task_id
        counter, verb = (("overlap_terminated", "terminated") if terminate
                         else ("overlap_cancelled", "asked to cancel"))
        self.scheduler.singleton_stats[counter] += 1
        logger.info("Beat entry %r tick %s: the previous run %s still runs, %s (%s)",
                    entry.name, tick_name(tick), task_id, verb, keys.base)

    # -- skip: a tick after a late one ----------------------------------------------

    def note_if_late(self, entry: Any, tick: dt.datetime) -> bool:
        """Before sending ``tick`` more than :data:`LATE_SEND` late, under
        ``skip``: note for the tick after it how late this one goes, in
        ``<entry>:late`` = ``<next tick ms> <next tick ms + lateness ms> <this
        tick ms>``. True when noted (:meth:`unnote` if the send fails).

        The first tick after a start or a restart is sent when the beat comes
        up, anywhere in its period; its run may then still run at the next
        tick, which ``skip`` would drop although, sent on time, the run could
        have ended by then. Each beat decides the next tick from this note,
        whichever beat sent the late one (one ``SET`` per late send)."""
        if self.mode_of(entry) != "skip":
            return False
        now = self.singleton_now()
        late_ms = to_ms(now) - to_ms(tick)
        if late_ms <= LATE_SEND * 1000 or self._task_keys(entry) is None:
            return False
        following = tick_after(entry.schedule, tick)
        if following is None:
            return False
        try:
            self._write_note(entry, to_ms(following), to_ms(following) + late_ms, tick)
            return True
        except redis.RedisError as exc:
            logger.warning("Beat entry %r tick %s goes %.2f s late and that could not be "
                           "noted (%s, %r): if its run still runs at the next tick, that one "
                           "is skipped", entry.name, tick_name(tick), late_ms / 1000,
                           redis_failure(exc), exc)
            return False

    def unnote(self, entry: Any, tick: dt.datetime) -> None:
        """``tick`` was noted late but not sent after all (the send failed, or a
        queue-scoped task refused it): the tick after it waits for nothing."""
        try:
            engine_for(self.scheduler.app).take(
                late_key(get_config(self.scheduler.app).key_prefix, entry.name))
        except redis.RedisError as exc:
            logger.warning("Beat entry %r tick %s was not sent and its late note could not "
                           "be taken back (%s, %r): the next tick waits for its run until "
                           "the tick after", entry.name, tick_name(tick), redis_failure(exc),
                           exc)

    def _write_note(self, entry: Any, following: int, deadline: int, tick: dt.datetime) -> None:
        """``<entry>:late`` = ``following deadline tick``: the tick at
        ``following`` (ms) waits for ``tick``'s run, until ``deadline`` (ms)
        at least; kept until then and a margin."""
        engine_for(self.scheduler.app).write(
            late_key(get_config(self.scheduler.app).key_prefix, entry.name),
            f"{following} {deadline} {to_ms(tick)}",
            max(deadline - to_ms(self.singleton_now()), 0) + _LATE_NOTE_MARGIN_MS)

    def _wait_for_late_run(self, entry: Any, tick: dt.datetime,
                           record: Mapping[str, str]) -> bool:
        """``skip``: True when the tick before was sent late (:meth:`note_if_late`
        named this tick) and its run is still to end; the tick then waits for it.

        ``record``: the run in the way, taken for the late one's; the tick waits
        for it as long as that run started late (by its grant's time, so a
        worker slow to pick the late tick up counts too; at least as long as
        the send was late): sent once the run ended, skipped if it still runs
        then (started on time, it would have run into this tick as well).
        Empty: no run in the way, but the late tick's own run may not have
        started yet (no run marker: its message waits for a worker). Sent now,
        this tick would meet it at the workers and one of the two would be
        refused; so it waits for that run to start and end, at most until the
        tick after it. Sent late in turn, it notes that for the tick after it."""
        prefix = get_config(self.scheduler.app).key_prefix
        engine = engine_for(self.scheduler.app)
        try:
            raw = engine.read(late_key(prefix, entry.name))
        except redis.RedisError:
            return False
        try:
            following, deadline, late_tick = (int(part) for part in _text(raw or "").split())
        except ValueError:  # none, or not three numbers
            return False
        if following != to_ms(tick):
            return False
        after = tick_after(entry.schedule, tick)
        if after is None:
            return False
        wait = _LateWait(entry, tick, deadline, to_ms(after), late_tick)
        if not record and self._tick_decided(entry, late_tick):
            # started since the look at the key (or started and ended, or was
            # decided against): the key once more, now the marker was seen
            record = self._holder(entry) or {}
            if not record:
                return False
        if record:
            wait.running(record)
        else:
            # it will have started later than this tick's time, so later than a
            # period after its own: its wait reaches the cap once it starts
            wait.deadline = wait.cap
        if to_ms(self.singleton_now()) >= wait.deadline:
            return False
        self._late_waits[entry.name] = wait
        try:
            # this tick goes late in turn, maybe after the next one's time: whichever
            # beat decides that one waits for this one's run (until its own lateness
            # is noted, at the send, it waits at most until the tick after it)
            self._write_note(entry, wait.cap, wait.cap, tick)
        except redis.RedisError as exc:
            logger.warning("Beat entry %r tick %s waits for a late run and that could not "
                           "be noted (%s, %r): the next tick may be sent into its run",
                           entry.name, tick_name(tick), redis_failure(exc), exc)
        self.scheduler.singleton_stats["waited_for_late_run"] += 1
        logger.info("Beat entry %r tick %s waits: the run of the tick before it, sent %.2f s "
                    "late, %s; this tick is sent when that run ends, skipped if it still "
                    "runs at %s", entry.name, tick_name(tick), (deadline - following) / 1000,
                    "still runs" if wait.started else "has not started yet",
                    tick_name(from_ms(wait.deadline)))
        return True

    def _decided_against(self, wait: _LateWait) -> None:
        """A waiting tick skipped: its run marker says so, so the tick after it
        (noted to wait for its run) does not wait for a run that never comes."""
        key = run_key(get_config(self.scheduler.app).key_prefix, wait.entry.name, wait.tick)
        try:
            engine_for(self.scheduler.app).write(key, "skipped by the beat", RUN_MARKER_TTL_MS)
        except redis.RedisError as exc:
            logger.warning("Beat entry %r tick %s: its skip could not be noted (%s, %r): the "
                           "next tick waits for its run until the tick after", wait.entry.name,
                           tick_name(wait.tick), redis_failure(exc), exc)

    def _holder(self, entry: Any) -> Optional[Mapping[str, str]]:
        """The owner record of the entry's run's key; {} when free; None when
        Redis does not answer."""
        keys = self._task_keys(entry)
        try:
            return engine_for(self.scheduler.app).owner(keys) if keys is not None else {}
        except redis.RedisError:
            return None

    def _tick_decided(self, entry: Any, tick_ms: int) -> bool:
        """Whether the run marker of ``entry``'s tick at ``tick_ms`` is there
        (the worker writes it once the run's lock is granted, or the run was
        decided against). Unseen (Redis failing): taken as there."""
        key = run_key(get_config(self.scheduler.app).key_prefix, entry.name, from_ms(tick_ms))
        try:
            return engine_for(self.scheduler.app).read(key) is not None
        except redis.RedisError:
            return True

    def _send_after_late_runs(self) -> None:
        """Send each tick waiting for a late run once that run ended; skip it
        if the run still runs (or has not started) at its deadline."""
        for name, wait in list(self._late_waits.items()):
            # the marker before the key: a run granted in between is seen holding it
            decided = wait.started or self._tick_decided(wait.entry, wait.late_tick)
            record = self._holder(wait.entry)  # None: unseen, looked at again
            if record:
                wait.running(record)
            # free once it started (seen holding the key, or its marker there): it ended
            running = record is None or bool(record) or not decided
            if running and to_ms(self.singleton_now()) < wait.deadline:
                continue
            del self._late_waits[name]
            last = self.scheduler.last_decided(name)
            if running or (last is not None and last > wait.tick):
                self.scheduler.singleton_stats["overlap_skipped"] += 1
                why = ("a later tick was decided meanwhile" if not running else
                       "the previous run still runs" if wait.started or decided else
                       "the previous run has not started")
                logger.info("Beat entry %r tick %s skipped: %s (waited for it until %s)",
                            name, tick_name(wait.tick), why, tick_name(from_ms(wait.deadline)))
                self._decided_against(wait)
                continue
            logger.info("Beat entry %r tick %s sent: the late run before it ended", name,
                        tick_name(wait.tick))
            self._send(wait.entry, wait.tick, self.scheduler.producer)

    # -- buffer_one, cancel_other, terminate_other: one tick waits -------------------

    def _buffer(self, entry: Any, tick: dt.datetime, why: str) -> None:
        """Keep the tick in Redis, replacing an older one: at most one run waits."""
        key = buffer_key(get_config(self.scheduler.app).key_prefix, entry.name)
        try:
            replaced = engine_for(self.scheduler.app).write(key, str(to_ms(tick)),
                                                            RUN_MARKER_TTL_MS, previous=True)
        except redis.RedisError as exc:
            self.scheduler.singleton_stats["backend_error"] += 1
            logger.error("Beat entry %r tick %s not buffered: %s (%r)",
                         entry.name, tick_name(tick), redis_failure(exc), exc)
            return
        if replaced is not None and _text(replaced) != str(to_ms(tick)):
            self.scheduler.singleton_stats["buffer_dropped"] += 1
            logger.info("Beat entry %r tick %s dropped from the buffer: tick %s is newer",
                        entry.name, tick_name(from_ms(int(replaced))), tick_name(tick))
        self.scheduler.singleton_stats["buffered"] += 1
        logger.info("Beat entry %r tick %s buffered: %s", entry.name, tick_name(tick), why)
        self._buffered[entry.name] = entry

    def _send_buffered(self) -> None:
        """Send a buffered tick once the run before it ended; GETDEL: one beat sends it."""
        engine = engine_for(self.scheduler.app)
        prefix = get_config(self.scheduler.app).key_prefix
        for name, entry in list(self._buffered.items()):
            keys = self._task_keys(entry)
            try:
                if keys is not None and engine.owner(keys):
                    continue
                waiting = engine.take(buffer_key(prefix, name))
            except redis.RedisError:
                continue
            del self._buffered[name]
            if waiting is None:
                continue  # another beat sent it, or a newer buffer replaced it
            tick = from_ms(int(waiting))
            decided = self.scheduler.last_decided(name)
            if decided is not None and decided > tick:
                # a newer tick was decided meanwhile (sent, buffered or skipped):
                # it stands for this one, which would run late and out of order
                self.scheduler.singleton_stats["buffer_dropped"] += 1
                logger.info("Beat entry %r tick %s dropped from the buffer: tick %s came "
                            "after it", name, tick_name(tick), tick_name(decided))
                continue
            logger.info("Beat entry %r tick %s sent from the buffer", name, tick_name(tick))
            self._send(entry, tick, self.scheduler.producer)

    # -- buffer_all: every tick waits, in order --------------------------------------

    def _queue_gate(self, name: str, keys: Any) -> tuple[str, bool]:
        """(the last tick sent, as stored; whether the run before the next one ended).

        Ended: the last tick sent has started (its run marker, which the worker
        writes once the tick's lock is granted, exists) and, looked at after
        that, the lock is free; or no tick sent is remembered (none, or it did
        not start within the claim TTL: a beat that died between taking and
        sending it). The marker is read first: a lock seen free before its
        tick's grant would read as "ended" once the marker appears.
        """
        engine = engine_for(self.scheduler.app)
        prefix = get_config(self.scheduler.app).key_prefix
        raw = engine.read(last_sent_key(prefix, name))
        last = _text(raw) if raw is not None else ""
        if last and not engine.present(run_key(prefix, name, from_ms(int(last)))):
            return last, False
        return last, not engine.owner(keys)

    def _arrive_queued(self, entry: Any, tick: dt.datetime, keys: Any) -> bool:
        """buffer_all: True to send the tick now; else it waits (or the queue is full)."""
        prefix = get_config(self.scheduler.app).key_prefix
        last, ended = self._queue_gate(entry.name, keys)
        verdict = _text(engine_for(self.scheduler.app).run_script(
            _ARRIVE, [queue_key(prefix, entry.name), last_sent_key(prefix, entry.name)],
            [str(to_ms(tick)), last, "1" if ended else "0",
             self.scheduler.singleton_beat.buffer_max, RUN_MARKER_TTL_MS,
             self.scheduler.singleton_beat.claim_ttl_ms]))
        if verdict == "send":
            return True
        if verdict == "full":
            self.scheduler.singleton_stats["buffer_dropped"] += 1
            logger.info("Beat entry %r tick %s dropped: %d ticks already wait "
                        "(singleton_beat_buffer_max)", entry.name, tick_name(tick),
                        self.scheduler.singleton_beat.buffer_max)
        else:
            self.scheduler.singleton_stats["buffered"] += 1
            logger.info("Beat entry %r tick %s buffered: the previous run still runs",
                        entry.name, tick_name(tick))
        self._queued[entry.name] = entry
        return False

    def _send_queued(self) -> None:
        """Send the oldest waiting tick of each queue whose previous run ended."""
        engine = engine_for(self.scheduler.app)
        prefix = get_config(self.scheduler.app).key_prefix
        for name, entry in list(self._queued.items()):
            keys = self._task_keys(entry)
            try:
                last, ended = self._queue_gate(name, keys)
                if not ended:
                    continue
                taken = engine.run_script(
                    _TAKE, [queue_key(prefix, name), last_sent_key(prefix, name)],
                    [last, self.scheduler.singleton_beat.claim_ttl_ms])
            except redis.RedisError:
                continue
            if taken == -1:
                del self._queued[name]  # nothing waits
                continue
            if taken == 0:
                continue  # another beat sent one: its run comes first
            tick = from_ms(int(taken))
            logger.info("Beat entry %r tick %s sent from the buffer", name, tick_name(tick))
            self._send(entry, tick, self.scheduler.producer)
