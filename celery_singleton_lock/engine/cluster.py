"""Redis Cluster: every script call on the wire of the node that owns its slot.

Every key of one lock shares a hash tag (``{<digest>}``), so each script call
touches one slot. redis-py's ``RedisCluster`` keeps the slot map (read from the
cluster, refreshed when a node answers MOVED); the calls themselves go out on
one :class:`~.wire.Wire` per primary, as fast as on a single server: routing
is a CRC16 and a list index.

A MOVED reply (a slot migrated, a replica promoted) refreshes the map and
sends the call again to the new owner; an ASK reply (a slot half migrated)
sends it once to the importing node after ``ASKING``. A broken connection
marks the map stale, so the call after a node's failover asks the cluster
where its slot went.

A release (or the undo of an acquire whose reply never came) that could not
reach its primary is owed, here rather than to that node's wire: a thread
sends it again, reading the slot map each time, until the node answers or
the replica promoted in its place does. The release is owner-checked, so it
is safe to send late, and the key is freed as soon as the promotion is done,
not when its lease runs out.

A renewal round (:func:`renew_per_slot`) is one ``renew.lua`` call per slot,
since a script may touch one hash slot only: every call sent before any reply
is read; with ``WAIT`` on, the calls of each node go in one write with
``WAIT`` after them.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional, Sequence

import redis
from redis.crc import key_slot
from redis.exceptions import AskError, MovedError

from ..process import ForkSafeLock
from . import replies
from .calls import renew_call
from .outage import PROBE_FIRST, PROBE_GIVE_UP, PROBE_MAX, Answered, Owed, owed_on
from .replies import Renew
from .scripts import Script
from .wire import BROKEN, Wire

logger = logging.getLogger("celery_singleton_lock")

#: how many redirections one call follows before giving up
MAX_REDIRECTS = 5


class LazyCluster:
    """A ``RedisCluster`` made on first use: making one reads the slot map, and
    making an engine must not dial (nor fail while the cluster is down)."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self._client: Optional[Any] = None
        self._making = ForkSafeLock()

    def get(self) -> Any:
        client = self._client
        if client is None:
            with self._making:
                if self._client is None:
                    try:
                        self._client = self._make()
                    except redis.exceptions.RedisClusterException as exc:
                        # unreachable at start: the callers' ConnectionError paths apply
                        raise redis.ConnectionError(str(exc)) from exc
                client = self._client
        return client

    def __getattr__(self, name: str) -> Any:
        return getattr(self.get(), name)


