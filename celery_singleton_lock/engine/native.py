"""The native path: a task's lock in plain commands, no script, on a server
that compares before it writes (Valkey 9.0+, Redis 8.4+: :mod:`.commands`).

:class:`~.server.LockEngine` sends a task here when the server has the
commands and the task's options need nothing more (scope ``run``, no limit,
throttle or ``replace``, no ``WAIT``); every other call stays a script. The
owner record and the keys are the scripts' own (docs/redis-keys.md), so a
lock taken one way is renewed, listed, released and written back the other.

The promises are the scripts':

* a grant is ``SET lock <record> NX PX <lease> GET`` (the holder's record
  when refused, so a redelivered copy of the holder is found in the same
  round trip); a release, a renewal and a hand-off compare the whole record
  first (``DELIFEQ``, ``SET ... IFEQ``), so only the holder frees or extends
  it; a record changed meanwhile (a copy marked it) is read and compared again;
* the finish marker a copy needs is written before the record is deleted;
* the fencing token is above every token the key had, and the server clock
  its floor: the grant proposes one (this process's estimate of the server
  clock, :class:`ServerClock`), and in the same write creates the key's
  counter at it if there is none, and reads the counter and the clock. The
  proposal stands when it is at or above that clock (read after the grant),
  at most :data:`AHEAD_US` above it, and above the counter; otherwise a
  second round trip writes a token that is. A counter the grant found is
  raised to the token right behind it (sent at once, its reply read with the
  next call), so before anyone's release of the lock. Every write of the
  counter is "create if none" or "compare, then raise": it never goes down.
  A token may run up to :data:`AHEAD_US` ahead of the clock (a script's is
  the clock itself): a counter lost that soon after a grant (deleted by hand;
  a restart or a failover takes longer) could let the next grant come below;
* a grant lives until its request's deadline until its holder confirms it
  (:meth:`Native.confirm`), as a script's does.

Over 500 lines: one class, the lock's life in plain commands (grant,
confirmation, release, hand-off, renewal, write-back), each the twin of a
script in ``lua/`` and kept beside the others: they share the owner record's
layout, the held records they compare, and the way they read a record again
when it changed under them.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import redis

from ..exceptions import LateRequestError
from ..keys import LockKeys
from ..process import Holder
from .calls import fence_of, fence_ttl_ms, record_rest
from .clock import AHEAD_US, now_us, server_us
from .commands import (
    COMMANDS,
    FIELDS,
    GRANT,
    Command,
    Flavor,
    fields_of,
    new_record,
    task_of,
    with_copies,
    with_token,
)
from .outage import RedisUnanswered
from .replies import (
    Acquire,
    Acquired,
    Confirmation,
    Reclaim,
    Reclaimed,
    Release,
    Released,
    Renew,
    holder_of,
    lease_of,
)
from .request import Request
from .wire import BROKEN, Wire

logger = logging.getLogger("celery_singleton_lock")

#: how often a compare-and-write whose record keeps changing is tried again
TRIES = 8


@dataclass
class Held:
    """A lock this process was granted natively."""

    #: the owner record as written, which a release and a renewal compare
    record: str
    token: int


class Native:
    """A task's lock in plain commands, on one server's wire."""

    def __init__(self, wire: Wire, flavor: Flavor, keep_ms: int, fin_ms: int,
                 everything: bool = False) -> None:
        self.wire = wire
        self.flavor = flavor
        #: every call is this path's: the server runs no script
        self.everything = everything
        #: how long a key's fencing counter outlives its lock (singleton_fence_ttl)
        self.keep_ms = keep_ms
        self.fin_ms = fin_ms
        #: the wire's estimate of the server clock (a grant proposes its token from it)
        self.clock = wire.clock
        #: (lock key, execution id) -> what this process holds
        self.held: dict[tuple[str, str], Held] = {}
        #: fencing counters whose raise behind a grant has not been answered yet
        self._raising: dict[str, threading.Event] = {}

    def serves(self, lock: str, exec_id: str) -> bool:
        """A call on this lock is this path's: it granted the lock, or the
        server runs no script."""
        return self.everything or (lock, exec_id) in self.held

    def send(self, commands: Sequence[Command]) -> tuple[list[Any], bool]:
        """Commands in one write: their replies, and whether they were sent twice."""
        reply, repeated = self.wire.call(COMMANDS, [], commands)
        return (reply if len(commands) > 1 else [reply]), repeated

    # -- a grant ------------------------------------------------------------------------

    def acquire(self, keys: LockKeys, request: Request, *, again: int = TRIES,
                deadline: int = 0, confirm_by: int = 0) -> Acquired:
        """Take the lock for an execution that starts now (acquire.lua for a
        :attr:`.Request.plain` request): one round trip, two when the proposed
        token does not stand or a copy is marked. ``again``: how many more
        times it starts over when the record changed between its two writes;
        ``deadline``: the server clock (ms) past which the grant does nothing
        (:data:`.commands.GRANT`; :class:`.LateRequestError`); ``confirm_by``:
        when the grant expires unless confirmed (:meth:`confirm`) before."""
        task_id, exec_id, lease_ms = request.task_id, request.exec_id, request.lease.ms
        done, retries = request.done, request.retries
        rest = record_rest(request, self.fin_ms)
        if not self.clock.known:  # the server's clock, once per process
            sent = now_us()
            self.clock.heard(sent, self.send([("TIME",)])[0][0], now_us())
        proposed = self.clock.propose()
        record = new_record(exec_id, proposed, proposed, rest)
        fence_ms = fence_ttl_ms(lease_ms, self.keep_ms)
        names = [keys.lock, keys.fence, keys.fin, keys.done] if done else [
            keys.lock, keys.fence, keys.fin]
        sent = now_us()
        try:
            answers, _ = self.wire.call(GRANT, names, [record, lease_ms, proposed, fence_ms,
                                                       deadline, confirm_by])
        except BROKEN as exc:
            if not isinstance(exc, RedisUnanswered):
                # Redis may still run it: undone, owner-checked, once it answers
                self.wire.owe(exc, COMMANDS, [], [self.flavor.delete_if(keys.lock, record)])
            raise
        self.clock.heard(sent, answers[-1], now_us())
        holder = answers[0]
        if deadline and answers.pop(1) != "OK" and holder is None:
            # set to expire at its deadline, already past: Redis wrote nothing
            raise LateRequestError("grant", server_us(answers[-1]) // 1000, deadline)
        ttl, counter, fin = answers[1], answers[2], answers[3]
        done_by = answers[4] if done else None
        now = server_us(answers[-1])

        handed = copied = False
        if holder is not None and holder.endswith("\n" + task_id):
            fields = fields_of(holder)
            if len(fields) > FIELDS and fields[FIELDS] == task_id:
                if fields[1] != "" and fields[1] == str(retries):
                    handed = True  # the retry takes back the key its attempt kept
                    copied = fields[2] == "1"
                elif fields[0] == exec_id:
                    # this execution asked again (a reply lost on the way): its lease
                    # anew, its own record's only (compared: the key may have changed
                    # hands since the grant read it; then decided again, below)
                    kept = self._rewrite(keys.lock, exec_id, holder, lambda r: r,
                                         ("PX", lease_ms))
                    if kept is None:
                        return self._again(keys, request, again, deadline, confirm_by)
                    token = int(fields_of(kept)[3])
                    self.held[(keys.lock, exec_id)] = Held(kept, token)
                    if counter is not None and counter != str(proposed):
                        self._raise_later(keys.fence, token,
                                          fence_ttl_ms(lease_ms, self.keep_ms), counter)
                    return Acquired(Acquire.GRANTED, token=token)
                else:
                    # a redelivered copy: the holder must leave a finish marker
                    if fields[2] != "1":
                        self._mark_copied(keys.lock, holder)
                    return Acquired(Acquire.SAME_TASK, holder=holder_of(holder))
        if not handed:
            if done_by is not None:
                if holder is None:
                    self._give_back(keys.lock, record)
                by = task_of(done_by)
                return Acquired(Acquire.FINISHED if by == task_id else Acquire.DONE,
                                holder=Holder(by))
            if holder is not None:
                return Acquired(Acquire.HELD, holder=holder_of(holder), ttl_ms=ttl,
                                lease_ms=lease_of(holder))
            if fin == task_id:
                self._give_back(keys.lock, record)
                return Acquired(Acquire.FINISHED, holder=Holder(task_id))

        # the counter this grant created (none was there), or the one it found:
        # one found holding the very token proposed is another grant's, and
        # the token goes one above it (two holders never share one)
        created = counter is None
        last = None if created else int(counter)
        if now <= proposed <= now + AHEAD_US and (last is None or proposed > last):
            token = proposed
        else:
            token = max(now + 1, last + 1 if last is not None else 0)
        seen = str(proposed) if created else counter
        if handed:
            # the retry takes back the key its earlier attempt handed off to it,
            # and the mark of a copy that attempt saw (it waits for the finish)
            record = new_record(exec_id, token, now, rest)
            if copied:
                record = with_copies(record)
            written: Optional[str] = record
            if self.send([("SET", keys.lock, record, "IFEQ", holder, "PX", lease_ms)]
                         )[0][0] != "OK":
                written = None
        elif token == proposed:
            self.held[(keys.lock, exec_id)] = Held(record, token)
            if not created:  # the counter it found, raised right behind the grant
                self._raise_later(keys.fence, token, fence_ms, counter)
            return Acquired(Acquire.GRANTED, token=token, confirmation=self.confirm(
                keys.lock, exec_id, lease_ms, confirm_by) if deadline else None)
        else:
            # the proposal did not stand: the record and the counter carry the token
            written = self._rewrite(keys.lock, exec_id, record,
                                    lambda r: with_token(r, token, now), ("KEEPTTL",))
        if written is None:
            # changed between the two writes (a copy marked it, its lease ran
            # out): decided again, from what the key holds now
            return self._again(keys, request, again, deadline, confirm_by)
        self._raise(keys.fence, token, fence_ms, seen)
        self.held[(keys.lock, exec_id)] = Held(written, token)
        return Acquired(Acquire.GRANTED, token=token, confirmation=self.confirm(
            keys.lock, exec_id, lease_ms, confirm_by) if deadline and not handed else None)

    def _again(self, keys: LockKeys, request: Request, again: int, deadline: int,
               confirm_by: int) -> Acquired:
        """:meth:`acquire` started over: its record changed between its two
        writes; an error once it has ``again`` times."""
        if again <= 0:
            raise redis.ResponseError(f"lock {keys.base} kept changing during its grant")
        return self.acquire(keys, request, again=again - 1, deadline=deadline,
                            confirm_by=confirm_by)

    def confirm(self, lock: str, exec_id: str, lease_ms: int, confirm_by: int
                ) -> Optional[Confirmation]:
        """A grant is its holder's: its lease from now (until then it lives
        until ``confirm_by``, server ms), sent without waiting, the reply read
        with this process's next call; what it found goes to the holder
        (:class:`.Confirmation`). A grant found gone by then (its reply came
        too late, the server stalled) is said in the log."""
        held = self.held.get((lock, exec_id))
        if held is None:
            return None
        confirmation = Confirmation(self.clock.local_time_of(confirm_by), time.monotonic())

        def done(reply: Any, error: Optional[Exception], repeated: bool) -> None:
            answers = reply if isinstance(reply, list) else [reply]
            if error is not None:
                return  # a Redis error: the renewer's next round decides
            if answers[0] == "OK":
                confirmation.answered(Renew.RENEWED)
                return
            try:  # the record changed (a copy marked it): compared as it is now
                renewed = self._renew_read(lock, exec_id, lease_ms)
            except redis.RedisError as exc:
                logger.warning("Could not confirm the grant of %s: %s", lock, exc)
                return
            confirmation.answered(renewed)
            if renewed is not Renew.RENEWED:
                # released already, or its reply came too late: the renewer
                # says so if the task still holds it
                logger.debug("Singleton lock %s was not its holder's when its grant was "
                             "confirmed (%s)", lock, renewed.name)

        # (the counter's TTL, set by the grant, already counts from a full lease)
        self.wire.call_later(COMMANDS, [], [
            ("SET", lock, held.record, "IFEQ", held.record, "PX", lease_ms)], done)
        return confirmation

    def _give_back(self, lock: str, record: str) -> None:
        """A grant for a task that must not run (finished, done): undone."""
        self.send([self.flavor.delete_if(lock, record)])

    def _mark_copied(self, lock: str, record: str) -> None:
        """Set the holder's ``copies`` field (with_copies in ``_record.lua``)."""
        holder = fields_of(record)[0]
        for _ in range(TRIES):
            answers, _ = self.send([("SET", lock, with_copies(record), "IFEQ", record,
                                     "KEEPTTL", "GET")])
            if answers[0] in (None, record):
                return  # gone (its holder finished: its own release saw no copy yet)
            record = answers[0]
            fields = fields_of(record)
            if fields[0] != holder or fields[2] == "1":
                return

    def _rewrite(self, lock: str, exec_id: str, record: str, change: Callable[[str], str],
                 expiry: tuple[Any, ...]) -> Optional[str]:
        """Compare-and-set ``lock`` from ``record`` to ``change(record)``, reading
        it again while it changes under this execution; None once it is not
        this execution's."""
        for _ in range(TRIES):
            new = change(record)
            answers, _ = self.send([("SET", lock, new, "IFEQ", record, *expiry)])
            if answers[0] == "OK":
                return new
            current = self.send([("GET", lock)])[0][0]
            if current is None or fields_of(current)[0] != exec_id:
                return None
            record = current
        return None

    def _raise_later(self, fence: str, token: int, px: int, seen: str) -> None:
        """:meth:`_raise` sent now, its reply read with this process's next call
        (before its release is sent): the counter is raised before anyone
        else's release of the lock, which comes after the task ran."""
        raised = threading.Event()
        self._raising[fence] = raised

        def done(reply: Any, error: Optional[Exception], repeated: bool) -> None:
            try:
                if error is None and reply != "OK":
                    try:  # raced (a holder whose lease ran out raised it too)
                        self._raise(fence, token, px, self.send([("GET", fence)])[0][0])
                    except redis.RedisError as exc:
                        logger.warning("Could not raise the fencing counter %s: %s", fence,
                                       exc)
            finally:
                raised.set()
                if self._raising.get(fence) is raised:
                    del self._raising[fence]

        self.wire.call_later(COMMANDS, [], [("SET", fence, token, "IFEQ", seen, "PX", px)],
                             done, owe=True)

    def _raised_first(self, lock: str) -> None:
        """Before a release of ``lock`` is sent: the raise of its counter sent
        right behind its grant (:meth:`_raise_later`) has been answered, so
        the server ran it first, whichever connection each went out on. It
        has, but for a task that ended within a round trip of its grant."""
        raised = self._raising.get(fence_of(lock))
        if raised is not None and not raised.is_set():
            self.wire.settle()
            raised.wait(self.wire.budget or None)

    def _raise(self, fence: str, token: int, px: int, seen: Optional[str]) -> None:
        """Raise the counter ``fence`` to at least ``token``; ``seen``: what it
        held (None: none). Only ever a create or a compared raise."""
        for _ in range(TRIES):
            if seen is not None and int(seen) >= token:
                return
            if seen is None:
                answers, _ = self.send([("SET", fence, token, "NX", "PX", px, "GET")])
                if answers[0] is None:
                    return
                seen = answers[0]
                continue
            answers, _ = self.send([("SET", fence, token, "IFEQ", seen, "PX", px)])
            if answers[0] == "OK":
                return
            seen = self.send([("GET", fence)])[0][0]

    # -- the end of a lock ------------------------------------------------------------

    def release(self, keys: LockKeys, exec_id: str, task_id: str, mode: int, done_ms: int,
                task_name: str) -> tuple[Release, bool]:
        """release.lua: ``mode`` 1 finished (a finish marker if a copy was seen),
        2 finished and recorded always, 0 not finished; ``done_ms``: the key
        stays done that long."""
        held = self.held.pop((keys.lock, exec_id), None)
        self._raised_first(keys.lock)
        if held is None:
            return self._release_read(keys, exec_id, task_id, mode, done_ms, task_name), False
        answers, repeated = self.send(self._release_commands(keys, held, task_id, mode,
                                                             done_ms, task_name))
        return self._released(keys, exec_id, task_id, mode, done_ms, task_name, held,
                              answers), repeated

    def release_later(self, keys: LockKeys, exec_id: str, task_id: str, mode: int,
                      done_ms: int, task_name: str,
                      answered: Callable[[Optional[Released], Optional[Exception]], None]
                      ) -> None:
        """:meth:`release` without waiting for the reply (read by the wire's next
        call or its settle); owed while the server is silent."""
        held = self.held.pop((keys.lock, exec_id), None)
        self._raised_first(keys.lock)
        if held is None:
            try:
                status = self._release_read(keys, exec_id, task_id, mode, done_ms, task_name)
            except redis.RedisError as exc:
                answered(None, exc)
                return
            answered(Released(status), None)
            return
        kept = held

        def done(reply: Any, error: Optional[Exception], repeated: bool) -> None:
            if error is not None:
                answered(None, error)
                return
            answers = reply if isinstance(reply, list) else [reply]
            try:
                status = self._released(keys, exec_id, task_id, mode, done_ms, task_name, kept,
                                        answers)
            except redis.RedisError as exc:
                answered(None, exc)
                return
            answered(Released(status, repeated), None)

        self.wire.call_later(COMMANDS, [], self._release_commands(
            keys, held, task_id, mode, done_ms, task_name), done, owe=True)

    def _release_commands(self, keys: LockKeys, held: Held, task_id: str, mode: int,
                          done_ms: int, task_name: str) -> list[Command]:
        commands = self._markers(keys, task_id, mode, done_ms, task_name) if (
            mode != 1 or done_ms) else []
        if mode == 1 and held.record.split("\n", 3)[2] == "1":
            # a copy was seen (and renewed past)
            fields = fields_of(held.record)
            commands.append(("SET", keys.fin, fields[FIELDS], "PX", fields[6]))
        commands.append(self.flavor.delete_if(keys.lock, held.record))
        return commands

    def _markers(self, keys: LockKeys, task_id: str, mode: int, done_ms: int,
                 task_name: str) -> list[Command]:
        """What a release writes whoever holds the key (release.lua)."""
        out: list[Command] = []
        if mode == 2:
            out.append(("SET", keys.fin, task_id, "PX", self.fin_ms))
        if done_ms > 0:
            out.append(("SET", keys.done, f"{task_name}\n{task_id}", "PX", done_ms))
        return out

    def _released(self, keys: LockKeys, exec_id: str, task_id: str, mode: int, done_ms: int,
                  task_name: str, held: Held, answers: list[Any]) -> Release:
        if answers[-1] != 1:  # changed under it (a copy marked it), or not ours
            return self._release_read(keys, exec_id, task_id, mode, done_ms, task_name)
        return Release.RELEASED

    def _release_read(self, keys: LockKeys, exec_id: str, task_id: str, mode: int,
                      done_ms: int, task_name: str) -> Release:
        """A release that reads the record first: another process's lock (a dead
        child's, ``celery singleton release``), or one changed since its grant."""
        markers = self._markers(keys, task_id, mode, done_ms, task_name)
        for _ in range(TRIES):
            record, counter = self.send([("GET", keys.lock), ("GET", keys.fence)])[0]
            if record is None or fields_of(record)[0] != exec_id:
                if markers:
                    self.send(markers)
                return Release.FREE if record is None else Release.TAKEN
            fields = fields_of(record)
            token = int(fields[3] or 0)
            commands = list(markers)
            if counter is None:
                commands.append(("SET", keys.fence, token, "NX", "PX", self.keep_ms))
            elif int(counter) < token:
                commands.append(("SET", keys.fence, token, "IFEQ", counter, "PX", self.keep_ms))
            if mode == 1 and fields[2] == "1":
                commands.append(("SET", keys.fin, fields[FIELDS], "PX", fields[6]))
            commands.append(self.flavor.delete_if(keys.lock, record))
            if self.send(commands)[0][-1] == 1:
                return Release.RELEASED
        return Release.TAKEN

    def hand_off(self, keys: LockKeys, exec_id: str, next_retries: int, lease_ms: int) -> bool:
        """handoff.lua: keep the lock for the retry; the counter raised first."""
        held = self.held.pop((keys.lock, exec_id), None)
        record = held.record if held is not None else self.send([("GET", keys.lock)])[0][0]
        if record is None or fields_of(record)[0] != exec_id:
            return False
        if held is None:  # another process's grant: its counter may be below its token
            token = int(fields_of(record)[3] or 0)
            self._raise(keys.fence, token, fence_ttl_ms(lease_ms, self.keep_ms),
                        self.send([("GET", keys.fence)])[0][0])

        def handed(r: str) -> str:
            f = r.split("\n", 2)
            return "\n".join((f[0], str(next_retries), f[2]))

        return self._rewrite(keys.lock, exec_id, record, handed, ("PX", lease_ms)) is not None

    # -- while it is held -------------------------------------------------------------

    def renew_with(self, entries: Sequence[tuple[str, str, int]],
                   scripts: Callable[[Sequence[tuple[str, str, int]]], list[Renew]]
                   ) -> list[Renew]:
        """The locks this path serves renewed here, the others by ``scripts``."""
        mine = [self.serves(e[0], e[1]) for e in entries]
        if all(mine):
            return self.renew(entries)
        if not any(mine):
            return scripts(entries)
        out: list[Renew] = [Renew.UNANSWERED] * len(entries)
        for ours, renew in ((False, scripts), (True, self.renew)):
            indexes = [i for i, m in enumerate(mine) if m is ours]
            for i, answer in zip(indexes, renew([entries[i] for i in indexes])):
                out[i] = answer
        return out

    def renew(self, entries: Sequence[tuple[str, str, int]]) -> list[Renew]:
        """renew.lua: each lock's lease anew, compared first, one write for
        all, then a read of each one that changed; the counter of each lock
        renewed extended after, sent without waiting (a lock no longer held
        leaves its key's counter as the last grant or renewal set it)."""
        commands: list[Command] = []
        known: list[Optional[Held]] = []
        for lock, exec_id, lease_ms in entries:
            held = self.held.get((lock, exec_id))
            known.append(held)
            if held is not None:
                commands.append(("SET", lock, held.record, "IFEQ", held.record, "PX", lease_ms))
        answers = self.send(commands)[0] if commands else []
        out: list[Renew] = []
        fences: list[Command] = []
        at = 0
        for (lock, exec_id, lease_ms), held in zip(entries, known):
            if held is not None:
                ok = answers[at] == "OK"
                at += 1
                if ok:
                    out.append(Renew.RENEWED)
                    fences.append(("PEXPIRE", fence_of(lock),
                                   fence_ttl_ms(lease_ms, self.keep_ms)))
                    continue
            out.append(self._renew_read(lock, exec_id, lease_ms))
        if fences:
            self.wire.call_later(COMMANDS, [], fences, _unread)
        return out

    def _renew_read(self, lock: str, exec_id: str, lease_ms: int) -> Renew:
        for _ in range(TRIES):
            record = self.send([("GET", lock)])[0][0]
            if record is None:
                return Renew.ABSENT
            fields = fields_of(record)
            if fields[0] != exec_id:
                return Renew.NOT_OURS
            if fields[1] != "":
                return Renew.HANDED_OFF
            answers, _ = self.send([("SET", lock, record, "IFEQ", record, "PX", lease_ms)])
            if answers[0] == "OK":
                self.wire.call_later(COMMANDS, [], [
                    ("PEXPIRE", fence_of(lock), fence_ttl_ms(lease_ms, self.keep_ms))], _unread)
                held = self.held.get((lock, exec_id))
                if held is not None:  # a copy marked it: compared as it is now
                    held.record = record
                return Renew.RENEWED
        return Renew.NOT_OURS

    def reclaim(self, keys: LockKeys, request: Request, token: int) -> Reclaimed:
        """reclaim.lua: write back a held lock the server forgot (its counter
        gone with it), not one released or expired (the counter still there)."""
        exec_id, lease_ms = request.exec_id, request.lease.ms
        record, counter, clock = self.send([("GET", keys.lock), ("GET", keys.fence),
                                            ("TIME",)])[0]
        if record is not None:
            fields = fields_of(record)
            if fields[0] == exec_id:
                # its lease anew, its own record's only (compared: the key may have
                # changed hands since it was read; then decided again)
                kept = self._rewrite(keys.lock, exec_id, record, lambda r: r,
                                     ("PX", lease_ms))
                if kept is None:
                    return self.reclaim(keys, request, token)
                return Reclaimed(Reclaim.OURS, token=int(fields_of(kept)[3]))
            return Reclaimed(Reclaim.HELD, holder=holder_of(record))
        if counter is not None:
            return Reclaimed(Reclaim.RELEASED)
        now = server_us(clock)
        new = max(now, token + 1)
        record = new_record(exec_id, new, now, record_rest(request, self.fin_ms))
        fence_ms = fence_ttl_ms(lease_ms, self.keep_ms)
        counter, holder = self.send([("SET", keys.fence, new, "NX", "PX", fence_ms, "GET"),
                                     ("SET", keys.lock, record, "NX", "PX", lease_ms, "GET")])[0]
        if holder is not None:
            if fields_of(holder)[0] == exec_id:
                return Reclaimed(Reclaim.OURS, token=int(fields_of(holder)[3]))
            return Reclaimed(Reclaim.HELD, holder=holder_of(holder))
        if counter is not None and int(counter) >= new:  # recreated meanwhile, above it
            new = int(counter) + 1
            written = self._rewrite(keys.lock, exec_id, record,
                                    lambda r: with_token(r, new, now), ("KEEPTTL",))
            if written is None:
                return Reclaimed(Reclaim.RELEASED)
            record = written
            self._raise(keys.fence, new, fence_ms, counter)
        self.held[(keys.lock, exec_id)] = Held(record, new)
        return Reclaimed(Reclaim.WRITTEN_BACK, token=new)

    def unclaim(self, key: str, value: str) -> bool:
        return bool(self.send([self.flavor.delete_if(key, value)])[0][0] == 1)


def _unread(reply: Any, error: Optional[Exception], repeated: bool) -> None:
    """The reply of a counter's extension after a renewal: nothing waits on it
    (a counter it missed lives on from the grant; the next renewal extends it)."""
