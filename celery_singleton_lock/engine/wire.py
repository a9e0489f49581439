"""The Redis wire: EVALSHA of our scripts, written on connections of our own.

Every lock call is one script call by SHA, one round trip (or, on the native
path, a few plain commands written at once: :mod:`.commands`). The hot path writes
the command itself on a connection it keeps out of redis-py's pool: taking one
is a list pop, where the pool's checkout and redis-py's generic command layer
cost more CPU than the round trip on a fast network.

Connections are bounded: a connection goes back to the idle list on every
path, broken or not (a broken one is disconnected and reconnects when next
used), so a process holds at most one per thread inside a lock call plus one
per release whose reply is still owed (each lock call reads those first).
However long Redis is down, however many calls fail meanwhile, nothing is
left behind: the next call after Redis is back connects and works.

A call that gets no reply in time is not repeated: the server may be frozen
with the command in its buffers. The wire's :class:`~.outage.Outage` makes
every later call fail at once until the server answers again, then sends what
is owed first (see :mod:`.outage`).

How a script call is written in RESP is in :mod:`.scripts`; each connection
is written and its replies read by a :class:`~.link.Link`.

Over 500 lines: one class, the calls of one process to one Redis on
connections of its own, and the rule every one of them keeps (a reply is read
by the call that sent for it, in order, before its connection is used by
anyone else); the ways of calling (now, with a command before and after,
several at once, without waiting) each follow it, and cut apart they would
each keep a copy of it.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterable, Optional, Sequence, Union

import redis
from redis.exceptions import NoScriptError

from ..process import ForkSafeLock
from .clock import ServerClock, now_us
from .commands import Commands
from .link import Link
from .outage import PROBE_READ, PROBE_READ_MOVING, Answered, Outage, Owed, failing_over, owed_on
from .scripts import Script, evalsha, pack

logger = logging.getLogger("celery_singleton_lock")

#: the errors after which a command may or may not have run, and the
#: connection is no longer in step: disconnect, and repeat the command once
BROKEN = (redis.ConnectionError, redis.TimeoutError)
#: sent before a call whose wire's estimate of the server clock is stale
_TIME = ("TIME",)

#: what the wire sends: a script by its SHA, or plain commands written at once
Call = Union[Script, Commands]


def pack_call(call: Call, keys: Sequence[str], args: Sequence[Any]) -> tuple[bytes, int]:
    """``call`` in RESP, and how many replies it gets."""
    if isinstance(call, Script):
        return evalsha(call, keys, args), 1
    return call.packed(keys, args)


def read_replies(link: Link, count: int) -> Any:
    """One reply, or a list of ``count`` (every one read, so the connection
    stays in step; the first error reply then raised)."""
    if count == 1:
        return link.read()
    out: list[Any] = []
    error: Optional[redis.ResponseError] = None
    for _ in range(count):
        try:
            out.append(link.read())
        except redis.ResponseError as exc:
            error = error or exc
            out.append(exc)
    if error is not None:
        raise error
    return out


class _Pending:
    """A command sent without waiting: what to repeat, whom to tell."""

    __slots__ = ("answered", "args", "count", "keys", "owe", "script")

    def __init__(self, script: Call, keys: Sequence[str], args: Sequence[Any],
                 answered: Answered, owe: bool = False, count: int = 1) -> None:
        self.script = script
        self.keys = keys
        self.args = args
        self.answered = answered
        self.owe = owe
        #: replies it gets
        self.count = count

    def answer(self, reply: Any, error: Optional[Exception], repeated: bool = False) -> None:
        try:
            self.answered(reply, error, repeated)
        except Exception:  # a reply read on someone else's call must not break it
            logger.exception("Handling a lock reply failed")


class Wire:
    """Script calls of one process to one Redis."""

    def __init__(self, client: redis.Redis, scripts: Iterable[Script] = ()) -> None:
        self.client = client
        # loaded on every connect: a fresh or restarted Redis knows them before
        # the first call, so a release sent without waiting never meets NOSCRIPT
        self._scripts = tuple(scripts)
        pool = client.connection_pool
        self._connection_class = pool.connection_class
        self._connection_kwargs = dict(pool.connection_kwargs)
        self._idle: list[Link] = []
        # connections owing the replies of commands sent without waiting, in
        # the order they were sent; whoever takes one off this list reads them
        self._unsettled: list[tuple[Link, list[_Pending]]] = []
        self._made = 0
        #: connections closed because a call left replies unread on them
        self.discarded = 0
        self._making = ForkSafeLock()
        #: the sentinels name the primary (``sentinel://``): it can move
        self._service = getattr(self._connection_kwargs.get("connection_pool"),
                                "service_name", None)
        self.outage = Outage(lambda: self.name, self._probe_connection, self._call_owed,
                             self._drop_idle if self._service is not None else None)
        #: this process's estimate of the server's clock (:mod:`.clock`)
        self.clock = ServerClock()
        #: how long a call waits for its reply before it gives up (the
        #: connections' read timeout): the budget of a request's deadline
        self.budget = float(self._connection_kwargs.get("socket_timeout") or 0.0)

    @property
    def name(self) -> str:
        """Where it goes, for messages: ``host:port``, the socket path, or the
        Sentinel service and the primary it was last seen on."""
        kw = self._connection_kwargs
        if "path" in kw:
            return str(kw["path"])
        if self._service is not None:
            address = getattr(kw["connection_pool"], "master_address", None)
            where = f"{address[0]}:{address[1]}" if address else "not known yet"
            return f"Sentinel primary {self._service!r} ({where})"
        return f"{kw.get('host', '?')}:{kw.get('port', '?')}"

    @property
    def connections(self) -> int:
        """Connections this wire has made (each is kept and reused, never dropped)."""
        return self._made

    @property
    def down(self) -> bool:
        """The server has not answered since a call got no reply (:mod:`.outage`)."""
        return self.outage.down

    @property
    def unsettled(self) -> int:
        """Commands sent whose reply has not been read yet."""
        return sum(len(owed) for _, owed in list(self._unsettled))

    def _take(self, force: bool = False) -> tuple[Link, list[_Pending]]:
        """A connection for a call, and the commands sent on it earlier whose
        replies are still to be read, in order: a call writes its own command
        first, then reads theirs (they come first) and its own. So a call
        waits for nothing sent before it but what has not answered by the time
        its own reply is there: a release sent at a task's end costs the next
        task's grant no round trip. Raises :class:`~.outage.RedisUnanswered`
        while the server does not answer (``force``: the outage's own owed
        calls, on a connection owing nothing)."""
        if not force:
            if self.outage.since is not None:
                self.outage.check()
            try:
                return self._unsettled.pop()
            except IndexError:
                pass
        try:
            return self._idle.pop(), []
        except IndexError:
            with self._making:
                self._made += 1
            conn = self._connection_class(**self._connection_kwargs)
            if self._scripts:
                conn.register_connect_callback(self._load_scripts)
            return Link(conn), []

    def _probe_connection(self) -> Any:
        """The outage probe's connection: its PING waits longer than a lock
        call would, so a frozen server's reply is read the moment it runs again;
        under Sentinel not that long, since each try asks the sentinels where
        the primary is now (a frozen one is replaced)."""
        read = PROBE_READ if self._service is None else PROBE_READ_MOVING
        return self._connection_class(**{**self._connection_kwargs, "socket_timeout": read})

    def _drop_idle(self) -> None:
        """The server answers again, maybe as another primary (Sentinel): the
        idle connections reconnect when next used, asking where it is now
        (one still open to a frozen old primary would wait out its timeout)."""
        idle: list[Link] = []
        while True:
            try:
                idle.append(self._idle.pop())
            except IndexError:
                break
        for link in idle:
            link.disconnect()
        self._idle.extend(idle)

    def _call_owed(self, script: Call, keys: Sequence[str], args: Sequence[Any]
                   ) -> tuple[Any, bool]:
        reply, repeated, _ = self.call_with(script, keys, args, force=True)
        return reply, repeated

    def owe(self, error: BaseException, script: Call, keys: Sequence[str],
            args: Sequence[Any]) -> None:
        """Send this call (an undo) once the server answers again, twice (see
        :mod:`.outage`): for a call that failed with ``error``, not knowing
        whether Redis ran it or will."""
        self.outage.begin(error, Owed(script, keys, args, twice=True))

    def new_connection(self) -> Any:
        """A connection for other uses (not in the idle list, no scripts loaded)."""
        with self._making:
            self._made += 1
        return self._connection_class(**self._connection_kwargs)

    def _load_scripts(self, conn: Any) -> None:
        """SCRIPT LOAD of every script and the server's ``TIME`` (the clock
        estimate, :mod:`.clock`), pipelined: one round trip per connect
        (redis-py reads the replies: its connect reads all it sent)."""
        sent = now_us()
        for script in self._scripts:
            conn.send_command("SCRIPT", "LOAD", script.source, check_health=False)
        conn.send_command("TIME", check_health=False)
        for _ in self._scripts:
            # a user not allowed SCRIPT LOAD: NOSCRIPT handling reports it later
            with contextlib.suppress(redis.ResponseError):
                conn.read_response()
        try:
            clock = conn.read_response()
        except redis.ResponseError:  # TIME not allowed: requests go without a deadline
            return
        self.clock.heard(sent, clock, now_us())

    def deadline_ms(self, key: str = "") -> int:
        """The deadline of a request sent now (for ``key``: on a Cluster, the
        node serving it) (server ms, :meth:`.clock.
        ServerClock.deadline_ms`; 0: none). The first one of a wire connects
        first, which reads the server's clock."""
        if not self.clock.known and self.budget > 0:
            if self.outage.since is not None:
                self.outage.check()
            link, _ = self._take(force=True)
            try:
                link.ensure()
            except BROKEN as exc:
                self._give(link, broken=True)
                self.outage.begin(exc)
                raise
            self._give(link)
        return self.clock.deadline_ms(self.budget)

    def _give(self, link: Link, broken: bool = False) -> None:
        """``link`` back to the idle list: in step (every reply sent for read)
        or closed. A connection still owed a reply (an error raised between
        two reads, a call interrupted) is closed, never reused: its next
        reader would take an older call's reply for its own."""
        if broken or link.owed:
            if link.owed and not broken:
                self.discarded += 1
            link.disconnect()  # it reconnects when next used
        self._idle.append(link)

    def call(self, script: Call, keys: Sequence[str], args: Sequence[Any]) -> tuple[Any, bool]:
        """EVALSHA ``script`` in one round trip: (reply, whether it was sent twice).

        A broken connection is retried once on a fresh connect (every script is
        safe to repeat: the owner check makes a repeat a no-op or a "not
        ours"); a server that lost its scripts gets them loaded again.
        """
        reply, repeated, _ = self.call_with(script, keys, args)
        return reply, repeated

    def call_many(self, script: Script, calls: Sequence[tuple[Sequence[str], Sequence[Any]]],
                  *, after: Sequence[Any] = ()) -> tuple[list[Any], Any]:
        """Several EVALSHAs of ``script`` in one write, their replies read after
        it: still one round trip, but Redis runs them one at a time and serves
        its other clients in between (a renewal of many locks never stalls it).
        ``after`` is one more command in the same write (``WAIT``); its reply,
        or its error, comes back second. Every call must be safe to repeat.
        """
        packed = b"".join(evalsha(script, keys, args) for keys, args in calls)
        if after:
            packed += pack(after)
        replies = len(calls) + (1 if after else 0)
        for attempt in (1, 2):
            link, owed = self._take()
            try:
                link.send(packed, replies)
            except BaseException as exc:
                self._give(link, broken=True)
                self._lost(owed, exc)
                if isinstance(exc, BROKEN) and attempt == 1 and not isinstance(
                        exc, redis.TimeoutError):
                    continue
                if isinstance(exc, BROKEN):
                    self.outage.begin(exc)
                raise
            try:
                self._read_owed(link, owed)
                # every reply read, errors included: the connection stays in step
                answers = [_read_or_error(link) for _ in calls]
                late = _read_late(link) if after else None
                lost = any(isinstance(a, NoScriptError) for a in answers)
                if lost:
                    link.send(pack(["SCRIPT", "LOAD", script.source]))
                    link.read()
            except BROKEN as exc:
                self._give(link, broken=True)
                if attempt == 2 or isinstance(exc, redis.TimeoutError):
                    self.outage.begin(exc)
                    raise
                continue
            except BaseException:
                self._give(link)  # closed if a reply is still owed on it
                raise
            self._give(link)
            if lost:
                continue  # the server lost its scripts: send them all again
            for answer in answers:
                if isinstance(answer, redis.ResponseError):
                    raise answer
            return answers, late
        raise redis.ConnectionError("the script calls could not be sent")

    def call_with(self, script: Call, keys: Sequence[str], args: Sequence[Any], *,
                  before: Sequence[Any] = (), after: Sequence[Any] = (), force: bool = False
                  ) -> tuple[Any, bool, Any]:
        """:meth:`call` with one command sent just before the script (``ASKING``)
        and/or one just after it (``WAIT``), in the same write on the same
        connection: (script reply, sent twice, reply of ``after`` or None).

        Still one round trip. Every reply of the write is read, error replies
        included, before anything is raised. An error reply of ``after`` is
        returned as its reply, not raised: the script's own reply is what the
        caller acts on; one of ``before`` counts only when the script's reply
        is an error too (the script's is raised). A broken connection is
        tried once more; no reply in time is not (the server may run the
        command yet): the outage begins.
        """
        if not before and self.clock.stale():
            before = _TIME  # the server's clock again, in the same write
        data, count = pack_call(script, keys, args)
        if before or after:
            data = (pack(before) if before else b"") + data + (pack(after) if after else b"")
        replies = count + (1 if before else 0) + (1 if after else 0)
        for attempt in (1, 2):
            link, owed = self._take(force)
            sent = now_us()
            try:
                link.send(data, replies)
            except BaseException as exc:
                self._give(link, broken=True)
                self._lost(owed, exc)
                if isinstance(exc, BROKEN) and attempt == 1 and not isinstance(
                        exc, redis.TimeoutError):
                    continue
                if isinstance(exc, BROKEN) and not force:
                    self.outage.begin(exc)
                raise
            try:
                self._read_owed(link, owed)
                reply, first, late = _exchange(link, script, data, replies, count, before,
                                               after)
            except BROKEN as exc:
                self._give(link, broken=True)
                if attempt == 2 or isinstance(exc, redis.TimeoutError):
                    if not force:
                        self.outage.begin(exc)
                    raise
                continue
            except BaseException:
                self._give(link)  # closed if a reply is still owed on it
                raise
            self._give(link)
            if before is _TIME and not isinstance(first, redis.ResponseError):
                self.clock.heard(sent, first, now_us())
            return reply, attempt == 2, late
        raise AssertionError("unreachable")

    def call_asking(self, script: Script, keys: Sequence[str], args: Sequence[Any]
                    ) -> tuple[Any, bool]:
        """:meth:`call` on a node importing the slot (after an ASK redirection)."""
        reply, repeated, _ = self.call_with(script, keys, args, before=["ASKING"])
        return reply, repeated

    def call_later(self, script: Call, keys: Sequence[str], args: Sequence[Any],
                   answered: Answered, owe: bool = False) -> None:
        """Send ``script`` now and read its reply later; ``answered(reply, error, repeated)``.

        The command leaves at once, so Redis runs it in order before anything
        this process sends afterwards; only the wait for the reply is saved.
        The reply is read by the next call on this wire or by :meth:`settle`.
        Nothing is lost when it fails: a server that lost its scripts or a
        broken connection gets the command again, waiting this time. ``owe``
        (a release): while the server is silent (:mod:`.outage`) the command
        is kept and sent when it answers again, then ``answered`` is told.
        """
        data, count = pack_call(script, keys, args)
        pending = _Pending(script, keys, args, answered, owe, count)
        # looked at without the outage's mutex: an outage that begins after
        # this look fails the send below at once, and _redo owes the command
        if owe and self.outage.since is not None and self.outage.owe(
                Owed(script, keys, args, pending.answer)):
            return  # sent when the server answers again
        try:
            link, owed = self._take()
            try:
                link.send(data, count)
            except BaseException as exc:
                self._give(link, broken=True)
                self._lost(owed, exc)
                raise
        except BROKEN:
            self._redo(pending, repeated=True)  # some of it may have left
            return
        owed.append(pending)
        self._unsettled.append((link, owed))

    def _read_owed(self, link: Link, owed: list[_Pending]) -> None:
        """Read the replies of ``owed`` (commands sent earlier on ``link``), in
        order, and tell each its answer. A connection that broke, got no
        reply in time or whose read was interrupted takes the rest with it
        (each handled as :meth:`_lost` says) and the error is raised: the
        calling command was on it too."""
        for i, pending in enumerate(owed):
            try:
                reply = read_replies(link, pending.count)
            except NoScriptError:
                self._redo(pending, repeated=False)  # it never ran; loads the script again
                continue
            except BROKEN as exc:
                self._lost(owed[i:], exc)
                raise
            except redis.RedisError as exc:
                if pending.owe and failing_over(exc):
                    # refused for a failover under way: sent again once it is over
                    self.outage.begin(exc, Owed(pending.script, pending.keys, pending.args,
                                                pending.answer))
                else:
                    pending.answer(None, exc)
                continue
            except BaseException as exc:
                # interrupted (a soft time limit, a signal): the connection is
                # closed with the rest unread; each told, as an interrupted write's
                self._lost(owed[i:], exc)
                raise
            try:
                pending.answer(reply, None)
            except BaseException as exc:  # its handler interrupted: the same for the rest
                self._lost(owed[i + 1:], exc)
                raise

    def _lost(self, owed: Sequence[_Pending], error: BaseException) -> None:
        """The connection ``owed`` were sent on is gone before their replies
        were read: no reply in time (the server may run them yet: an owed
        release is kept for when it answers, the others told), or broken
        (each sent again: it may have run)."""
        for pending in owed:
            if isinstance(error, redis.TimeoutError):
                if pending.owe:
                    self.outage.begin(error, Owed(pending.script, pending.keys, pending.args,
                                                  pending.answer))
                else:
                    self.outage.begin(error)
                    pending.answer(None, error, True)
            elif isinstance(error, BROKEN):
                self._redo(pending, repeated=True)
            else:
                pending.answer(None, redis.ConnectionError(
                    f"the connection was closed before the reply was read ({error!r})"), True)

    def _settle_link(self, link: Link, owed: list[_Pending]) -> None:
        try:
            self._read_owed(link, owed)
        except BROKEN:
            self._give(link, broken=True)
            return
        except BaseException:
            self._give(link, broken=True)
            raise
        self._give(link)

    def _redo(self, pending: _Pending, repeated: bool) -> None:
        try:
            reply, again = self.call(pending.script, pending.keys, pending.args)
        except redis.RedisError as exc:
            if pending.owe:
                owed = Owed(pending.script, pending.keys, pending.args, pending.answer)
                if owed_on(exc):
                    self.outage.begin(exc, owed)  # sent again once the server takes it
                    return
                if self.outage.owe(owed):
                    return
            pending.answer(None, exc, repeated)
        else:
            pending.answer(reply, None, repeated or again)

    def settle(self) -> None:
        """Read every reply still owed on this wire (none while the server is
        not answering: they are read once it is)."""
        unsettled = self._unsettled
        while unsettled and self.outage.since is None:
            try:
                link, owed = unsettled.pop()
            except IndexError:  # another thread took the last one
                return
            self._settle_link(link, owed)

    def close(self) -> None:
        """Read what is owed, then close every connection."""
        try:
            self.settle()
        finally:
            while self._idle:
                self._idle.pop().disconnect()


