"""Every reply of every script in ``lua/``, named once.

The scripts answer with small integers (and arrays that start with one); this
module is the only place that reads them. Each family has its own enum, so a
release's "taken" can never be mistaken for an acquire's "held", and a reply
no script gives raises :class:`UnexpectedReplyError` instead of being guessed at.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Callable, Optional

from ..exceptions import LateRequestError, UnexpectedReplyError
from ..process import Holder


class Acquire(IntEnum):
    """``acquire.lua``: what an execution that starts found."""

    HELD = 0  #: another task holds the key (running, or queued under queue_and_run)
    GRANTED = 1  #: the lock is this execution's
    SAME_TASK = 2  #: another execution of this very task id holds it (a redelivery)
    FINISHED = 3  #: this task id already finished: a late redelivery
    DONE = 4  #: another task succeeded within ``singleton_done_ttl``
    THROTTLED = 5  #: another task started within the ``singleton_throttle`` window
    REPLACED = 6  #: a later send took this queued one's place (``"replace"``)
    RATE_LIMITED = 7  #: the key's ``singleton_rate`` window is full (:mod:`.rate`)


class Release(IntEnum):
    """``release.lua``: what a release found."""

    TAKEN = 0  #: another execution holds the key
    RELEASED = 1  #: freed
    FREE = -1  #: no owner record: the lease ran out, or an earlier copy freed it


class Renew(IntEnum):
    """``renew.lua``: one per lock renewed."""

    NOT_OURS = 0  #: held by another execution
    RENEWED = 1
    HANDED_OFF = 2  #: kept for this task's retry; the retry renews it
    ABSENT = 3  #: no record at all (Redis restarted empty, an eviction, a lapsed lease)
    #: not answered this round (never a script's reply: a Cluster node that
    #: failed while others answered); the lock is left alone, like on an error
    UNANSWERED = -1


class Reclaim(IntEnum):
    """``reclaim.lua``: what writing back a lock whose key a renewal found gone found."""

    HELD = 0  #: another execution holds the key: the lock is lost
    WRITTEN_BACK = 1  #: the server had forgotten it; written back under a new token
    OURS = 2  #: it is this execution's already (written back by another call)
    RELEASED = -1  #: released or expired (its fencing counter is still there): lost


class Enqueue(IntEnum):
    """``enqueue.lua``: what a send under the queue scopes found."""

    HELD = 0  #: queued, or running (queue_and_run), as another task
    TAKEN = 1  #: the key is this send's
    REPLACED = 2  #: the key is this send's; the queued one it names is superseded
    DONE = 4  #: another task succeeded within ``singleton_done_ttl``


# Acquired and Released are made for every task: not frozen, since a frozen
# dataclass's __init__ sets each field through object.__setattr__ (three
# times the CPU). Nothing changes them after they are made.
@dataclass
class Acquired:
    """An acquire's answer: a grant with its fencing token, or who is in the way."""

    status: Acquire
    token: int = 0
    holder: Optional[Holder] = None
    #: the refused execution owns the key it took at send time (it was accepted)
    queued_by_it: bool = False
    #: THROTTLED, RATE_LIMITED: milliseconds until the window reopens
    reopens_ms: int = 0
    #: ``singleton_limit`` > 1: the slot granted, or the slot of ``holder``
    slot: int = 1
    #: HELD by a running execution: its lock's remaining ms (the shortest of the
    #: slots held), and the lease it was granted (-1, 0: not known). A grant
    #: its holder has not confirmed yet lives only until its request's
    #: deadline (grant_ttl in lua/_record.lua): :meth:`unconfirmed`
    ttl_ms: int = -1
    lease_ms: int = 0
    #: GRANTED with a deadline: the confirmation sent after it (:class:`Confirmation`)
    confirmation: Optional[Confirmation] = field(default=None, compare=False, repr=False)

    @property
    def doubtful(self) -> bool:
        """Refused by a holder that may not be running: its lock was not
        renewed on time (it lives less than two thirds of its lease; a holder
        renews when a third has passed). A grant its holder has not confirmed
        yet (and may never: its caller gave up; grant_ttl in lua/_record.lua),
        a holder cut off from Redis, or one whose release is still on its way.
        Its lock is decided within what it has left: renewed, or gone."""
        return (self.status is Acquire.HELD and self.lease_ms > 0
                and 0 <= self.ttl_ms < self.lease_ms * 2 // 3)

    def unconfirmed(self, budget_ms: int) -> bool:
        """:attr:`doubtful`, and decided soon: within twice ``budget_ms`` (how
        long a caller waits for a grant's reply: a grant not confirmed lives
        until its request's deadline and one more such wait), as a grant not
        confirmed yet is."""
        return self.doubtful and self.ttl_ms < 2 * budget_ms

    @property
    def holder_state(self) -> str:
        """What the holder is doing: ``"done"`` (its success keeps the key done),
        ``"queued"`` (it took the key when sent and has not started: its record
        names no execution), ``"running"``, or ``"started"`` (it started within
        the throttle window)."""
        if self.status is Acquire.DONE:
            return "done"
        if self.status in (Acquire.THROTTLED, Acquire.RATE_LIMITED):
            return "started"
        if self.status is Acquire.REPLACED:
            return "queued"
        return "queued" if self.holder is not None and not self.holder.exec_id else "running"


class Confirmation:
    """The confirmation of a grant, sent without waiting right after it.

    Until confirmed, a grant lives only until its request's deadline and one
    more wait (grant_ttl in ``lua/_record.lua``): a confirmation that reaches
    the server later than that (the server stalled, the path held it) finds
    the key gone, and another execution may have it by then. So until its
    answer is read the holder counts on its lock only until :attr:`until`,
    a moment of this process's monotonic clock before which the grant is
    surely still there; the answer, read with the process's next call or by
    its renewer at once, tells the holder (:meth:`listen`) whether it was
    confirmed, and from when its lease counts."""

    __slots__ = ("_listener", "_mutex", "answer", "sent_at", "until")

    def __init__(self, until: float, sent_at: float) -> None:
        self.until = until
        #: when the confirmation left (monotonic): its lease counts from then
        self.sent_at = sent_at
        #: its answer once read (None: not yet, or a Redis error)
        self.answer: Optional[Renew] = None
        self._listener: Optional[Callable[[Renew, float], None]] = None
        self._mutex = threading.Lock()

    def answered(self, answer: Renew) -> None:
        """The confirmation's reply was read: ``answer`` is what it found."""
        with self._mutex:
            self.answer, listener = answer, self._listener
        if listener is not None:
            listener(answer, self.sent_at)

    def listen(self, listener: Callable[[Renew, float], None]) -> None:
        """``listener(answer, sent_at)`` once the answer is read (at once if it
        was already): called once, by whichever comes second."""
        with self._mutex:
            self._listener, answer = listener, self.answer
        if answer is not None:
            listener(answer, self.sent_at)


@dataclass(frozen=True)
class Reclaimed:
    status: Reclaim
    token: int = 0  #: the owner record's token now (WRITTEN_BACK, OURS)
    holder: Optional[Holder] = None  #: who holds the key (HELD)


@dataclass(frozen=True)
class Enqueued:
    status: Enqueue
    holder: Optional[Holder] = None
    #: HELD: the holder has started (queue_and_run); else it is still queued
    running: bool = False
    #: debounced sends (TAKEN, REPLACED): the countdown to send with, in ms
    countdown_ms: Optional[int] = None
    #: REPLACED: every task id this send supersedes (the holder, and those it
    #: had superseded)
    superseded: tuple[str, ...] = ()

    @property
    def holder_state(self) -> str:
        """``"done"``, ``"running"`` or ``"queued"``: what the holder is doing."""
        if self.status is Enqueue.DONE:
            return "done"
        return "running" if self.running else "queued"


@dataclass
class Released:
    """What a release sent without waiting found, read later.

    ``repeated``: the command was sent again after its reply was lost with the
    connection, so FREE most likely means the first attempt worked.
    """

    status: Release
    repeated: bool = False


def _enum(family: type[IntEnum], value: Any, script: str) -> Any:
    try:
        return family(int(value))
    except (TypeError, ValueError):
        raise UnexpectedReplyError(script, value) from None


#: the reply every request with a deadline gives when it arrived after it:
#: ``{8, server clock ms}`` (``arrival`` in lua/_record.lua)
LATE = 8


def _first(reply: Any, script: str) -> Any:
    if not isinstance(reply, list) or not reply:
        raise UnexpectedReplyError(script, reply)
    if reply[0] == LATE and len(reply) == 2 and isinstance(reply[1], int):
        raise LateRequestError(script, reply[1], 0)
    return reply[0]


#: the owner record's fields, in order (``acquire.lua``, docs/redis-keys.md): one
#: string, joined by newlines, the task id last (only it may hold a newline)
RECORD_FIELDS = ("exec", "handoff", "copies", "token", "at", "lease", "fin", "retries", "pid",
                 "hostkey", "host", "name", "task")
_LAST = len(RECORD_FIELDS) - 1


def record(raw: Any) -> dict[str, str]:
    """The owner record as a dict (empty when the key is free); ``at`` in ms.

    ``handoff`` and ``copies`` appear only when set, as they did when the
    record was a hash."""
    if not raw:
        return {}
    if isinstance(raw, bytes):
        raw = raw.decode("utf-8", "surrogateescape")
    values = raw.split("\n", _LAST)
    if len(values) != len(RECORD_FIELDS):
        raise UnexpectedReplyError("owner record", raw)
    out = {k: v for k, v in zip(RECORD_FIELDS, values) if v or k not in ("handoff", "copies")}
    at = out.get("at", "")
    if at.isdigit():
        out["at"] = at[:-3] or "0"  # microseconds in Redis
    return out


def holder_of(raw: Any) -> Holder:
    """The holder an owner record (as stored) names."""
    values = raw.split("\n", _LAST)
    return Holder(task_id=values[12], exec_id=values[0], host_key=values[9],
                  pid=int(values[8] or 0), hostname=values[10])


def lease_of(raw: Any) -> int:
    """The lease (ms) an owner record (as stored) was granted; 0 when not known,
    or when the record is kept for a retry (its ``handoff`` set: its TTL is
    the retry's wait, not a grant's)."""
    fields = raw.split("\n", 6)
    if len(fields) < 7 or fields[1]:
        return 0
    return int(fields[5]) if fields[5].isdigit() else 0


def acquired(reply: Any) -> Acquired:
    if isinstance(reply, str):  # granted: the fencing token
        try:
            return Acquired(Acquire.GRANTED, token=int(reply))
        except ValueError:
            raise UnexpectedReplyError("acquire", reply) from None
    status: Acquire = _enum(Acquire, _first(reply, "acquire"), "acquire")
    try:
        if status is Acquire.GRANTED:
            return Acquired(status, token=int(reply[1]),
                            slot=int(reply[2]) if len(reply) > 2 else 1)
        if status in (Acquire.FINISHED, Acquire.DONE, Acquire.REPLACED):
            return Acquired(status, holder=Holder(reply[1]))
        if status in (Acquire.THROTTLED, Acquire.RATE_LIMITED):
            return Acquired(status, holder=Holder(reply[1]),
                            reopens_ms=max(int(reply[2]), 0))
        # HELD: {0, record, accepted[, ttl]} (acquire.lua), {0, record, 0, slot, ttl}
        # (acquire_slots.lua); SAME_TASK: {2, record[, slot]}
        if status is not Acquire.HELD:
            return Acquired(status, holder=holder_of(reply[1]),
                            slot=int(reply[2]) if len(reply) > 2 else 1)
        slots = len(reply) > 4
        return Acquired(status, holder=holder_of(reply[1]),
                        queued_by_it=len(reply) > 2 and reply[2] == 1,
                        slot=int(reply[3]) if slots else 1,
                        ttl_ms=int(reply[-1]) if len(reply) > 3 else -1,
                        lease_ms=lease_of(reply[1]))
    except (IndexError, TypeError, ValueError, AttributeError):
        raise UnexpectedReplyError("acquire", reply) from None


def reclaimed(reply: Any) -> Reclaimed:
    try:
        if isinstance(reply, str):
            return Reclaimed(Reclaim.WRITTEN_BACK, token=int(reply))
        if reply == -1:
            return Reclaimed(Reclaim.RELEASED)
        if isinstance(reply, list) and reply[0] == 1:
            return Reclaimed(Reclaim.OURS, token=int(reply[1]))
        if isinstance(reply, list) and reply[0] == 0:
            return Reclaimed(Reclaim.HELD, holder=holder_of(reply[1]))
        if isinstance(reply, list):
            _first(reply, "reclaim")  # too late: raised
    except (IndexError, TypeError, ValueError, AttributeError):
        pass
    raise UnexpectedReplyError("reclaim", reply)


def enqueued(reply: Any) -> Enqueued:
    status: Enqueue = _enum(Enqueue, _first(reply, "enqueue"), "enqueue")
    try:
        if status is Enqueue.TAKEN:
            return Enqueued(status, countdown_ms=int(reply[1]) if len(reply) > 1 else None)
        if status is Enqueue.REPLACED:
            return Enqueued(status, holder=Holder(reply[1]), countdown_ms=int(reply[2]),
                            superseded=tuple(str(x) for x in reply[3:]))
        return Enqueued(status, holder=Holder(reply[1]), running=len(reply) > 2 and reply[2] == 1)
    except (IndexError, TypeError, ValueError):
        raise UnexpectedReplyError("enqueue", reply) from None


#: release.lua's replies (a lookup: every task's release is read here)
_RELEASE = {int(r): r for r in Release}


def released(reply: Any, repeated: bool = False) -> Released:
    status = _RELEASE.get(reply) if reply.__class__ is int else None
    if status is None:
        status = _enum(Release, reply, "release")
    return Released(status, repeated)


def renewed(reply: Any, count: int) -> list[Renew]:
    if not isinstance(reply, list) or len(reply) != count:
        raise UnexpectedReplyError("renew", reply)
    return [_enum(Renew, x, "renew") for x in reply]


def flag(reply: Any, script: str) -> bool:
    """A yes/no script (``handoff``, ``unqueue``): 1 or 0."""
    if reply not in (0, 1):
        raise UnexpectedReplyError(script, reply)
    return bool(reply)
