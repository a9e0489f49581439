"""A pure model of one lock key on the engine's servers, for the stateful
property test (``test_model.py``): what each operation must answer and what
each server must hold after it, with no Redis and no clock of its own.

A :class:`Store` is what one server holds for the key: the owner of each
slot (its execution, task, retry hand-off, a copy seen), whether the fencing
counter, the finish marker and the write-back hash exist, the task of the
send-time marker of the queue scopes (:meth:`Store.enqueue`,
:meth:`Store.unqueue`; :meth:`Store.acquire` passes it to its task's grant),
and the window of server time (ms) in which each of those keys must expire.
An empty restart forgets all of it (:meth:`Store.forget`). One server, a
Sentinel-managed primary and a Cluster node are one store; Redlock is one
store per master, combined by majority (:func:`redlock_acquire` and the rest).

The model never decides time: a step that writes a TTL gives the server's
clock read before and after it, and the key must then expire inside that
window plus its TTL (:meth:`Store.expires`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

#: the answers, by name (the engine's enums' names)
GRANTED, HELD, SAME_TASK, FINISHED = "GRANTED", "HELD", "SAME_TASK", "FINISHED"
RENEWED, NOT_OURS, HANDED_OFF, ABSENT = "RENEWED", "NOT_OURS", "HANDED_OFF", "ABSENT"
WRITTEN_BACK, OURS, RELEASED = "WRITTEN_BACK", "OURS", "RELEASED"
TAKEN = "TAKEN"
QUORUM_ERROR = "QuorumError"


@dataclass
class Execution:
    """One attempt of a task, as the test drives it (a simulated worker child)."""

    name: str
    task_id: str
    exec_id: str
    retries: int
    engine: int
    #: believes it holds its lock (granted, not released, lapsed, lost or replaced)
    live: bool = False
    #: ever granted (its slot and token are the last grant's)
    granted: bool = False
    slot: int = 0
    token: int = 0
    #: the lease (ms) it renews with
    lease_ms: int = 0
    #: granted by the native commands (it writes back natively too)
    native: bool = False
    #: the retry count its hand-off kept the key for (0: none)
    handed: int = 0
    #: ``singleton_scope`` of its task: ``run``, ``queue`` or ``queue_and_run``
    scope: str = "run"
    #: sent with the key taken at send time (a marker), not yet run or unqueued
    sent: bool = False

    def __str__(self) -> str:
        return f"{self.name}(task={self.task_id}, retries={self.retries}, slot={self.slot})"


@dataclass
class Owner:
    exec_id: str
    task_id: str
    token: int
    handoff: int = 0  # the retry count the key is kept for; 0: none
    copies: bool = False


@dataclass
class Store:
    """The key on one server."""

    owners: dict[int, Owner] = field(default_factory=dict)
    fence: bool = False
    #: the task id of the finish marker (None: no marker)
    fin: Optional[str] = None
    #: the slots written back since the server forgot the key (None: no hash)
    back: Optional[set[int]] = None
    #: the task id of the send-time marker (the queue scopes; None: no marker)
    queued: Optional[str] = None
    #: key name -> (earliest, latest) server ms at which it must expire
    windows: dict[str, tuple[int, int]] = field(default_factory=dict)

    def expires(self, key: str, ttl_ms: int, before: int, after: int) -> None:
        """``key`` was given ``ttl_ms`` between the server clocks ``before`` and ``after``."""
        self.windows[key] = (before + ttl_ms, after + ttl_ms)

    def forget(self) -> None:
        """The server restarted empty."""
        self.owners.clear()
        self.fence, self.fin, self.back, self.queued = False, None, None, None
        self.windows.clear()

    def unmark(self) -> None:
        self.queued = None
        self.windows.pop("queued", None)

    def owner_of(self, ex: Execution) -> Optional[int]:
        """The slot ``ex`` owns here, or None."""
        for slot, owner in self.owners.items():
            if owner.exec_id == ex.exec_id:
                return slot
        return None

    # -- what one server answers (the scripts' and the native commands' rules) ------

    def enqueue(self, task_id: str, scope: str) -> tuple[str, Optional[str], bool]:
        """enqueue.lua, a send under the queue scopes (no done window, no
        replace): (answer, the holder's task id, it is running). TAKEN
        leaves the marker (its TTL is the caller's to set)."""
        if self.queued is not None:
            return HELD, self.queued, False
        owner = self.owners.get(1)
        if scope == "queue_and_run" and owner is not None:
            return HELD, owner.task_id, True
        self.queued = task_id
        return TAKEN, None, False

    def unqueue(self, task_id: str) -> bool:
        if self.queued != task_id:
            return False
        self.unmark()
        return True

    def acquire(self, ex: Execution, slots: int) -> tuple[str, int]:
        """(answer, slot) of an acquire by ``ex``; the store changed as the server does.
        A grant's token is the caller's to set (:meth:`granted`). Under the
        queue scopes (one slot) the task's own send-time marker passes to
        a grant, and goes with a FINISHED; a HELD, a copy's SAME_TASK and a
        retry's grant of the key its attempt kept leave it."""
        own = ex.scope != "run" and self.queued is not None and self.queued == ex.task_id
        for slot in range(1, slots + 1):
            owner = self.owners.get(slot)
            if owner is not None and owner.task_id == ex.task_id:
                if owner.handoff and owner.handoff == ex.retries:
                    return GRANTED, slot  # the retry takes back what its attempt kept
                assert owner.exec_id != ex.exec_id, "the model never asks twice"
                owner.copies = True
                return SAME_TASK, slot
        free = [s for s in range(1, slots + 1) if s not in self.owners]
        if slots > 1 and free and self.back is not None:
            # acquire_slots.lua: while 'back' lives, only a slot written back
            # (then released) is granted
            free = [s for s in free if s in self.back]
        if not free:
            return HELD, 0
        if self.fin == ex.task_id:
            if own:
                self.unmark()
            return FINISHED, 0
        if ex.scope == "queue_and_run" and not own and self.queued is not None:
            return HELD, 0  # the queued task owns the key
        if own:
            self.unmark()
        return GRANTED, free[0]

    def granted(self, ex: Execution, slot: int, token: int) -> None:
        # a retry taking back the key its attempt kept keeps the mark of a copy
        # that attempt saw: the copy still waits for the task's finish marker
        kept = self.owners.get(slot)
        copies = kept is not None and kept.task_id == ex.task_id and kept.copies
        self.owners[slot] = Owner(ex.exec_id, ex.task_id, token, copies=copies)
        self.fence = True

    def release(self, ex: Execution) -> bool:
        slot = ex.slot
        owner = self.owners.get(slot)
        if owner is None or owner.exec_id != ex.exec_id:
            return False
        del self.owners[slot]
        self.windows.pop(f"lock:{slot}", None)
        return True

    def renew(self, ex: Execution) -> str:
        owner = self.owners.get(ex.slot)
        if owner is None:
            return ABSENT
        if owner.exec_id != ex.exec_id:
            return NOT_OURS
        return HANDED_OFF if owner.handoff else RENEWED

    def hand_off(self, ex: Execution, next_retries: int) -> bool:
        owner = self.owners.get(ex.slot)
        if owner is None or owner.exec_id != ex.exec_id:
            return False
        owner.handoff = next_retries
        return True

    def reclaim(self, ex: Execution, scripts: bool) -> str:
        """reclaim.lua (``scripts``) or the native write-back: the answer; a
        WRITTEN_BACK's token is the caller's to set (:meth:`written_back`)."""
        owner = self.owners.get(ex.slot)
        if owner is not None:
            return OURS if owner.exec_id == ex.exec_id else HELD
        if self.fence and not (scripts and self.back is not None and ex.slot not in self.back):
            return RELEASED
        return WRITTEN_BACK

    def written_back(self, ex: Execution, token: int, scripts: bool) -> None:
        self.owners[ex.slot] = Owner(ex.exec_id, ex.task_id, token)
        self.fence = True
        if scripts:
            self.back = (self.back or set()) | {ex.slot}


@dataclass
class Grant:
    """A token handed out: by a grant, a retry's grant, a write-back or a tie."""

    step: int
    execution: str
    slot: int
    token: int
    how: str

    def __str__(self) -> str:
        return f"#{self.step} {self.how} {self.execution} slot {self.slot} token {self.token}"


@dataclass
class Model:
    """Every store of the key, every execution, every token handed out."""

    stores: list[Store]
    slots: int
    executions: list[Execution] = field(default_factory=list)
    grants: list[Grant] = field(default_factory=list)
    history: list[str] = field(default_factory=list)

    @property
    def quorum(self) -> int:
        return len(self.stores) // 2 + 1

    @property
    def last_token(self) -> int:
        return max((g.token for g in self.grants), default=0)

    def token_handed(self, step: int, ex: Execution, slot: int, token: int, how: str) -> None:
        """A new token: above every token of the key before it, never equal."""
        last = self.last_token
        assert token > last, (f"{how} of {ex} gave token {token}, not above the key's last "
                              f"{last}" + (" (the same token again)" if token == last else ""))
        self.grants.append(Grant(step, ex.name, slot, token, how))

    def holders(self) -> dict[str, int]:
        """exec id -> slot, of the executions a quorum of stores name as owners."""
        counts: Counter[tuple[str, int]] = Counter()
        for store in self.stores:
            for slot, owner in store.owners.items():
                counts[(owner.exec_id, slot)] += 1
        return {e: s for (e, s), n in counts.items() if n >= self.quorum}

    def report(self) -> str:
        lines = ["model history:", *self.history, "grants (token order is grant order):"]
        lines += [f"  {g}" for g in self.grants]
        for i, store in enumerate(self.stores):
            lines.append(f"store {i}: owners={store.owners} fence={store.fence} "
                         f"fin={store.fin} back={store.back} queued={store.queued}")
        return "\n".join(lines)


# -- Redlock: the majority's answer from each master's ------------------------------

def redlock_acquire(answers: list[Optional[str]], quorum: int) -> set[str]:
    """What a Redlock acquire may answer, each master's answer given (None: it
    did not answer, frozen): GRANTED on a majority; a refusal when even the
    silent ones could not make one; else a QuorumError."""
    grants = sum(1 for a in answers if a == GRANTED)
    if grants >= quorum:
        return {GRANTED}
    refusals = [a for a in answers if a is not None and a != GRANTED]
    unknown = len(answers) - grants - len(refusals)
    if grants + unknown < quorum:
        return most_said(refusals)
    return {QUORUM_ERROR}


def most_said(answers: list[str]) -> set[str]:
    """The answers most masters gave (ties: any of them, whichever answered first)."""
    counts = Counter(answers)
    top = max(counts.values())
    return {a for a, n in counts.items() if n == top}


def redlock_renew(answers: list[str], quorum: int) -> str:
    said = Counter(answers)
    if said[RENEWED] >= quorum:
        return RENEWED
    if said[HANDED_OFF] and said[RENEWED] + said[HANDED_OFF] >= quorum:
        return HANDED_OFF
    return NOT_OURS if said[NOT_OURS] > said[ABSENT] else ABSENT
