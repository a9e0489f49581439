"""The engine of one lock Redis: a server, a Sentinel-managed primary or a Cluster.

Every lock operation of the library is one call of a script in ``lua/``; each
does compare-then-act on the execution id, so nobody frees or extends a lock
that is no longer theirs. On a server that compares before it writes (Valkey
9.0+, Redis 8.4+), a task whose options allow takes, renews and frees its lock
in plain commands instead (:mod:`.native`; :mod:`.paths` chooses, once).
:mod:`.wire` carries the calls (:mod:`.cluster` on a Cluster, one wire per
node), :mod:`.calls` builds each script's arguments, :mod:`.replies` names
their answers. :mod:`.registry` makes one engine per app and process, anew
after fork.

Over 500 lines: one class, the :class:`~.base.Engine` of one lock Redis; its
methods are the lock's operations (grant, release, renewal, hand-off, the
keys beside the lock) and what WAIT means after a grant, each short, all
sharing the wire and the settings read once in ``__init__``.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional, Sequence, TypeVar, Union

import redis

from ..config import SingletonConfig
from ..exceptions import (
    LateRequestError,
    TooFewReplicasError,
    UnconfirmedHolderError,
    describe,
)
from ..keys import LockKeys
from ..urls import mode_of
from . import replies
from .base import Engine, Entry, Watch
from .calls import (
    SCRIPTS,
    acquire_call,
    acquire_slots_call,
    enqueue_call,
    fence_call,
    handoff_call,
    marker_task,
    reclaim_call,
    release_call,
    release_mode,
    renew_call,
    unqueue_call,
)
from .clock import now_us
from .cluster import ClusterWire, LazyCluster, renew_per_slot
from .native import Native
from .outage import RedisUnanswered, failing_over
from .paths import SCRIPTS_ONLY, Path, choose
from .replies import (
    Acquire,
    Acquired,
    Confirmation,
    Enqueued,
    Reclaimed,
    Release,
    Released,
    Renew,
)
from .request import Request
from .scripts import Script
from .servers import CLIENT_DEFAULTS, make_client
from .shapes import text
from .watch import ClusterWatch, RedisWatch
from .wire import BROKEN, Wire

logger = logging.getLogger("celery_singleton_lock")

_T = TypeVar("_T")

#: locks renewed by one script call: each costs Redis a few microseconds, so a
#: call stays well under 5 ms however many locks a process holds
RENEW_CHUNK = 250
#: how long past ``singleton_wait_timeout`` a grant's WAIT marker lives (its
#: holder confirms or gives it back well within it; one that died meanwhile
#: leaves a marker that expires then)
PENDING_MARGIN_MS = 2000
#: how often a refused execution looks again at a grant still waiting on WAIT
PENDING_POLL = 0.02
#: at most one warning per this many seconds that no replica acknowledged
NO_REPLICA_EVERY = 30.0


class LockEngine(Engine):
    """All Redis work of one process for one app, on one lock Redis."""

    def __init__(self, client: redis.Redis, config: SingletonConfig) -> None:
        self.client = client
        self.config = config
        self.wire: Union[Wire, ClusterWire]
        if isinstance(client, LazyCluster):
            self.wire = ClusterWire(client, tuple(SCRIPTS.values()))
        else:
            self.wire = Wire(client, SCRIPTS.values())
        self._acquire = SCRIPTS["acquire"]
        self._acquire_slots = SCRIPTS["acquire_slots"]
        self._release = SCRIPTS["release"]
        self._renew = SCRIPTS["renew"]
        self._handoff = SCRIPTS["handoff"]
        self._enqueue = SCRIPTS["enqueue"]
        self._unqueue = SCRIPTS["unqueue"]
        self._fence = SCRIPTS["fence"]
        self._reclaim = SCRIPTS["reclaim"]
        self._fin_ms = int(config.finished_ttl * 1000)
        #: how long a key's fencing counter outlives its lock (singleton_fence_ttl)
        self._keep_ms = int(config.fence_ttl * 1000)
        self.renew_chunk = RENEW_CHUNK
        #: sent right after each grant and renewal, in the same write
        self._wait: tuple[Any, ...] = (
            ("WAIT", config.wait_replicas, config.wait_timeout) if config.wait_replicas else ())
        self._no_replica_said = float("-inf")
        #: how long a lock call waits for its reply (``socket_timeout``): a
        #: request's deadline is that long after it leaves (:mod:`.clock`)
        self.budget = self.wire.budget if isinstance(self.wire, Wire) else float(
            {**CLIENT_DEFAULTS, **config.redis_options}.get("socket_timeout") or 0.0)
        #: what the server offers, asked at the first call (:mod:`.paths`)
        self._path: Optional[Path] = None
        #: the native path, on a server that has the commands
        self.native: Optional[Native] = None

    @classmethod
    def from_config(cls, config: SingletonConfig) -> LockEngine:
        """The engine of one server, a Sentinel-managed primary or a Cluster
        (:func:`.registry.connect` picks the kind, Redlock included)."""
        url = config.redis_url
        if mode_of(url) == "redlock":
            raise ValueError("a redlock:// URL names several masters: "
                             "celery_singleton_lock.engine.registry.connect() makes its engine")
        options = {**CLIENT_DEFAULTS, **config.redis_options, "decode_responses": True}
        if mode_of(url) == "cluster":
            return cls(LazyCluster(lambda: make_client(url, options)), config)  # type: ignore[arg-type]
        return cls(make_client(url, options), config)

    def servers(self) -> list[tuple[str, Any]]:
        return [(self.wire.name, self.client)]

    @property
    def path(self) -> Path:
        """What the server offers the lock, asked once (a Redis error while
        it cannot be asked). A Cluster and Redlock's masters stay on scripts."""
        if self._path is None:
            path = SCRIPTS_ONLY
            if isinstance(self.wire, Wire) and mode_of(self.config.redis_url) != "redlock":
                path = choose(self.config, self.wire.call, self._unqueue)
                if path.native is not None:
                    self.native = Native(self.wire, path.native, self._keep_ms, self._fin_ms,
                                         everything=not path.scripts)
            self._path = path
        return self._path

    def clock_offset(self, ask: bool = False) -> Optional[float]:
        wires = [self.wire] if isinstance(self.wire, Wire) else self.wire.wires
        if not wires and ask and isinstance(self.wire, ClusterWire):
            wires = [self.wire.wire_for_slot(0)]
        for wire in wires:
            if ask and not wire.clock.known:
                wire.deadline_ms()  # its first connection reads the server's clock
            low = wire.clock.low()
            if low:
                return low / 1e6 - time.time()
        return None

    def lock_path(self) -> tuple[str, bool]:
        return self.path.describe(), self.path.scripts

    def _native_for(self, lock: str, exec_id: str) -> Optional[Native]:
        """The native path for a call on a lock it granted (on every lock
        where the server runs no script)."""
        native = self.native if self.path.native is not None else None
        return native if native is not None and native.serves(lock, exec_id) else None

    @property
    def down(self) -> bool:
        return self.wire.down

    def watch(self) -> Watch:
        if isinstance(self.wire, ClusterWire):
            return ClusterWatch(self.wire)
        return RedisWatch(self.wire.new_connection, self.wire.outage)

    @property
    def scripts(self) -> tuple[Script, ...]:
        return (self._acquire, self._acquire_slots, self._release, self._renew, self._handoff,
                self._enqueue, self._unqueue, self._fence, self._reclaim)

    def settle(self) -> None:
        """Read every reply still owed to this process (see :meth:`release_later`)."""
        self.wire.settle()

    @property
    def unsettled(self) -> int:
        return self.wire.unsettled

    def acquire(self, keys: LockKeys, request: Request) -> Acquired:
        """Take the lock for an execution that starts now.

        A refused execution that owns the key it took at send time keeps it
        (``queued_by_it`` in the answer): it was accepted, so it will wait and run.
        A task that a later send superseded is told so (``Acquire.REPLACED``);
        with slots, the answer's ``slot`` names the one granted.

        With ``singleton_wait_replicas``, a grant is not its holder's until
        WAIT confirms it: it is marked meanwhile (:meth:`.LockKeys.waiting`),
        and an execution refused by such a grant looks again every
        :data:`PENDING_POLL` s until it is confirmed (refused then, as by any
        running holder) or given back (and so free for it), instead of being
        refused for good by a holder that may never run. Still unconfirmed
        after that long (grants that keep being given back, no replica to
        acknowledge any): :class:`.UnconfirmedHolderError`, a Redis error, so
        ``singleton_on_backend_error`` decides (by default: retry later).
        """
        def once() -> Acquired:
            return self._in_time(keys.lock, lambda deadline: self._acquire_once(
                keys, request, deadline))

        answer = once()
        if answer.status is not Acquire.HELD:
            return answer
        # a grant not yet confirmed (by WAIT, or by its holder) is decided
        # within its own TTL, or WAIT's timeout, and a round trip; grants that
        # keep being given back to each other, within a few of that
        started = time.monotonic()
        last, until, each = "", 0.0, 0.0
        while True:
            pending, wait = self._unconfirmed(keys, answer, request.slots)
            if not pending:
                return answer  # confirmed, or a holder that never waited: running
            now = time.monotonic()
            if pending != last:
                last, until, each = pending, now + wait, max(each, wait)
            if now > until or now - started > 2 * each:
                if not self._wait or answer.doubtful:
                    return answer  # still doubtful: the task waits for it (policies)
                raise UnconfirmedHolderError(keys.base, pending, now - started)
            time.sleep(PENDING_POLL)
            answer = once()
            if answer.status is not Acquire.HELD:
                return answer

    def _unconfirmed(self, keys: LockKeys, answer: Acquired, slots: int) -> tuple[str, float]:
        """The execution id of a holder in the way of this refusal whose grant
        is not confirmed yet, and how long it takes at most to be decided; or
        ('', 0). A grant lives only until its request's deadline until its
        holder confirms it (grant_ttl in lua/_record.lua: a caller that gave
        up never does, and the key is free then); with WAIT, until WAIT
        confirms it too (its marker, :meth:`.LockKeys.waiting`)."""
        if answer.unconfirmed(int(self.budget * 1000)):
            # decided soon: looked at again here (a grant whose confirmation
            # is on its way); one doubtful for longer is the task's to wait for
            holder = answer.holder.exec_id if answer.holder is not None else ""
            return holder or "?", (answer.ttl_ms + PENDING_MARGIN_MS) / 1000
        if self._wait:
            pending = self._pending(keys, answer, slots)
            if pending:
                return pending, (self.config.wait_timeout + PENDING_MARGIN_MS) / 1000
        return "", 0.0

    def _pending(self, keys: LockKeys, answer: Acquired, slots: int) -> str:
        """The execution id of a holder in the way of this refusal whose grant
        still waits on WAIT, or ''. Under a limit, '?' when a slot is free by
        now: a grant in the way was given back since the refusal (during this
        request's own WAIT), and the caller asks again."""
        if slots == 1:
            execs = [answer.holder.exec_id] if answer.holder is not None else []
        else:
            owners = [self.owner(slot) for slot in keys.slots(slots)]
            if not all(owners):
                return "?"
            execs = [owner.get("exec", "") for owner in owners]
        for exec_id in execs:
            if exec_id and self.client.execute_command(
                    "GET", keys.waiting(exec_id)) is not None:
                return exec_id
        return ""

    def _in_time(self, key: str, send: Callable[[int], _T]) -> _T:
        """``send(deadline)`` of a request for ``key`` (:mod:`.clock`). One the
        server refused as too late although this process waited less than half
        its budget was not late: the server's clock is ahead of where the
        estimate put it (set forward). The estimate corrected from the
        refusal, which carries the server's clock, it is sent once more."""
        sent = now_us()
        try:
            return send(self.wire.deadline_ms(key))
        except LateRequestError as exc:
            received = now_us()
            wire = self._wire_of(key)
            wire.clock.heard(sent, divmod(exc.server_ms * 1000, 1_000_000), received)
            if received - sent >= wire.budget * 500_000:
                raise
            return send(self.wire.deadline_ms(key))

    def _wire_of(self, key: str) -> Wire:
        """The wire of the server holding ``key`` (on a Cluster, its slot's
        node): whose clock its deadlines are counted on."""
        return self.wire.wire_for(key) if isinstance(self.wire, ClusterWire) else self.wire

    def _acquire_once(self, keys: LockKeys, request: Request, deadline: int = 0) -> Acquired:
        confirm_by = self._confirm_by(deadline)
        if request.plain and not self._wait and self.path.native is not None:
            assert self.native is not None
            return self.native.acquire(keys, request, deadline=deadline, confirm_by=confirm_by)
        if request.slots > 1:
            script = self._acquire_slots
            keys_, args = acquire_slots_call(keys, request, self._fin_ms, keep_ms=self._keep_ms,
                                             deadline_ms=deadline, confirm_by_ms=confirm_by)
        else:
            script = self._acquire
            keys_, args = acquire_call(keys, request, self._fin_ms, keep_ms=self._keep_ms,
                                       deadline_ms=deadline, confirm_by_ms=confirm_by)
        exec_id, task_id, lease_ms = request.exec_id, request.task_id, request.lease.ms
        try:
            if not self._wait:
                reply, _ = self.wire.call(script, keys_, args)
                answer = replies.acquired(reply)
                if answer.status is Acquire.GRANTED and confirm_by:
                    answer.confirmation = self._confirm_grant(keys.slot(answer.slot), exec_id,
                                                              lease_ms, confirm_by)
                return answer
            # marked before the grant, in the same write: no one sees the grant unmarked
            marker = keys.waiting(exec_id)
            reply, _, acked = self.wire.call_with(
                script, keys_, args, after=self._wait,
                before=("SET", marker, exec_id, "PX",
                        self.config.wait_timeout + PENDING_MARGIN_MS))
        except BROKEN as exc:
            if not isinstance(exc, RedisUnanswered):
                # Redis may still run it (a frozen server runs what it has
                # read): undone, owner-checked, once it answers again
                for slot in keys.slots(request.slots):
                    self.wire.owe(exc, self._release, *release_call(
                        slot, exec_id, task_id, False, False, 0, self._fin_ms))
            raise
        answer = replies.acquired(reply)
        if answer.status is Acquire.GRANTED:
            self._replicated(keys.slot(answer.slot), acked, exec_id, task_id, marker)
            if confirm_by:
                answer.confirmation = self._confirm_grant(keys.slot(answer.slot), exec_id,
                                                          lease_ms, confirm_by)
        return answer

    def _confirm_by(self, deadline: int) -> int:
        """When a grant asked for by a request with ``deadline`` expires if
        its holder has not confirmed it: one more wait after the deadline, time
        enough for a reply that came in time to be followed by the
        confirmation (grant_ttl in lua/_record.lua). 0 with no deadline."""
        return deadline + int(self.budget * 1000) if deadline else 0

    def _confirm_grant(self, keys: LockKeys, exec_id: str, lease_ms: int, confirm_by: int
                       ) -> Confirmation:
        """A grant lives until :meth:`_confirm_by` until its holder confirms
        it: confirmed now, its lease from now (renew.lua), sent without
        waiting; its reply is read with this process's next call, and what it
        found goes to the holder (:class:`.Confirmation`)."""
        clock = self._wire_of(keys.lock).clock
        confirmation = Confirmation(clock.local_time_of(confirm_by), time.monotonic())
        self.wire.call_later(self._renew, *renew_call([(keys.lock, exec_id, lease_ms)],
                                                      self._keep_ms),
                             _confirmed(keys.lock, confirmation))
        return confirmation

    def _replicated(self, keys: LockKeys, acked: Any, exec_id: str, task_id: str,
                    marker: str) -> None:
        """Act on WAIT's answer after a grant (``singleton_wait_policy``, and
        ``singleton_wait_no_replica`` when none acknowledged): the grant is
        confirmed (its WAIT marker deleted) or given back (the marker left to
        expire, so an execution it refused meanwhile looks again)."""
        wanted = self.config.wait_replicas
        count = acked if isinstance(acked, int) else 0
        if count >= wanted:
            self._confirm(marker, exec_id)
            return
        if isinstance(acked, Exception):
            logger.warning("WAIT after granting %s failed: %s", keys.base, describe(acked))
        none = count == 0 and bool(self.config.wait_no_replica)
        policy = self.config.wait_no_replica if none else self.config.wait_policy
        setting = "singleton_wait_no_replica" if none else "singleton_wait_policy"
        if policy == "proceed":
            logger.warning("Singleton lock %s granted but only %d of %d replicas acknowledged "
                           "it: a failover now could lose it (%s: proceed)",
                           keys.base, count, wanted, setting)
            self._confirm(marker, exec_id)
            return
        try:
            self.release(keys, exec_id, task_id, finished=False)
        except redis.RedisError as exc:  # it expires with its lease
            logger.warning("Could not give back %s after WAIT fell short: %s", keys.base,
                           describe(exc))
        now = time.monotonic()
        if count == 0 and now - self._no_replica_said >= NO_REPLICA_EVERY:
            self._no_replica_said = now
            logger.warning(
                "No replica acknowledged the grant of singleton lock %s within %d ms (none "
                "connected, as on a primary just promoted, or none in step): grants are given "
                "back and their tasks retried until one does (%s: release; 'proceed' runs "
                "them with a warning instead)", keys.base, self.config.wait_timeout, setting)
        raise TooFewReplicasError(keys.base, count, wanted)

    def _confirm(self, marker: str, exec_id: str) -> None:
        """The grant is its holder's: delete its WAIT marker, not waiting for the
        reply (a marker left behind expires within PENDING_MARGIN_MS)."""
        self.wire.call_later(self._unqueue, [marker], [exec_id], _ignored)

    def release(self, keys: LockKeys, exec_id: str, task_id: str, *, finished: bool = True,
                always_record: bool = False, done_ms: int = 0, task_name: str = ""
                ) -> bool:
        """Free the lock if ``exec_id`` still owns it; True when this call freed it.

        A repeat after a lost reply that finds the key free counts as freed: its
        first attempt did it. ``done_ms`` > 0: the task (``task_name``)
        succeeded and its key stays done that long.
        """
        native = self._native_for(keys.lock, exec_id)
        if native is not None:
            status, repeated = native.release(keys, exec_id, task_id,
                                              release_mode(finished, always_record),
                                              done_ms, task_name)
            return status is Release.RELEASED or (status is Release.FREE and repeated)
        call = self._release_call(keys, exec_id, task_id, finished, always_record, done_ms,
                                  task_name)
        try:
            reply, repeated = self.wire.call(self._release, *call)
        except redis.ResponseError as exc:
            if failing_over(exc):
                # refused while a failover is under way: owner-checked, sent
                # again to whichever node serves the key once one takes it
                self.wire.owe(exc, self._release, *call)
            raise
        answer = replies.released(reply, repeated)
        return answer.status is Release.RELEASED or (
            answer.status is Release.FREE and answer.repeated)

    def _release_call(self, keys: LockKeys, exec_id: str, task_id: str, finished: bool,
                      always_record: bool, done_ms: int, task_name: str
                      ) -> tuple[list[str], list[Any]]:
        return release_call(keys, exec_id, task_id, finished, always_record, done_ms,
                            self._fin_ms, task_name)

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
        """:meth:`release` without waiting for the reply.

        Redis frees the key as soon as the command arrives, before anything
        this process sends next; ``answered(reply, error)`` is called when the
        reply has been read, with a :class:`~.replies.Released` (``error`` once
        repeating the command failed).
        """
        native = self._native_for(keys.lock, exec_id)
        if native is not None:
            native.release_later(keys, exec_id, task_id, release_mode(finished, always_record),
                                 done_ms, task_name, answered)
            return

        def done(reply: Any, error: Optional[Exception], repeated: bool) -> None:
            if error is not None:
                answered(None, error)
            else:
                answered(replies.released(reply, repeated), None)

        self.wire.call_later(self._release, *self._release_call(
            keys, exec_id, task_id, finished, always_record, done_ms, task_name), done, owe=True)

    def enqueue(self, keys: LockKeys, task_id: str, scope: str, ttl_ms: int,
                task_name: str = "", replace: Optional[tuple[int, int]] = None,
                done: bool = True) -> Enqueued:
        """Take the key for a task about to be sent; ``replace`` (debounce ms,
        debounce_max ms): take it from a task still queued, superseding it.
        ``done`` False: the task keeps no done window, none is looked for."""
        try:
            reply = self._in_time(keys.lock, lambda deadline: replies.enqueued(self.wire.call(
                self._enqueue, *enqueue_call(keys, task_id, scope, ttl_ms, task_name, replace,
                                             done, deadline))[0]))
        except BROKEN as exc:
            if not isinstance(exc, RedisUnanswered):
                # freed once Redis answers again: a send that went out without
                # its key takes the key when it starts, as any other
                self.wire.owe(exc, self._unqueue, *unqueue_call(keys, task_id))
            raise
        return reply

    def unqueue(self, keys: LockKeys, task_id: str) -> bool:
        """Free a key taken at send time, if ``task_id`` still has it."""
        reply, _ = self.wire.call(self._unqueue, *unqueue_call(keys, task_id))
        return replies.flag(reply, "unqueue")

    def claim(self, key: str, value: str, ttl_ms: int) -> tuple[bool, str]:
        """``SET key value NX PX ttl_ms``, one round trip: (won, the value now
        there). Won also when ``value`` was there already (the same claimant
        again). Beat's tick claims and the worker's tick-run markers."""
        pipe = self.client.pipeline(transaction=False)
        pipe.set(key, value, nx=True, px=ttl_ms)
        pipe.get(key)
        first, holder = pipe.execute()
        holder = str(holder) if holder is not None else ""
        return bool(first) or holder == value, holder

    def unclaim(self, key: str, value: str) -> bool:
        """Delete a :meth:`claim` if ``value`` still has it."""
        if self.path.native is not None and self.native is not None:
            return self.native.unclaim(key, value)
        reply, _ = self.wire.call(self._unqueue, [key], [value])
        return replies.flag(reply, "unclaim")

    def renew(self, entries: Sequence[Entry]) -> list[Renew]:
        """Renew ``(lock key, exec id, lease ms)`` entries in one round trip.

        At most :data:`RENEW_CHUNK` locks go in one script call, the calls all in
        one write: Redis is never busy with one renewal for long (10,000 locks
        in one call kept it busy 45-90 ms, stalling every other client).
        """
        if not entries:
            return []
        if self.path.native is not None and self.native is not None:
            return self.native.renew_with(entries, self._renew_scripts)
        return self._renew_scripts(entries)

    def _renew_scripts(self, entries: Sequence[Entry]) -> list[Renew]:
        if isinstance(self.wire, ClusterWire):
            return renew_per_slot(self.wire, self._renew, entries, wait=self._wait,
                                  wait_replicas=self.config.wait_replicas,
                                  chunk=self.renew_chunk, keep_ms=self._keep_ms)
        chunk = self.renew_chunk
        calls: list[tuple[list[str], list[Any]]] = []
        for start in range(0, len(entries), chunk):
            calls.append(renew_call(entries[start:start + chunk], self._keep_ms))
        if len(calls) == 1 and not self._wait:
            reply, _ = self.wire.call(self._renew, *calls[0])
            return replies.renewed(reply, len(entries))
        answers, acked = self.wire.call_many(self._renew, calls, after=self._wait or ())
        if self._wait and (not isinstance(acked, int) or acked < self.config.wait_replicas):
            # renewed on the primary all the same: only a failover now could cost them
            logger.warning("Renewed %d singleton lock(s) but only %s of %d replicas "
                           "acknowledged", len(entries), acked, self.config.wait_replicas)
        out: list[Renew] = []
        for (keys, _), reply in zip(calls, answers):
            out.extend(replies.renewed(reply, len(keys) // 2))
        return out

    def reclaim(self, keys: LockKeys, request: Request, token: int) -> Reclaimed:
        """A renewal found the key of a lock this execution holds gone: write it
        back if the server forgot it (the key's fencing counter is gone too),
        not if someone released it or another execution holds it now."""
        native = self._native_for(keys.lock, request.exec_id)
        if native is not None:
            return native.reclaim(keys, request, token)
        return self._in_time(keys.lock, lambda deadline: replies.reclaimed(self.wire.call(
            self._reclaim, *reclaim_call(keys, request, token, self._fin_ms,
                                         keep_ms=self._keep_ms, deadline_ms=deadline))[0]))

    def raise_fence(self, keys: LockKeys, exec_id: str, token: int) -> bool:
        """Raise the key's fencing counter (and the owner record's token) to at
        least ``token``, if ``exec_id`` holds the lock here. Redlock uses it to
        put the token it hands out on a majority of its masters."""
        reply, _ = self.wire.call(self._fence, *fence_call(keys, exec_id, token, self._keep_ms))
        return replies.flag(reply, "fence")

    def hand_off(self, keys: LockKeys, exec_id: str, next_retries: int, lease_ms: int) -> bool:
        native = self._native_for(keys.lock, exec_id)
        if native is not None:
            return native.hand_off(keys, exec_id, next_retries, lease_ms)
        reply, _ = self.wire.call(self._handoff,
                                  *handoff_call(keys, exec_id, next_retries, lease_ms))
        return replies.flag(reply, "handoff")

    def owner(self, keys: LockKeys) -> dict[str, str]:
        """The owner record, empty when the key is free."""
        # a command by name: LazyCluster.get() is the cluster client itself
        raw = self.client.execute_command("GET", keys.lock)
        return replies.record(raw)

    def read(self, key: str) -> Optional[str]:
        value = self.client.execute_command("GET", key)
        return None if value is None else text(value)

    def write(self, key: str, value: str, ttl_ms: int, *, previous: bool = False
              ) -> Optional[str]:
        if previous:
            # by name with the option redis-py reads: SET's reply is else made a bool
            old = self.client.execute_command("SET", key, value, "PX", ttl_ms, "GET", get=True)
            return None if old is None else text(old)
        self.client.execute_command("SET", key, value, "PX", ttl_ms)
        return None

    def take(self, key: str) -> Optional[str]:
        value = self.client.execute_command("GETDEL", key)
        return None if value is None else text(value)

    def present(self, key: str) -> bool:
        return bool(self.client.execute_command("EXISTS", key))

    def run_script(self, script: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        reply, _ = self.wire.call(script, keys, args)
        return reply

    def read_hash(self, key: str) -> dict[str, str]:
        raw = self.client.execute_command("HGETALL", key) or {}
        if isinstance(raw, list):  # RESP2 without redis-py's callback: a flat list
            raw = dict(zip(raw[::2], raw[1::2]))
        return {text(k): text(v) for k, v in raw.items()}

    def update_hash(self, key: str, *, add: Optional[dict[str, float]] = None,
                    put: Optional[dict[str, str]] = None, drop: Sequence[str] = (),
                    ttl_s: int = 0) -> None:
        pipe = self.client.pipeline(transaction=False)
        for name, amount in (add or {}).items():
            if float(amount).is_integer():
                pipe.hincrby(key, name, int(amount))
            else:
                pipe.hincrbyfloat(key, name, amount)
        if put:
            pipe.hset(key, mapping=put)
        if drop:
            pipe.hdel(key, *drop)
        if ttl_s and (add or put):
            pipe.expire(key, ttl_s)
        if add or put or drop:
            pipe.execute()

    def queued_by(self, keys: LockKeys) -> str:
        """The id of the task that took the key when it was sent, or ''."""
        return marker_task(self.client.get(keys.queued))[1]

    def close(self) -> None:
        self.wire.close()


def _ignored(reply: Any, error: Optional[Exception], repeated: bool) -> None:
    """The reply of a call whose outcome nobody waits for (a WAIT marker's delete)."""


def _confirmed(lock: str, confirmation: Confirmation
               ) -> Callable[[Any, Optional[Exception], bool], None]:
    """The answer of a grant's confirmation, told to its holder: a grant gone
    by then (its reply came too late, the server stalled, a failover) is also
    said in the log. A Redis error tells nothing: the renewer's next round
    decides."""
    def done(reply: Any, error: Optional[Exception], repeated: bool) -> None:
        if error is None:
            answer = replies.renewed(reply, 1)[0]
            confirmation.answered(answer)
            if answer is not Renew.RENEWED:
                # released already (a short task whose release went out on
                # another connection), or its reply came too late: the
                # renewer says so if the task still holds it
                logger.debug("Singleton lock %s was not its holder's when its grant was "
                             "confirmed (%s)", lock, answer.name)
    return done