def _read_or_error(link: Link) -> Any:
    """The next reply, an error reply returned as its exception."""
    try:
        return link.read()
    except redis.ResponseError as exc:
        return exc


def _exchange(link: Link, script: Call, data: bytes, replies: int, count: int,
              before: Sequence[Any], after: Sequence[Any]) -> tuple[Any, Any, Any]:
    """Read every reply of ``data``, written already (``replies`` replies:
    ``before``'s, the call's ``count``, ``after``'s): (the call's reply,
    ``before``'s, ``after``'s). A server that lost the script gets it loaded and the
    write sent once more."""
    for loaded in (False, True):
        if loaded:
            link.send(data, replies)
        first = _read_or_error(link) if before else None
        try:
            reply, error = read_replies(link, count), None
        except redis.ResponseError as exc:
            reply, error = None, exc
        late = _read_late(link) if after else None
        if isinstance(error, NoScriptError) and not loaded and isinstance(script, Script):
            link.send(pack(["SCRIPT", "LOAD", script.source]))
            link.read()
            continue  # sent again, in step: every reply of the first write was read
        if error is not None:
            raise error
        if isinstance(first, redis.ResponseError) and before is not _TIME:
            logger.warning("%s sent before %s failed: %s", before[0], script.name, first)
        return reply, first, late
    raise AssertionError("unreachable")


def _read_late(link: Link) -> Any:
    """The reply of a command sent after the script (``WAIT``): an error reply
    comes back as the reply, since the script's own reply is what counts."""
    try:
        return link.read()
    except redis.ResponseError as exc:
        return exc
