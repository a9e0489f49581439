"""Redlock: the keys beside the lock, each on a majority of the masters.

The send-time key of the queue scopes (taken, freed, read), and claims:
beat's tick claims and the worker's tick-run markers, won on a majority;
claimants that split the masters give back and try again. The lock itself
is in :mod:`.engine`.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from typing import Any, Optional

from ...exceptions import ConfigurationError, QuorumError
from ...keys import LockKeys
from ..replies import Enqueue, Enqueued
from .quorum import MISSING, Masters, _settled_by

#: rounds a claim tries when its claimants split the masters between them
CLAIM_ROUNDS = 6


def no_replace() -> ConfigurationError:
    return ConfigurationError("singleton_on_duplicate", "'replace' needs one lock Redis "
                              "(a server, Sentinel or Cluster), not redlock://")


class Claims:
    """The send-time keys and claims of :class:`.engine.RedlockEngine`, each won
    on a majority of its masters."""

    def __init__(self, majority: Masters) -> None:
        self.majority = majority

    def enqueue(self, keys: LockKeys, task_id: str, scope: str, ttl_ms: int,
                task_name: str = "", replace: Optional[tuple[int, int]] = None,
                done: bool = True) -> Enqueued:
        """Take the key at send time on a majority, or say who has it."""
        if replace is not None:
            raise no_replace()
        quorum, total = self.majority.quorum, len(self.majority.masters)

        def taken(r: Any) -> bool:
            return isinstance(r, Enqueued) and r.status is Enqueue.TAKEN

        results = self.majority.each(lambda e: e.enqueue(keys, task_id, scope, ttl_ms, task_name,
                                                done=done),
                            decided=_settled_by(quorum, Enqueued, taken))
        if sum(1 for r in results if taken(r)) >= quorum:
            return Enqueued(Enqueue.TAKEN)
        mine = [i for i, r in enumerate(results)
                if not (isinstance(r, Enqueued) and not taken(r))]
        if mine:
            self.majority.each(lambda e: e.unqueue(keys, task_id), only=mine, timeout=0.0,
                      skip_stale=False)
        refusals = [r for r in results if isinstance(r, Enqueued) and not taken(r)]
        if len(refusals) + quorum > total:
            counts = Counter((r.status, r.holder.task_id if r.holder else "") for r in refusals)
            best = max(counts.values())
            return next(r for r in refusals
                        if counts[(r.status, r.holder.task_id if r.holder else "")] == best)
        raise QuorumError(f"send-time key {keys.base} not decided", self.majority.failed(
            results, lambda r: isinstance(r, Enqueued)), len(refusals), quorum)

    def claim(self, key: str, value: str, ttl_ms: int) -> tuple[bool, str]:
        """Won when a majority of the masters hold ``value`` at ``key``.

        Claimants racing for one key (beats at one tick, workers given two
        copies of one tick) can split the masters so that none has a
        majority: each gives back what it took and tries again after a random
        pause, until one has a majority (the others then see it and lose).
        Raises :class:`QuorumError` when failures, not a rival, leave the
        claim undecided.
        """
        quorum = self.majority.quorum
        results: list[Any] = []
        for round_ in range(CLAIM_ROUNDS):
            results = self.majority.each(lambda e: e.claim(key, value, ttl_ms),
                                decided=_settled_by(quorum, tuple, lambda r: isinstance(
                                    r, tuple) and r[1] == value))
            ours = [i for i, r in enumerate(results) if isinstance(r, tuple) and r[1] == value]
            if len(ours) >= quorum:
                return True, value
            rivals = Counter(r[1] for r in results if isinstance(r, tuple) and r[1] != value)
            if ours:  # give back what this round took, before anyone tries again
                self.majority.each(lambda e: e.unclaim(key, value), only=ours, skip_stale=False)
            late = [i for i, r in enumerate(results) if r is MISSING]
            if late:  # queued after the claim still going on there
                self.majority.each(lambda e: e.unclaim(key, value), only=late, timeout=0.0,
                          skip_stale=False)
            if rivals and rivals.most_common(1)[0][1] >= quorum:
                return False, rivals.most_common(1)[0][0]
            if sum(1 for r in results if isinstance(r, Exception)) >= quorum:
                break
            time.sleep(random.uniform(0.005, 0.03) * (round_ + 1))
        raise QuorumError(f"claim of {key} not decided", self.majority.failed(
            results, lambda r: isinstance(r, tuple)), sum(
                1 for r in results if isinstance(r, tuple)), quorum)

    def unclaim(self, key: str, value: str) -> bool:
        """Give back a claim on every master that holds ``value`` there."""
        results = self.majority.each(lambda e: e.unclaim(key, value), skip_stale=False,
                                     decided=lambda rs: sum(r is True for r in rs)
                                     >= self.majority.quorum)
        return any(r is True for r in results)

    def unqueue(self, keys: LockKeys, task_id: str) -> bool:
        results = self.majority.each(lambda e: e.unqueue(keys, task_id),
                            decided=lambda rs: sum(r is True for r in rs) >= self.majority.quorum,
                            skip_stale=False)
        if all(isinstance(r, Exception) or r is MISSING for r in results):
            raise QuorumError(f"freeing the send-time key {keys.base}", self.majority.failed(
                results, lambda r: isinstance(r, bool)), 0, self.majority.quorum)
        return any(r is True for r in results)

    def queued_by(self, keys: LockKeys) -> str:
        results = self.majority.each(lambda e: e.queued_by(keys))
        ids = [r for r in results if isinstance(r, str)]
        if len(ids) < self.majority.quorum:
            raise QuorumError(f"reading the send-time key {keys.base}", self.majority.failed(
                results, lambda r: isinstance(r, str)), len(ids), self.majority.quorum)
        held = Counter(i for i in ids if i)
        return held.most_common(1)[0][0] if held else ""
