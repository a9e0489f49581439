"""Redlock: every lock on a majority of N independent masters.

:class:`RedlockEngine` is a :class:`~.engine.LockEngine` made of one plain
engine per master. Each operation runs the same script on every master, as
one server would, and combines their answers; the scripts stay the only place
where lock logic lives.

- **Acquire** is granted when a majority granted within the validity time: the
  lease minus the clock drift allowed (1 % of it plus 2 ms). Otherwise every
  master that may have granted is released and the answer is the refusal most
  masters gave (HELD, naming the holder), or :class:`QuorumError` (a Redis
  error: ``singleton_on_backend_error`` decides) when failures, not a holder,
  kept a majority out of reach.
- **Fencing tokens**: each master grants its own (counter + 1, floored at its
  clock in microseconds). The quorum's token is the largest of them, written
  back as the counter of every granted master that gave less before it is
  handed out, and only once a majority carries it (masters that had not
  answered yet get it too, not waited for). Any later majority shares
  a master with this one, whose counter is then at least this token: the next
  token is larger.
- **Renew** on every master: a lock stays held while a majority renewed it;
  fewer answers leave it alone (its deadline makes it lost, as a lapsed lease),
  a majority that no longer has it makes it lost at once. A master that says
  it no longer has a lock a majority renewed (restarted empty) gets it written
  back (:meth:`RedlockEngine.refill`, from the renewer): :mod:`.renewal`.
- **Claims** (beat's tick claims, the worker's tick-run markers) and the
  queue scopes' send-time key: won on a majority; claimants that split the
  masters give back and try again: :mod:`.claims`.
- **Release** on every master; one that does not answer is left to its TTL.

Calls to the masters go out concurrently (:mod:`.quorum`): a call waits until
the answer is decided or every master answered, never longer than
:attr:`RedlockEngine.call_timeout`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Any, Callable, Optional, Sequence

import redis

from ...config import SingletonConfig
from ...exceptions import ConfigurationError, QuorumError
from ...keys import LockKeys
from ..base import Engine, Entry, Watch
from ..replies import (
    Acquire,
    Acquired,
    Confirmation,
    Enqueued,
    Reclaimed,
    Release,
    Released,
    Renew,
)
from ..request import Request
from ..server import LockEngine
from ..servers import CLIENT_DEFAULTS, make_clients
from ..watch import MastersWatch
from ..wire import Wire
from .claims import Claims, no_replace
from .quorum import MISSING, Master, Masters, _settled_by
from .renewal import Renewal

logger = logging.getLogger("celery_singleton_lock")

#: what each master's client gets unless the URL or ``singleton_redis_options``
#: say otherwise: a master that hangs must cost a call far less than a lease
REDLOCK_CLIENT_DEFAULTS: dict[str, Any] = {
    "socket_timeout": 0.5,
    "socket_connect_timeout": 0.5,
}

#: clock drift allowed per lease (the Redlock rule: 1 % of it plus 2 ms)
DRIFT_FACTOR = 0.01
DRIFT_MS = 2


class RedlockEngine(Engine):
    """All Redis work of one process for one app, on a majority of masters.

    Made of one :class:`~..server.LockEngine` per master, the
    :class:`~.quorum.Masters` that reach them all, and the two parts that
    combine their answers beside the lock's own operations: :class:`~.claims.
    Claims` (send-time keys, tick claims) and :class:`~.renewal.Renewal`.
    """

    def __init__(self, masters: Sequence[tuple[str, redis.Redis]],
                 config: SingletonConfig) -> None:
        if len(masters) < 3 or len(masters) % 2 == 0:
            raise ValueError(f"Redlock needs an odd number of masters, at least 3: "
                             f"got {len(masters)}")
        #: one plain engine per master, and each as the quorum reaches it
        self._engines = [LockEngine(client, config) for _, client in masters]
        self.masters = [Master(name, engine)
                        for (name, _), engine in zip(masters, self._engines)]
        first = self.masters[0].engine
        self.config = config
        #: stats, held-lock listings and beat tick claims live on the first master
        self.client = first.client
        kwargs = first.client.connection_pool.connection_kwargs
        timeout = float(kwargs.get("socket_timeout") or 5.0)
        connect = float(kwargs.get("socket_connect_timeout") or timeout)
        #: every call reaches the masters through it; one waits at most twice
        #: a timeout and a connect (a broken connection is tried once more)
        self.majority = Masters(self.masters, call_timeout=2 * (timeout + connect))
        self.claims = Claims(self.majority)
        self.renewal = Renewal(self.majority)

    @property
    def quorum(self) -> int:
        return self.majority.quorum

    @property
    def call_timeout(self) -> float:
        return self.majority.call_timeout

    @property
    def refilled(self) -> int:
        """Locks written back on a master that had lost them."""
        return self.renewal.refilled

    def servers(self) -> list[tuple[str, Any]]:
        return [(m.name, m.engine.client) for m in self.masters]

    @property
    def down(self) -> bool:
        """Too few masters answer for a majority."""
        return sum(m.engine.down for m in self.masters) > len(self.masters) - self.quorum

    def watch(self) -> Watch:
        wires = []
        for master, engine in zip(self.masters, self._engines):
            wire = engine.wire
            assert isinstance(wire, Wire)  # a redlock:// URL names plain servers
            wires.append((master.name, wire))
        return MastersWatch(wires)

    def clock_offset(self, ask: bool = False) -> Optional[float]:
        """The first master's that answers (their clocks are apart by far less
        than a wait is long: the lease's drift allowance says so)."""
        for master in self.masters:
            try:
                offset = master.engine.clock_offset(ask)
            except redis.RedisError:
                continue
            if offset is not None:
                return offset
        return None

    def lease_margin(self, lease: float) -> float:
        """The clock drift allowed (1 % of the lease plus 2 ms): the masters'
        clocks may run that much fast, so the holder's deadline comes that much
        before the lease's end, at grant and after each renewal."""
        return lease * DRIFT_FACTOR + DRIFT_MS / 1000.0

    @classmethod
    def from_config(cls, config: SingletonConfig) -> RedlockEngine:
        defaults = {**CLIENT_DEFAULTS, **REDLOCK_CLIENT_DEFAULTS}
        options = {**config.redis_options, "decode_responses": True}
        return cls(make_clients(config.redis_url, options, defaults), config)

    # -- the lock operations -------------------------------------------------------

    def acquire(self, keys: LockKeys, request: Request) -> Acquired:
        """Take the lock on a majority of the masters within the validity time
        (``rate`` is refused by the settings' check: :func:`refusals`)."""
        if request.slots > 1:
            # each master could grant a different slot: no majority would hold one
            raise ConfigurationError("singleton_limit", f"{request.slots} slots per key: not "
                                     "on Redlock (one server, Sentinel or Cluster only)")
        if request.replace:
            raise no_replace()
        exec_id, task_id, lease_ms = request.exec_id, request.task_id, request.lease.ms
        started = time.monotonic()
        validity = lease_ms / 1000.0 - self.lease_margin(lease_ms / 1000.0)
        quorum, total = self.quorum, len(self.masters)

        def granted(r: Any) -> bool:
            return isinstance(r, Acquired) and r.status is Acquire.GRANTED

        decided = _settled_by(quorum, Acquired, granted)
        results = self.majority.each(
            lambda e: e.acquire(keys, request),
            decided=decided, timeout=min(self.call_timeout, max(validity, 0.0)))
        grants = [i for i, r in enumerate(results) if granted(r)]
        if len(grants) >= quorum:
            token = max(results[i].token for i in grants)
            carried = self._carry(keys, exec_id, token, results, grants)
            elapsed = time.monotonic() - started
            if carried >= quorum and elapsed < validity:
                late = [i for i, r in enumerate(results) if r is MISSING]
                if late:
                    # a master still answering may grant below the token: raise
                    # it there too, after its acquire (not waited for)
                    self.majority.each(lambda e: e.raise_fence(keys, exec_id, token), only=late,
                              timeout=0.0)
                return Acquired(Acquire.GRANTED, token=token, confirmation=_of_majority(
                    [results[i].confirmation for i in grants], quorum, started))
            self._give_back(keys, exec_id, task_id, results)
            failed = {} if carried >= quorum else self.majority.failed(
                results, lambda r: granted(r) and r.token == token)
            raise QuorumError(
                f"lock {keys.base} granted by a majority but "
                + ("too late: the validity time had passed" if carried >= quorum else
                   "its fencing token could not be put on a majority"),
                failed, carried, quorum)
        self._give_back(keys, exec_id, task_id, results)
        refusals = [r for r in results if isinstance(r, Acquired) and not granted(r)]
        unknown = total - len(grants) - len(refusals)
        if len(grants) + unknown < quorum:
            # out of reach even had every master that failed granted: a holder
            # decided it, not an outage
            return self._most_given(refusals)
        raise QuorumError(
            f"lock {keys.base} not decided ({len(grants)} master(s) granted it, "
            f"{len(refusals)} refused: neither is a majority)", self.majority.failed(
            results, lambda r: isinstance(r, Acquired)), len(grants) + len(refusals), quorum)

    def _carry(self, keys: LockKeys, exec_id: str, token: int, results: list[Any],
               grants: list[int]) -> int:
        """Put ``token`` on the granted masters that gave less; how many carry it."""
        lower = [i for i in grants if results[i].token < token]
        carried = len(grants) - len(lower)
        if lower:
            raised = self.majority.each(lambda e: e.raise_fence(keys, exec_id, token), only=lower,
                               decided=lambda rs: carried + sum(r is True for r in rs)
                               >= self.quorum)
            carried += sum(1 for r in raised if r is True)
        return carried

    def _give_back(self, keys: LockKeys, exec_id: str, task_id: str,
                   results: list[Any]) -> None:
        """Release wherever this execution may hold the key (a refusal is not it)."""
        mine = [i for i, r in enumerate(results)
                if not (isinstance(r, Acquired) and r.status is not Acquire.GRANTED)]
        if mine:
            # not waited for: each master's queue sends it after the acquire
            self.majority.each(lambda e: e.release(keys, exec_id, task_id, finished=False),
                               only=mine, timeout=0.0, skip_stale=False)

    @staticmethod
    def _most_given(refusals: list[Acquired]) -> Acquired:
        """The refusal most masters gave (the first among equals)."""
        def name(a: Acquired) -> tuple[Any, ...]:
            return (a.status, a.holder.exec_id if a.holder else "",
                    a.holder.task_id if a.holder else "")
        counts = Counter(name(a) for a in refusals)
        best = max(counts.values())
        return next(a for a in refusals if counts[name(a)] == best)

    def release(self, keys: LockKeys, exec_id: str, task_id: str, *, finished: bool = True,
                always_record: bool = False, done_ms: int = 0, task_name: str = ""
                ) -> bool:
        """Release on every master; True when it freed the lock on any (a
        master that does not answer keeps it until its TTL)."""
        results = self.majority.each(
            lambda e: e.release(keys, exec_id, task_id, finished=finished,
                                always_record=always_record, done_ms=done_ms,
                                task_name=task_name),
            decided=lambda rs: sum(r is True for r in rs) >= self.quorum, skip_stale=False)
        if all(isinstance(r, Exception) or r is MISSING for r in results):
            raise QuorumError(f"release of {keys.base}", self.majority.failed(
                results, lambda r: isinstance(r, bool)), 0, self.quorum)
        return any(r is True for r in results)

    def release_later(
        self,
        keys: LockKeys,
        exec_id: str,
        task_id: str,
        answered: Callable[[Optional[Released], Optional[Exception]], None],
        *,
        always_record: bool = False,
        done_ms: int = 0,
        task_name: str = "",
        finished: bool = True,
    ) -> None:
        """:meth:`release` without waiting: each master's queue sends it before
        anything this process sends that master next; ``answered`` is called
        once, when a majority released or every master answered."""
        results: list[Any] = [MISSING] * len(self.masters)
        told = [False]
        mutex = threading.Lock()
        quorum = self.quorum

        def freed(r: Any) -> bool:
            return isinstance(r, Released) and (
                r.status is Release.RELEASED or (r.status is Release.FREE and r.repeated))

        def tell() -> Optional[tuple[Optional[Released], Optional[Exception]]]:
            ok = sum(1 for r in results if freed(r))
            if ok >= quorum:
                return Released(Release.RELEASED), None
            if any(r is MISSING for r in results):
                return None
            given = [r for r in results if isinstance(r, Released)]
            if len(given) < quorum:
                return None, QuorumError(f"release of {keys.base}", self.majority.failed(
                    results, lambda r: isinstance(r, Released)), len(given), quorum)
            taken = sum(1 for r in given if r.status is Release.TAKEN)
            free = sum(1 for r in given if r.status is Release.FREE)
            return Released(Release.TAKEN if taken > free else Release.FREE), None

        def one(i: int) -> Callable[[Optional[Released], Optional[Exception]], None]:
            def got(reply: Optional[Released], error: Optional[Exception]) -> None:
                with mutex:
                    results[i] = error if error is not None else reply
                    if told[0]:
                        return
                    outcome = tell()
                    if outcome is None:
                        return
                    told[0] = True
                answered(*outcome)
            return got

        def send(i: int) -> Callable[[], None]:
            def run() -> None:
                try:
                    self.masters[i].engine.release_later(
                        keys, exec_id, task_id, one(i), always_record=always_record,
                        done_ms=done_ms, task_name=task_name, finished=finished)
                except Exception as exc:
                    one(i)(None, exc)
            return run

        for i, master in enumerate(self.masters):
            master.submit(send(i))

    def hand_off(self, keys: LockKeys, exec_id: str, next_retries: int, lease_ms: int) -> bool:
        results = self.majority.each(lambda e: e.hand_off(keys, exec_id, next_retries, lease_ms),
                            decided=lambda rs: sum(r is True for r in rs) >= self.quorum)
        return sum(1 for r in results if r is True) >= self.quorum

    def owner(self, keys: LockKeys) -> dict[str, str]:
        """The owner record most masters hold (empty when none holds one)."""
        results = self.majority.each(lambda e: e.owner(keys))
        records = [r for r in results if isinstance(r, dict)]
        if len(records) < self.quorum:
            raise QuorumError(f"reading the owner of {keys.base}", self.majority.failed(
                results, lambda r: isinstance(r, dict)), len(records), self.quorum)
        held = Counter(r.get("exec", "") for r in records if r.get("exec"))
        if not held:
            return {}
        top = held.most_common(1)[0][0]
        chosen: dict[str, str] = next(r for r in records if r.get("exec") == top)
        return chosen

    def raise_fence(self, keys: LockKeys, exec_id: str, token: int) -> bool:
        return self._carry(keys, exec_id, token, [
            Acquired(Acquire.GRANTED, token=0)] * len(self.masters),
            list(range(len(self.masters)))) >= self.quorum

    # -- what the two parts do ----------------------------------------------------

    def renew(self, entries: Sequence[Entry]) -> list[Renew]:
        return self.renewal.renew_round(entries)[0]

    def renew_round(self, entries: Sequence[Entry], *, every: bool = False
                    ) -> tuple[list[Renew], list[list[int]]]:
        return self.renewal.renew_round(entries, every=every)

    def refill(self, keys: LockKeys, request: Request, token: int, *,
               only: Sequence[int], still_held: Callable[[], bool]) -> None:
        self.renewal.refill(keys, request, token, only=only, still_held=still_held)

    def reclaim(self, keys: LockKeys, request: Request, token: int) -> Reclaimed:
        return self.renewal.reclaim(keys, request, token)

    def enqueue(self, keys: LockKeys, task_id: str, scope: str, ttl_ms: int,
                task_name: str = "", replace: Optional[tuple[int, int]] = None,
                done: bool = True) -> Enqueued:
        return self.claims.enqueue(keys, task_id, scope, ttl_ms, task_name, replace, done)

    def unqueue(self, keys: LockKeys, task_id: str) -> bool:
        return self.claims.unqueue(keys, task_id)

    def _as_most_say(self, results: list[Any], what: str) -> Any:
        """What most masters answered (a majority answered at all), the
        answer of each master being a value or None; else QuorumError."""
        answered = [r for r in results if r is not MISSING and not isinstance(r, Exception)]
        if len(answered) < self.quorum:
            raise QuorumError(what, self.majority.failed(
                results, lambda r: r is not MISSING and not isinstance(r, Exception)),
                len(answered), self.quorum)
        said = Counter(repr(r) for r in answered).most_common(1)[0][0]
        return next(r for r in answered if repr(r) == said)

    def read(self, key: str) -> Optional[str]:
        said: Optional[str] = self._as_most_say(self.majority.each(lambda e: e.read(key)),
                                                f"reading {key}")
        return said

    def write(self, key: str, value: str, ttl_ms: int, *, previous: bool = False
              ) -> Optional[str]:
        results = self.majority.each(lambda e: e.write(key, value, ttl_ms, previous=previous))
        said: Optional[str] = self._as_most_say(results, f"writing {key}")
        return said

    def take(self, key: str) -> Optional[str]:
        said: Optional[str] = self._as_most_say(
            self.majority.each(lambda e: e.take(key), skip_stale=False), f"taking {key}")
        return said

    def present(self, key: str) -> bool:
        return bool(self._as_most_say(self.majority.each(lambda e: e.present(key)),
                                      f"reading {key}"))

    def run_script(self, script: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        return self._as_most_say(self.majority.each(lambda e: e.run_script(script, keys, args)),
                                 f"{getattr(script, 'name', 'a script')} on {keys[0]}")

    def read_hash(self, key: str) -> dict[str, str]:
        """The first master's that answers (counters: every master is written alike)."""
        results = self.majority.each(lambda e: e.read_hash(key))
        for result in results:
            if isinstance(result, dict):
                return result
        raise QuorumError(f"reading {key}", self.majority.failed(
            results, lambda r: isinstance(r, dict)), 0, self.quorum)

    def update_hash(self, key: str, *, add: Optional[dict[str, float]] = None,
                    put: Optional[dict[str, str]] = None, drop: Sequence[str] = (),
                    ttl_s: int = 0) -> None:
        results = self.majority.each(lambda e: e.update_hash(key, add=add, put=put, drop=drop,
                                                             ttl_s=ttl_s))
        if sum(1 for r in results if r is None) < self.quorum:
            raise QuorumError(f"writing {key}", self.majority.failed(
                results, lambda r: r is None), sum(1 for r in results if r is None),
                self.quorum)

    def queued_by(self, keys: LockKeys) -> str:
        return self.claims.queued_by(keys)

    def claim(self, key: str, value: str, ttl_ms: int) -> tuple[bool, str]:
        return self.claims.claim(key, value, ttl_ms)

    def unclaim(self, key: str, value: str) -> bool:
        return self.claims.unclaim(key, value)

    # -- replies owed --------------------------------------------------------------

    def settle(self) -> None:
        """Have every master's thread read the replies it still owes (not
        waited for: each reads them in its own queue, before its next call)."""
        self.majority.each(lambda e: e.settle(), timeout=0.0, skip_stale=False)

    @property
    def unsettled(self) -> int:
        return sum(m.engine.unsettled for m in self.masters)

    def close(self) -> None:
        for engine in self._engines:
            engine.wire.close()


def _of_majority(each: list[Optional[Confirmation]], quorum: int, started: float
                 ) -> Optional[Confirmation]:
    """The confirmation of a grant held on a majority, from each master's
    (None: a grant without a deadline, which lives its lease from the grant):
    the lock is surely held until the last moment ``quorum`` of the masters'
    grants surely are, and confirmed once ``quorum`` of them are (its lease
    from the earliest of their confirmations); in doubt at once when too
    few can be any more. None when a majority needs no confirmation."""
    without = sum(c is None for c in each)
    if without >= quorum:
        return None
    untils = sorted((float("inf") if c is None else c.until for c in each), reverse=True)
    out = Confirmation(untils[quorum - 1],
                       min(started if c is None else c.sent_at for c in each))
    mutex = threading.Lock()
    renewed, other = without, 0

    def heard(answer: Renew, _sent_at: float) -> None:
        nonlocal renewed, other
        with mutex:
            if answer is Renew.RENEWED:
                renewed += 1
                decided = renewed == quorum
            else:
                other += 1
                decided = len(each) - other == quorum - 1  # a majority no longer can
        if decided:
            out.answered(answer)

    for confirmation in each:
        if confirmation is not None:
            confirmation.listen(heard)
    return out
