"""This process's estimate of one lock Redis's clock: from it a native grant
proposes its token (:mod:`.native`), and every grant, write-back and
send-time key carries its deadline (:meth:`ServerClock.deadline_ms`): the
server refuses a request that reaches it after its caller gave up waiting, so
nothing of an abandoned call is left behind it (a request held in a network
path, a relay or a kernel's retransmission queue past its caller's timeout).

The estimate comes from ``TIME`` replies: one read with every new connection
(in the same write as the scripts' ``SCRIPT LOAD``), each native grant's, and
each refusal of a late request (which carries the server's clock).
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
        #: its round trip µs), latest last
        self.heard_from: deque[tuple[int, int]] = deque(maxlen=WINDOW)
        #: what a proposal adds to this process's monotonic clock
        self._ahead = 0

    @property
    def known(self) -> bool:
        return bool(self.heard_from)

    def low(self) -> int:
        """A lower bound of the server clock now (µs; 0 before anything was
        heard): the clock a reply carried was read by the server before that
        reply arrived here, so the server's clock is at least that plus the
        time since the reply arrived. The best (highest) of the last
        :data:`WINDOW` replies counts."""
        heard = self.heard_from
        if not heard:
            return 0
        return time.monotonic_ns() // 1000 + max(o - t for o, t in heard)

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
        clock was read after its request left, so the server's clock runs at
        most that far ahead of this one (the least of the last
        :data:`WINDOW` replies counts). ``-inf`` before anything was heard."""
        heard = self.heard_from
        if not heard:
            return float("-inf")
        return (server_ms * 1000 - min(o for o, _ in heard)) / 1_000_000

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
        if heard and max(o - t for o, t in heard) > offset:
            # the server's clock is behind what an earlier reply proved it
            # had reached: it was set back. What was heard before no longer holds
            heard.clear()
        heard.append((offset, received - sent))
        trips = [t for _, t in heard]
        margin = min(MARGIN_MAX_US, max(MARGIN_US, trips[-1] - min(trips)))
        self._ahead = min(o for o, _ in heard) + margin
