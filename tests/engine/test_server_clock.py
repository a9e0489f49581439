"""The estimate of the lock Redis's clock, from ``TIME`` replies, in figures:
what each bound comes to for replies of known offset, round trip and age
(no server: the replies are made here)."""

from __future__ import annotations

import time

import pytest

from celery_singleton_lock.engine.clock import ServerClock, server_us

pytestmark = pytest.mark.unit  # no server, no worker: the fast run (-m unit)

SECOND = 1_000_000


def local_us() -> int:
    return time.monotonic_ns() // 1000


def reply(clock: ServerClock, offset: int, trip: int, age: int = 0) -> int:
    """A request sent ``age`` µs ago, answered ``trip`` µs later with a
    server clock ``offset`` µs ahead of ours as it left; its send time."""
    sent = local_us() - age
    clock.heard(sent, divmod(sent + offset, SECOND), sent + trip)
    return sent


def test_time_replies_are_read_as_microseconds() -> None:
    assert server_us((b"1700000000", b"000005")) == 1_700_000_000_000_005


def test_nothing_heard_bounds_nothing() -> None:
    clock = ServerClock()
    assert (clock.known, clock.low(), clock.deadline_ms(2.0), clock.propose()) == (
        False, 0, 0, 0)
    assert clock.local_time_of(10**12) == float("-inf")


def test_the_moment_the_server_reaches_a_time_is_its_offset_back_less_the_drift() -> None:
    """The server's clock read 5 s ahead of ours as the request left: it
    reaches 4 s past that no sooner than 4 s of ours later, less 0.1 % of
    those 4 s (it may run that much faster)."""
    clock = ServerClock()
    sent = reply(clock, 5 * SECOND, 300)
    target_ms = (sent + 5 * SECOND + 4 * SECOND) // 1000
    at = target_ms * 1000 - 5 * SECOND  # 4 s after the send, to the ms
    expected = at / 1e6 - (at - sent) / 1e6 * 0.001 / 1.001
    assert clock.local_time_of(target_ms) == pytest.approx(expected, abs=2e-6)


def test_the_least_the_server_clock_reads_now_is_its_reply_plus_the_time_since() -> None:
    """The server read its clock before the reply arrived: it reads at least
    that plus the time since the reply arrived (here 5 s ahead, a 300 µs
    round trip); a deadline is that plus the caller's wait, in ms."""
    clock = ServerClock()
    reply(clock, 5 * SECOND, 300)
    before = local_us()
    low = clock.low()
    after = local_us()
    assert before + 5 * SECOND - 300 <= low <= after + 5 * SECOND - 300
    before = local_us()
    deadline = clock.deadline_ms(2.0)
    after = local_us()
    assert (before + 5 * SECOND - 300 + 2 * SECOND) // 1000 <= deadline
    assert deadline <= (after + 5 * SECOND - 300 + 2 * SECOND) // 1000
    before = local_us()
    deadline = clock.deadline_ms(0.25)  # a wait under a second has one too
    after = local_us()
    assert (before + 5 * SECOND - 300 + SECOND // 4) // 1000 <= deadline
    assert deadline <= (after + 5 * SECOND - 300 + SECOND // 4) // 1000
    assert clock.deadline_ms(0.0) == 0


def test_the_best_of_the_last_eight_replies_counts() -> None:
    """The reply showing the server least far ahead bounds the moment it
    reaches a time; once eight replies came after it, it no longer counts."""
    clock = ServerClock()
    sent = reply(clock, 5 * SECOND, 100)
    target_ms = (sent + 9 * SECOND) // 1000
    for _ in range(7):
        reply(clock, 5 * SECOND + 1_000, 100)
    assert len(clock.heard_from) == 8
    best = clock.local_time_of(target_ms)
    assert best == pytest.approx((target_ms * 1000 - 5 * SECOND) / 1e6 - 0.004, abs=1e-4)
    reply(clock, 5 * SECOND + 1_000, 100)
    assert len(clock.heard_from) == 8
    assert clock.local_time_of(target_ms) == pytest.approx(best - 0.001, abs=1e-4)


def test_a_server_clock_set_back_makes_what_was_heard_before_void() -> None:
    """A reply showing the server behind what an earlier one proved it had
    reached (its clock set back): the earlier replies are dropped."""
    clock = ServerClock()
    for _ in range(3):
        reply(clock, 5 * SECOND, 100)
    reply(clock, 3 * SECOND, 100)
    assert [offset for offset, _, _ in clock.heard_from] == [3 * SECOND]


@pytest.mark.parametrize("trips, margin", [
    ([300, 300], 100),      # no jitter: the least margin
    ([300, 800], 500),      # the last trip's jitter over the quickest
    ([300, 5_000], 1_000),  # capped
])
def test_a_proposed_token_stands_just_above_the_server_clock(trips: list[int],
                                                              margin: int) -> None:
    """A native grant proposes the server's clock as its request arrives: the
    least offset heard, plus a margin of the last round trip's jitter
    (100 µs to 1 ms)."""
    clock = ServerClock()
    for trip in trips:
        reply(clock, 5 * SECOND, trip)
    before = local_us()
    proposed = clock.propose()
    after = local_us()
    assert before + 5 * SECOND + margin <= proposed <= after + 5 * SECOND + margin
