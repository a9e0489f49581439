"""Overlap: what a beat does with a tick whose entry's previous run still runs.

The modes (entry option ``singleton_overlap``, setting ``singleton_beat_overlap``;
docs/beat.md):

``skip``             the tick is not sent
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
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections import Counter
from typing import Any, Mapping

import redis
from redis.exceptions import NoPermissionError, NoScriptError

from .config import OVERLAP_MODES, choice, get_config
from .engines import engine_for
from .scripts import Script
from .ticks import (
    RUN_MARKER_TTL_MS,
    buffer_key,
    cancel_key,
    from_ms,
    last_sent_key,
    queue_key,
    run_key,
    tick_name,
    to_ms,
)

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

# buffer_all's two scripts (lua/beat_*.lua), called by SHA: EVALSHA and SCRIPT
# LOAD are in the lock user's rule already (docs/redis-acl.md)
_ARRIVE = Script.load("beat_arrive")
_TAKE = Script.load("beat_take")


def _script(client: Any, script: Script, keys: list[str], *args: Any) -> Any:
    """EVALSHA of one of buffer_all's scripts, loaded first when the server
    does not have it (a fresh or restarted Redis, a failover)."""
    try:
        return client.evalsha(script.sha, len(keys), *keys, *args)
    except NoScriptError:
        client.script_load(script.source)
        return client.evalsha(script.sha, len(keys), *keys, *args)


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


def cancel_requested(task: Any) -> bool:
    """True when a beat entry with overlap ``cancel_other`` asked this run to stop.

    Call it from a running ``SingletonTask`` (``cancel_requested(self)``) as
    often as stopping early matters; one Redis ``GET``. Celery's own revoke
    without ``terminate`` does nothing to a running task, so this is how the
    body learns of the request: return (or raise) when it is True.
    """
    lock = task.singleton
    try:
        value = engine_for(task.app).client.get(cancel_key(lock.keys))
    except redis.RedisError:
        return False
    return value is not None and bool(lock.task_id) and _text(value) == lock.task_id


class OverlapMixin:
    """The overlap half of :class:`.beat.SingletonSchedulerMixin`."""

    app: Any
    schedule: Any
    producer: Any
    singleton_beat: Any
    singleton_stats: Counter[str]
    _done: dict[str, dt.datetime]

    def _overlap_init(self) -> None:
        self._buffered: dict[str, Any] = {}  # entries this beat polls a buffered tick of
        self._queued: dict[str, Any] = {}  # buffer_all entries this beat polls the queue of
        self._stopped: dict[str, str] = {}  # task id this beat last cancelled/terminated
        self._adopt_at = 0.0  # monotonic time of the next look for others' buffers
        self._adopt_failing = False  # the last look failed (said once, not every second)

    def _send(self, entry: Any, tick: dt.datetime, producer: Any) -> None:
        raise NotImplementedError  # the scheduler's

    # -- the mode -------------------------------------------------------------------

    def singleton_overlap(self, entry: Any) -> str:
        """The entry's overlap mode: its ``singleton_overlap`` option, else the setting."""
        mode = (entry.options or {}).get(OVERLAP_OPTION)
        if mode is None:
            return str(self.singleton_beat.overlap)
        return str(choice(OVERLAP_MODES, "overlap mode")(
            f"{OVERLAP_OPTION} of beat entry {entry.name!r}", mode))

    def _task_keys(self, entry: Any) -> Any:
        """The lock keys the entry's next run takes, or None when it is no SingletonTask."""
        from .task import SingletonTask  # task.py imports beat lazily too

        task = self.app.tasks.get(entry.task)
        if not isinstance(task, SingletonTask):
            return None
        return task.singleton_keys(*_evaluate(entry.args), **_evaluate(entry.kwargs))

    # -- every tick of the scheduler -----------------------------------------------

    def _overlap_before_tick(self) -> bool:
        """Look for others' waiting ticks (once a second) and send the ones
        whose run ended. True when this beat has waiting-mode entries."""
        waiting = [e for e in self.schedule.values()
                   if self.singleton_overlap(e) in WAITING_MODES
                   and self._task_keys(e) is not None]
        if waiting and time.monotonic() >= self._adopt_at:
            self._adopt_buffers(waiting)
            self._adopt_at = time.monotonic() + BUFFER_ADOPT
        if self._buffered:
            self._send_buffered()
        if self._queued:
            self._send_queued()
        return bool(waiting)

    def _overlap_delay(self, delay: float, waiting: bool) -> float:
        if self._buffered or self._queued:
            delay = min(delay, BUFFER_POLL)
        if waiting:
            delay = min(delay, max(self._adopt_at - time.monotonic(), 0.0))
        return delay

    def _adopt_buffers(self, entries: list[Any]) -> None:
        """Take on the waiting ticks this beat does not hold: the beat that
        buffered one may be dead, and nobody would send it. Every beat that
        holds a buffer polls it; ``GETDEL`` / ``ZPOPMIN`` lets one of them send it."""
        client = engine_for(self.app).client
        prefix = get_config(self.app).key_prefix
        for entry in entries:
            queued = self.singleton_overlap(entry) == "buffer_all"
            held = self._queued if queued else self._buffered
            if entry.name in held:
                continue
            key = (queue_key if queued else buffer_key)(prefix, entry.name)
            try:
                waiting = client.exists(key)
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

    def _previous_still_runs(self, entry: Any, tick: dt.datetime, overlap: str) -> bool:
        """True when the tick must not be sent now (skipped, buffered or waiting)."""
        keys = self._task_keys(entry)
        if keys is None:
            return False  # only a SingletonTask's run is visible in Redis
        try:
            if overlap == "buffer_all":
                return not self._arrive_queued(entry, tick, keys)
            record = engine_for(self.app).owner(keys)
        except redis.RedisError as exc:
            logger.warning("Beat entry %r tick %s: could not see whether its previous run "
                           "still runs (%r); sent, the task's own lock decides",
                           entry.name, tick_name(tick), exc)
            return False
        if not record:
            return False
        if overlap == "buffer_one":
            self._buffer(entry, tick, "the previous run still runs")
            return True
        if overlap in ("cancel_other", "terminate_other"):
            self._stop_holder(entry, tick, keys, record, overlap == "terminate_other")
            self._buffer(entry, tick, "it is sent when the previous run ended")
            return True
        self.singleton_stats["overlap_skipped"] += 1
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
                engine_for(self.app).client.set(cancel_key(keys), task_id,
                                                px=RUN_MARKER_TTL_MS)
            self.app.control.revoke(task_id, terminate=terminate)
        except Exception as exc:
            logger.warning("Beat entry %r tick %s: could not %s the running task %s (%r)",
                           entry.name, tick_name(tick),
                           "terminate" if terminate else "cancel", task_id, exc)
            return
        self._stopped[entry.name] = task_id
        counter, verb = (("overlap_terminated", "terminated") if terminate
                         else ("overlap_cancelled", "asked to cancel"))
        self.singleton_stats[counter] += 1
        logger.info("Beat entry %r tick %s: the previous run %s still runs, %s (%s)",
                    entry.name, tick_name(tick), task_id, verb, keys.base)

    # -- buffer_one, cancel_other, terminate_other: one tick waits -------------------

    def _buffer(self, entry: Any, tick: dt.datetime, why: str) -> None:
        """Keep the tick in Redis, replacing an older one: at most one run waits."""
        client = engine_for(self.app).client
        key = buffer_key(get_config(self.app).key_prefix, entry.name)
        try:
            replaced = client.set(key, str(to_ms(tick)), px=RUN_MARKER_TTL_MS, get=True)
        except redis.RedisError as exc:
            self.singleton_stats["backend_error"] += 1
            logger.error("Beat entry %r tick %s not buffered: %s (%r)",
                         entry.name, tick_name(tick), redis_failure(exc), exc)
            return
        if replaced is not None and _text(replaced) != str(to_ms(tick)):
            self.singleton_stats["buffer_dropped"] += 1
            logger.info("Beat entry %r tick %s dropped from the buffer: tick %s is newer",
                        entry.name, tick_name(from_ms(int(replaced))), tick_name(tick))
        self.singleton_stats["buffered"] += 1
        logger.info("Beat entry %r tick %s buffered: %s", entry.name, tick_name(tick), why)
        self._buffered[entry.name] = entry

    def _send_buffered(self) -> None:
        """Send a buffered tick once the run before it ended; GETDEL: one beat sends it."""
        client = engine_for(self.app).client
        prefix = get_config(self.app).key_prefix
        for name, entry in list(self._buffered.items()):
            keys = self._task_keys(entry)
            try:
                if keys is not None and engine_for(self.app).owner(keys):
                    continue
                waiting = client.getdel(buffer_key(prefix, name))
            except redis.RedisError:
                continue
            del self._buffered[name]
            if waiting is None:
                continue  # another beat sent it, or a newer buffer replaced it
            tick = from_ms(int(waiting))
            decided = self._done.get(name)
            if decided is not None and decided > tick:
                # a newer tick was decided meanwhile (sent, buffered or skipped):
                # it stands for this one, which would run late and out of order
                self.singleton_stats["buffer_dropped"] += 1
                logger.info("Beat entry %r tick %s dropped from the buffer: tick %s came "
                            "after it", name, tick_name(tick), tick_name(decided))
                continue
            logger.info("Beat entry %r tick %s sent from the buffer", name, tick_name(tick))
            self._send(entry, tick, self.producer)

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
        client = engine_for(self.app).client
        prefix = get_config(self.app).key_prefix
        raw = client.get(last_sent_key(prefix, name))
        last = _text(raw) if raw is not None else ""
        if last and not client.exists(run_key(prefix, name, from_ms(int(last)))):
            return last, False
        return last, not engine_for(self.app).owner(keys)

    def _arrive_queued(self, entry: Any, tick: dt.datetime, keys: Any) -> bool:
        """buffer_all: True to send the tick now; else it waits (or the queue is full)."""
        client = engine_for(self.app).client
        prefix = get_config(self.app).key_prefix
        last, ended = self._queue_gate(entry.name, keys)
        verdict = _text(_script(
            client, _ARRIVE, [queue_key(prefix, entry.name), last_sent_key(prefix, entry.name)],
            str(to_ms(tick)), last, "1" if ended else "0", self.singleton_beat.buffer_max,
            RUN_MARKER_TTL_MS, self.singleton_beat.claim_ttl_ms))
        if verdict == "send":
            return True
        if verdict == "full":
            self.singleton_stats["buffer_dropped"] += 1
            logger.info("Beat entry %r tick %s dropped: %d ticks already wait "
                        "(singleton_beat_buffer_max)", entry.name, tick_name(tick),
                        self.singleton_beat.buffer_max)
        else:
            self.singleton_stats["buffered"] += 1
            logger.info("Beat entry %r tick %s buffered: the previous run still runs",
                        entry.name, tick_name(tick))
        self._queued[entry.name] = entry
        return False

    def _send_queued(self) -> None:
        """Send the oldest waiting tick of each queue whose previous run ended."""
        client = engine_for(self.app).client
        prefix = get_config(self.app).key_prefix
        for name, entry in list(self._queued.items()):
            keys = self._task_keys(entry)
            try:
                last, ended = self._queue_gate(name, keys)
                if not ended:
                    continue
                taken = _script(client, _TAKE, [queue_key(prefix, name),
                                                last_sent_key(prefix, name)],
                                last, self.singleton_beat.claim_ttl_ms)
            except redis.RedisError:
                continue
            if taken == -1:
                del self._queued[name]  # nothing waits
                continue
            if taken == 0:
                continue  # another beat sent one: its run comes first
            tick = from_ms(int(taken))
            logger.info("Beat entry %r tick %s sent from the buffer", name, tick_name(tick))
            self._send(entry, tick, self.producer)
