"""Renewal rounds on a Redis Cluster: a script may touch one hash slot only,
so a round is one ``renew.lua`` call per slot, every call sent before any
reply is read; with ``WAIT`` on, the calls of each node go in one write with
``WAIT`` after them.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import redis

from . import replies
from .calls import renew_call
from .cluster import ClusterWire, slot_of
from .replies import Renew
from .scripts import Script
from .wire import BROKEN, Wire

logger = logging.getLogger("celery_singleton_lock")


def renew_per_slot(wire: ClusterWire, script: Script, entries: Sequence[tuple[str, str, int]],
                   *, wait: tuple[Any, ...], wait_replicas: int, chunk: int) -> list[Renew]:
    """Renew on a Cluster: one call per slot (a script may touch one slot
    only), all sent before any reply is read, so a round costs about one
    round trip per node. With ``WAIT`` on, see :func:`_renew_per_node`."""
    groups: dict[int, list[int]] = {}
    for i, entry in enumerate(entries):
        groups.setdefault(slot_of(entry[0]), []).append(i)
    if wait:
        return _renew_per_node(wire, script, entries, groups, wait, wait_replicas, chunk)
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
            wire.call_later(script, *renew_call([entries[i] for i in indexes]),
                            answer(indexes))
        except redis.RedisError as exc:
            errors.append(exc)
    wire.settle()
    return _renew_answers(out, errors)


def _renew_per_node(cluster: ClusterWire, script: Script,
                    entries: Sequence[tuple[str, str, int]], groups: dict[int, list[int]],
                    wait: tuple[Any, ...], wait_replicas: int, chunk: int) -> list[Renew]:
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
        calls = [renew_call([entries[i] for i in part]) for part in parts]
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