class ClusterWire:
    """Script calls of one process to a Redis Cluster, routed by slot."""

    def __init__(self, client: LazyCluster, scripts: Sequence[Script] = ()) -> None:
        self.client = client
        self._scripts = tuple(scripts)
        self._by_node: dict[str, Wire] = {}
        self._by_slot: list[Optional[Wire]] = []
        #: goes up each time the slot map is read
        self.map_version = 0
        self._mutex = ForkSafeLock()
        #: calls owed to whichever node serves their slot (see the module doc)
        self._owed: list[Owed] = []
        self._owed_mutex = ForkSafeLock()
        self._sender: Optional[threading.Thread] = None

    # -- the slot map ------------------------------------------------------------

    def _wire_of(self, node: Any) -> Wire:
        wire = self._by_node.get(node.name)
        if wire is None:
            wire = Wire(self.client.get_redis_connection(node), self._scripts)
            self._by_node[node.name] = wire
        return wire

    def _load(self, refresh: bool = False) -> list[Optional[Wire]]:
        with self._mutex:
            cluster = self.client.get()
            if refresh:
                cluster.nodes_manager.initialize()
            by_slot: list[Optional[Wire]] = [None] * 16384
            for slot, nodes in cluster.nodes_manager.slots_cache.items():
                if nodes:
                    by_slot[slot] = self._wire_of(nodes[0])
            self._by_slot = by_slot
            self.map_version += 1
            return by_slot

    def refresh(self) -> None:
        """Read the slot map again (after MOVED, or a node that went away)."""
        self._load(refresh=True)

    def deadline_ms(self, key: str = "") -> int:
        """:meth:`Wire.deadline_ms` of the node serving ``key``'s slot."""
        return self.wire_for(key).deadline_ms()

    def wire_for(self, key: str) -> Wire:
        by_slot = self._by_slot or self._load()
        wire = by_slot[key_slot(key.encode())]
        if wire is None:
            by_slot = self._load(refresh=True)
            wire = by_slot[key_slot(key.encode())]
            if wire is None:
                raise redis.ConnectionError(f"no node serves the slot of {key!r}")
        return wire

    # -- the Wire interface ------------------------------------------------------

    @property
    def connections(self) -> int:
        return sum(w.connections for w in list(self._by_node.values()))

    @property
    def down(self) -> bool:
        """No node known answers (:attr:`Wire.down` of each)."""
        wires = self.wires
        return bool(wires) and all(w.down for w in wires)

    @property
    def unsettled(self) -> int:
        return sum(w.unsettled for w in list(self._by_node.values()))

    @property
    def wires(self) -> list[Wire]:
        return list(self._by_node.values())

    def call(self, script: Script, keys: Sequence[str], args: Sequence[Any]) -> tuple[Any, bool]:
        """:meth:`Wire.call` on the node owning ``keys[0]``'s slot, following
        MOVED and ASK; calls owed to that slot go first (a release kept
        through a failover before a new grant of its key)."""
        if self._owed:
            self._owed_first(keys[0])
        return self._call(script, keys, args)

    def _call(self, script: Script, keys: Sequence[str], args: Sequence[Any]
              ) -> tuple[Any, bool]:
        repeated = False
        for _ in range(MAX_REDIRECTS):
            wire = self.wire_for(keys[0])
            try:
                reply, again = wire.call(script, keys, args)
            except MovedError:
                self.refresh()
                continue
            except AskError as exc:
                node = self.client.get().nodes_manager.get_node(exc.host, exc.port)
                if node is None:
                    self.refresh()
                    continue
                reply, again = self._wire_of(node).call_asking(script, keys, args)
                return reply, repeated or again
            except BROKEN:
                self.stale()
                raise
            return reply, repeated or again
        raise redis.exceptions.ClusterError(f"too many redirections for {keys[0]!r}")

    def call_with(self, script: Script, keys: Sequence[str], args: Sequence[Any], *,
                  before: Sequence[Any] = (), after: Sequence[Any] = ()
                  ) -> tuple[Any, bool, Any]:
        """:meth:`Wire.call_with` on the node owning the slot (``WAIT`` there
        counts that node's replicas); MOVED refreshes the map and repeats.
        Calls owed to the slot go first, as in :meth:`call`."""
        if self._owed:
            self._owed_first(keys[0])
        for _ in range(MAX_REDIRECTS):
            try:
                return self.wire_for(keys[0]).call_with(script, keys, args, before=before,
                                                        after=after)
            except MovedError:
                self.refresh()
            except BROKEN:
                self.stale()
                raise
        raise redis.exceptions.ClusterError(f"too many redirections for {keys[0]!r}")

    def stale(self) -> None:
        """A node went away: learn where its slots went before the next call
        (after a failover a replica serves them)."""
        try:
            self.refresh()
        except Exception as exc:  # the cluster may be electing: next call tries again
            logger.debug("Could not read the cluster slot map: %r", exc)
            self._by_slot = []

    def call_later(self, script: Script, keys: Sequence[str], args: Sequence[Any],
                   answered: Answered, owe: bool = False) -> None:
        """:meth:`Wire.call_later` on the owning node; a redirection in the reply
        sends the command again, waiting, to the new owner. ``owe`` (a
        release): when the node does not answer, the command is owed to
        whichever node serves the slot next (the module doc)."""
        def done(reply: Any, error: Optional[Exception], repeated: bool) -> None:
            if isinstance(error, AskError):  # MOVED too
                try:
                    reply, again = self.call(script, keys, args)
                except redis.RedisError as exc:
                    if owe and owed_on(exc):
                        self._keep(Owed(script, keys, args, answered))
                        return
                    answered(None, exc, repeated)
                else:
                    answered(reply, None, repeated or again)
                return
            if isinstance(error, BROKEN):
                self.stale()
            if owe and error is not None and owed_on(error):
                # no answer, or a failover's: sent to whoever serves the slot next
                self._keep(Owed(script, keys, args, answered))
                return
            answered(reply, error, repeated)

        if self._owed:
            if owe and self._owes(keys[0]):
                # behind the calls already owed to its slot, in order
                self._keep(Owed(script, keys, args, answered))
                return
            self._owed_first(keys[0])
        try:
            wire = self.wire_for(keys[0])
        except BROKEN as exc:
            self.stale()
            if not owe:
                raise
            self._keep(Owed(script, keys, args, answered))
            logger.debug("Owed a lock call for %s: %r", keys[0], exc)
            return
        # the node's wire never keeps it: its probe would wait for that node,
        # not for the replica promoted in its place
        wire.call_later(script, keys, args, done, False)

    def owe(self, error: BaseException, script: Script, keys: Sequence[str],
            args: Sequence[Any]) -> None:
        """:meth:`Wire.owe` for the slot of ``keys``, to whichever node serves
        it once one answers (sent twice, as :mod:`.outage` says)."""
        self._keep(Owed(script, keys, args, twice=True))

    def _keep(self, owed: Owed) -> None:
        with self._owed_mutex:
            self._owed.append(owed)
            if self._sender is None or not self._sender.is_alive():
                self._sender = threading.Thread(target=self._send_owed, daemon=True,
                                                name="singleton-cluster-owed")
                self._sender.start()

    @property
    def owed(self) -> int:
        """Calls owed to a slot whose node has not answered since."""
        return len(self._owed)

    def _owes(self, key: str) -> list[Owed]:
        slot = slot_of(key)
        with self._owed_mutex:
            return [o for o in self._owed if slot_of(o.keys[0]) == slot]

    def _owed_first(self, key: str) -> None:
        """Send the calls owed to ``key``'s slot now, in order, before a new
        call to it: a failure is the new call's too (its node still does not
        take them)."""
        for owed in self._owes(key):
            reply, _ = self._call(owed.script, owed.keys, owed.args)
            if owed.twice:
                reply, _ = self._call(owed.script, owed.keys, owed.args)
            with self._owed_mutex:
                if owed not in self._owed:
                    continue  # the sender sent it meanwhile (sent twice: owner-checked)
                self._owed.remove(owed)
            if owed.answered is not None:
                try:
                    owed.answered(reply, None, True)
                except Exception:
                    logger.exception("Handling a lock reply failed")

    def _send_owed(self) -> None:
        """Send every owed call, in order, to the node serving its slot now,
        reading the map again after each failure, backing off, until all went
        or :data:`~.outage.PROBE_GIVE_UP` x 5 passed (each key's TTL frees it)."""
        backoff, started = PROBE_FIRST, time.monotonic()
        while True:
            with self._owed_mutex:
                if not self._owed:
                    self._sender = None
                    return
                owed = self._owed[0]
            try:
                reply, _ = self._call(owed.script, owed.keys, owed.args)
                if owed.twice:
                    reply, _ = self._call(owed.script, owed.keys, owed.args)
            except redis.RedisError as exc:
                if time.monotonic() - started > PROBE_GIVE_UP * 5:
                    self._drop_owed(exc)
                    continue
                logger.debug("An owed lock call for %s failed again: %r", owed.keys[0], exc)
                time.sleep(backoff)
                backoff = min(backoff * 2, PROBE_MAX)
                continue
            with self._owed_mutex:
                if owed not in self._owed:
                    continue  # a call to its slot sent it first
                self._owed.remove(owed)
            backoff = PROBE_FIRST
            if owed.answered is not None:
                try:
                    owed.answered(reply, None, True)
                except Exception:
                    logger.exception("Handling a lock reply failed")

    def _drop_owed(self, error: Exception) -> None:
        with self._owed_mutex:
            dropped, self._owed = self._owed, []
        logger.warning("%d lock call(s) owed to the Cluster not sent (%r): the keys they "
                       "were for free when their TTLs run out", len(dropped), error)
        for owed in dropped:
            if owed.answered is not None:
                try:
                    owed.answered(None, error, True)
                except Exception:
                    logger.exception("Handling a lock reply failed")

    def settle(self) -> None:
        for wire in list(self._by_node.values()):
            wire.settle()

    def new_connection(self) -> Any:
        """A connection to the primary of slot 0."""
        return self.wire_for_slot(0).new_connection()

    def slots_by_primary(self) -> dict[str, tuple[Wire, set[int]]]:
        """Every node serving slots now, by name: its wire and its slots."""
        by_slot = self._by_slot or self._load()
        out: dict[str, tuple[Wire, set[int]]] = {}
        for slot, wire in enumerate(by_slot):
            if wire is not None:
                out.setdefault(wire.name, (wire, set()))[1].add(slot)
        return out

    def wire_for_slot(self, slot: int) -> Wire:
        by_slot = self._by_slot or self._load()
        wire = by_slot[slot]
        if wire is None:
            raise redis.ConnectionError(f"no node serves slot {slot}")
        return wire

    @property
    def name(self) -> str:
        """For messages: the deployment, not one node (calls go to each slot's)."""
        return "Redis Cluster"

    def close(self) -> None:
        for wire in list(self._by_node.values()):
            wire.close()


