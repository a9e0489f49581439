"""A lock Redis that stopped answering, as one wire sees it.

After a call got no reply in time (the server frozen, a network path that
drops packets) or could not connect at all, every later call of the wire
fails at once with :class:`RedisUnanswered` instead of waiting
``socket_timeout`` again: ``singleton_on_backend_error`` decides at once, and
a pool process waits at most one timeout per outage.

A thread of the wire then waits for the server: one ``PING`` on one
connection, whose reply comes the moment the server runs again. Before calls
go through again, the calls owed are sent. A command whose reply never came
may still run when the server wakes (Redis runs what is in its buffers): an
acquire that got no answer would leave an owner record that nobody holds, so
it is undone (an owner-checked release of its execution id), and a release
whose reply never came is sent again. An undo is sent twice, the second time
after the first one's reply: by then the server has run every command that
reached it before, on any connection, so nothing of the abandoned call is
left behind it.

A release that could not be sent at all (a refused or reset connection) is
owed too: a replicated deployment still has the key on the replica it
promotes (Sentinel), and the release, owner-checked, is safe to send late. A
Sentinel-managed wire's probe asks the sentinels for the primary on every
try and reads for :data:`PROBE_READ_MOVING` only, so a frozen old primary does
not hold it while the promoted one already takes writes. (A Cluster's owed
calls follow the slot to its new primary: :mod:`.cluster`.)
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional, Sequence

import redis

from ..exceptions import describe
from ..process import ForkSafeLock

logger = logging.getLogger("celery_singleton_lock")

#: how soon the probe tries again to connect to a server that refused (doubling)
PROBE_FIRST, PROBE_MAX = 0.02, 0.25
#: probes waiting for an answer at once, each on its own connection
PROBE_AT_ONCE = 4
#: how long the probe's PING waits for a reply before it asks again: a frozen
#: server's reply arrives the moment it runs again
PROBE_READ = 5.0
#: the same where the primary can move (Sentinel): each try asks the
#: sentinels anew, so a frozen old primary holds the probe this long at most
PROBE_READ_MOVING = 0.5
#: a probe with nothing owed stops after this long, and the next call tries
#: for real (a Cluster node failed over for good is not probed for ever); with
#: calls owed, after five times as long (each lock's TTL frees what they would)
PROBE_GIVE_UP = 60.0

#: ``answered(reply, error, repeated)`` of a command sent without waiting
Answered = Callable[[Any, Optional[Exception], bool], None]
#: sends one script call, past the outage check: (reply, whether sent twice)
Call = Callable[[Any, Sequence[str], Sequence[Any]], tuple[Any, bool]]


class RedisUnanswered(redis.ConnectionError):
    """A lock call not sent at all: the server has not answered since an
    earlier call got no reply. Nothing of it reached Redis."""


#: connection errors that say the server answered (a wrong password, a
#: refused user, a full client table): no outage, each call says so itself
_ANSWERED = (redis.AuthenticationError, redis.exceptions.AuthorizationError,
             redis.exceptions.MaxConnectionsError)


def unreachable(error: BaseException) -> bool:
    """``error`` means the server did not answer: it is down, frozen or cut off."""
    return isinstance(error, (redis.TimeoutError, redis.ConnectionError)) and not isinstance(
        error, _ANSWERED)


#: error replies of a server in the middle of a failover or a restart: the
#: command was refused before it ran, and is taken once that is over
FAILING_OVER = ("CLUSTERDOWN", "TRYAGAIN", "MASTERDOWN", "READONLY", "LOADING")
_FAILING_OVER_CLASSES = (redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError,
                         redis.exceptions.ReadOnlyError, redis.exceptions.BusyLoadingError)


def failing_over(error: BaseException) -> bool:
    """``error`` is a failover's answer, not a refusal of the call: a Cluster
    without a primary for some slot (``CLUSTERDOWN``, ``MASTERDOWN``), a slot
    moving (``TRYAGAIN``), a primary demoted (``READONLY``), a restart loading
    its data (``LOADING``). The call did not run; sent again later, it will.
    (redis-py gives most their own class; an older one, a plain ResponseError
    whose text starts with the code.)"""
    if isinstance(error, _FAILING_OVER_CLASSES):
        return True
    if isinstance(error, redis.ResponseError):
        return str(error).split(" ", 1)[0].upper() in FAILING_OVER
    return False


def owed_on(error: BaseException) -> bool:
    """An owner-checked call (a release, the undo of a grant) that failed
    with ``error`` is kept and sent again once the server answers: it did
    not answer, or answered that a failover is under way."""
    return unreachable(error) or failing_over(error)


class Owed:
    """A call to send once the server answers again."""

    __slots__ = ("answered", "args", "keys", "script", "twice")

    def __init__(self, script: Any, keys: Sequence[str], args: Sequence[Any],
                 answered: Optional[Answered] = None, twice: bool = False) -> None:
        self.script = script
        self.keys = keys
        self.args = args
        self.answered = answered
        self.twice = twice


class Outage:
    """The outage state of one wire: since when, what is owed, the probe."""

    def __init__(self, name: Callable[[], str], connect: Callable[[], Any], call: Call,
                 resumed: Optional[Callable[[], None]] = None) -> None:
        self._name = name
        self._connect = connect
        self._call = call
        #: called when the probe got an answer, before the owed calls are sent
        self._resumed = resumed
        self._mutex = ForkSafeLock()
        #: monotonic time the server stopped answering; None while it answers
        self.since: Optional[float] = None
        self._owed: list[Owed] = []
        self._thread: Optional[threading.Thread] = None
        self._wake = threading.Event()

    @property
    def down(self) -> bool:
        return self.since is not None

    @property
    def owed(self) -> int:
        return len(self._owed)

    def check(self) -> None:
        """Raise :class:`RedisUnanswered` while the server is not answering."""
        since = self.since
        if since is not None:
            raise RedisUnanswered(
                f"the lock Redis at {self._name()} has not answered for "
                f"{time.monotonic() - since:.1f} s (lock calls fail at once until it does)")

    def begin(self, error: BaseException, owed: Optional[Owed] = None) -> None:
        """A call got no reply (``error``), or a failover's answer: calls fail
        at once from now until the server answers; ``owed`` is sent then. An
        error that shows the server answered (a wrong password) begins nothing."""
        if not owed_on(error):
            return
        with self._mutex:
            if owed is not None:
                self._owed.append(owed)
            if self.since is None:
                self.since = time.monotonic()
                logger.warning("Lock Redis at %s did not answer (%s): lock calls fail at once "
                               "until it answers again", self._name(), describe(error))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="singleton-outage",
                                                daemon=True)
                self._thread.start()

    def owe(self, owed: Owed) -> bool:
        """Keep ``owed`` (a release: owner-checked, safe to send late) for when
        the server answers, while it is not answering, however the outage
        began: a silent server may still run what it read, and one that
        refused may come back with the key (a restart with persistence, a
        replica promoted in its place). False while it answers: the caller
        sends it itself, or reports that it could not."""
        with self._mutex:
            if self.since is None:
                return False
            self._owed.append(owed)
            return True

    def answered_elsewhere(self, wait: float) -> None:
        """Another connection just got an answer from this server (the
        renewer's watch): probe now, and wait up to ``wait`` seconds for the
        owed calls to go out and calls to go through again."""
        if self.since is None:
            return
        self._wake.set()
        deadline = time.monotonic() + wait
        while self.since is not None and time.monotonic() < deadline:
            time.sleep(0.005)

    # -- the probe's thread -----------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                if not self._wait_for_server():
                    self._give_up()
                    return
                if self._resumed is not None:
                    self._resumed()
                if not self._send_owed():
                    # answered, but not taking them yet (a failover under way)
                    self._wake.wait(PROBE_MAX)
                    self._wake.clear()
                    continue
                with self._mutex:
                    if self._owed:  # owed while the others were being sent
                        continue
                    since, self.since = self.since, None
                logger.info("Lock Redis at %s answers again, after %.1f s",
                            self._name(), time.monotonic() - (since or time.monotonic()))
                return
        except Exception:  # never leave calls failing for good
            logger.exception("Waiting for the lock Redis failed")
            with self._mutex:
                self.since = None

    def _give_up(self) -> None:
        with self._mutex:
            dropped, self._owed = self._owed, []
            since, self.since = self.since, None  # the next call tries for real
        error = redis.ConnectionError(f"the lock Redis at {self._name()} did not answer for "
                                      f"{time.monotonic() - (since or 0.0):.0f} s")
        if dropped:
            logger.warning("%s: %d lock call(s) owed to it not sent; the keys they were "
                           "for free when their TTLs run out", error, len(dropped))
        for owed in dropped:
            if owed.answered is not None:
                try:
                    owed.answered(None, error, True)
                except Exception:
                    logger.exception("Handling a lock reply failed")

    def _wait_for_server(self) -> bool:
        """Until a PING is answered: True; False after :data:`PROBE_GIVE_UP`.

        Each probe is a connection of its own, and a new one starts every
        backoff (up to :data:`PROBE_AT_ONCE` waiting at once) rather than
        after the last gave up: on a path that drops packets, a probe whose
        SYN or PING was lost waits out TCP's retransmission (a second, then
        two, four ...), while the next one, sent meanwhile, gets through."""
        backoff = PROBE_FIRST
        started = time.monotonic()
        answered = threading.Event()
        probes: list[threading.Thread] = []
        while True:
            probes = [p for p in probes if p.is_alive()]
            if len(probes) < PROBE_AT_ONCE:
                probe = threading.Thread(target=self._probe, args=(answered,),
                                         name="singleton-outage-probe", daemon=True)
                probe.start()
                probes.append(probe)
            if self._woken(backoff, answered):
                return True
            waited = time.monotonic() - started
            if waited > PROBE_GIVE_UP * (5 if self._owed else 1):
                return False
            backoff = min(backoff * 2, PROBE_MAX)

    def _woken(self, wait: float, answered: threading.Event) -> bool:
        """Wait up to ``wait`` seconds for a probe's answer, or a wake-up (the
        renewer heard the server: probe again now); whether a probe answered."""
        deadline = time.monotonic() + wait
        while not answered.is_set():
            left = deadline - time.monotonic()
            if left <= 0 or self._wake.wait(min(left, PROBE_FIRST)):
                self._wake.clear()
                break
        return answered.is_set()

    def _probe(self, answered: threading.Event) -> None:
        """One PING on a connection of its own; ``answered`` set when it is
        answered (the moment a frozen server runs again)."""
        conn = self._connect()
        try:
            conn.connect()
            conn.send_command("PING", check_health=False)
            conn.read_response()
            answered.set()
        except redis.RedisError:
            pass
        except Exception:  # never let a probe's thread die loudly
            logger.debug("An outage probe failed", exc_info=True)
        finally:
            conn.disconnect()

    def _send_owed(self) -> bool:
        """Send every owed call, in order; False when one failed (still down)."""
        while True:
            with self._mutex:
                if not self._owed:
                    return True
                owed = self._owed[0]
            error: Optional[Exception] = None
            try:
                reply, _ = self._call(owed.script, owed.keys, owed.args)
                if owed.twice:
                    reply, _ = self._call(owed.script, owed.keys, owed.args)
            except redis.RedisError as exc:
                if owed_on(exc):
                    logger.debug("An owed lock call failed again: %r", exc)
                    return False
                # the server answers and refuses this call for good (no failover's
                # answer: a full Redis, a denied command): told, not sent again,
                # so the outage ends (its key frees when its TTL runs out)
                logger.warning("A lock call owed to %s was refused: %s", self._name(),
                               describe(exc))
                reply, error = None, exc
            with self._mutex:
                self._owed.remove(owed)
            if owed.answered is not None:
                try:
                    owed.answered(reply, error, True)
                except Exception:
                    logger.exception("Handling a lock reply failed")
