"""This process's estimate of one lock Redis's clock: from it a native grant
proposes its token (:mod:`.native`), and every grant, write-back and
send-time key carries its deadline (:meth:`ServerClock.deadline_ms`): the
server refuses a request that reaches it after its caller gave up waiting, so
nothing of an abandoned call is left behind it (a request held in a network
path, a relay or a kernel's retransmission queue past its caller's timeout).

The estimate comes from ``TIME`` replies: one read with every new connection
(in the same write as the scripts' ``SCRIPT LOAD``), each native grant's,
each refusal of a late request (which carries the server's clock), and one
sent with a call whenever the last is older than :data:`REFRESH_US` (in the
call's own write). The two clocks may run apart by up to :data:`DRIFT_PPM`
(NTP slews a clock at most half that): the moment a grant's holder counts
on it until (:meth:`ServerClock.local_time_of`) comes sooner by that rate
with the age of the reply it is drawn from, so an old reply is never
trusted as if it were new.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

#: a proposed token stands only this close above the server clock (µs):
#: tokens stay that near the clock, so one whose counter is gone (expired
#: long after, or lost with a restart, which takes longer) is below the clock
#: at the next grant
AHEAD_US = 2_000
#: the least a proposal is set above the estimated server clock (µs), and the
#: most: a grant reaches the server up to its round trip's jitter later
MARGIN_US, MARGIN_MAX_US = 100, 1_000
#: grants the estimate is made of: the least delayed of them counts
WINDOW = 8
#: how far apart the two clocks may run, per million (0.1 %; NTP slews a
#: clock by 0.05 % at most; a clock set, not slewed, is a step: see heard())
DRIFT_PPM = 1_000
#: a call carries a ``TIME`` of its own when the last reply is older than
#: this (µs): a bound drawn from it is then off by at most 30 ms
REFRESH_US = 30_000_000


def now_us() -> int:
    return time.monotonic_ns() // 1000


def server_us(reply: Any) -> int:
    """``TIME`` in microseconds."""
    return int(reply[0]) * 1_000_000 + int(reply[1])


class ServerClock:
    """This process's estimate of the lock Redis's clock, from the ``TIME``
    each grant reads. The server's clock when a request arrives is at most
    the clock it answered an earlier request with, plus the time since that
    request left: of the last :data:`WINDOW` requests, the least delayed
    (whose answer came soonest after it left) bounds it closest."""

    def __init__(self) -> None:
        #: (server µs less this process's monotonic µs as the request left,
        #: its round trip µs, this process's monotonic µs as it left), latest last
        self.heard_from: deque[tuple[int, int, int]] = deque(maxlen=WINDOW)
        #: what a proposal adds to this process's monotonic clock
        self._ahead = 0

    @property
    def known(self) -> bool:
        return bool(self.heard_from)

    def stale(self) -> bool:
        """Whether the last reply heard is older than :data:`REFRESH_US`
        (False before anything was heard: there is nothing to refresh)."""
        heard = self.heard_from
        return bool(heard) and now_us() - heard[-1][2] > REFRESH_US

    def low(self) -> int:
        """A lower bound of the server clock now (µs; 0 before anything was
        heard): the clock a reply carried was read by the server before that
        reply arrived here, so the server's clock is at least that plus the
        time since the reply arrived. The best (highest) of the last
        :data:`WINDOW` replies counts.

        The drift allowed is not counted here: this bounds a request's
        deadline, and one a little late lets a request held past its caller's
        wait through by that much at most (its grant, never confirmed,
        expires by :meth:`local_time_of`'s bound), where counting it would
        refuse the first call after half an hour without one as too late."""
        heard = self.heard_from
        if not heard:
            return 0
        return now_us() + max(o - t for o, t, _ in heard)

    def deadline_ms(self, budget: float) -> int:
        """The server clock (ms) past which a request sent now is one its
        caller gave up on, waiting ``budget`` seconds for the reply: at most
        the server's clock when the caller gives up, so a request that
        arrives later is surely refused (one that arrives a round trip
        sooner may be too: the caller then sees it refused, not lost). 0, no
        deadline, before anything was heard or without a budget."""
        low = self.low()
        if not low or budget <= 0:
            return 0
        return (low + int(budget * 1_000_000)) // 1000

    def local_time_of(self, server_ms: int) -> float:
        """A moment of this process's monotonic clock (seconds) before which
        the server's clock has surely not reached ``server_ms``: a reply's
        clock was read after its request left, so the server's clock was at
        most that far ahead of this one then, and has gained at most the
        drift allowed since (the latest such moment of the last
        :data:`WINDOW` replies counts). ``-inf`` before anything was heard."""
        heard = self.heard_from
        if not heard:
            return float("-inf")
        target = server_ms * 1000
        return max(target - o + max(target - o - s, 0) * -DRIFT_PPM // (1_000_000 + DRIFT_PPM)
                   for o, _, s in heard) / 1_000_000

    def propose(self) -> int:
        """A token at or a little above the server clock as a request sent
        now arrives; 0 before anything was heard."""
        if not self.heard_from:
            return 0
        return time.monotonic_ns() // 1000 + self._ahead

    def heard(self, sent: int, reply: Any, received: int) -> None:
        """A request sent at ``sent`` (this process's monotonic µs) was
        answered, with the server's ``TIME`` ``reply``, at ``received``."""
        heard = self.heard_from
        offset = server_us(reply) - sent
        if heard and max(o - t for o, t, _ in heard) > offset:
            # the server's clock is behind what an earlier reply proved it
            # had reached: it was set back. What was heard before no longer holds
            heard.clear()
        heard.append((offset, received - sent, sent))
        trips = [t for _, t, _ in heard]
        margin = min(MARGIN_MAX_US, max(MARGIN_US, trips[-1] - min(trips)))
        self._ahead = min(o for o, _, _ in heard) + margin
