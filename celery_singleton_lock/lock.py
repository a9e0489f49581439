"""``self.singleton``: what a running task sees of its lock.

The lease counts on this process's monotonic clock from before the acquire
left, so the task learns its lock may be gone (``lost``) as soon as the lease
could have run out, even when no renewal can reach Redis to say so. A grant
whose confirmation has not been answered yet counts only until the moment
Redis may free it unconfirmed (:class:`~.engine.replies.Confirmation`): past
it the lock is in doubt, ``lost`` until an answer or a renewal says it is
still this execution's.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional, Union

from .engine.replies import Confirmation, Release, Released, Renew
from .engine.request import Lease, Request
from .exceptions import LockLostError, describe
from .keys import LockKeys
from .observe import monitor
from .rollout import OtherLock

logger = logging.getLogger("celery_singleton_lock")

#: the clock leases are counted on; a test may hand a lock another
Clock = Callable[[], float]

#: the attribute of a task's request that holds its execution's lock
REQUEST_ATTR = "_singleton_lock"


class SingletonLock:
    """What a running task sees as ``self.singleton``.

    ``key``     the lock's key (a hash: no argument value in it)
    ``token``   fencing token, increasing with every grant of this key (0: no lock)
    ``lost``    true once the lock is known or presumed no longer ours
    ``check()`` raises :class:`LockLostError` when ``lost``
    """

    __slots__ = (
        "_clock",
        "_deadline",
        "_doubt_after",
        "_lost_reason",
        "acquired_at",
        "companion",
        "exec_id",
        "handed_off",
        "held",
        "hostname",
        "key",
        "keys",
        "lease",
        "margin",
        "retries",
        "slot",
        "task_id",
        "task_name",
        "token",
    )

    def __init__(
        self,
        keys: LockKeys,
        *,
        task_id: str = "",
        task_name: str = "",
        exec_id: str = "",
        token: int = 0,
        lease: Union[float, Lease] = 0.0,
        started: float = 0.0,
        held: bool = False,
        hostname: str = "",
        retries: int = 0,
        margin: float = 0.0,
        clock: Clock = time.monotonic,
        slot: int = 1,
        companion: Optional[OtherLock] = None,
        confirmation: Optional[Confirmation] = None,
    ) -> None:
        self.keys = keys
        #: which of the key's ``singleton_limit`` slots this execution holds
        self.slot = slot
        #: the old library's lock held beside this one (``singleton_also_lock``),
        #: renewed with it
        self.companion = companion
        self.key = keys.base
        self.task_id = task_id
        self.task_name = task_name
        self.exec_id = exec_id
        self.token = token
        self.lease = Lease.of(lease)
        self.held = held
        self.handed_off = False
        # what the owner record says, to write it again (see Heartbeat)
        self.hostname = hostname
        self.retries = retries
        # The lease counts from before the request left: a conservative deadline,
        # ``margin`` shorter still (the clock drift Redlock allows)
        self.margin = margin
        self._deadline = started + self.lease.seconds - margin if held else float("inf")
        self._lost_reason: Optional[str] = None
        self._clock = clock
        #: a grant not confirmed yet: from then on the lock is in doubt (None: confirmed)
        self._doubt_after: Optional[float] = None
        if held and confirmation is not None:
            self._doubt_after = confirmation.until
            confirmation.listen(self._confirmed)
        #: wall-clock time of the grant: the age shown by ``celery inspect stats``
        self.acquired_at = time.time()

    @property
    def lost(self) -> bool:
        """Known or presumed no longer this execution's: told so, its lease ran
        out here, or (for now) :attr:`in_doubt`."""
        return self.gone or self.in_doubt

    @property
    def gone(self) -> bool:
        """Lost for good: told so, or its lease ran out before a renewal."""
        if self._lost_reason is not None:
            return True
        if self.held and self._clock() > self._deadline:
            self.mark_lost("lease ran out before it could be renewed")
            return True
        return False

    @property
    def in_doubt(self) -> bool:
        """A grant whose confirmation has not been answered, past the moment
        Redis may have freed it unconfirmed (or answered that it had): lost
        until a renewal finds it still this execution's, or for good when it
        does not."""
        doubt = self._doubt_after
        return (doubt is not None and self._lost_reason is None and self.held
                and self._clock() > doubt)

    @property
    def confirm_until(self) -> Optional[float]:
        """While :attr:`confirming`: when the grant's window ends (monotonic)."""
        return self._doubt_after if self.confirming else None

    @property
    def confirming(self) -> bool:
        """The grant's confirmation has not said yet that the lock is ours."""
        return self._doubt_after is not None and self._lost_reason is None

    def _confirmed(self, answer: Renew, sent_at: float) -> None:
        """The grant's confirmation was answered (:class:`.Confirmation`)."""
        if answer is Renew.RENEWED:
            self.renewed(sent_at)
        elif self._doubt_after is not None:
            # gone when it came (a stall past its window), or released first:
            # in doubt at once, and the renewer's next round decides
            self._doubt_after = float("-inf")

    def check(self) -> None:
        """Raise :class:`LockLostError` if this execution may no longer hold the lock."""
        if self.lost:  # with no reason given, only in doubt
            raise LockLostError(self.key, self.token, self._lost_reason or (
                "its grant was not confirmed in time (Redis may have freed it)"))

    @property
    def request(self) -> Request:
        """What this execution asked for, to ask again (a write-back)."""
        return Request(self.task_id, self.exec_id, self.lease, self.hostname, self.retries,
                       self.task_name)

    @property
    def expired(self) -> bool:
        """The lease's local deadline has passed (a grant read this late is no grant)."""
        return self.held and self._clock() > self._deadline

    def renewed(self, sent_at: float) -> None:
        """A renewal (or the grant's confirmation) sent at ``sent_at`` found
        the lock this execution's: its lease counts from then, and no doubt
        is left."""
        if self._lost_reason is None:
            self._deadline = sent_at + self.lease.seconds - self.margin
            self._doubt_after = None

    def mark_lost(self, reason: str) -> None:
        if self._lost_reason is None:
            self._lost_reason = reason
            monitor.count(None, "lost", self.task_name)  # the locks_lost metric
            logger.warning(
                "Lost singleton lock %s (token %s) of %s[%s]: %s",
                self.key, self.token, self.task_name, self.task_id, reason,
            )

    def released(self, reply: Optional[Released], error: Optional[Exception]) -> None:
        """What the release's reply says about this lock (read after the task
        returned, on this process's next call to the lock Redis)."""
        if error is not None or reply is None:
            logger.error("Could not release singleton lock %s of %s[%s] (%s): it frees "
                         "within %ss", self.key, self.task_name, self.task_id, describe(error),
                         self.lease.seconds)
        elif reply.status is Release.FREE and reply.repeated:
            # The reply of the first attempt was lost with its connection;
            # finding the key free, the repeat most likely sees that attempt's work.
            logger.info("Released singleton lock %s of %s[%s] (the release was repeated "
                        "after a lost reply and found the key free)",
                        self.key, self.task_name, self.task_id)
        elif reply.status is Release.FREE:
            self.mark_lost("at release the lease had run out (the key was free)")
        elif reply.status is Release.TAKEN:
            self.mark_lost(
                "at release another execution held the key" + (
                    " (the release was repeated after a lost reply: the first attempt "
                    "may have freed it before that execution took it)"
                    if reply.repeated else ""))

    def __repr__(self) -> str:
        state = "lost" if self._lost_reason else (
            "in doubt" if self.in_doubt else "held" if self.held else "unlocked")
        return f"<SingletonLock {self.key} token={self.token} {state}>"
