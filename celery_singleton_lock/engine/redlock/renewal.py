"""Redlock: keeping a held lock on a majority of the masters.

Renewal on every master (a lock stays held while a majority renewed it), the
write-back on a master that lost a lock a majority still holds (restarted
empty, or it evicted the key), and the holder's own write-back of a lock the
masters lost (:meth:`Renewal.reclaim`). The lock's other operations
are in :mod:`.engine`.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any, Callable, Sequence

import redis

from ...exceptions import QuorumError, describe
from ...keys import LockKeys
from ..base import Engine
from ..replies import Acquire, Reclaim, Reclaimed, Renew
from ..request import Request
from .quorum import Masters, _settled_by

logger = logging.getLogger("celery_singleton_lock")


class Renewal:
    """How :class:`.engine.RedlockEngine` keeps a held lock on a majority."""

    def __init__(self, majority: Masters) -> None:
        self.majority = majority
        #: locks written back on a master that had lost them (:meth:`refill`)
        self.refilled = 0
        self._counting = threading.Lock()

    def renew_round(self, entries: Sequence[tuple[str, str, int]], *, every: bool = False
                    ) -> tuple[list[Renew], list[list[int]]]:
        """Renew on every master; per lock: RENEWED while a majority renewed it,
        UNANSWERED when too few masters answered (left alone, like an error),
        else lost (ABSENT or NOT_OURS, whichever more masters said). And per
        lock the masters that answered that they no longer have it while a
        majority renewed it (a master restarted empty, or one that evicted the
        key): :meth:`refill` writes it back there.

        Only masters that answered before the outcome was decided are heard;
        ``every``: wait for every master (up to :attr:`call_timeout`), as after
        a master came back, which reconnects and answers last.
        """
        if not entries:
            return [], []
        quorum = self.majority.quorum

        def all_renewed(results: list[Any]) -> bool:
            answers = [r for r in results if isinstance(r, list)]
            return len(answers) >= quorum and all(
                sum(1 for a in answers if a[i] is Renew.RENEWED) >= quorum
                for i in range(len(entries)))

        results = self.majority.each(lambda e: e.renew(entries),
                            decided=None if every else all_renewed)
        answers = [r for r in results if isinstance(r, list)]
        if not answers:
            raise QuorumError(f"renewal of {len(entries)} lock(s)", self.majority.failed(
                results, lambda r: isinstance(r, list)), 0, quorum)
        out: list[Renew] = []
        gaps: list[list[int]] = []
        for i in range(len(entries)):
            said = Counter(a[i] for a in answers)
            gaps.append([])
            if said[Renew.RENEWED] >= quorum:
                out.append(Renew.RENEWED)
                gaps[i] = [m for m, r in enumerate(results)
                           if isinstance(r, list) and r[i] is Renew.ABSENT]
            elif said[Renew.HANDED_OFF] and said[Renew.RENEWED] + said[Renew.HANDED_OFF] >= quorum:
                out.append(Renew.HANDED_OFF)
            elif len(answers) - said[Renew.RENEWED] - said[Renew.HANDED_OFF] < quorum:
                out.append(Renew.UNANSWERED)  # a majority may still have it
            else:
                out.append(Renew.NOT_OURS if said[Renew.NOT_OURS] > said[Renew.ABSENT]
                           else Renew.ABSENT)
        return out, gaps

    def refill(self, keys: LockKeys, request: Request, token: int, *,
               only: Sequence[int], still_held: Callable[[], bool]) -> None:
        """Write a lock held on a majority back on the masters at ``only``,
        which lost it, with a fencing counter of at least ``token`` there.

        Without it a lock held through one master's empty restart stands on
        one master fewer until released: a second such restart during a long
        task could hand a majority to another execution. Not waited for: each
        master's queue runs it in order, after asking ``still_held`` (a
        release sent meanwhile comes after it in the same queue and frees the
        key again). A master where the key is taken, or done, is left alone.
        """
        def write_back(engine: Engine) -> bool:
            if not still_held():
                return False
            got = engine.acquire(keys, request._replace(scope="run"))
            if got.status is not Acquire.GRANTED:
                return False
            if got.token < token:
                engine.raise_fence(keys, request.exec_id, token)
            return True

        def job(i: int) -> Callable[[Engine], bool]:
            def run(engine: Engine) -> bool:
                try:
                    done = write_back(engine)
                except redis.RedisError as exc:
                    logger.warning("Could not write singleton lock %s back on %s: %s",
                                   keys.base, self.majority.masters[i].name, describe(exc))
                    return False
                if done:
                    with self._counting:
                        self.refilled += 1
                    logger.warning("Wrote singleton lock %s of %s[%s] back on %s: that "
                                   "master had lost it (restarted empty?)", keys.base,
                                   request.task_name, request.task_id,
                                   self.majority.masters[i].name)
                return done
            return run

        for i in only:
            self.majority.each(job(i), only=[i], timeout=0.0)

    def reclaim(self, keys: LockKeys, request: Request, token: int) -> Reclaimed:
        """:meth:`Engine.reclaim` on every master: held again when a majority
        wrote it back (or had it); otherwise what was written is given back
        and the answer is the refusal most masters gave."""
        def kept(r: Any) -> bool:
            return isinstance(r, Reclaimed) and r.status in (Reclaim.WRITTEN_BACK, Reclaim.OURS)

        results = self.majority.each(
            lambda e: e.reclaim(keys, request, token),
            decided=_settled_by(self.majority.quorum, Reclaimed, kept))
        held = [i for i, r in enumerate(results) if kept(r)]
        if len(held) >= self.majority.quorum:
            written = any(results[i].status is Reclaim.WRITTEN_BACK for i in held)
            return Reclaimed(Reclaim.WRITTEN_BACK if written else Reclaim.OURS,
                             token=max(results[i].token for i in held))
        if held:  # not waited for: each master's queue sends it after the write-back
            self.majority.each(lambda e: e.release(keys, request.exec_id, request.task_id,
                                                   finished=False),
                               only=held, timeout=0.0, skip_stale=False)
        refusals = [r for r in results if isinstance(r, Reclaimed) and not kept(r)]
        if not refusals:
            raise QuorumError(f"write-back of {keys.base}", self.majority.failed(
                results, lambda r: isinstance(r, Reclaimed)), len(held), self.majority.quorum)
        counts = Counter(r.status for r in refusals)
        return next(r for r in refusals if counts[r.status] == max(counts.values()))
