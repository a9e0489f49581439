"""The native path's fencing tokens: this process's estimate of the lock
Redis's clock, from which a grant proposes its token (:mod:`.native`), and
how far a proposal may stand from the clock the grant then reads.
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

    def propose(self) -> int:
        """A token at or a little above the server clock as a request sent
        now arrives; 0 before anything was heard."""
        if not self.heard_from:
            return 0
        return time.monotonic_ns() // 1000 + self._ahead

    def heard(self, sent: int, reply: Any, received: int) -> None:
        heard = self.heard_from
        heard.append((server_us(reply) - sent, received - sent))
        trips = [t for _, t in heard]
        margin = min(MARGIN_MAX_US, max(MARGIN_US, trips[-1] - min(trips)))
        self._ahead = min(o for o, _ in heard) + margin