def slot_of(key: str) -> int:
    return int(key_slot(key.encode()))


def renew_per_slot(wire: ClusterWire, script: Script, entries: Sequence[tuple[str, str, int]],
                   *, wait: tuple[Any, ...], wait_replicas: int, chunk: int, keep_ms: int
                   ) -> list[Renew]:
    """Renew on a Cluster: one call per slot (a script may touch one slot
    only), all sent before any reply is read, so a round costs about one
    round trip per node. With ``WAIT`` on, see :func:`_renew_per_node`.
    ``keep_ms``: how long each key's fencing counter outlives its lock."""
    groups: dict[int, list[int]] = {}
    for i, entry in enumerate(entries):
        groups.setdefault(slot_of(entry[0]), []).append(i)
    if wait:
        return _renew_per_node(wire, script, entries, groups, wait, wait_replicas, chunk,
                               keep_ms)
    out: list[Optional[Renew]] = [None] * len(entries)
    errors: list[Exception] = []

    def answer(indexes: list[int]) -> Any:
        def done(reply: Any, error: Optional[Exception], repeated: bool) -> None:
            if error is not None:
                errors.append(error)
                return
            for i, result in zip(indexes, replies.renewed(reply, len(indexes))):
                out[i] = result
        return done

    for indexes in groups.values():
        try:
            wire.call_later(script, *renew_call([entries[i] for i in indexes], keep_ms),
                            answer(indexes))
        except redis.RedisError as exc:
            errors.append(exc)
    wire.settle()
    return _renew_answers(out, errors)


