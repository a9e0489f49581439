"""How long duplicates waiting under ``retry`` wait, and in which order they run.

A duplicate under ``singleton_on_duplicate="retry"`` is sent again with a
countdown (``singleton_retry_delay`` doubling per wait up to
``singleton_retry_max_delay``, 0.8-1.2 of it), so several waiting on one key
are not served in the order they came: whichever comes back first once the
key is free runs. What holds is a bound on the number of waits, from the
settings (docs/concepts.md#retry-waits):

* a wait after ``j`` earlier ones lasts at least ``g(j) = 0.8 x min(delay x
  2^j, max_delay)``;
* ``j0`` is the first ``j`` with ``g(j)`` longer than a holder keeps the key:
  from its ``j0``-th wait on, a waiter's tries are further apart than that,
  so one holder is in the way of at most one of them;
* each of the other ``n - 1`` calls of a burst of ``n`` holds the key once,
  so a waiter is refused at most ``j0 + n - 1`` times: it runs after at most
  ``K = j0 + n - 1`` waits (:func:`most_waits`; a holder that keeps the key
  longer than ``0.8 x max_delay`` can be in the way of several tries, and
  the bound grows by that many per holder).

The test sends a burst of calls of one key, with a body of fixed length, to
two workers, and checks every call ran once, none overlapped, and none waited
more than ``K`` times. It prints each call's arrival rank, start rank, waits
and wait (the figures in docs/concepts.md come from it with
``RETRY_ORDER_DELAY=1 RETRY_ORDER_MAX_DELAY=30 RETRY_ORDER_BODY=1``).
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import pytest

from tests.support import Worker, discard, wait_for
from tests.workerapp import make_app

#: calls in the burst, and each one's body (s)
CALLS = int(os.environ.get("RETRY_ORDER_CALLS", "8"))
BODY = float(os.environ.get("RETRY_ORDER_BODY", "0.25"))
#: the settings: a fifth of the defaults (1 s, 30 s) unless told
DELAY = float(os.environ.get("RETRY_ORDER_DELAY", "0.2"))
MAX_DELAY = float(os.environ.get("RETRY_ORDER_MAX_DELAY", "6"))
#: the longest a lock is held around its body: the grant before the start
#: event, the release after the end event (each a round trip on loopback)
AROUND = 0.1


def least_wait(waits: int, delay: float, max_delay: float) -> float:
    """The shortest countdown of a wait after ``waits`` earlier ones
    (:func:`celery_singleton_lock.conflict.policies.backoff`: 0.8 of it)."""
    return 0.8 * min(delay * float(2 ** min(waits, 30)), max_delay)


def most_waits(calls: int, held: float, delay: float, max_delay: float) -> int:
    """The most waits a call of a burst of ``calls`` on one key makes before
    it runs, each call holding the key at most ``held`` seconds (see the
    module): for any ``j``, a waiter's tries from its ``j``-th on are at least
    ``g(j)`` apart, so one holding is in the way of at most ``held // g(j) +
    1`` of them; the least such bound over ``j``."""
    best, j = None, 0
    while True:
        gap = least_wait(j, delay, max_delay)
        bound = j + (calls - 1) * (int(held // gap) + 1)
        best = bound if best is None else min(best, bound)
        if gap > held or gap >= 0.8 * max_delay:
            return best  # a later j only adds tries before it
        j += 1


@pytest.mark.unit
def test_the_bound_from_the_settings() -> None:
    # the defaults, a 1 s body: from the second wait (1.6 s at least) on,
    # one holder is in the way of one try at most
    assert most_waits(8, 1.1, 1.0, 30.0) == 1 + 7
    # a 5 s body: from the fourth (6.4 s at least)
    assert most_waits(8, 5.1, 1.0, 30.0) == 3 + 7
    # a body longer than 0.8 x singleton_retry_max_delay: two tries per holder
    # from the fifth wait (12.8 s at least) on
    assert most_waits(8, 25.0, 1.0, 30.0) == 4 + 7 * 2
    # one call waits for nobody
    assert most_waits(1, 5.0, 1.0, 30.0) == 0


@pytest.mark.worker
@pytest.mark.timeout(600)
def test_a_burst_of_waiting_duplicates_runs_within_the_bound(redis_server, events):
    """``CALLS`` calls of one key under ``retry``, each ``BODY`` long, sent at
    once to two workers: every call runs once, no two at the same time, and
    none waits more often than the bound the settings give."""
    queue = f"order-{uuid.uuid4().hex[:8]}"
    conf = {"singleton_retry_delay": DELAY, "singleton_retry_max_delay": MAX_DELAY,
            "singleton_ttl": 30.0, "slt_record_received": True}
    workers = [Worker(redis_server.url(), queue, concurrency=2, conf=conf, name=n).start()
               for n in ("a", "b")]
    try:
        app = make_app(redis_server.url(), queue, conf=conf)
        task = app.tasks["t.hold_retry"]
        key = uuid.uuid4().hex[:8]
        calls = [task.delay(key, BODY, f"order{i}") for i in range(CALLS)]
        wait_for(lambda: all(c.ready() for c in calls), 540, what="every call of the burst ran")
        assert sorted(c.get(timeout=10)["tag"] for c in calls) == sorted(
            f"order{i}" for i in range(CALLS))
    finally:
        for w in workers:
            discard(w)
    everything = events.all()
    starts = sorted(events.starts("order"), key=lambda e: e["t"])
    ends = {e["id"]: e["t"] for e in events.ends("order")}
    assert max(e["concurrent"] for e in starts) == 1
    assert len(starts) == CALLS
    received: dict[str, list[dict[str, Any]]] = {}
    for e in sorted(everything, key=lambda e: e["t"]):
        if e["ev"] == "received":
            received.setdefault(e["id"], []).append(e)
    arrival = sorted((received[c.id][0]["t"], c.id) for c in calls)
    rank = {task_id: n for n, (_, task_id) in enumerate(arrival)}
    held = max(ends[e["id"]] - e["t"] for e in starts) + AROUND
    bound = most_waits(CALLS, held, DELAY, MAX_DELAY)
    rows, waits = [], {}
    for order, e in enumerate(starts):
        came = received[e["id"]][0]["t"]
        # each wait is a message received again; the one that ran is the last
        waits[e["id"]] = len(received[e["id"]]) - 1
        rows.append(f"  arrived {rank[e['id']] + 1}, started {order + 1}, after "
                    f"{waits[e['id']]} waits, {e['t'] - came:.2f} s")
    longest = max(e["t"] - received[e["id"]][0]["t"] for e in starts)
    in_order = sum(1 for order, e in enumerate(starts) if rank[e["id"]] == order)
    print(f"\n{CALLS} calls of {BODY:g} s, retry delay {DELAY:g} s up to {MAX_DELAY:g} s: "
          f"longest wait {longest:.2f} s ({longest / BODY:.1f} bodies), most waits "
          f"{max(waits.values())} (bound {bound}), {in_order} started in their arrival place, "
          f"all done after {starts[-1]['t'] + BODY - arrival[0][0]:.2f} s "
          f"({CALLS * BODY:g} s of bodies)\n" + "\n".join(rows))
    assert max(waits.values()) <= bound, (waits, bound)
