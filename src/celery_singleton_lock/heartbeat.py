"""One renewer per worker process: every held lock, one Redis call per interval.

The thread starts with the first lock the process takes (so after fork) and
sleeps on an Event between rounds. A lock whose renewal answers "not ours" is
marked lost at once; a Redis error leaves the lock alone, and the lock's own
monotonic deadline makes it lost if no renewal succeeds in time.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

import redis

from .lock import LockEngine, SingletonLock

logger = logging.getLogger("celery_singleton_lock")

#: a lease is renewed when a third of it has passed
RENEW_FRACTION = 3.0


class Heartbeat:
    def __init__(self, engine: LockEngine) -> None:
        self.engine = engine
        self._held: dict[int, SingletonLock] = {}
        self._mutex = threading.Lock()
        self._wake = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._sleeping: Optional[float] = None  # the renewer's current wait
        # With nothing held the renewer still wakes this often, so a lock with
        # the usual lease never has to wake it: taking a lock is a dict insert.
        self.idle_interval = engine.config.ttl / RENEW_FRACTION
        self.rounds = 0

    def add(self, lock: SingletonLock) -> None:
        with self._mutex:
            self._held[id(lock)] = lock
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="singleton-heartbeat", daemon=True
                )
                self._thread.start()
            elif self._sleeping is not None and lock.lease / RENEW_FRACTION < self._sleeping:
                # the renewer sleeps longer than this lease allows: wake it to reschedule
                self._wake.set()

    def discard(self, lock: SingletonLock) -> None:
        with self._mutex:
            self._held.pop(id(lock), None)

    def held(self) -> list[SingletonLock]:
        with self._mutex:
            return list(self._held.values())

    def _interval_locked(self) -> float:
        if not self._held:
            return self.idle_interval
        return min(lock.lease for lock in self._held.values()) / RENEW_FRACTION

    def _run(self) -> None:
        while True:
            with self._mutex:
                self._sleeping = self._interval_locked()
                self._wake.clear()
            woken = self._wake.wait(self._sleeping)
            try:
                # replies of releases sent without waiting, when no later call read them
                self.engine.settle()
            except Exception:
                logger.exception("Reading singleton lock replies failed")
            if woken:
                # woken by a shorter lease: only the schedule changes (a wake
                # never lengthens any lock's wait, so skipping this round is safe)
                continue
            try:
                self.renew_now()
            except Exception:  # never let the renewer die
                logger.exception("Singleton heartbeat round failed")

    def renew_now(self) -> None:
        """One round: renew every held lock in one call."""
        locks = [lock for lock in self.held() if not lock.handed_off]
        if not locks:
            return
        sent_at = time.monotonic()
        entries = [(lock.keys.lock, lock.exec_id, int(lock.lease * 1000)) for lock in locks]
        try:
            results = self.engine.renew(entries)
        except redis.RedisError as exc:
            logger.warning("Could not renew %d singleton lock(s): %r", len(locks), exc)
            for lock in locks:
                _ = lock.lost  # mark and log the ones whose deadline passed
            return
        self.rounds += 1
        for lock, result in zip(locks, results):
            if result == 1:
                lock.renewed(sent_at)
            elif result == 0 and lock.held and not lock.handed_off:
                lock.mark_lost("renewal found the lock expired or held by another execution")


def heartbeat_for(engine: LockEngine) -> Heartbeat:
    """The heartbeat of ``engine`` (engines are per process already)."""
    hb = engine.heartbeat
    if hb is None:
        with _create_lock:
            hb = engine.heartbeat
            if hb is None:
                hb = engine.heartbeat = Heartbeat(engine)
    assert isinstance(hb, Heartbeat)
    return hb


_create_lock = threading.Lock()