def _renew_per_node(cluster: ClusterWire, script: Script,
                    entries: Sequence[tuple[str, str, int]], groups: dict[int, list[int]],
                    wait: tuple[Any, ...], wait_replicas: int, chunk: int, keep_ms: int
                    ) -> list[Renew]:
    """Renew on a Cluster with ``WAIT``: the calls of every slot a node
    serves in one write with ``WAIT`` after them, on the same connection,
    so WAIT counts that node's replicas for exactly these writes. Nodes are
    asked one after another (each may wait up to ``singleton_wait_timeout``)."""
    by_node: dict[int, tuple[Wire, list[list[int]]]] = {}
    out: list[Optional[Renew]] = [None] * len(entries)
    errors: list[Exception] = []
    for indexes in groups.values():
        try:
            node = cluster.wire_for(entries[indexes[0]][0])
        except redis.RedisError as exc:
            errors.append(exc)
            continue
        for start in range(0, len(indexes), chunk):
            by_node.setdefault(id(node), (node, []))[1].append(indexes[start:start + chunk])
    short: list[str] = []
    for node, parts in by_node.values():
        calls = [renew_call([entries[i] for i in part], keep_ms) for part in parts]
        try:
            answers, acked = node.call_many(script, calls, after=wait)
        except redis.exceptions.AskError:  # MOVED too: the slot map changed
            cluster.refresh()
            answers, acked = [], None
            for keys, args in calls:  # once more, to the new owners, without WAIT
                try:
                    answers.append(cluster.call(script, keys, args)[0])
                except redis.RedisError as exc:
                    errors.append(exc)
                    answers.append(None)
        except redis.RedisError as exc:
            if isinstance(exc, BROKEN):
                cluster.stale()  # the node is gone: its replica may serve next round
            errors.append(exc)
            continue
        for part, reply in zip(parts, answers):
            if reply is not None:
                for i, result in zip(part, replies.renewed(reply, len(part))):
                    out[i] = result
        if not isinstance(acked, int) or acked < wait_replicas:
            short.append(f"{acked} on {node.name}")
    if short:
        # renewed on the primaries all the same: only a failover now could cost them
        logger.warning("Renewed singleton locks but fewer than %d replicas acknowledged "
                       "(%s)", wait_replicas, ", ".join(short))
    return _renew_answers(out, errors)


def _renew_answers(out: list[Optional[Renew]], errors: list[Exception]) -> list[Renew]:
    """A round's answers; the first error when no lock was answered at all. A
    slot whose node failed this round leaves its locks alone, as on any Redis
    error: their own deadlines make them lost if it lasts."""
    if errors and all(result is None for result in out):
        raise errors[0]
    return [Renew.UNANSWERED if result is None else result for result in out]
