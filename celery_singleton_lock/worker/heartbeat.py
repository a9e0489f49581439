"""Renewal: one renewer per worker process, every held lock in one Redis call
per interval.

The thread starts with the first lock the process takes (so after fork). It
sleeps in ``select`` on two things: a wake-up pipe (a lock with a shorter lease
arrived) and its watch (:mod:`..engine.watch`), a connection of its own to the lock
Redis that turns readable the moment the server goes away, so the renewer
learns of it at once instead of at its next round, and re-asserts every held
lock as soon as Redis answers again. On a Cluster it watches every primary the
same way, with Redlock every master (a lock held on a majority is written back
on a master that lost it).

Each round, per lock: renewed; handed to a retry (left alone); held by another
execution (lost, at once); or absent. An absent key whose local lease is still
valid is asked about at once, in the same order whichever round or watch found
it: if its fencing counter is gone too, Redis forgot it (restarted empty,
flushed) and it is written back, under a new, higher fencing token, so later
grants stay above it; the task keeps the token it was granted, so a resource
that saw a newer writer meanwhile still refuses it. If the counter is there,
the key was released (an operator) or ran out, and the lock is lost; so it is
when another execution holds it. A Redis error leaves the locks alone, and
each lock's own monotonic deadline makes it lost if no renewal succeeds in
time.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
import weakref
from typing import Optional

import redis

from .. import rollout
from ..engine.base import Engine
from ..engine.replies import Reclaim, Renew
from ..engine.watch import RECONNECT_MAX
from ..exceptions import describe
from ..lock import SingletonLock
from ..observe import monitor
from ..process import ForkSafeLock

logger = logging.getLogger("celery_singleton_lock")

#: a lease is renewed when a third of it has passed
RENEW_FRACTION = 3.0
#: how soon a renewal round that got no answer is tried again
RETRY_FAILED = 0.5
#: how soon the renewer reads the replies of releases sent without waiting
#: when no lock call of the process has read them
SETTLE_WITHIN = 0.5
#: how long the renewer waits, when its watch got an answer, for the wire's
#: lock calls to go through again (its owed calls sent first: see outage.py)
RESUME_WAIT = 0.5


class Heartbeat:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._held: dict[int, SingletonLock] = {}
        self._mutex = ForkSafeLock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._thread: Optional[threading.Thread] = None
        self._sleeping: Optional[float] = None  # the renewer's current interval
        # With nothing held the renewer still wakes this often, so a lock with
        # the usual lease never has to wake it: taking a lock is a dict insert.
        self.idle_interval = engine.config.ttl / RENEW_FRACTION
        self.watch = engine.watch()
        self.rounds = 0
        self.reasserted = 0
        self.failed_rounds = 0  # in a row, since the last round that got through
        #: a server came back: a round is owed at once, until one gets through
        self._owed = False
        #: when to read the replies of releases sent since (see :meth:`discard`)
        self._settle_at: Optional[float] = None

    def add(self, lock: SingletonLock) -> None:
        """Renew ``lock`` from now on. A grant whose confirmation is still to be
        read has it read within :data:`SETTLE_WITHIN`, or half of what is left
        of the grant's short window if that is sooner (:meth:`_step` settles),
        not only with the process's next lock call: a long task makes none
        until its renewal, and until the answer is read the lock counts only
        on that window. One wake-up serves every lock taken meanwhile; a short
        task's release reads the answer first anyway."""
        with self._mutex.lock:
            self._held[id(lock)] = lock
            until = lock.confirm_until
            if until is not None:
                now = time.monotonic()
                due = now + max(min(SETTLE_WITHIN, (until - now) / 2), 0.0)
                if self._settle_at is None or self._settle_at > due:
                    self._settle_at = due  # the renewer's wait is shortened to it
                    if self._thread is not None:
                        os.write(self._wake_w, b"s")
            if self._thread is None:  # set back to None if the renewer ever ends
                self._thread = threading.Thread(
                    target=self._run, name="singleton-heartbeat", daemon=True
                )
                self._thread.start()
            elif self._sleeping is not None and (
                    lock.lease.seconds / RENEW_FRACTION < self._sleeping):
                # the renewer sleeps longer than this lease allows: wake it to reschedule
                os.write(self._wake_w, b"x")

    def discard(self, lock: SingletonLock) -> None:
        """``lock`` is no longer held; its release follows, sent without
        waiting: the renewer reads its reply within :data:`SETTLE_WITHIN` if
        no lock call of this process does first, so a release the server
        never answers (frozen, failing over) is owed and sent again at once,
        not a round later (one wake-up per that long, however many end)."""
        with self._mutex.lock:
            self._held.pop(id(lock), None)
            if self._settle_at is None and self._thread is not None:
                self._settle_at = time.monotonic() + SETTLE_WITHIN
                os.write(self._wake_w, b"s")

    def held(self) -> list[SingletonLock]:
        with self._mutex:
            return list(self._held.values())

    def _interval_locked(self) -> float:
        if not self._held:
            return self.idle_interval
        return min(lock.lease.seconds for lock in self._held.values()) / RENEW_FRACTION

    def _run(self) -> None:
        try:
            with self._mutex:
                self._sleeping = self._interval_locked()
            next_round = time.monotonic() + self._sleeping
            while True:
                try:
                    next_round = self._step(next_round)
                except Exception:  # never let the renewer die
                    logger.exception("Singleton heartbeat round failed")
                    time.sleep(RECONNECT_MAX)
        finally:  # only a BaseException ends it: the next add starts another
            with self._mutex:
                self._thread = None

    def _step(self, next_round: float) -> float:
        """Wait for the round, a wake-up or the server going away; act; the next
        round's time."""
        fds, back = self.watch.poll()
        if back:
            restarted = any(b.restarted for b in back)
            logger.info("Lock Redis is back (%s): re-asserting held locks at once",
                        "restarted" if restarted else "same server or not told")
            self._owed = True
            for b in back:  # the watch got an answer: so do lock calls, at once
                if b.outage is not None:
                    b.outage.answered_elsewhere(RESUME_WAIT)
            return self._reassert()
        timeout = max(next_round - time.monotonic(), 0.0)
        retry_in = self.watch.retry_in
        if retry_in is not None:
            timeout = min(timeout, retry_in)
        settle_at = self._settle_at
        if settle_at is not None:
            timeout = min(timeout, max(settle_at - time.monotonic(), 0.0))
        ready, _, _ = select.select([self._wake_r, *fds], [], [], timeout)
        if self._wake_r in ready:
            self._drain_wake()
        try:
            # replies of releases sent without waiting, when no later call read them
            if settle_at is not None and time.monotonic() >= settle_at:
                self._settle_at = None
            self.engine.settle()
        except Exception:
            logger.exception("Reading singleton lock replies failed")
        lost = [fd for fd in fds if fd in ready and self.watch.gone(fd)]
        if lost:
            # with nothing held nothing is at stake (a test suite's Redis
            # stopping at its end, say): not a warning
            held = len(self.held())
            logger.log(logging.WARNING if held else logging.DEBUG,
                       "Lost the connection to the lock Redis, holding %d lock(s): watching "
                       "for its return", held)
            return next_round
        if self._wake_r in ready:
            # woken by a shorter lease: reschedule (never later than planned)
            return min(next_round, time.monotonic() + self._current_interval())
        if time.monotonic() < next_round:
            return next_round  # a reconnect attempt was due, not the round
        if self._owed:
            return self._reassert()
        if self.renew_now():
            return time.monotonic() + self._current_interval()
        # not answered (Redis down, a Cluster primary failing over): ask again
        # soon rather than a third of a lease later, while the leases still run
        return time.monotonic() + min(RETRY_FAILED, self._current_interval())

    def _reassert(self) -> float:
        """Renew now (a key the server forgot is written back); until such a
        round gets through (a restarted Cluster node refuses calls until it
        has rejoined), try again every :data:`RETRY_FAILED` seconds."""
        if self.renew_now(take_back=True):
            self._owed = False
            return time.monotonic() + self._current_interval()
        return time.monotonic() + RETRY_FAILED

    def _current_interval(self) -> float:
        with self._mutex:
            self._sleeping = self._interval_locked()
            return self._sleeping

    def _drain_wake(self) -> None:
        """Read the wake-up bytes, only while ``select`` says some are there:
        eventlet's monkey-patched ``os.read`` waits for data on an empty pipe
        instead of raising BlockingIOError, which stopped the renewer for good."""
        try:
            while select.select([self._wake_r], [], [], 0)[0]:
                if not os.read(self._wake_r, 512):
                    return
        except BlockingIOError:
            pass

    def renew_now(self, take_back: bool = False) -> bool:
        """One round: renew every held lock in one call.

        A key found absent while its local lease is valid is written back when
        Redis forgot it (restarted empty: the key's fencing counter is gone
        too), and lost when someone released it (``celery singleton release
        --force``) or another execution has it (:meth:`_take_back`), whichever
        thread or watch noticed first. ``take_back``: a server just came back;
        with Redlock every master is heard, the one that came back included.

        True when every lock got an answer; False after a Redis error, or when
        the node of some lock did not answer (a Cluster node still rejoining).
        """
        # a lock handed to a retry is the retry's to renew; one lost is
        # renewed nowhere (on Redlock, the masters that still have it would
        # keep it alive for nobody: its holder was told it is lost)
        locks = [lock for lock in self.held() if not lock.handed_off and not lock.gone]
        if not locks:
            return True
        sent_at = time.monotonic()
        entries = [(lock.keys.lock, lock.exec_id, lock.lease.ms) for lock in locks]
        gaps: list[list[int]] = []
        try:
            # after a server came back, hear it too: it answers last
            results, gaps = self.engine.renew_round(entries, every=take_back)
        except redis.RedisError as exc:
            # said once per outage: failed rounds are tried again every 0.5 s
            logger.log(logging.DEBUG if self.failed_rounds else logging.WARNING,
                       "Could not renew %d singleton lock(s): %s", len(locks), describe(exc))
            self.failed_rounds += 1
            for lock in locks:
                monitor.count(self.engine, "renew_failed", lock.task_name)  # metrics
                _ = lock.lost  # mark and log the ones whose deadline passed
            return False
        if self.failed_rounds:
            logger.info("Renewing singleton locks again, after %d failed round(s)",
                        self.failed_rounds)
            self.failed_rounds = 0
        self.rounds += 1
        companions = []
        for i, (lock, result) in enumerate(zip(locks, results)):
            if result is Renew.RENEWED:
                lock.renewed(sent_at)
                if lock.companion is not None:
                    companions.append((lock.companion, lock.lease.ms))
                if gaps and gaps[i]:
                    self._refill(lock, gaps[i])
            elif result is Renew.ABSENT and lock.held and not lock.handed_off:
                self._take_back(lock, sent_at)
            elif result is Renew.NOT_OURS and lock.held and not lock.handed_off:
                lock.mark_lost("renewal found the lock held by another execution")
        if companions:  # singleton_also_lock: the old library's keys live as long
            rollout.renew(companions)
        return Renew.UNANSWERED not in results

    def _refill(self, lock: SingletonLock, masters: list[int]) -> None:
        """Redlock: the lock is held on a majority but some masters answered
        that they no longer have it: write it back on them."""
        def still_held() -> bool:
            with self._mutex:
                mine = self._held.get(id(lock)) is lock
            return mine and lock.held and not lock.handed_off and not lock.gone

        self.engine.refill(lock.keys, lock.request, lock.token, only=masters,
                           still_held=still_held)

    def _take_back(self, lock: SingletonLock, sent_at: float) -> None:
        """A renewal found the key of a lock whose local lease is still valid
        gone: write the owner record again, with a higher fencing token, if
        Redis forgot it; lost if it was released or another execution has it."""
        if lock.gone:
            return  # the lease ran out locally: too late to take anything back
        try:
            answer = self.engine.reclaim(lock.keys, lock.request, lock.token)
        except redis.RedisError as exc:
            logger.warning("Could not take back singleton lock %s: %s", lock.key, describe(exc))
            return
        if answer.status is Reclaim.WRITTEN_BACK:
            self.reasserted += 1
            lock.renewed(sent_at)
            logger.warning(
                "Took back singleton lock %s of %s[%s]: Redis had forgotten its key "
                "(new record token %s; the task keeps token %s)",
                lock.key, lock.task_name, lock.task_id, answer.token, lock.token)
        elif answer.status is Reclaim.OURS:
            lock.renewed(sent_at)
        elif answer.status is Reclaim.HELD:
            holder = answer.holder.task_id if answer.holder is not None else "?"
            lock.mark_lost(f"its key was gone from Redis and {holder} has it now")
        else:
            lock.mark_lost("renewal found the lock gone (released, or expired)")


#: each engine's heartbeat, kept here: the renewer belongs to the worker, not
#: to the engine it renews through
_heartbeats: weakref.WeakKeyDictionary[Engine, Heartbeat] = weakref.WeakKeyDictionary()
_create_lock = ForkSafeLock()


def heartbeat_for(engine: Engine) -> Heartbeat:
    """The heartbeat of ``engine`` (engines are per process already)."""
    hb = _heartbeats.get(engine)
    if hb is None:
        with _create_lock:
            hb = _heartbeats.get(engine)
            if hb is None:
                hb = _heartbeats[engine] = Heartbeat(engine)
                monitor.PUBLISHER.held_from(engine, hb.held)  # shown by inspect and Flower
    return hb


def running_heartbeat(engine: Engine) -> Optional[Heartbeat]:
    """``engine``'s heartbeat if this process made one (it holds or held a lock)."""
    return _heartbeats.get(engine)
